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

# The dtypes and the scale layouts are the kernels' own definitions, shared with them (and re-exported
# here, where tests and users have always found them); the numerics below are the oracle's alone.
from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS, check_quantize_blockwise_args, scale_layouts
from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES, HIGH_PRECISION_DTYPES, SCALE_DTYPES, fp8_max

_FLOAT_MAX = torch.finfo(torch.float32).max
_FLOAT_MIN_NORMAL = torch.finfo(torch.float32).tiny


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


def transpose_last2(q: torch.Tensor) -> torch.Tensor:
    """``q`` with its last two dimensions swapped, as a contiguous copy (a stack: each matrix transposed)."""
    return q.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


# The bias gradient's float32 summation order: runs of BIAS_GRAD_RUN rows summed in row order, each run
# added to the sum of its block of BIAS_GRAD_BLOCK rows, the blocks added in order.
BIAS_GRAD_RUN, BIAS_GRAD_BLOCK = 16, 256


def bias_grad(grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of grad_output viewed as (rows, last dim), accumulated in float32 in the order above (which
    fixes the bits whatever the thread count), rounded to ``dtype``.

    Rows past the last whole run and block are zeros here: adding +0 to a float32 changes nothing but a -0,
    and every run enters its block's sum, which starts at +0, so the padding cannot show.
    """
    cols = grad_output.shape[-1] if grad_output.dim() else 1
    rows = grad_output.numel() // cols if cols else 0
    x = grad_output.reshape(rows, cols).float()
    blocks = max(1, -(-rows // BIAS_GRAD_BLOCK))
    runs_per_block = BIAS_GRAD_BLOCK // BIAS_GRAD_RUN
    x = torch.nn.functional.pad(x, (0, 0, 0, blocks * BIAS_GRAD_BLOCK - rows))
    x = x.reshape(blocks, runs_per_block, BIAS_GRAD_RUN, cols)
    run = x[:, :, 0].clone()
    for i in range(1, BIAS_GRAD_RUN):
        run = run + x[:, :, i]
    block = torch.zeros(blocks, cols, dtype=torch.float32, device=x.device)
    for j in range(runs_per_block):
        block = block + run[:, j]
    total = torch.zeros(cols, dtype=torch.float32, device=x.device)
    for b in range(blocks):
        total = total + block[b]
    return total.to(dtype)


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


# ---------------------------------------------------------------------------
# Block scaling (Float8BlockScaling, MXFP8, rowwise): one scale per block
# ---------------------------------------------------------------------------

_E8M0_BIAS = 127
_SIGN_EXP_MASK = -(1 << 23)  # 0xff800000 as an int32: sign and exponent of a float32


def block_amax(x: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """max |x| over each (bm, bk) block of a 2-D ``x``, float32 of shape (ceil(M/bm), ceil(K/bk)).

    Partial edge blocks use the amax of what they hold; NaN anywhere in a
    block gives NaN for that block.
    """
    bm, bk = block_shape
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    xf = torch.nn.functional.pad(x.detach().float().abs(), (0, kb * bk - k, 0, mb * bm - m))
    return xf.reshape(mb, bm, kb, bk).amax(dim=(1, 3))


def round_down_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """2^floor(log2(scale)) for positive normal float32 scales: the mantissa bits cleared."""
    return (scale.float().view(torch.int32) & _SIGN_EXP_MASK).view(torch.float32)


def block_scale(amax: torch.Tensor, fp8_max: float, power_2_scale: bool = False) -> torch.Tensor:
    """float32 block scales: compute_scale(amax, fp8_max, 0, fallback=1), optionally rounded down to 2^n.

    amax = 0 or non-finite gives 1; the scale is always finite, positive and normal.
    """
    scale = compute_scale(amax, fp8_max, 0, 1.0)
    return round_down_power_of_2(scale) if power_2_scale else scale


def e8m0_exponent(amax: torch.Tensor, fp8_max: float, rounding: str = "ceil") -> torch.Tensor:
    """Unbiased int32 exponent e of the E8M0 scale_inv 2^e of each block, in [-127, 127].

    ``"ceil"`` (what TE and cuBLAS use): e = ceil(log2(amax / fp8_max)) with the
    quotient rounded to float32, so amax * 2^-e never exceeds fp8_max (up to that
    rounding) and nothing saturates. ``"floor"`` (the OCP MX rule):
    e = floor(log2(amax)) - floor(log2(fp8_max)); the block's largest values may
    saturate. amax = 0 or non-finite gives e = 0 (scale 1), like block_scale.
    """
    if rounding not in E8M0_ROUNDINGS:
        raise ValueError(f"e8m0 rounding must be 'ceil' or 'floor', got {rounding!r}")
    amax = amax.float()
    valid = (amax > 0) & torch.isfinite(amax)
    if rounding == "ceil":
        v = torch.div(amax, torch.full_like(amax, fp8_max))
        bits = v.view(torch.int32)
        biased = bits >> 23  # v is positive: no sign bit
        mantissa = bits & 0x7FFFFF
        # Round up when inexact; a subnormal quotient (biased 0) needs -126 above 2^-127.
        up = torch.where(biased > 0, mantissa != 0, mantissa > 0x400000)
        e = biased - _E8M0_BIAS + up.int()
    else:
        emax = int(math.floor(math.log2(fp8_max)))
        e = torch.frexp(amax).exponent - 1 - emax
    e = torch.clamp(e, -_E8M0_BIAS, _E8M0_BIAS)
    return torch.where(valid, e, torch.zeros_like(e)).int()


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """torch.float8_e8m0fnu tensor holding 2^e (biased exponent e + 127)."""
    return (e + _E8M0_BIAS).to(torch.uint8).view(E8M0_DTYPE)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """float32 value 2^(bits - 127) of E8M0 scales (0xff, NaN, never occurs in package scales)."""
    e = s.view(torch.uint8).int() - _E8M0_BIAS
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def quantize_blockwise_ref(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    e8m0_rounding: str = "ceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``x`` with one scale per (bm, bk) block; returns (q, scale_inv).

    Per block: amax (block_amax) -> scale (block_scale, or 2^-e with e from
    e8m0_exponent when scale_dtype is E8M0) -> q = saturate(rne(x * scale))
    exactly as :func:`quantize`. scale_inv has shape (ceil(M/bm), ceil(K/bk)):
    float32 1/scale, or E8M0 2^e. NaN stays NaN, +-inf saturates to +-max.

    Args:
        x: (M, K) float32, bfloat16 or float16.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        block_shape: (bm, bk), e.g. (1, 128), (128, 128), (1, 32), (1, K).
        scale_dtype: torch.float32 or torch.float8_e8m0fnu.
        power_2_scale: round float32 scales down to powers of two (E8M0 always is).
        e8m0_rounding: "ceil" or "floor", see e8m0_exponent.
    """
    bm, bk = check_quantize_blockwise_args(x, dtype, block_shape, scale_dtype, e8m0_rounding)
    m, k = x.shape
    limit = fp8_max(dtype)
    block_amaxes = block_amax(x, (bm, bk))
    if scale_dtype == E8M0_DTYPE:
        e = e8m0_exponent(block_amaxes, limit, e8m0_rounding)
        scale = torch.ldexp(torch.ones_like(block_amaxes), -e)
        scale_inv = e8m0_from_exponent(e)
    else:
        scale = block_scale(block_amaxes, limit, power_2_scale)
        scale_inv = torch.reciprocal(scale)
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    q = torch.clamp(x.float() * full, -limit, limit).to(dtype)
    return q, scale_inv


def scaling_types(scale_inv: torch.Tensor, rows: int, cols: int) -> dict[str, tuple[int, int]]:
    """The scaled_mm ScalingTypes a scale_inv can stand for on a (rows, cols) operand, with their blocks.

    torch's conventions (float32 unless noted):

    ================  ==============================  ===============
    ScalingType       scale_inv shape                 block
    ================  ==============================  ===============
    TensorWise        1 element                       (rows, cols)
    RowWise           (rows, 1)                       (1, cols)
    BlockWise1x128    (rows, ceil(cols/128))          (1, 128)
    BlockWise128x128  (ceil(rows/128), ceil(cols/128))  (128, 128)
    BlockWise1x32     (rows, ceil(cols/32)), e8m0     (1, 32)
    ================  ==============================  ===============

    Several entries can match one shape (rows = 1, cols <= 128); they then
    give the same blocks of that operand. Returns {} when none matches.
    """
    shape = tuple(scale_inv.shape)
    return {
        name: block
        for name, (expected, block) in scale_layouts(scale_inv.dtype, rows, cols).items()
        if (scale_inv.numel() == 1 and scale_inv.dim() <= 2 if expected is None else shape == expected)
    }


def block_shape_of(scale_inv: torch.Tensor, rows: int, cols: int) -> tuple[int, int]:
    """The (bm, bk) block of a (rows, cols) operand under ``scale_inv`` (see scaling_types).

    Raises:
        ValueError: the shape and dtype match no ScalingType.
    """
    found = scaling_types(scale_inv, rows, cols)
    if not found:
        r128, c128, c32 = -(-rows // 128), -(-cols // 128), -(-cols // 32)
        raise ValueError(
            f"scale_inv of shape {list(scale_inv.shape)} and dtype {scale_inv.dtype} matches no scaling of a "
            f"({rows}, {cols}) operand: expected 1 element, ({rows}, 1), ({rows}, {c128}) or ({r128}, {c128}) "
            f"float32, or ({rows}, {c32}) float8_e8m0fnu"
        )
    return next(iter(found.values()))


def expand_scale_inv(scale_inv: torch.Tensor, block_shape: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Elementwise float64 (rows, cols) scale_inv of an operand with the given blocks."""
    s = e8m0_to_float(scale_inv) if scale_inv.dtype == E8M0_DTYPE else scale_inv.float()
    s = s.double().reshape(-(-rows // block_shape[0]), -(-cols // block_shape[1]))
    return s.repeat_interleave(block_shape[0], 0)[:rows].repeat_interleave(block_shape[1], 1)[:, :cols]


def fp8_gemm_blockwise(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Block-scaled GEMM: sum over K-blocks of (a_blk @ b_blk.T) * a_scale * b_scale [+ bias], in float64.

    The kernels accumulate each K-block's partial sum in float32 and multiply it
    by its two block scales before adding it to the float32 total (DeepGEMM's
    promotion), so any K works; in exact arithmetic that is the product of the
    dequantized operands, which is what this computes (float64). Each operand's
    blocks follow from its scale_inv's shape and dtype (block_shape_of).
    """
    (m, k), n = a.shape, b.shape[0]
    a_deq = a.double() * expand_scale_inv(a_scale_inv, block_shape_of(a_scale_inv, m, k), m, k)
    b_deq = b.double() * expand_scale_inv(b_scale_inv, block_shape_of(b_scale_inv, n, k), n, k)
    out = a_deq @ b_deq.t()
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)
