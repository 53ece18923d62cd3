"""The quantizer of one tensor role, :class:`TensorQuantizer`, and what it returns, :class:`Quantized`.

As Transformer Engine's Float8Quantizer / Float8CurrentScalingQuantizer / Float8BlockQuantizer /
MXFP8Quantizer, without tensor subclasses. A quantizer knows its data and scale dtypes, its blocks, its
margin, whether its scale comes from the layer's delayed-scaling state, how to quantize (every recipe's
result is a :class:`Quantized`), how a GEMM reads each usage of that result and which ScalingType it
resolves to. It knows no recipe: recipe/quantization.py builds a recipe's quantizers.

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
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear import ops
from transformer_linear.formats import layout
from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS
from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES
from transformer_linear.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from transformer_linear.formats.nvfp4 import E2M1_VALUES

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
    "Quantized",
    "TensorQuantizer",
    "flat",
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
        if not isinstance(self.block_shape, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in self.block_shape
        ):
            raise TypeError(
                "TensorQuantizer: 'block_shape' must be a list of ints ([] for one scale per tensor, [rows, cols] "
                f"for blocks), got {self.block_shape!r}"
            )
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


def tensorwise_result(q: ops.QuantizeOutput) -> Quantized:
    """A per-tensor quantize pass's output as a :class:`Quantized` (its columnwise usage shares scale_inv)."""
    return Quantized(q.data, q.scale_inv, q.data_t, q.scale_inv.new_empty(0), q.amax, q.dbias)


def quantize_tensorwise(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int, **kwargs: Any
) -> ops.QuantizeOutput:
    """``ops.quantize_fused`` (``scale`` None: current scaling) with the transposed copy where the backend
    needs it (``layout.needs_columnwise``)."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=layout.needs_columnwise(x.device), **kwargs)
