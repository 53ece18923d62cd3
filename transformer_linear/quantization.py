"""How a recipe quantizes the Linear's three tensors: the one place that reads the recipe class.

:func:`quantization_spec` turns a recipe into a :class:`QuantizationSpec`, a
frozen description of how ``input``, ``weight`` and ``grad_output`` are
quantized (a :class:`TensorQuantizer` each). The forward, dgrad and wgrad code
of linear_ops.py consults the spec, never the recipe, so a new recipe is a new
entry in ``_SPEC_BUILDERS`` here and nothing else.

Tensorwise quantizers (``block_shape == []``) keep the delayed / current
scaling path with its one scale per tensor. Block quantizers describe one
scale per ``block_shape`` block (``[1, 0]``: a scale per whole row), of
``scale_dtype`` (float32, or E8M0 for MX). Every GEMM of a Linear contracts
along a different dimension of two of the tensors, so each block-quantized
tensor comes in two layouts: the rowwise copy (blocks along its last dim) and
the columnwise copy, the transpose quantized from the high-precision tensor
with the blocks along the other dim. A square block (128x128) covers the same
elements either way, so that copy is the rowwise one transposed.

Scales whose shape depends on the batch leave ops 1-D (``quantize_flat``, the
``quantize_blockwise_flat`` op; ``scale_grid`` gives their 2-D shape back), so
that a traced graph holds no tensor with a row-block count as a size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear import layout, ops
from transformer_linear.recipe import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    Recipe,
)
from transformer_linear.block_scaling import E8M0_ROUNDINGS
from transformer_linear.dtypes import E8M0_DTYPE, FP8_DTYPES

__all__ = [
    "BlockQuantized",
    "QuantizationSpec",
    "TensorQuantizer",
    "flat",
    "quantization_spec",
    "quantize_tensorwise",
]


class BlockQuantized(NamedTuple):
    """A block-quantized 2-D tensor in its two layouts (an unrequested layout is empty)."""

    data: Tensor
    """FP8 (M, K), blocks along K."""
    scale_inv: Tensor
    data_t: Tensor
    """FP8 (K, M): the transpose with blocks along M (what a GEMM contracting over M reads)."""
    scale_inv_t: Tensor


@dataclasses.dataclass(frozen=True)
class TensorQuantizer:
    """How one tensor is quantized.

    Attributes:
        dtype: the FP8 dtype.
        block_shape: ``[]``: one scale for the tensor (delayed or current
            scaling); ``[bm, bk]``: one scale per block, ``bk == 0`` meaning
            the whole row (rowwise scaling).
        scale_dtype: float32, or torch.float8_e8m0fnu (MX) for block scales.
        power_2_scale: round float32 block scales down to powers of two.
        e8m0_rounding: E8M0 scales' rounding, "ceil" or "floor" (reference.e8m0_exponent).
    """

    dtype: torch.dtype
    block_shape: list[int]
    scale_dtype: torch.dtype
    power_2_scale: bool
    e8m0_rounding: str = "ceil"

    def __post_init__(self) -> None:
        if self.dtype not in FP8_DTYPES:
            raise TypeError(f"TensorQuantizer: 'dtype' must be an FP8 dtype, got {self.dtype}")
        if len(self.block_shape) not in (0, 2) or any(b < 0 for b in self.block_shape):
            raise ValueError(f"TensorQuantizer: 'block_shape' must be [] or [rows, cols >= 0], got {self.block_shape}")
        if self.scale_dtype not in (torch.float32, E8M0_DTYPE):
            raise TypeError(f"TensorQuantizer: 'scale_dtype' must be float32 or float8_e8m0fnu, got {self.scale_dtype}")
        if self.e8m0_rounding not in E8M0_ROUNDINGS:
            raise ValueError(f"TensorQuantizer: 'e8m0_rounding' must be 'ceil' or 'floor', got {self.e8m0_rounding!r}")

    @property
    def blockwise(self) -> bool:
        """One scale per block rather than per tensor."""
        return bool(self.block_shape)

    def block_for(self, cols: int) -> tuple[int, int]:
        """The (bm, bk) block of a tensor with ``cols`` columns (rowwise: the whole row)."""
        bm, bk = self.block_shape
        # int(): the ops take a concrete block; a Linear's row length (in/out_features) is static anyway.
        return bm, (bk if bk > 0 else max(int(cols), 1))

    def scale_grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The 2-D shape of the scale_inv of a (rows, cols) tensor quantized rowwise with these blocks
        (a columnwise copy is such a tensor too: the transpose, with blocks along its rows)."""
        bm, bk = self.block_for(cols)
        return -(-rows // bm), -(-cols // bk)

    def quantize_flat(self, x: Tensor, rowwise: bool = True, columnwise: bool = False) -> BlockQuantized:
        """:meth:`quantize` with 1-D scales (``scale_grid`` gives them back their shape), as one op.

        What a traced graph holds between ops: torch guards every size of a graph tensor against 1
        (its contiguity metadata), and a 2-D scale's row-block count (ceil(M / 128) for a batch of M
        rows) is 1 for some batch sizes, so a graph holding it would specialize on M <= 128. The 1-D
        scale has (columns x row blocks) elements, never 1 for a batch of 2 rows or more.
        """
        out = _quantize_flat_op(
            x, self.dtype, list(self.block_shape), self.scale_dtype, self.power_2_scale, rowwise, columnwise,
            self.e8m0_rounding,
        )
        return BlockQuantized(*out)

    def quantize(self, x: Tensor, rowwise: bool = True, columnwise: bool = False) -> BlockQuantized:
        """Block-quantize a contiguous 2-D ``x`` into the requested layouts, in one pass.

        A square block's columnwise copy is the rowwise one transposed (the same
        blocks), so only non-square blocks quantize the transpose from ``x``.
        """
        block = self.block_for(x.shape[1])
        # The declared block, not the resolved one: a one-column tensor's rowwise block is (1, 1), yet its
        # columnwise copy needs whole-row blocks of the transpose, not the (1, 1) blocks transposed.
        square = self.block_shape[0] == self.block_shape[1]
        # The fused pass reads a block as long as the row (bk >= K) as rowwise scaling and gives the
        # transpose whole-row blocks too; a 1x32 / 1x128 block on a short row must stay 1x32 / 1x128
        # along the other dimension, so that transpose is quantized on its own.
        separate_t = columnwise and not square and self.block_shape[1] > 0 and block[1] >= x.shape[1]
        quantize = functools.partial(ops.quantize_blockwise_fused, dtype=self.dtype, scale_dtype=self.scale_dtype,
                                     power_2_scale=self.power_2_scale, e8m0_rounding=self.e8m0_rounding)
        rowwise_pass = rowwise or (columnwise and square)
        columnwise_pass = columnwise and not square and not separate_t
        if rowwise_pass or columnwise_pass:
            out = quantize(x, block_shape=block, rowwise=rowwise_pass, columnwise=columnwise_pass)
        if separate_t:
            q_t, s_t, _, _ = quantize(x.t().contiguous(), block_shape=self.block_for(x.shape[0]))
            if not rowwise_pass:  # the transpose alone: empty rowwise slots, as the fused pass leaves them
                return BlockQuantized(q_t.new_empty(0), s_t.new_empty((0, 0)), q_t, s_t)
            out = out._replace(data_t=q_t, scale_inv_t=s_t)
        if columnwise and square:
            # Copies even where the transpose is already contiguous (a (1, n) grid): outputs of one op may
            # not alias each other.
            def transposed_copy(t: Tensor) -> Tensor:
                return t.t().clone(memory_format=torch.contiguous_format)

            out = out._replace(data_t=transposed_copy(out.data), scale_inv_t=transposed_copy(out.scale_inv))
        return BlockQuantized(*out)


def flat(t: Tensor) -> Tensor:
    """A contiguous ``t`` as a 1-D view. Not ``reshape`` / ``view``: on symbolic sizes those check
    contiguity, which guards on each size being 1 (see TensorQuantizer.quantize_flat)."""
    return t.as_strided((t.numel(),), (1,))


def _flat_scales(
    x: Tensor, dtype: torch.dtype, block_shape: list[int], scale_dtype: torch.dtype, power_2_scale: bool,
    rowwise: bool, columnwise: bool, e8m0_rounding: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """TensorQuantizer.quantize_flat's op: a quantizer's fields in, 1-D scales out."""
    quantizer = TensorQuantizer(dtype, list(block_shape), scale_dtype, power_2_scale, e8m0_rounding)
    q = quantizer.quantize(x, rowwise, columnwise)
    return q.data, flat(q.scale_inv), q.data_t, flat(q.scale_inv_t)


# Made of custom ops and views only, so it is its own fake implementation.
_quantize_flat_op = torch.library.custom_op("transformer_linear::quantize_blockwise_flat", mutates_args=())(
    _flat_scales
)
_quantize_flat_op.register_fake(_flat_scales)


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
    """How a recipe quantizes the Linear's input, weight and grad_output."""

    input: TensorQuantizer
    weight: TensorQuantizer
    grad_output: TensorQuantizer

    @property
    def blockwise(self) -> bool:
        """Block scales (all three tensors are block-quantized or none is; see quantization_spec)."""
        return self.input.blockwise


def _tensorwise(recipe: DelayedScaling | CurrentScaling) -> QuantizationSpec:
    fmt = recipe.fp8_format
    fwd, bwd = (TensorQuantizer(d, [], torch.float32, False) for d in (fmt.fwd_dtype, fmt.bwd_dtype))
    return QuantizationSpec(fwd, fwd, bwd)


def _float8_block(recipe: Float8BlockScaling) -> QuantizationSpec:
    fmt, p2 = recipe.fp8_format, recipe.power_2_scale
    return QuantizationSpec(
        TensorQuantizer(fmt.fwd_dtype, list(recipe.x_block_shape), torch.float32, p2),
        TensorQuantizer(fmt.fwd_dtype, list(recipe.w_block_shape), torch.float32, p2),
        TensorQuantizer(fmt.bwd_dtype, list(recipe.grad_block_shape), torch.float32, p2),
    )


def _mxfp8(recipe: MXFP8BlockScaling) -> QuantizationSpec:
    fmt = recipe.fp8_format
    fwd, bwd = (
        TensorQuantizer(d, [1, 32], E8M0_DTYPE, False, recipe.e8m0_rounding) for d in (fmt.fwd_dtype, fmt.bwd_dtype)
    )
    return QuantizationSpec(fwd, fwd, bwd)


def _rowwise(recipe: Float8RowwiseScaling) -> QuantizationSpec:
    fmt, p2 = recipe.fp8_format, recipe.power_2_scale
    fwd, bwd = (TensorQuantizer(d, [1, 0], torch.float32, p2) for d in (fmt.fwd_dtype, fmt.bwd_dtype))
    return QuantizationSpec(fwd, fwd, bwd)


_SPEC_BUILDERS: dict[type, Callable[..., QuantizationSpec]] = {
    DelayedScaling: _tensorwise,
    CurrentScaling: _tensorwise,
    Float8BlockScaling: _float8_block,
    MXFP8BlockScaling: _mxfp8,
    Float8RowwiseScaling: _rowwise,
}

# What the Linear runs without a recipe (high precision); only its dtypes are read.
NO_QUANTIZATION = _tensorwise(CurrentScaling())


def quantization_spec(recipe: Recipe) -> QuantizationSpec:
    """The :class:`QuantizationSpec` of ``recipe``.

    Raises:
        TypeError: ``recipe`` is not one of recipe.py's recipes.
    """
    builder = _SPEC_BUILDERS.get(type(recipe))
    if builder is None:
        names = ", ".join(t.__name__ for t in _SPEC_BUILDERS)
        raise TypeError(f"'recipe' must be one of {names}, got {recipe!r}")
    return builder(recipe)


def quantize_tensorwise(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int, **kwargs: Any
) -> ops.QuantizeOutput:
    """``ops.quantize_fused`` (``scale`` None: current scaling) with the transposed copy where the backend
    needs it (``layout.needs_columnwise``)."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=layout.needs_columnwise(x.device), **kwargs)
