"""Block-scaled FP8 ops: blockwise quantize, and the kernels of block-scaled GEMMs.

A scale per block of the tensor instead of one per tensor: 1x128 / 128x128
tiles (DeepSeek-V3, TE ``Float8BlockScaling``), 1x32 blocks with E8M0 scales
(OCP MXFP8) and one scale per row (torchao's rowwise). Each op is a
``torch.library`` custom op with a fake implementation; CPU tensors run the
extension's kernels, CUDA tensors the Triton kernels of
``transformer_linear.ops.triton`` (block-scaled GEMMs: cuBLASLt's block-scaled
matmul where the GPU and build have it, see ``ops.gemm_block_cuda``), each
registered for its device. ``ops.fp8_gemm`` routes block scales here (through
the private ``_fp8_gemm_blockwise*`` functions, which take the scalings
``block_scaling.resolve_gemm_scalings`` found: each operand's ScalingType and
block, passed down to the kernels as they are); the public functions are
re-exported by ``ops``.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.block_scaling import (
    BlockQuantizeOutput,
    GemmScalings,
    blockwise_outputs,
    check_quantize_blockwise_args,
    check_scale_dtype,
    columnwise_block_shape,
)
from transformer_linear.formats.checks import check_hp_dtype, check_same_device, check_scale_values, gemm_out_shape
from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.ops import gemm_block_cuda, library, triton_route
from transformer_linear.ops.descriptors import desc, stream_for

__all__ = ["quantize_blockwise", "quantize_blockwise_fused"]


def _check_block_gemm_op(op, a, a_scale_inv, b, b_scale_inv, bias, out):
    """What the block-GEMM ops check themselves (called directly through ``torch.ops``, they have no
    Python entry before them): one device (a 'meta' tensor among CPU tensors would route the call to
    the fake implementation) and the scale dtypes. Scale values: _run_blockwise_gemm (CPU only)."""
    check_same_device(
        op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, "bias": bias, "out": out},
        optional=("bias", "out"),
    )
    check_scale_dtype(op, "a_scale_inv", a_scale_inv.dtype)
    check_scale_dtype(op, "b_scale_inv", b_scale_inv.dtype)


def _kernel_scale(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales cross into the kernels as their uint8 bits."""
    return t.view(torch.uint8) if t.dtype == E8M0_DTYPE else t


@library.custom_op("transformer_linear::fp8_gemm_blockwise", device_types="cpu")
def _fp8_gemm_blockwise_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: list[int],
    b_block: list[int],
    a_scaling: str,
    b_scaling: str,
) -> torch.Tensor:
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    out = torch.empty(gemm_out_shape(a, b), dtype=out_dtype, device=a.device)
    _run_blockwise_gemm("fp8_gemm", a, a_scale_inv, b, b_scale_inv, a_block, b_block, bias, out, accumulate=False)
    return out


def _run_blockwise_gemm(op, a, a_scale_inv, b, b_scale_inv, a_block, b_block, bias, out, accumulate):
    """The extension's block-scaled GEMM into ``out`` (= or +=), after checking the scale values."""
    check_scale_values(op, {"a_scale_inv": a_scale_inv, "b_scale_inv": b_scale_inv})
    _C.fp8_gemm_blockwise(
        desc(a, op, "a"),
        desc(_kernel_scale(a_scale_inv), op, "a_scale_inv"),
        desc(b, op, "b"),
        desc(_kernel_scale(b_scale_inv), op, "b_scale_inv"),
        a_block[0],
        a_block[1],
        b_block[0],
        b_block[1],
        desc(bias, op, "bias"),
        desc(out, op, "d"),
        accumulate,
        stream_for(a),
    )


def _cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings: GemmScalings):
    """cuBLASLt's block-scaled matmul where it takes the pair (gemm_block_cuda.py), the Triton GEMM otherwise."""
    out = gemm_block_cuda.fp8_gemm_cublaslt(
        a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings.a_scaling, scalings.b_scaling
    )
    if out is None:
        out = triton_route.kernels().fp8_gemm_resolved(
            a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings.a_block, scalings.b_block
        )
    return out


def _op_scalings(a_block: list[int], b_block: list[int], a_scaling: str, b_scaling: str) -> GemmScalings:
    return GemmScalings(a_scaling, tuple(a_block), b_scaling, tuple(b_block))


@_fp8_gemm_blockwise_op.register_kernel("cuda")
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block, a_scaling, b_scaling):
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    scalings = _op_scalings(a_block, b_block, a_scaling, b_scaling)
    return _cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings)


@_fp8_gemm_blockwise_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block, a_scaling, b_scaling):
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    return a.new_empty(gemm_out_shape(a, b), dtype=out_dtype)


def _fp8_gemm_blockwise(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    scalings: GemmScalings,
) -> torch.Tensor:
    """The block-scaled GEMM for the scalings ``ops.fp8_gemm`` resolved (block_scaling.resolve_gemm_scalings).

    Private: ``ops.fp8_gemm`` is the public entry; it validates the operands
    and resolves each operand's ScalingType and block from its scale tensor.
    """
    a_scaling, a_block, b_scaling, b_block = scalings
    a_scale_inv, b_scale_inv = _block_grid(a_scale_inv, a_scaling), _block_grid(b_scale_inv, b_scaling)
    if triton_route.routes(a) and not gemm_block_cuda.cublaslt_takes(a, b, a_scaling, b_scaling):
        return triton_route.kernels().fp8_gemm_resolved(
            a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block
        )
    return library.call(
        _fp8_gemm_blockwise_op,
        a, a_scale_inv, b, b_scale_inv, out_dtype, bias, list(a_block), list(b_block), a_scaling, b_scaling
    )


def _block_grid(scale_inv: torch.Tensor, scaling: str) -> torch.Tensor:
    """An operand's scale_inv as the block kernels read it, a 2-D grid of its blocks: a TensorWise scale
    (one element of any shape, paired with a block-scaled operand) is a 1x1 grid of one block."""
    return scale_inv.reshape(1, 1) if scaling == "TensorWise" else scale_inv


@library.custom_op("transformer_linear::quantize_blockwise", device_types="cpu")
def _quantize_blockwise_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: list[int],
    scale_dtype: torch.dtype,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
    e8m0_floor: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s, q_t, s_t = blockwise_outputs(x, dtype, block_shape, scale_dtype, rowwise, columnwise)
    bt = columnwise_block_shape(tuple(block_shape), *x.shape)
    op = "quantize_blockwise"
    _C.quantize_blockwise(
        desc(x, op, "x"),
        desc(q, op, "output") if rowwise else None,
        desc(_kernel_scale(s), op, "scale_inv") if rowwise else None,
        desc(q_t, op, "output_t") if columnwise else None,
        desc(_kernel_scale(s_t), op, "scale_inv_t") if columnwise else None,
        block_shape[0],
        block_shape[1],
        bt[0],
        bt[1],
        power_2_scale,
        e8m0_floor,
        stream_for(x),
    )
    return q, s, q_t, s_t


@_quantize_blockwise_op.register_kernel("cuda")
def _(x, dtype, block_shape, scale_dtype, power_2_scale, rowwise, columnwise, e8m0_floor):
    rounding = "floor" if e8m0_floor else "ceil"
    return triton_route.kernels().quantize_blockwise_fused(
        x, dtype, tuple(block_shape), scale_dtype, power_2_scale, rowwise=rowwise, columnwise=columnwise,
        e8m0_rounding=rounding,
    )


@_quantize_blockwise_op.register_fake
def _(x, dtype, block_shape, scale_dtype, power_2_scale, rowwise, columnwise, e8m0_floor):
    return blockwise_outputs(x, dtype, block_shape, scale_dtype, rowwise, columnwise)


def quantize_blockwise_fused(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    e8m0_rounding: str = "ceil",
) -> BlockQuantizeOutput:
    """Blockwise quantize producing the row-major and/or the transposed copy from one pass.

    Numerics: reference.quantize_blockwise_ref. The transposed copy is
    ``quantize_blockwise(x.t(), ...)`` with the block of columnwise_block_shape.

    Args:
        x: contiguous (M, K) float32, bfloat16 or float16.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        block_shape: (bm, bk): (1, 128), (128, 128), (1, 32), (1, K), ...
        scale_dtype: torch.float32 or torch.float8_e8m0fnu (MX).
        power_2_scale: round float32 scales down to powers of two.
        rowwise: produce data / scale_inv.
        columnwise: produce data_t / scale_inv_t.
        e8m0_rounding: E8M0 scales only: "ceil" (default; TE and cuBLAS,
            torchao's ``ScaleCalculationMode.RCEIL``) or "floor" (the OCP MX
            spec, torchao's ``ScaleCalculationMode.FLOOR``); the rules are
            reference.e8m0_exponent's.
    """
    bm, bk = check_quantize_blockwise_args(x, dtype, block_shape, scale_dtype, e8m0_rounding)
    if not (rowwise or columnwise):
        raise ValueError("quantize_blockwise: at least one of 'rowwise' and 'columnwise' must be True")
    if triton_route.routes(x):
        return triton_route.kernels().quantize_blockwise_fused(
            x, dtype, (bm, bk), scale_dtype, power_2_scale, rowwise=rowwise, columnwise=columnwise,
            e8m0_rounding=e8m0_rounding,
        )
    out = library.call(
        _quantize_blockwise_op,
        x, dtype, [bm, bk], scale_dtype, bool(power_2_scale), rowwise, columnwise, e8m0_rounding == "floor"
    )
    return BlockQuantizeOutput(*out)


def quantize_blockwise(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    e8m0_rounding: str = "ceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``x`` with one scale per ``block_shape`` block; returns ``(q, scale_inv)``.

    scale_inv has shape (ceil(M / bm), ceil(K / bk)); partial edge blocks use
    the amax of what they hold. Numerics: reference.quantize_blockwise_ref.
    Arguments as :func:`quantize_blockwise_fused`'s.
    """
    out = quantize_blockwise_fused(x, dtype, block_shape, scale_dtype, power_2_scale, e8m0_rounding=e8m0_rounding)
    return out.data, out.scale_inv


@library.custom_op(
    "transformer_linear::fp8_gemm_blockwise_accumulate", mutates_args=("out",), device_types="cpu"
)
def _fp8_gemm_blockwise_accumulate_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    a_block: list[int],
    b_block: list[int],
    a_scaling: str,
    b_scaling: str,
) -> None:
    op = "fp8_gemm_accumulate"
    _check_block_gemm_op(op, a, a_scale_inv, b, b_scale_inv, None, out)
    _run_blockwise_gemm(op, a, a_scale_inv, b, b_scale_inv, a_block, b_block, None, out, accumulate=True)


@_fp8_gemm_blockwise_accumulate_op.register_kernel("cuda")
def _(a, a_scale_inv, b, b_scale_inv, out, a_block, b_block, a_scaling, b_scaling):
    _check_block_gemm_op("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, None, out)
    # Neither cuBLASLt's block-scaled matmul nor the Triton GEMM accumulates into out here: an fp32 result, added.
    scalings = _op_scalings(a_block, b_block, a_scaling, b_scaling)
    out.add_(_cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32, None, scalings))


@_fp8_gemm_blockwise_accumulate_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out, a_block, b_block, a_scaling, b_scaling):
    _check_block_gemm_op("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, None, out)
    return None


def _fp8_gemm_blockwise_accumulate_(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    scalings: GemmScalings,
) -> None:
    """out += block-scaled (a @ b.T), in place, for the scalings ``ops.fp8_gemm_accumulate_`` resolved.

    Private: ``ops.fp8_gemm_accumulate_`` is the public entry (block scales route here).
    Each K-block's fp32 partial sum is promoted with its two block scales into
    an fp32 total, which is added to ``out`` in float32 and rounded once to
    ``out``'s dtype (on the CPU no separate product tensor is made).
    """
    a_scaling, a_block, b_scaling, b_block = scalings
    a_scale_inv, b_scale_inv = _block_grid(a_scale_inv, a_scaling), _block_grid(b_scale_inv, b_scaling)
    _fp8_gemm_blockwise_accumulate_op(
        a, a_scale_inv, b, b_scale_inv, out, list(a_block), list(b_block), a_scaling, b_scaling
    )
