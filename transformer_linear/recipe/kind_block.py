"""The ``"block"`` scaling kind: one float32 or E8M0 scale per block (128x128, 1x128, MX's 1x32, rowwise).

Every GEMM of a Linear contracts along a different dimension of two of the tensors, so each block-quantized
tensor comes in two layouts: the rowwise copy (blocks along its last dim) and the columnwise copy, the
transpose quantized from the high-precision tensor with the blocks along the other dim. A square block
(128x128) covers the same elements either way, so that copy is the rowwise one transposed; a non-square
block's (1x32, 1x128, rowwise) is a quantization of its own.

Scales whose shape depends on the batch leave ops 1-D (:meth:`BlockKind.quantize_flat`, the
``quantize_blockwise_flat`` op; ``scale_grid`` gives their 2-D shape back), so that a traced graph holds no
tensor with a row-block count as a size.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from transformer_linear import ops, reference
from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS
from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES
from transformer_linear.formats.grouped_scaling import GROUPED_GEMM_SCALINGS, TOKEN_BLOCKS, WHOLE, token_scale_cols
from transformer_linear.ops import library
from transformer_linear.ops.grouped import fp8_grouped_gemm, fp8_grouped_gemm_wgrad_blockwise
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise
from transformer_linear.recipe.kind import (
    Quantized,
    QuantizerFields,
    ScalingKind,
    block_for,
    no_usages,
    register_scaling_kind,
)
from transformer_linear.recipe.kind_tensorwise import transposed

__all__ = ["BlockKind", "block_range_stats", "flat", "token_block"]

_GEMM_SCALING_OF_BLOCK = {(1, 0): "RowWise", (1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128",
                          (1, 32): "BlockWise1x32"}
"""The block_shape -> scaled_mm ScalingType of its scales (block_scaling.fp8_gemm_scalings)."""


def token_block(q: QuantizerFields) -> int:
    """The token block of a block quantizer's grouped columnwise copy: its block along the row of the
    transposed tensor (WHOLE for rowwise scaling: one scale per column and group)."""
    return WHOLE if q.block_shape[1] == 0 else q.block_shape[1]


def flat(t: Tensor) -> Tensor:
    """A contiguous ``t`` as a 1-D view. Not ``reshape`` / ``view``: on symbolic sizes those check
    contiguity, which guards on each size being 1 (see BlockKind.quantize_flat)."""
    return t.as_strided((t.numel(),), (1,))


def block_range_stats(
    x: Tensor, dtype: torch.dtype, block_shape: tuple[int, int], scale_dtype: torch.dtype, power_2_scale: bool
) -> dict[str, float]:
    """numerics' range statistics of a 2-D tensor under block scaling (reference.quantize_blockwise_ref).

    ``scale`` is the smallest block scale (the block with the largest amax); a block's scale comes from its
    own amax and is never rounded up, so nothing saturates, and underflow counts the elements flushed within
    their block.
    """
    x = x.detach().float().reshape(-1, x.shape[-1])
    q, scale_inv = reference.quantize_blockwise_ref(x, dtype, block_shape, scale_dtype, power_2_scale)
    scale_inv = reference.e8m0_to_float(scale_inv) if scale_inv.dtype == reference.E8M0_DTYPE else scale_inv
    n = x.numel()
    underflow = ((q.float() == 0) & (x != 0)).sum().item() / n if n else 0.0
    return {
        "amax": float(reference.amax(x)) if n else 0.0,
        "scale": float(1 / scale_inv.max()) if n else 1.0,
        "underflow": underflow,
        "saturation": 0.0,
    }


class BlockKind(ScalingKind):
    """FP8 data with a float32 or E8M0 scale per block (see the module docstring)."""

    name = "block"

    def check(self, q: QuantizerFields) -> None:
        super().check(q)
        if len(q.block_shape) != 2 or q.dtype not in FP8_DTYPES or q.scale_dtype not in (torch.float32, E8M0_DTYPE):
            raise ValueError(
                "TensorQuantizer: the 'block' kind takes FP8 data with float32 or E8M0 scales of [rows, cols] blocks, "
                f"got {q.dtype} data, {q.scale_dtype} scales, blocks {q.block_shape}"
            )
        if q.e8m0_rounding not in E8M0_ROUNDINGS:
            raise ValueError(f"TensorQuantizer: 'e8m0_rounding' must be 'ceil' or 'floor', got {q.e8m0_rounding!r}")

    def gemm_scaling(self, q: QuantizerFields) -> str:
        scaling = _GEMM_SCALING_OF_BLOCK.get(tuple(q.block_shape))
        if scaling is None:
            raise ValueError(f"TensorQuantizer: no FP8 GEMM reads {list(q.block_shape)} blocks "
                             f"(the GEMMs read {[list(b) for b in _GEMM_SCALING_OF_BLOCK]})")
        return scaling

    def quantize(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, scale: Optional[Tensor] = None,
        dbias_dtype: Optional[torch.dtype] = None, global_amax: Optional[Tensor] = None,
    ) -> Quantized:
        """The usages asked for, in one pass; ``scale`` and ``dbias_dtype`` do not apply.

        A square block's columnwise copy is the rowwise one transposed (the same blocks), so only non-square
        blocks quantize the transpose from ``x``.

        Raises:
            ValueError: ``global_amax`` given (each block's scale is its own).
        """
        if global_amax is not None:
            raise ValueError("TensorQuantizer.quantize: 'global_amax' applies to NVFP4 quantizers only among block "
                             f"scales (each block's scale is its own), not to {q}")
        block = block_for(q, x.shape[1])
        # The declared block, not the resolved one: a one-column tensor's rowwise block is (1, 1), yet its
        # columnwise copy needs whole-row blocks of the transpose, not the (1, 1) blocks transposed.
        square = q.block_shape[0] == q.block_shape[1]
        # The fused pass reads a block as long as the row (bk >= K) as rowwise scaling and gives the
        # transpose whole-row blocks too; a 1x32 / 1x128 block on a short row must stay 1x32 / 1x128
        # along the other dimension, so that transpose is quantized on its own.
        separate_t = columnwise and not square and q.block_shape[1] > 0 and block[1] >= x.shape[1]
        quantize = functools.partial(ops.quantize_blockwise_fused, dtype=q.dtype, scale_dtype=q.scale_dtype,
                                     power_2_scale=q.power_2_scale, e8m0_rounding=q.e8m0_rounding)
        rowwise_pass = rowwise or (columnwise and square)
        columnwise_pass = columnwise and not square and not separate_t
        if rowwise_pass or columnwise_pass:
            out = quantize(x, block_shape=block, rowwise=rowwise_pass, columnwise=columnwise_pass)
        if separate_t:
            q_t, s_t, _, _ = quantize(x.t().contiguous(), block_shape=block_for(q, x.shape[0]))
            if not rowwise_pass:  # the transpose alone: empty rowwise slots, as the fused pass leaves them
                return Quantized(q_t.new_empty(0), s_t.new_empty((0, 0)), q_t, s_t)
            out = out._replace(data_t=q_t, scale_inv_t=s_t)
        if columnwise and square:
            # Copies even where the transpose is already contiguous (a (1, n) grid): outputs of one op may
            # not alias each other.
            data_t, scale_inv_t = self.transpose_copy(q, out.data, out.scale_inv)
            out = out._replace(data_t=data_t, scale_inv_t=scale_inv_t)
        return Quantized(*out)

    def quantize_flat(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, dbias_dtype: Optional[torch.dtype]
    ) -> Quantized:
        """The quantize as one op with 1-D scales.

        What a traced graph holds between ops: torch guards every size of a graph tensor against 1 (its
        contiguity metadata), and a 2-D scale's row-block count (ceil(M / 128) for a batch of M rows) is 1 for
        some batch sizes, so a graph holding it would specialize on M <= 128. The 1-D scale has
        (columns x row blocks) elements, never 1 for a batch of 2 rows or more. Asking for no usage gives
        empty tensors.
        """
        if not (rowwise or columnwise):
            return no_usages(q, x)
        out = _quantize_flat_op(
            x, q.dtype, list(q.block_shape), q.scale_dtype, q.power_2_scale, rowwise, columnwise, q.e8m0_rounding,
        )
        return Quantized(*out)

    def dequantize(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
        rows, cols = data.shape[0], data.shape[1]
        bm, bk = block_for(q, cols)
        scale = scale_inv.reshape(self.scale_grid(q, rows, cols)).float()
        scale = scale.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
        return (data.float() * scale).to(dtype)

    def columnwise_is_transpose(self, q: QuantizerFields) -> bool:
        return q.block_shape[0] == q.block_shape[1]

    def transpose_copy(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor) -> tuple[Tensor, Tensor]:
        if not self.columnwise_is_transpose(q):
            return super().transpose_copy(q, data, scale_inv)
        return transposed(data), transposed(scale_inv)

    def grouped_problem(self, input: QuantizerFields, weight: QuantizerFields,
                        grad_output: QuantizerFields) -> Optional[str]:
        # The grouped wgrad's copies have 1 x B token blocks restarting at each group (B 128, 32 or the whole
        # group, formats/grouped_scaling.py); the forward and dgrad pair each activation scaling with the weight's.
        for role, q in (("input", input), ("grad_output", grad_output)):
            block = token_block(q)
            if q.block_shape[0] != 1 or block not in TOKEN_BLOCKS or TOKEN_BLOCKS[block] != q.scale_dtype:
                return (f"quantizes the {role} in {list(q.block_shape)} blocks of {q.scale_dtype} scales (the grouped "
                        "weight gradient takes 1x128 / 1x0 float32 or 1x32 E8M0 blocks)")
            pair = (self.gemm_scaling(q), self.gemm_scaling(weight))
            if pair not in GROUPED_GEMM_SCALINGS:
                return f"pairs {pair[0]} {role} scales with {pair[1]} weight scales"
        if input.block_shape != grad_output.block_shape:
            return (f"quantizes the input in {list(input.block_shape)} blocks and grad_output in "
                    f"{list(grad_output.block_shape)} blocks (the grouped weight gradient takes one token block)")
        return None

    def grouped_gemm(
        self, q_a: QuantizerFields, a: Tensor, a_scale_inv: Tensor, q_b: QuantizerFields, b: Tensor,
        b_scale_inv: Tensor, offs: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> Tensor:
        scalings = (self.gemm_scaling(q_a), self.gemm_scaling(q_b))
        return fp8_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, scalings=scalings)

    def grouped_columnwise(
        self, q: QuantizerFields, t: Tensor, offs: Tensor, rowwise: Optional[Quantized]
    ) -> tuple[Tensor, Tensor]:
        # Blocks restart at each group's first token; the scales 1-D (no graph guard on a grid size of 1).
        out = quantize_grouped_columnwise(t, offs, q.dtype, token_block(q), q.power_2_scale, q.e8m0_rounding)
        return out.data_t, flat(out.scale_inv_t)

    def grouped_wgrad(
        self, q: QuantizerFields, grad: Tensor, grad_scale_inv: Tensor, x: Tensor, x_scale_inv: Tensor,
        offs: Tensor, out_dtype: torch.dtype,
    ) -> Tensor:
        block = token_block(q)

        def grid(data: Tensor, scale_inv: Tensor) -> Tensor:
            return scale_inv.reshape(data.shape[0], token_scale_cols(data.shape[1], offs.shape[0], block))

        return fp8_grouped_gemm_wgrad_blockwise(grad, grid(grad, grad_scale_inv), x, grid(x, x_scale_inv), offs,
                                                out_dtype, block)

    def range_stats(self, q: QuantizerFields, x: Tensor, scale: Optional[Tensor]) -> dict[str, float]:
        return block_range_stats(x, q.dtype, block_for(q, x.shape[-1]), q.scale_dtype, q.power_2_scale)


BLOCK = register_scaling_kind(BlockKind())


def _flat_scales(
    x: Tensor, dtype: torch.dtype, block_shape: list[int], scale_dtype: torch.dtype, power_2_scale: bool,
    rowwise: bool, columnwise: bool, e8m0_rounding: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """BlockKind.quantize_flat's op: a quantizer's fields in, 1-D scales out."""
    fields = _BlockFields(dtype, list(block_shape), scale_dtype, power_2_scale, e8m0_rounding)
    out = BLOCK.quantize(fields, x, rowwise, columnwise)
    return out.data, flat(out.scale_inv), out.data_t, flat(out.scale_inv_t)


class _BlockFields:
    """The quantizer fields BlockKind.quantize reads, rebuilt from the op's arguments."""

    def __init__(self, dtype: torch.dtype, block_shape: list[int], scale_dtype: torch.dtype, power_2_scale: bool,
                 e8m0_rounding: str) -> None:
        self.dtype, self.block_shape, self.scale_dtype = dtype, block_shape, scale_dtype
        self.power_2_scale, self.e8m0_rounding = power_2_scale, e8m0_rounding


# Made of custom ops and views only, so it is its own fake implementation.
_quantize_flat_op = library.custom_op("transformer_linear::quantize_blockwise_flat", mutates_args=())(
    _flat_scales
)
_quantize_flat_op.register_fake(_flat_scales)
