"""How a recipe quantizes the Linear's three tensors: the one place that reads the recipe class.

:func:`quantization_spec` turns a recipe into a :class:`QuantizationSpec`: one
:class:`TensorQuantizer` per tensor role (``input``, ``weight``,
``grad_output``), as Transformer Engine's Float8Quantizer /
Float8CurrentScalingQuantizer / Float8BlockQuantizer / MXFP8Quantizer, without
tensor subclasses. A quantizer knows its data and scale dtypes, its blocks, its
margin, whether its scale comes from the layer's delayed-scaling state, how to
quantize (every recipe's result is a :class:`Quantized`), how a GEMM reads each
usage of that result and which ScalingType it resolves to. linear.py and
linear_ops.py ask the quantizers, never the recipe: a recipe whose quantizers the
kernels support is a new entry in ``_SPEC_BUILDERS`` here, or a ``recipe.CustomRecipe`` whose
factory returns them (no edit of the package at all). A subclass of a recipe class is built as
that class.

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

from transformer_linear import ops
from transformer_linear.formats import layout
from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS
from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES
from transformer_linear.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from transformer_linear.formats.nvfp4 import E2M1_VALUES
from transformer_linear.recipe import (
    BACKWARD_OVERRIDES,
    CUSTOM_RECIPE_ROLES,
    CurrentScaling,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8RowwiseScaling,
    HistoryConfig,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

FP4_STORAGE_DTYPE = torch.uint8
"""How a quantizer holds FP4 data (two E2M1 codes a byte, formats/nvfp4.py): torch.export cannot save float4
dtypes, in tensors or as op arguments, so a quantizer given ``torch.float4_e2m1fn_x2`` keeps this dtype."""
DATA_DTYPES = (*FP8_DTYPES, torch.float4_e2m1fn_x2, FP4_STORAGE_DTYPE)
"""What a quantizer's data may be: FP8, or FP4 (two E2M1 values a byte; ``torch.float4_e2m1fn_x2`` or its
storage dtype uint8) with E4M3 scales per 1x16 or 16x16 block (NVFP4, ops/nvfp4.py)."""
_NVFP4_BLOCKS = ([1, 16], [16, 16])
QUANTIZER_SCALE_DTYPES = (torch.float32, E8M0_DTYPE, torch.float8_e4m3fn)
"""What its scale_inv may be: float32, E8M0 (MX blocks) or E4M3 (FP4 blocks)."""

__all__ = [
    "DATA_DTYPES",
    "FP4_STORAGE_DTYPE",
    "QUANTIZER_SCALE_DTYPES",
    "QuantizationSpec",
    "Quantized",
    "TensorQuantizer",
    "check_recipe",
    "flat",
    "quantization_spec",
    "quantize_tensorwise",
    "tensorwise_result",
]


class Quantized(NamedTuple):
    """What a quantizer returns, for every recipe: a 2-D tensor in the usages it produced (an
    unproduced one is empty).

    NVFP4 (``TensorQuantizer.is_nvfp4``): each usage is its own copy, uint8 data (two E2M1 codes a
    byte, (M, K/2) and (K, M/2)) and 1-D packed scales: the float32 global decode scale (8 elements of
    4 bits), then the E4M3 block scales (ops.nvfp4.pack_scales), so the one scale tensor a usage has
    carries both and every op of the Linear passes it along unchanged; ops.fp8_gemm unpacks it.

    One scale per tensor: ``data_t`` is ``data`` transposed where the backend's GEMM wants it
    materialized (layout.needs_columnwise), sharing ``scale_inv``; ``scale_inv_t`` is empty. Block
    scales: ``data_t`` is the columnwise copy, quantized with blocks along the other dimension, with its
    own ``scale_inv_t``.
    """

    data: Tensor
    """Rowwise usage: (M, K), blocks along K."""
    scale_inv: Tensor
    data_t: Tensor
    """Columnwise usage: (K, M), what a GEMM contracting over M reads."""
    scale_inv_t: Tensor
    amax: Optional[Tensor] = None
    """One scale per tensor: the 0-dim amax the quantize pass measured (what delayed scaling records);
    None for block scales."""
    dbias: Optional[Tensor] = None
    """Column sums fused into a per-tensor quantize pass (a bias gradient; empty when not asked for);
    None where the quantizer does not fuse them."""


_GEMM_SCALING_OF_BLOCK = {(1, 0): "RowWise", (1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128",
                          (1, 32): "BlockWise1x32"}
"""The block_shape -> scaled_mm ScalingType of its scales (block_scaling.fp8_gemm_scalings)."""


@dataclasses.dataclass(frozen=True)
class TensorQuantizer:
    """How one tensor role (input, weight or grad_output) is quantized.

    The forward and backward ask it how to quantize, which usages its result holds and how a GEMM reads
    them; they never ask which recipe made it. The input and weight are read rowwise by the forward GEMM
    and columnwise by wgrad / dgrad; grad_output rowwise by dgrad and columnwise by wgrad.

    Attributes:
        dtype: the data dtype (an FP8 format; FP4 for recipes whose kernels take it).
        block_shape: ``[]``: one scale for the tensor (delayed or current
            scaling); ``[bm, bk]``: one scale per block, ``bk == 0`` meaning
            the whole row (rowwise scaling).
        scale_dtype: the dtype of scale_inv: float32, E8M0 (MX) or E4M3 (FP4 block scales).
        power_2_scale: round float32 block scales down to powers of two.
        e8m0_rounding: E8M0 scales' rounding, "ceil" or "floor" (reference.e8m0_exponent).
        margin: one scale per tensor: power-of-two head room of the scale.
        scale_from_history: the scale is handed in from the layer's delayed-scaling state (its amax
            history, delayed_scaling.py) rather than computed from the tensor being quantized.
        rht: NVFP4, 1x16 blocks: the columnwise copy is quantized after a random Hadamard transform of each
            16-element block along its rows (formats/nvfp4.hadamard_transform). Both operands of a GEMM
            over that dimension must be transformed (wgrad: input and grad_output), which cancels it.
        stochastic_rounding: NVFP4: round to E2M1 stochastically, with a seed drawn per quantize from
            torch's default generator (ops.nvfp4.sr_seed).
    """

    dtype: torch.dtype
    block_shape: list[int]
    scale_dtype: torch.dtype
    power_2_scale: bool
    e8m0_rounding: str = "ceil"
    margin: int = 0
    scale_from_history: bool = False
    rht: bool = False
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if self.dtype == torch.float4_e2m1fn_x2:
            object.__setattr__(self, "dtype", FP4_STORAGE_DTYPE)
        if self.dtype not in DATA_DTYPES:
            raise TypeError(f"TensorQuantizer: 'dtype' must be one of {DATA_DTYPES}, got {self.dtype}")
        if len(self.block_shape) not in (0, 2) or any(b < 0 for b in self.block_shape):
            raise ValueError(f"TensorQuantizer: 'block_shape' must be [] or [rows, cols >= 0], got {self.block_shape}")
        if self.scale_dtype not in QUANTIZER_SCALE_DTYPES:
            raise TypeError(
                f"TensorQuantizer: 'scale_dtype' must be one of {QUANTIZER_SCALE_DTYPES}, got {self.scale_dtype}"
            )
        if self.e8m0_rounding not in E8M0_ROUNDINGS:
            raise ValueError(f"TensorQuantizer: 'e8m0_rounding' must be 'ceil' or 'floor', got {self.e8m0_rounding!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin < 127:
            raise ValueError(f"TensorQuantizer: 'margin' must be an integer in [0, 127), got {self.margin!r}")
        if self.block_shape and (self.margin or self.scale_from_history):
            raise ValueError("TensorQuantizer: 'margin' and 'scale_from_history' apply to one scale per tensor only")
        for name in ("rht", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TensorQuantizer: '{name}' must be a bool, got {getattr(self, name)!r}")
        if self.is_nvfp4:
            if list(self.block_shape) not in _NVFP4_BLOCKS or self.scale_dtype != torch.float8_e4m3fn:
                raise ValueError(
                    "TensorQuantizer: FP4 data takes float8_e4m3fn scales of [1, 16] or [16, 16] blocks (NVFP4), "
                    f"got {self.scale_dtype} scales of {self.block_shape} blocks"
                )
            if self.rht and self.block_shape != [1, 16]:
                raise ValueError("TensorQuantizer: 'rht' applies to [1, 16] blocks only (a 16x16 tile's copies are "
                                 "each other's transpose)")
        elif self.rht or self.stochastic_rounding:
            raise ValueError("TensorQuantizer: 'rht' and 'stochastic_rounding' apply to FP4 (NVFP4) data only")

    @property
    def is_nvfp4(self) -> bool:
        """FP4 data with E4M3 block scales and a float32 global scale (ops/nvfp4.py)."""
        return self.dtype == FP4_STORAGE_DTYPE

    @property
    def blockwise(self) -> bool:
        """One scale per block rather than per tensor."""
        return bool(self.block_shape)

    @property
    def columnwise_is_copy(self) -> bool:
        """The columnwise usage is a copy of its own (``data_t``, ``scale_inv_t``) that backward GEMMs read
        as it is; otherwise it is the rowwise data transposed (layout.py), sharing its scale."""
        return self.blockwise

    @property
    def records_amax(self) -> bool:
        """Its results carry the tensor's amax (one scale per tensor)."""
        return not self.blockwise

    @property
    def gemm_scaling(self) -> str:
        """The scaled_mm ScalingType a GEMM resolves for either usage of its results
        (block_scaling.resolve_gemm_scalings): the blocks run along the contracted dimension both ways."""
        if not self.blockwise:
            return "TensorWise"
        if self.is_nvfp4:
            return "NVFP4"  # ops.fp8_gemm's NVFP4 path (1x16 and 16x16 scales are both read per 1x16 block)
        return _GEMM_SCALING_OF_BLOCK[tuple(self.block_shape)]

    def data_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The shape of the data of a (rows, cols) tensor quantized rowwise (FP4: two values a byte)."""
        return (rows, cols // 2) if self.is_nvfp4 else (rows, cols)

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

    def scale_2d(self, scale_inv: Tensor, operand: Tensor) -> Tensor:
        """``scale_inv`` of the GEMM operand ``operand`` in the shape the GEMM reads: block scales of an
        activation cross the graph 1-D (see :meth:`quantize_flat`); a per-tensor scale is as it is."""
        if self.is_nvfp4:
            return scale_inv  # packed with the global scale (Quantized); the NVFP4 GEMM unpacks it
        return scale_inv.reshape(self.scale_grid(*operand.shape)) if self.blockwise else scale_inv

    def columnwise_usage(self, q: Quantized) -> tuple[Tensor, Tensor]:
        """(what backward keeps of ``q`` for its columnwise usage, its scale_inv): the columnwise copy, or
        layout.saved_form of the rowwise data (the CPU keeps the rowwise data and transposes a view)."""
        if self.columnwise_is_copy:
            return q.data_t, q.scale_inv_t
        return layout.saved_form(q.data, q.data_t), q.scale_inv

    def columnwise_operand(self, saved: Tensor) -> Tensor:
        """The columnwise usage as a GEMM operand, from what :meth:`columnwise_usage` kept."""
        return saved if self.columnwise_is_copy else layout.transposed(saved)

    def dequantize(self, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
        """The rowwise usage of one of its results (``data`` and its ``scale_inv``, 2-D or 1-D as
        :meth:`quantize_flat` leaves it) back in high precision: each value times its scales, in float32,
        rounded once to ``dtype``. What ``backward_override="dequantized"`` computes the backward GEMMs from.
        """
        if not self.blockwise:
            return ops.dequantize(data, scale_inv, dtype)
        rows, cols = data.shape[0], data.shape[1]
        if self.is_nvfp4:
            cols = 2 * cols
            block_scale, global_scale = ops.nvfp4.unpack_scales(scale_inv, rows, cols)
            raw = data.view(torch.uint8)
            codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(rows, cols)
            table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
            values = table[codes.long()].reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
            values = values * block_scale.float().unsqueeze(-1)
            return (values.reshape(rows, cols) * global_scale).to(dtype)
        bm, bk = self.block_for(cols)
        scale = scale_inv.reshape(self.scale_grid(rows, cols)).float()
        scale = scale.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
        return (data.float() * scale).to(dtype)

    def quantize(
        self,
        x: Tensor,
        rowwise: bool = True,
        columnwise: bool = False,
        scale: Optional[Tensor] = None,
        dbias_dtype: Optional[torch.dtype] = None,
        global_amax: Optional[Tensor] = None,
    ) -> Quantized:
        """Quantize a contiguous 2-D ``x`` into the requested usages, in one pass.

        One scale per tensor: ``scale`` (None: from ``x``'s amax) and ``margin``; the rowwise data always,
        its transpose where the backend needs it (the usages asked for do not change the pass), and the
        bias gradient in ``dbias_dtype`` when given. Block scales: the usages asked for; ``scale`` and
        ``dbias_dtype`` do not apply. NVFP4: ``global_amax`` (a one-element float32 tensor) is the amax its
        global scale is computed from instead of ``x``'s (a shard quantized as part of a whole tensor;
        not with an RHT columnwise copy).

        Raises:
            ValueError: ``global_amax`` given to a quantizer that is not NVFP4.
        """
        if global_amax is not None and not self.is_nvfp4:
            raise ValueError(f"TensorQuantizer.quantize: 'global_amax' applies to NVFP4 quantizers only, not {self}")
        if not self.blockwise:
            return tensorwise_result(quantize_tensorwise(x, self.dtype, scale, self.margin, dbias_dtype=dbias_dtype))
        if self.is_nvfp4:
            return self._quantize_nvfp4(x, rowwise, columnwise, global_amax)
        return self._quantize_blocks(x, rowwise, columnwise)

    def quantize_flat(
        self, x: Tensor, rowwise: bool = True, columnwise: bool = False, dbias_dtype: Optional[torch.dtype] = None
    ) -> Quantized:
        """:meth:`quantize` with 1-D scales (``scale_grid`` gives them back their shape), as one op.

        What a traced graph holds between ops: torch guards every size of a graph tensor against 1
        (its contiguity metadata), and a 2-D scale's row-block count (ceil(M / 128) for a batch of M
        rows) is 1 for some batch sizes, so a graph holding it would specialize on M <= 128. The 1-D
        scale has (columns x row blocks) elements, never 1 for a batch of 2 rows or more. A per-tensor
        scale is 1-D already: that is :meth:`quantize`. Asking for no usage of block scales gives
        empty tensors.
        """
        if not self.blockwise or self.is_nvfp4:  # NVFP4 scales are 1-D (packed) already
            return self.quantize(x, rowwise, columnwise, dbias_dtype=dbias_dtype)
        if not (rowwise or columnwise):
            empty_fp8, empty_scale = x.new_empty(0, dtype=self.dtype), x.new_empty(0, dtype=self.scale_dtype)
            return Quantized(empty_fp8, empty_scale, empty_fp8.clone(), empty_scale.clone())
        out = _quantize_flat_op(
            x, self.dtype, list(self.block_shape), self.scale_dtype, self.power_2_scale, rowwise, columnwise,
            self.e8m0_rounding,
        )
        return Quantized(*out)

    def _quantize_nvfp4(
        self, x: Tensor, rowwise: bool, columnwise: bool, global_amax: Optional[Tensor] = None
    ) -> Quantized:
        """NVFP4 copies of a 2-D ``x`` in the requested usages (Quantized's packed form), one pass; the global
        scale from ``global_amax`` where given, else from ``x``'s amax."""
        if not (rowwise or columnwise):
            empty_fp4, empty_scale = x.new_empty(0, dtype=self.dtype), x.new_empty(0, dtype=self.scale_dtype)
            return Quantized(empty_fp4, empty_scale, empty_fp4.clone(), empty_scale.clone())
        seed = ops.nvfp4.sr_seed(x) if self.stochastic_rounding else None
        scaling_2d = self.block_shape == [16, 16]
        out = ops.nvfp4.quantize_nvfp4_packed(
            x, rowwise, columnwise, scaling_2d, self.rht and columnwise, self.stochastic_rounding, seed, global_amax
        )
        return Quantized(*out)

    def _quantize_blocks(self, x: Tensor, rowwise: bool, columnwise: bool) -> Quantized:
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
                return Quantized(q_t.new_empty(0), s_t.new_empty((0, 0)), q_t, s_t)
            out = out._replace(data_t=q_t, scale_inv_t=s_t)
        if columnwise and square:
            # Copies even where the transpose is already contiguous (a (1, n) grid): outputs of one op may
            # not alias each other.
            def transposed_copy(t: Tensor) -> Tensor:
                return t.t().clone(memory_format=torch.contiguous_format)

            out = out._replace(data_t=transposed_copy(out.data), scale_inv_t=transposed_copy(out.scale_inv))
        return Quantized(*out)


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
    q = quantizer._quantize_blocks(x, rowwise, columnwise)
    return q.data, flat(q.scale_inv), q.data_t, flat(q.scale_inv_t)


# Made of custom ops and views only, so it is its own fake implementation.
_quantize_flat_op = torch.library.custom_op("transformer_linear::quantize_blockwise_flat", mutates_args=())(
    _flat_scales
)
_quantize_flat_op.register_fake(_flat_scales)


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
    """How a recipe quantizes the Linear's input, weight and grad_output.

    Each tensor has its own quantizer: the roles may differ in format, blocks and scaling. Only where
    the scales come from the layer's amax history must all three agree on that, and input and weight
    on their dtype and margin (the forward state updates their scales together); ``history`` then says
    how the scales are computed.

    Raises:
        TypeError: a role is not a TensorQuantizer, or ``history`` not a HistoryConfig.
        ValueError: ``scale_from_history`` differs across the roles, ``history`` is given without it
            (or missing with it), or input and weight taking scales from it differ in dtype or margin.
    """

    input: TensorQuantizer
    weight: TensorQuantizer
    grad_output: TensorQuantizer
    history: Optional[HistoryConfig] = None
    """Scales from the amax history: its length, how amax is computed from it, the first step's rule."""
    backward_override: Optional[str] = None
    """The recipe's ``backward_override`` (recipe.BACKWARD_OVERRIDES): None, the backward GEMMs read each
    operand quantized for them; ``"high_precision"``, they read the original input, weight and grad_output;
    ``"dequantized"``, the forward's quantized input and weight dequantized (:meth:`TensorQuantizer.dequantize`)
    and the original grad_output. See :attr:`backward_operands`."""

    def __post_init__(self) -> None:
        for role in ("input", "weight", "grad_output"):
            if not isinstance(getattr(self, role), TensorQuantizer):
                raise TypeError(f"QuantizationSpec: '{role}' must be a TensorQuantizer, got {getattr(self, role)!r}")
        from_history = {role: getattr(self, role).scale_from_history for role in ("input", "weight", "grad_output")}
        if len(set(from_history.values())) != 1:
            raise ValueError(
                "QuantizationSpec: 'scale_from_history' must be the same for input, weight and grad_output "
                f"(the layer updates their amax histories together), got {from_history}"
            )
        if self.history is not None and not isinstance(self.history, HistoryConfig):
            raise TypeError(f"QuantizationSpec: 'history' must be a recipe.HistoryConfig or None, got {self.history!r}")
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(
                "QuantizationSpec: 'backward_override' must be None, 'high_precision' or 'dequantized', "
                f"got {self.backward_override!r}"
            )
        if self.backward_override is not None and self.input.scale_from_history:
            # The backward would quantize no grad_output, so its amax history would never be recorded (TE too).
            raise ValueError("QuantizationSpec: 'backward_override' must be None where the scales come from the "
                             "amax history")
        if (self.history is not None) != self.input.scale_from_history:
            raise ValueError("QuantizationSpec: 'history' is given exactly where the scales come from the history")
        fwd = {(q.dtype, q.margin) for q in (self.input, self.weight)}
        if self.history is not None and len(fwd) > 1:
            # The forward state updates both scales in one pass, with one FP8 maximum and margin.
            raise ValueError(
                "QuantizationSpec: with scales from the amax history, input and weight must have the same dtype "
                f"and margin, got {self.input.dtype} / {self.input.margin} and "
                f"{self.weight.dtype} / {self.weight.margin}"
            )

    @property
    def scale_from_history(self) -> bool:
        """The scales come from the layer's delayed-scaling state (all three or none)."""
        return self.input.scale_from_history

    @property
    def backward_operands(self) -> str:
        """What the backward GEMMs (dgrad, wgrad) read: ``"quantized"`` (each operand in the usage its
        quantizer gives the GEMM, grad_output quantized too), ``"high_precision"`` (the original tensors,
        which forward saves) or ``"dequantized"`` (forward saves the rowwise usage it computed with, which
        backward dequantizes; grad_output is not quantized)."""
        return self.backward_override or "quantized"


def _tensorwise(recipe: DelayedScaling | CurrentScaling, scale_from_history: bool) -> QuantizationSpec:
    fmt = recipe.fp8_format
    fwd, bwd = (
        TensorQuantizer(d, [], torch.float32, False, margin=recipe.margin, scale_from_history=scale_from_history)
        for d in (fmt.fwd_dtype, fmt.bwd_dtype)
    )
    return QuantizationSpec(fwd, fwd, bwd, recipe.history if scale_from_history else None)


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


def _nvfp4(recipe: NVFP4BlockScaling) -> QuantizationSpec:
    """TE's NVFP4 quantizers: RHT on the wgrad operands' columnwise copies (input, grad_output), 16x16
    weight tiles, stochastic rounding of grad_output; each switch of the recipe turns one off."""
    rht = not recipe.disable_rht
    weight_block = [1, 16] if recipe.disable_2d_quantization else [16, 16]

    def fp4(block_shape: list[int], rht: bool = False, stochastic_rounding: bool = False) -> TensorQuantizer:
        return TensorQuantizer(recipe.fp4_format.fwd_dtype, block_shape, recipe.fp8_format.fwd_dtype, False,
                               rht=rht, stochastic_rounding=stochastic_rounding)

    return QuantizationSpec(
        fp4([1, 16], rht=rht),
        fp4(weight_block),
        fp4([1, 16], rht=rht, stochastic_rounding=not recipe.disable_stochastic_rounding),
    )


def _custom(recipe: CustomRecipe) -> QuantizationSpec:
    """The quantizers ``recipe.qfactory`` returns for the roles of CUSTOM_RECIPE_ROLES."""
    quantizers = []
    for role in CUSTOM_RECIPE_ROLES:
        quantizer = recipe.qfactory(role)
        if not isinstance(quantizer, TensorQuantizer):
            raise TypeError(
                f"CustomRecipe: qfactory({role!r}) must return a transformer_linear.TensorQuantizer, got {quantizer!r}"
            )
        quantizers.append(quantizer)
    from_history = [q.scale_from_history for q in quantizers]
    if len(set(from_history)) != 1:
        roles = ", ".join(f"{role}={flag}" for role, flag in zip(CUSTOM_RECIPE_ROLES, from_history))
        raise ValueError(
            f"CustomRecipe: 'scale_from_history' must be the same for every role (the layer updates their amax "
            f"histories together), got {roles}"
        )
    history = (recipe.history or HistoryConfig()) if from_history[0] else None
    return QuantizationSpec(*quantizers, history=history)


_SPEC_BUILDERS: dict[type, Callable[..., QuantizationSpec]] = {
    DelayedScaling: functools.partial(_tensorwise, scale_from_history=True),
    CurrentScaling: functools.partial(_tensorwise, scale_from_history=False),
    Float8BlockScaling: _float8_block,
    MXFP8BlockScaling: _mxfp8,
    Float8RowwiseScaling: _rowwise,
    NVFP4BlockScaling: _nvfp4,
    CustomRecipe: _custom,
}

# What the Linear runs without a recipe (high precision); only its dtypes are read.
NO_QUANTIZATION = _tensorwise(CurrentScaling(), scale_from_history=False)


def _builder(recipe: object) -> Optional[Callable[..., QuantizationSpec]]:
    """The spec builder of ``recipe``'s class or of the nearest recipe class it derives from (None: none)."""
    for cls in type(recipe).__mro__:
        builder = _SPEC_BUILDERS.get(cls)
        if builder is not None:
            return builder
    return None


def _unknown_recipe(where: str, recipe: object) -> TypeError:
    names = ", ".join(t.__name__ for t in _SPEC_BUILDERS)
    return TypeError(f"{where}: 'recipe' must be one of {names} (or a subclass) or None, got {recipe!r}")


def check_recipe(where: str, recipe: object) -> None:
    """Raise unless ``recipe`` is None or a recipe this module builds quantizers for.

    Raises:
        TypeError: naming ``where`` and the recipes that have quantizers.
    """
    if recipe is not None and _builder(recipe) is None:
        raise _unknown_recipe(where, recipe)


def quantization_spec(recipe: Recipe) -> QuantizationSpec:
    """The :class:`QuantizationSpec` of ``recipe`` (a subclass of a recipe class is built as that class).

    Raises:
        TypeError: ``recipe`` has no quantizers (see check_recipe); a CustomRecipe's factory returned
            something other than a TensorQuantizer (the message names the role).
        ValueError: a CustomRecipe's quantizers differ in ``scale_from_history``.
    """
    builder = _builder(recipe)
    if builder is None:
        raise _unknown_recipe("quantization_spec", recipe)
    spec = builder(recipe)
    override = recipe.backward_override  # a field of every recipe class, as in TE
    return spec if override is None else dataclasses.replace(spec, backward_override=override)


def tensorwise_result(q: ops.QuantizeOutput) -> Quantized:
    """A per-tensor quantize pass's output as a :class:`Quantized` (its columnwise usage shares scale_inv)."""
    return Quantized(q.data, q.scale_inv, q.data_t, q.scale_inv.new_empty(0), q.amax, q.dbias)


def quantize_tensorwise(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int, **kwargs: Any
) -> ops.QuantizeOutput:
    """``ops.quantize_fused`` (``scale`` None: current scaling) with the transposed copy where the backend
    needs it (``layout.needs_columnwise``)."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=layout.needs_columnwise(x.device), **kwargs)
