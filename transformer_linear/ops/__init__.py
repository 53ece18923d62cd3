"""The FP8 kernels as ``torch.library`` custom ops (namespace ``transformer_linear``).

Each kernel is registered once, with a fake (meta) implementation, so the ops
trace under ``torch.compile(fullgraph=True)`` and ``torch.export``. Each op
registers the extension's kernel for the CPU and a CUDA kernel that picks the
extension or, where its CUDA kernels cannot run, the torch fallback
(``torch_cuda.register_cuda_kernel``).

Public functions::

    amax = ops.amax(x)                                         # 0-dim fp32
    q, scale_inv = ops.quantize(x, scale, dtype)
    q, scale_inv, amax = ops.quantize_with_amax(x, scale, dtype)
    q, scale_inv, amax = ops.quantize_current(x, dtype, margin=0)
    out = ops.quantize_fused(x, dtype, scale=None, ...)        # every output of one pass
    x_hp = ops.dequantize(q, scale_inv, out_dtype)
    q_t = ops.transpose(q)                                     # last two dims swapped, contiguous
    dbias = ops.bias_grad(grad_output, out_dtype)              # column sums, fp32 accumulation
    d = ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None)
    ops.fp8_gemm_accumulate_(a, a_scale_inv, b, b_scale_inv, out)   # out += ...
    out, q, scale_inv, amax = ops.quantize_fp8_gemm(x, dtype, scale, b, b_scale_inv, out_dtype)  # fused
    q, scale_inv = ops.quantize_blockwise(x, dtype, block_shape)  # one scale per block
    out = ops.quantize_blockwise_fused(x, dtype, block_shape, columnwise=True)

``fp8_gemm`` takes tensorwise and block scales (see fp8_gemm_scalings); it
resolves the pair once (block_scaling.py) and hands it down. The block-scaled
ops live in ops/block.py and are re-exported here.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

# Helpers are reached through their modules (or imported with a leading underscore): every public
# name here is an op that validates its arguments (tests/test_bad_input.py walks them all).
from transformer_linear import _C
from transformer_linear.formats import checks, layout
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.formats.block_scaling import BlockQuantizeOutput, fp8_gemm_scalings, resolve_gemm_scalings
from transformer_linear.ops import (
    descriptors,
    grouped,  # noqa: F401  (registers the grouped GEMM ops: ops.grouped.*)
    nvfp4,  # noqa: F401  (registers the NVFP4 ops: ops.nvfp4.*)
    library,
    nvfp4_cuda,  # noqa: F401  (registers the NVFP4 ops' CUDA kernels)
    torch_cuda,
)
from transformer_linear.ops.quantize_gemm import QuantizeGemmOutput, quantize_fp8_gemm
from transformer_linear.ops.block import (
    _fp8_gemm_blockwise,
    _fp8_gemm_blockwise_accumulate_,
    quantize_blockwise,
    quantize_blockwise_fused,
)

__all__ = [
    "BlockQuantizeOutput",
    "QuantizeGemmOutput",
    "QuantizeOutput",
    "amax",
    "dequantize",
    "fp8_gemm",
    "fp8_gemm_accumulate_",
    "fp8_gemm_scalings",
    "resolve_gemm_scalings",
    "transpose",
    "bias_grad",
    "quantize",
    "quantize_current",
    "quantize_fp8_gemm",
    "quantize_fused",
    "quantize_blockwise",
    "quantize_blockwise_fused",
    "quantize_with_amax",
]

def _scalar(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=like.device)


def _transposed_shape(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() > 0 else 1
    return (cols, x.numel() // cols if cols else math.prod(x.shape[:-1]))


# ---------------------------------------------------------------------------
# amax
# ---------------------------------------------------------------------------


def _amax_kernel(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((), dtype=torch.float32, device=x.device)
    _C.amax(descriptors.desc(x, "amax", "input"), descriptors.desc(out, "amax", "amax"), descriptors.stream_for(x))
    return out


_amax_op = library.custom_op("transformer_linear::amax", device_types="cpu")(_amax_kernel)
torch_cuda.register_cuda_kernel(_amax_op, _amax_kernel, torch_cuda.amax)


@_amax_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (NaN-propagating; 0 for an empty tensor).

    Args:
        x: contiguous float32, bfloat16 or float16 tensor on the CPU or a GPU.
    """
    checks.check_tensor("amax", "input", x)
    return library.call(_amax_op, x)


# ---------------------------------------------------------------------------
# quantize: one op for every variant of the one-pass kernel
# ---------------------------------------------------------------------------


def _quantize_checks(x, scale, dtype, margin, rowwise, columnwise, dbias_dtype):
    _check_quantize_args(x, scale, dtype, rowwise, columnwise, dbias_dtype)
    checks.check_scale_values("quantize", {"scale": scale}, reciprocal=True)


def _quantize_kernel(x, scale, dtype, margin, rowwise, columnwise, dbias_dtype):
    """The extension's quantize (the op's arguments, checked by _quantize_checks)."""
    op = "quantize"
    q, q_t, scale_inv, x_amax, dbias = _quantize_outputs(x, dtype, rowwise, columnwise, dbias_dtype)
    current = scale is None
    # Current scaling computes the scale into scratch memory; only 1/scale is returned.
    scale_arg = _scalar(x) if current else scale
    _C.quantize(
        descriptors.desc(x, op, "input"),
        descriptors.desc(scale_arg, op, "scale"),
        descriptors.desc(q, op, "output") if rowwise else None,
        descriptors.desc(q_t, op, "output_t") if columnwise else None,
        descriptors.desc(scale_inv, op, "scale_inv"),
        descriptors.desc(x_amax, op, "amax"),
        descriptors.desc(dbias, op, "dbias") if dbias_dtype is not None else None,
        current,
        margin,
        descriptors.stream_for(x),
    )
    return q, q_t, scale_inv, x_amax, dbias


@library.custom_op("transformer_linear::quantize", device_types="cpu")
def _quantize_op(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    dtype: torch.dtype,
    margin: int,
    rowwise: bool,
    columnwise: bool,
    dbias_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _quantize_checks(x, scale, dtype, margin, rowwise, columnwise, dbias_dtype)
    return _quantize_kernel(x, scale, dtype, margin, rowwise, columnwise, dbias_dtype)


torch_cuda.register_cuda_kernel(_quantize_op, _quantize_kernel, torch_cuda.quantize, _quantize_checks)


def _check_quantize_args(x, scale, dtype, rowwise, columnwise, dbias_dtype):
    checks.check_same_device("quantize", {"input": x, "scale": scale}, optional=("scale",))
    checks.check_fp8_dtype("quantize", "dtype", dtype)
    if dbias_dtype is not None:
        checks.check_hp_dtype("quantize", "dbias_dtype", dbias_dtype)
    if not (rowwise or columnwise):
        raise ValueError("quantize: at least one of 'rowwise' and 'columnwise' must be True")


def _quantize_outputs(x, dtype, rowwise, columnwise, dbias_dtype):
    """Allocate the quantize op's outputs; unrequested ones are empty tensors."""
    empty = x.new_empty(0, dtype=dtype)
    q = x.new_empty(x.shape, dtype=dtype) if rowwise else empty
    q_t = x.new_empty(_transposed_shape(x), dtype=dtype) if columnwise else empty.clone()
    dbias = (
        x.new_empty(x.shape[-1:], dtype=dbias_dtype)
        if dbias_dtype is not None
        else x.new_empty(0, dtype=torch.float32)
    )
    return q, q_t, x.new_empty(1, dtype=torch.float32), x.new_empty((), dtype=torch.float32), dbias


@_quantize_op.register_fake
def _(x, scale, dtype, margin, rowwise, columnwise, dbias_dtype):
    _check_quantize_args(x, scale, dtype, rowwise, columnwise, dbias_dtype)
    return _quantize_outputs(x, dtype, rowwise, columnwise, dbias_dtype)


class QuantizeOutput(NamedTuple):
    """Everything one quantize pass can produce (unrequested tensors are empty)."""

    data: torch.Tensor
    """FP8 tensor of the input's shape."""
    data_t: torch.Tensor
    """FP8 (last dim, rest) tensor: the input viewed as 2-D, transposed."""
    scale_inv: torch.Tensor
    """1-element float32, 1 / scale."""
    amax: torch.Tensor
    """0-dim float32, max |input|."""
    dbias: torch.Tensor
    """Column sums of the input viewed as 2-D (a bias gradient)."""


def quantize_fused(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    *,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    dbias_dtype: Optional[torch.dtype] = None,
) -> QuantizeOutput:
    """One pass over ``x`` producing any of: FP8 data, its transpose, amax, bias gradient.

    Args:
        x: contiguous float32, bfloat16 or float16 tensor.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: 1-element float32 scale (delayed scaling); ``None`` computes it
            from this tensor's amax (current scaling, see reference.compute_scale).
        margin: current scaling's power-of-two head room.
        rowwise: produce ``data`` (x's shape).
        columnwise: produce ``data_t`` (the fused cast + transpose).
        dbias_dtype: produce ``dbias`` in this dtype.
    """
    checks.check_same_device("quantize", {"input": x, "scale": scale}, optional=("scale",))
    checks.check_fp8_dtype("quantize", "dtype", dtype)
    checks.check_margin("quantize", margin)
    return QuantizeOutput(*library.call(_quantize_op, x, scale, dtype, margin, rowwise, columnwise, dbias_dtype))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q = saturate(round_nearest_even(x * scale)) in ``dtype``; returns ``(q, scale_inv)``."""
    out = quantize_fused(x, dtype, scale)
    return out.data, out.scale_inv


def quantize_with_amax(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` that also records max |x| in the same pass (delayed scaling)."""
    out = quantize_fused(x, dtype, scale)
    return out.data, out.scale_inv, out.amax


def quantize_current(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax -> scale = fp8_max / amax / 2^margin -> cast; returns (q, scale_inv, amax)."""
    out = quantize_fused(x, dtype, None, margin=margin)
    return out.data, out.scale_inv, out.amax


# ---------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------


def _check_dequantize_args(q, scale_inv, out_dtype):
    checks.check_same_device("dequantize", {"input": q, "scale_inv": scale_inv})
    checks.check_hp_dtype("dequantize", "out_dtype", out_dtype)


def _dequantize_checks(q, scale_inv, out_dtype):
    _check_dequantize_args(q, scale_inv, out_dtype)
    checks.check_scale_values("dequantize", {"scale_inv": scale_inv})


def _dequantize_kernel(q, scale_inv, out_dtype):
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    op = "dequantize"
    _C.dequantize(descriptors.desc(q, op, "input"), descriptors.desc(scale_inv, op, "scale_inv"), descriptors.desc(out, op, "output"), descriptors.stream_for(q))
    return out


@library.custom_op("transformer_linear::dequantize", device_types="cpu")
def _dequantize_op(q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _dequantize_checks(q, scale_inv, out_dtype)
    return _dequantize_kernel(q, scale_inv, out_dtype)


torch_cuda.register_cuda_kernel(_dequantize_op, _dequantize_kernel, torch_cuda.dequantize, _dequantize_checks)


@_dequantize_op.register_fake
def _(q, scale_inv, out_dtype):
    _check_dequantize_args(q, scale_inv, out_dtype)
    return q.new_empty(q.shape, dtype=out_dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """float(q) * scale_inv rounded to ``out_dtype`` (float32, bfloat16 or float16)."""
    _check_dequantize_args(q, scale_inv, out_dtype)
    return library.call(_dequantize_op, q, scale_inv, out_dtype)


# ---------------------------------------------------------------------------
# transpose of FP8 data
# ---------------------------------------------------------------------------


def _check_transpose_args(q):
    checks.check_tensor("transpose", "input", q)
    if q.dtype not in FP8_DTYPES:
        raise TypeError(f"transpose: argument 'input' must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    if q.dim() not in (2, 3):
        raise ValueError(f"transpose: argument 'input' must be 2-D or 3-D (a stack), got {q.dim()}-D")


def _transpose_out(q):
    return q.new_empty((*q.shape[:-2], q.shape[-1], q.shape[-2]))


@library.custom_op("transformer_linear::transpose", device_types="cpu")
def _transpose_op(q: torch.Tensor) -> torch.Tensor:
    _check_transpose_args(q)
    out = _transpose_out(q)
    _C.transpose(descriptors.desc(q, "transpose", "input"), descriptors.desc(out, "transpose", "output"),
                 descriptors.stream_for(q))
    return out


@_transpose_op.register_kernel("cuda")
def _(q):
    # torch's copy kernel runs a transpose at the GPU memory's rate; there is no kernel of ours to add.
    return layout.transposed_copy(q)


@_transpose_op.register_fake
def _(q):
    _check_transpose_args(q)
    return _transpose_out(q)


def transpose(q: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of FP8 ``q`` with its last two dimensions swapped: the columnwise copy of data already
    quantized (a square-block weight's, an all-gathered weight's), bitwise :func:`reference.transpose_last2`.

    On the CPU a blocked byte transpose in registers (torch's strided copy of one-byte elements runs at a
    twentieth of the memory's rate there); on a GPU torch's copy.

    Args:
        q: contiguous FP8 (rows, cols), or a stack (n, rows, cols) of them.
    """
    _check_transpose_args(q)
    return library.call(_transpose_op, q.contiguous())


# ---------------------------------------------------------------------------
# the bias gradient on its own
# ---------------------------------------------------------------------------


def _check_bias_grad_args(grad_output, dtype):
    checks.check_tensor("bias_grad", "grad_output", grad_output)
    checks.check_hp_dtype("bias_grad", "grad_output", grad_output.dtype)
    checks.check_hp_dtype("bias_grad", "dtype", dtype)


def _bias_grad_out(grad_output, dtype):
    return grad_output.new_empty(grad_output.shape[-1:] if grad_output.dim() else (1,), dtype=dtype)


@library.custom_op("transformer_linear::bias_grad", device_types="cpu")
def _bias_grad_op(grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _check_bias_grad_args(grad_output, dtype)
    dbias = _bias_grad_out(grad_output, dtype)
    _C.bias_grad(descriptors.desc(grad_output, "bias_grad", "input"), descriptors.desc(dbias, "bias_grad", "dbias"),
                 descriptors.stream_for(grad_output))
    return dbias


@_bias_grad_op.register_kernel("cuda")
def _(grad_output, dtype):
    # torch's reduction runs at the GPU memory's rate; there is no kernel of ours to add.
    cols = grad_output.shape[-1] if grad_output.dim() else 1
    return torch.sum(grad_output.reshape(-1, cols), 0, dtype=torch.float32).to(dtype)


@_bias_grad_op.register_fake
def _(grad_output, dtype):
    _check_bias_grad_args(grad_output, dtype)
    return _bias_grad_out(grad_output, dtype)


def bias_grad(grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient where no quantize pass computes it: the column sums of ``grad_output`` viewed as
    (rows, last dim), accumulated in float32, rounded to ``dtype``.

    On the CPU the sums follow :func:`reference.bias_grad`'s order (runs of 16 rows, blocks of 256 added in
    order), bitwise, as ``quantize_fused``'s ``dbias`` does, whatever the thread count: torch's column
    reduction of a bfloat16 (4096, 4096) tensor took 23 ms on a two-core AMX Xeon, this op 2.9. On a GPU
    torch's sum.

    Args:
        grad_output: float32, bfloat16 or float16, any shape.
        dtype: the bias gradient's dtype (float32, bfloat16 or float16).
    """
    _check_bias_grad_args(grad_output, dtype)
    return library.call(_bias_grad_op, grad_output.contiguous(), dtype)


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------


def _check_gemm_scales(a_scale_inv, b_scale_inv):
    checks.check_scale_values("fp8_gemm", {"a_scale_inv": a_scale_inv, "b_scale_inv": b_scale_inv})


def _run_gemm(a, a_scale_inv, b, b_scale_inv, bias, out, accumulate, use_split_accumulator):
    op = "fp8_gemm"
    workspace = descriptors.cublas_workspace(a.device) if a.device.type == "cuda" else None
    _C.fp8_gemm(
        descriptors.desc(a, op, "a"),
        descriptors.desc(a_scale_inv, op, "a_scale_inv"),
        descriptors.desc(b, op, "b"),
        descriptors.desc(b_scale_inv, op, "b_scale_inv"),
        descriptors.desc(bias, op, "bias"),
        descriptors.desc(out, op, "d"),
        accumulate,
        use_split_accumulator,
        descriptors.desc(workspace, op, "workspace"),
        descriptors.stream_for(a),
    )


def _check_gemm_devices(op, a, a_scale_inv, b, b_scale_inv, last_name, last):
    """One device for the GEMM's operands and its bias or output (``last``: None for no bias)."""
    checks.check_same_device(
        op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, last_name: last},
        optional=("bias",),
    )


def _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    _check_gemm_devices("fp8_gemm", a, a_scale_inv, b, b_scale_inv, "bias", bias)
    checks.check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)


def _fp8_gemm_checks(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    _check_gemm_scales(a_scale_inv, b_scale_inv)


def _fp8_gemm_kernel(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    """The extension's GEMM (the op's arguments, checked by _fp8_gemm_checks)."""
    out = torch.empty(checks.gemm_out_shape(a, b), dtype=out_dtype, device=a.device)
    _run_gemm(a, a_scale_inv, b, b_scale_inv, bias, out, False, use_split_accumulator)
    return out


@library.custom_op("transformer_linear::fp8_gemm", device_types="cpu")
def _fp8_gemm_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    use_split_accumulator: bool,
) -> torch.Tensor:
    _fp8_gemm_checks(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator)
    return _fp8_gemm_kernel(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator)


torch_cuda.register_cuda_kernel(_fp8_gemm_op, _fp8_gemm_kernel, torch_cuda.fp8_gemm, _fp8_gemm_checks)


@_fp8_gemm_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator):
    _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    return a.new_empty(checks.gemm_out_shape(a, b), dtype=out_dtype)


def _fp8_gemm_accumulate_checks(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator):
    _check_gemm_devices("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, "out", out)
    _check_gemm_scales(a_scale_inv, b_scale_inv)


def _fp8_gemm_accumulate_kernel(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator):
    _run_gemm(a, a_scale_inv, b, b_scale_inv, None, out, True, use_split_accumulator)


@library.custom_op("transformer_linear::fp8_gemm_accumulate", mutates_args=("out",), device_types="cpu")
def _fp8_gemm_accumulate_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    use_split_accumulator: bool,
) -> None:
    _fp8_gemm_accumulate_checks(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator)
    _fp8_gemm_accumulate_kernel(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator)


torch_cuda.register_cuda_kernel(
    _fp8_gemm_accumulate_op, _fp8_gemm_accumulate_kernel, torch_cuda.fp8_gemm_accumulate_,
    _fp8_gemm_accumulate_checks,
)


@_fp8_gemm_accumulate_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator):
    _check_gemm_devices("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, "out", out)


def _is_nvfp4(a: object, a_scale_inv: object, b: object, b_scale_inv: object) -> bool:
    """NVFP4 operands: packed E2M1 pairs (uint8; FP8 operands have FP8 dtypes) with 1-D packed E4M3 scales.
    Anything else goes the FP8 way, whose checks name what is wrong."""
    operands = (a, a_scale_inv, b, b_scale_inv)
    return all(isinstance(t, torch.Tensor) for t in operands) and (
        a.dtype == b.dtype == torch.uint8
        and a_scale_inv.dtype == b_scale_inv.dtype == torch.float8_e4m3fn
        and a_scale_inv.dim() == b_scale_inv.dim() == 1
    )


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    use_split_accumulator: bool = False,
) -> torch.Tensor:
    """(a @ b.T) * a_scale_inv * b_scale_inv [+ bias], accumulated in float32.

    Args:
        a: FP8 (M, K), row-major or a column-major view (e.g. ``x.t()``).
        a_scale_inv: 1-element float32.
        b: FP8 (N, K), row-major or column-major; e4m3 and e5m2 may be mixed.
        b_scale_inv: 1-element float32.
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) tensor of ``out_dtype``, or None.
        use_split_accumulator: CUDA only: fp32 promotion of partial sums
            (more exact, slower); the CPU always accumulates in float32.

    Block scales: ``a_scale_inv`` / ``b_scale_inv`` may be any pair of
    :func:`fp8_gemm_scalings`; each K-block's fp32 partial sum is then
    multiplied by its two block scales before it is added (always promoted).

    NVFP4: uint8 operands (two E2M1 codes a byte, (M, K/2) and (N, K/2)) with
    packed scales (``ops.nvfp4.quantize_nvfp4_packed``) run
    ``ops.nvfp4.nvfp4_gemm_packed``; ``use_split_accumulator`` does not apply.

    Raises:
        TypeError: an argument is not a tensor, or not on ``a``'s device, or
            has an unsupported dtype.
        ValueError: bad shapes or layouts, a combination of scalings not in
            :func:`fp8_gemm_scalings`; on the CPU, a scale that is not
            positive and finite.
    """
    _check_gemm_devices("fp8_gemm", a, a_scale_inv, b, b_scale_inv, "bias", bias)
    if _is_nvfp4(a, a_scale_inv, b, b_scale_inv):
        return nvfp4.nvfp4_gemm_packed(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    scalings = resolve_gemm_scalings(a, a_scale_inv, b, b_scale_inv)
    if scalings.tensorwise:
        a_scale_inv, b_scale_inv = a_scale_inv.reshape(1), b_scale_inv.reshape(1)
        return library.call(_fp8_gemm_op, a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_split_accumulator)
    return _fp8_gemm_blockwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings)


def fp8_gemm_accumulate_(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    *,
    use_split_accumulator: bool = True,
) -> None:
    """out += (a @ b.T) * a_scale_inv * b_scale_inv, in place (wgrad into ``main_grad``).

    Arguments as :func:`fp8_gemm`'s, block scales included; ``out`` is a
    contiguous (M, N) float32, bfloat16 or float16 tensor, the kernels'
    output ``d``. With block scales the promoted fp32 total is added to
    ``out`` in float32 and rounded once.

    Raises:
        ValueError: besides :func:`fp8_gemm`'s errors, when ``out`` shares
            memory with an operand (the message names it output 'd').
    """
    _check_gemm_devices("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, "out", out)
    if _is_nvfp4(a, a_scale_inv, b, b_scale_inv):
        if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"fp8_gemm_accumulate: argument 'out' must be float32, bfloat16 or float16, got {out.dtype}"
            )
        # One float32 GEMM result added in out's dtype: rounded once, as the FP8 block-scaled path does.
        out.add_(nvfp4.nvfp4_gemm_packed(a, a_scale_inv, b, b_scale_inv, torch.float32))
        return
    scalings = resolve_gemm_scalings(a, a_scale_inv, b, b_scale_inv)
    if scalings.tensorwise:
        a_scale_inv, b_scale_inv = a_scale_inv.reshape(1), b_scale_inv.reshape(1)
        _fp8_gemm_accumulate_op(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator)
    else:
        _fp8_gemm_blockwise_accumulate_(a, a_scale_inv, b, b_scale_inv, out, scalings)
