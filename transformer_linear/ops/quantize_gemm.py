"""The fused forward op ``transformer_linear::quantize_fp8_gemm``: a high-precision input quantized with one
scale for the tensor (current or delayed scaling) and multiplied by an FP8 operand, in one call.

On the CPU the cast runs inside the GEMM (csrc/cpu/quantize_gemm_cpu.cpp): each block of the input's rows is
cast by the thread about to pack it for the GEMM, so the FP8 copy is written once and packed from cache rather
than read back from memory after a pass of its own. The outputs are bitwise those of ``ops.quantize_fused``
(rowwise) followed by ``ops.fp8_gemm``; on a GPU the op runs those two kernels in turn.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_linear import _C
from transformer_linear.formats import checks
from transformer_linear.ops import descriptors, library, torch_cuda

__all__ = ["QuantizeGemmOutput", "quantize_fp8_gemm"]

_OP = "quantize_fp8_gemm"


class QuantizeGemmOutput(NamedTuple):
    """What the fused forward returns."""

    out: torch.Tensor
    """(M, N) ``out_dtype``: the product, plus the bias."""
    data: torch.Tensor
    """(M, K) FP8: the input quantized (the GEMM's operand, what backward reads)."""
    scale_inv: torch.Tensor
    """1-element float32, 1 / scale."""
    amax: torch.Tensor
    """0-dim float32, max |input|."""


def _check_args(x, scale, dtype, b, b_scale_inv, out_dtype, bias):
    checks.check_same_device(
        _OP, {"input": x, "scale": scale, "b": b, "b_scale_inv": b_scale_inv, "bias": bias}, optional=("scale", "bias")
    )
    checks.check_fp8_dtype(_OP, "dtype", dtype)
    checks.check_hp_dtype(_OP, "out_dtype", out_dtype)
    if x.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{_OP}: 'input' and 'b' must be 2-D, got shapes {tuple(x.shape)} and {tuple(b.shape)}")


def _checks(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    _check_args(x, scale, dtype, b, b_scale_inv, out_dtype, bias)
    checks.check_scale_values(_OP, {"scale": scale}, reciprocal=True)
    checks.check_scale_values(_OP, {"b_scale_inv": b_scale_inv})


def _outputs(x, dtype, b, out_dtype):
    return (
        x.new_empty((x.shape[0], b.shape[0]), dtype=out_dtype),
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(1, dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


def _kernel(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    """The extension's fused forward (the op's arguments, checked by _checks)."""
    out, q, scale_inv, x_amax = _outputs(x, dtype, b, out_dtype)
    current = scale is None
    # Current scaling computes the scale into scratch memory; only 1/scale is returned.
    scale_arg = x.new_empty(1, dtype=torch.float32) if current else scale
    workspace = descriptors.cublas_workspace(x.device) if x.device.type == "cuda" else None
    _C.quantize_fp8_gemm(
        descriptors.desc(x, _OP, "input"),
        descriptors.desc(scale_arg, _OP, "scale"),
        descriptors.desc(q, _OP, "output"),
        descriptors.desc(scale_inv, _OP, "scale_inv"),
        descriptors.desc(x_amax, _OP, "amax"),
        current,
        margin,
        descriptors.desc(b, _OP, "b"),
        descriptors.desc(b_scale_inv, _OP, "b_scale_inv"),
        descriptors.desc(bias, _OP, "bias"),
        descriptors.desc(out, _OP, "d"),
        use_split_accumulator,
        descriptors.desc(workspace, _OP, "workspace"),
        descriptors.stream_for(x),
    )
    return out, q, scale_inv, x_amax


def _torch_fallback(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    """The op in torch (a GPU where the extension's CUDA kernels cannot run): quantize, then the GEMM."""
    q, _, scale_inv, x_amax, _ = torch_cuda.quantize(x, scale, dtype, margin, True, False, None)
    out = torch_cuda.fp8_gemm(q, scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator)
    return out, q, scale_inv, x_amax


@library.custom_op("transformer_linear::quantize_fp8_gemm", device_types="cpu")
def _quantize_fp8_gemm_op(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    dtype: torch.dtype,
    margin: int,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    use_split_accumulator: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _checks(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator)
    return _kernel(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator)


torch_cuda.register_cuda_kernel(_quantize_fp8_gemm_op, _kernel, _torch_fallback, _checks)


@_quantize_fp8_gemm_op.register_fake
def _(x, scale, dtype, margin, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    _check_args(x, scale, dtype, b, b_scale_inv, out_dtype, bias)
    return _outputs(x, dtype, b, out_dtype)


def quantize_fp8_gemm(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: Optional[torch.Tensor],
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    margin: int = 0,
    use_split_accumulator: bool = False,
) -> QuantizeGemmOutput:
    """``ops.quantize_fused(x, dtype, scale, margin=margin)`` (rowwise) then ``ops.fp8_gemm`` of its data with
    ``b``, as one op (the CPU casts ``x`` inside the GEMM; see the module docstring).

    Args:
        x: contiguous (M, K) float32, bfloat16 or float16 tensor.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: 1-element float32 scale (delayed scaling); ``None`` computes it from ``x``'s amax (current
            scaling, see reference.compute_scale).
        b: FP8 (N, K), row-major or column-major.
        b_scale_inv: ``b``'s one float32 scale_inv (one element).
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) tensor of ``out_dtype``, or None.
        margin: current scaling's power-of-two head room.
        use_split_accumulator: as :func:`ops.fp8_gemm`'s.

    Raises:
        TypeError: an argument is not a tensor, not on ``x``'s device, or has an unsupported dtype.
        ValueError: bad shapes or layouts; on the CPU, a scale that is not positive and finite.
    """
    checks.check_same_device(_OP, {"input": x, "scale": scale, "b": b, "b_scale_inv": b_scale_inv},
                             optional=("scale",))
    checks.check_fp8_dtype(_OP, "dtype", dtype)
    checks.check_margin(_OP, margin)
    if b_scale_inv.numel() != 1:
        raise ValueError(f"{_OP}: 'b_scale_inv' must have one element (one scale for b), got {b_scale_inv.numel()}")
    return QuantizeGemmOutput(*library.call(
        _quantize_fp8_gemm_op, x, scale, dtype, margin, b, b_scale_inv.reshape(1), out_dtype, bias,
        use_split_accumulator,
    ))
