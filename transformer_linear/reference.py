"""Pure-PyTorch definition of every numeric op in the package.

This module is the oracle: every kernel and backend is tested against it
(quantize bitwise, GEMMs within the tolerance of tests/tolerances.py). The
C++/CUDA element math lives in csrc/include/transformer_linear/fp8_math.h and
follows these definitions operation for operation.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_FLOAT_MAX = torch.finfo(torch.float32).max
_FLOAT_MIN_NORMAL = torch.finfo(torch.float32).tiny


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor; NaN anywhere gives NaN; empty gives 0."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().float().abs().amax()


def compute_scale(
    amax: torch.Tensor, fp8_max: float, margin: int = 0, fallback: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """scale = fp8_max / amax / 2^margin, never inf, NaN or 0.

    Computed in float32 as ``(fp8_max / amax) * 2^-margin``. When amax is 0,
    negative, inf or NaN the scale is ``fallback`` (the previous scale under
    delayed scaling, 1 under current scaling). A quotient that overflows
    becomes FLT_MAX; a product below FLT_MIN becomes FLT_MIN.

    Args:
        amax: float32 tensor of amaxes (any shape).
        fp8_max: the format's largest finite value.
        margin: non-negative integer, the power-of-two head room.
        fallback: the scale to keep where amax gives none.
    """
    amax = amax.float()
    # torch.div with a tensor numerator: ``float / tensor`` would compute a
    # reciprocal first and round twice.
    scale = torch.div(torch.full_like(amax, fp8_max), amax)
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, _FLOAT_MAX))
    scale = scale * (2.0**-margin)
    scale = torch.clamp(scale, min=_FLOAT_MIN_NORMAL)
    valid = (amax > 0) & torch.isfinite(amax)
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    return torch.where(valid, scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q = saturate(round_nearest_even(x * scale)); returns (q, 1 / scale).

    The product is rounded to float32 first, then cast: values beyond the
    format's max (and +-inf) saturate to +-max, NaN stays NaN.
    """
    limit = fp8_max(dtype)
    scale = scale.float().reshape(())
    scaled = x.float() * scale
    q = torch.clamp(scaled, -limit, limit).to(dtype)
    return q, torch.reciprocal(scale).reshape(1)


def quantize_current(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax -> scale (compute_scale, fallback 1) -> quantize.

    Returns (q, scale_inv, amax).
    """
    x_amax = amax(x)
    scale = compute_scale(x_amax, fp8_max(dtype), margin, 1.0)
    q, scale_inv = quantize(x, scale, dtype)
    return q, scale_inv, x_amax


def transpose_2d(q: torch.Tensor) -> torch.Tensor:
    """The transposed layout the fused cast+transpose writes: (last dim, rest) contiguous."""
    cols = q.shape[-1] if q.dim() > 0 else 1
    # math.prod, not -1: a reshape cannot infer a dimension beside a 0.
    return q.reshape(math.prod(q.shape[:-1]), cols).t().contiguous()


def bias_grad(grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of grad_output viewed as (rows, last dim), accumulated in float32."""
    cols = grad_output.shape[-1]
    return grad_output.reshape(math.prod(grad_output.shape[:-1]), cols).float().sum(0).to(dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """float(q) * scale_inv, rounded once to out_dtype."""
    return (q.float() * scale_inv.float().reshape(())).to(out_dtype)


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    accumulate_into: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(a @ b.T) * (a_scale_inv * b_scale_inv) [+ bias] [+ accumulate_into], in float64.

    The kernels accumulate in float32; tests compare them with this float64
    result under tests/tolerances.py. Returns a new tensor of out_dtype.
    """
    acc = a.double() @ b.double().t()
    out = acc * (a_scale_inv.double().reshape(()) * b_scale_inv.double().reshape(()))
    if bias is not None:
        out = out + bias.double()
    if accumulate_into is not None:
        out = out + accumulate_into.double()
    return out.to(out_dtype)


# ---------------------------------------------------------------------------
# The Linear layer (transformer_linear.Linear's FP8 numerics)
# ---------------------------------------------------------------------------


def quantize_for_linear(
    x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with a given scale (delayed scaling) or x's own (current scaling, scale=None)."""
    if scale is None:
        q, scale_inv, _ = quantize_current(x, dtype, margin)
        return q, scale_inv
    return quantize(x, scale, dtype)


def _quantized_matmul(a, a_dtype, a_scale, b, b_dtype, b_scale, margin, out_dtype, bias=None):
    """q(a) @ q(b) [+ bias] for 2-D a (M, K) and b (K, N), in float64 rounded to out_dtype.

    Quantization is elementwise and amax ignores layout, so q(bᵀ) = q(b)ᵀ:
    quantizing the transposed operand is the same as transposing the quantized one.
    """
    qa, sa = quantize_for_linear(a, a_dtype, a_scale, margin)
    qb, sb = quantize_for_linear(b, b_dtype, b_scale, margin)
    return fp8_gemm(qa, sa, qb.t(), sb, out_dtype, bias)


def linear_fwd(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    dtype: torch.dtype,
    inp_scale: Optional[torch.Tensor] = None,
    weight_scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """y = q(x) q(W)ᵀ + b for x of shape (..., in_features)."""
    out_dtype = out_dtype or inp.dtype
    b = bias.to(out_dtype) if bias is not None else None
    x2d = inp.reshape(-1, weight.shape[1])
    y = _quantized_matmul(x2d, dtype, inp_scale, weight.t(), dtype, weight_scale, margin, out_dtype, b)
    return y.reshape(*inp.shape[:-1], weight.shape[0])


def linear_dgrad(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    grad_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    grad_scale: Optional[torch.Tensor] = None,
    weight_scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """dx = q(grad_output) q(W), in grad_output's leading shape."""
    g2d = grad_output.reshape(-1, weight.shape[0])
    out_dtype = out_dtype or grad_output.dtype
    dx = _quantized_matmul(g2d, grad_dtype, grad_scale, weight, weight_dtype, weight_scale, margin, out_dtype)
    return dx.reshape(*grad_output.shape[:-1], weight.shape[1])


def linear_wgrad(
    grad_output: torch.Tensor,
    inp: torch.Tensor,
    grad_dtype: torch.dtype,
    inp_dtype: torch.dtype,
    grad_scale: Optional[torch.Tensor] = None,
    inp_scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """dW = q(grad_output)ᵀ q(x), (out_features, in_features)."""
    g_t = grad_output.reshape(-1, grad_output.shape[-1]).t()
    x2d = inp.reshape(-1, inp.shape[-1])
    return _quantized_matmul(g_t, grad_dtype, grad_scale, x2d, inp_dtype, inp_scale, margin, out_dtype or inp.dtype)
