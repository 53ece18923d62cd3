"""The quantizer of one tensor role, :class:`TensorQuantizer`, and what it returns, :class:`Quantized`.

As Transformer Engine's Float8Quantizer / Float8CurrentScalingQuantizer / Float8BlockQuantizer /
MXFP8Quantizer / NVFP4Quantizer, without tensor subclasses. A quantizer is the small frozen description
that op schemas carry: its data and scale dtypes, its blocks, its margin, whether its scale comes from the
layer's delayed-scaling state, and the name of its scaling kind (recipe/kind.py), which owns the behaviour:
how to quantize (every kind's result is a :class:`Quantized`), how a GEMM reads each usage of that result,
which ScalingType it resolves to, how its columnwise copy relates to the rowwise one. The quantizer's
methods ask the kind; it knows no recipe: recipe/quantization.py builds a recipe's quantizers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from transformer_linear.formats import layout
from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS
from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES
from transformer_linear.recipe.kind import GatheredShard, Quantized, ScalingKind, block_for, scaling_kind
from transformer_linear.recipe.kind_block import BLOCK, flat
from transformer_linear.recipe.kind_nvfp4 import FP4_STORAGE_DTYPE, NVFP4
from transformer_linear.recipe.kind_tensorwise import TENSORWISE, quantize_tensorwise, tensorwise_result

DATA_DTYPES = (*FP8_DTYPES, torch.float4_e2m1fn_x2, FP4_STORAGE_DTYPE)
"""What a quantizer's data may be: FP8, or FP4 (two E2M1 values a byte; ``torch.float4_e2m1fn_x2`` or its
storage dtype uint8, which a quantizer keeps: torch.export cannot save float4 dtypes) with E4M3 scales per
1x16 or 16x16 block (NVFP4, ops/nvfp4.py)."""
QUANTIZER_SCALE_DTYPES = (torch.float32, E8M0_DTYPE, torch.float8_e4m3fn)
"""What its scale_inv may be: float32, E8M0 (MX blocks) or E4M3 (FP4 blocks)."""

__all__ = [
    "DATA_DTYPES",
    "FP4_STORAGE_DTYPE",
    "QUANTIZER_SCALE_DTYPES",
    "GatheredShard",
    "Quantized",
    "TensorQuantizer",
    "flat",
    "quantize_tensorwise",
    "tensorwise_result",
]


def _default_kind(dtype: torch.dtype, block_shape: list[int]) -> str:
    """The built-in kind of a quantizer that names none: FP4 data is NVFP4, blocks are block scaling."""
    if dtype == FP4_STORAGE_DTYPE:
        return NVFP4.name
    return BLOCK.name if block_shape else TENSORWISE.name


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
        kind: the name of its scaling kind (recipe.register_scaling_kind); "" (the default) picks the
            built-in one the fields describe: "nvfp4" for FP4 data, "block" for blocks, else "tensorwise".
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
    kind: str = ""

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
        for name in ("rht", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TensorQuantizer: '{name}' must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.kind, str):
            raise TypeError(f"TensorQuantizer: 'kind' must be a scaling kind's name (a str), got {self.kind!r}")
        if not self.kind:
            object.__setattr__(self, "kind", _default_kind(self.dtype, list(self.block_shape)))
        kind = self.scaling_kind  # raises for an unknown name
        if not kind.per_tensor_scale(self) and (self.margin or self.scale_from_history):
            raise ValueError("TensorQuantizer: 'margin' and 'scale_from_history' apply to one scale per tensor only")
        kind.check(self)

    @property
    def scaling_kind(self) -> ScalingKind:
        """The behaviour of its kind (recipe/kind.py): what every user of its results asks."""
        return scaling_kind(self.kind)

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
        return self.scaling_kind.columnwise_is_copy(self)

    @property
    def columnwise_is_transpose(self) -> bool:
        """The columnwise copy is exactly the rowwise one transposed (:meth:`transpose_copy` makes it without
        quantizing again): a stored or gathered weight carries the rowwise copy alone."""
        return self.scaling_kind.columnwise_is_transpose(self)

    @property
    def records_amax(self) -> bool:
        """One scale per tensor: its results carry the tensor's amax, and its scale may be handed in."""
        return self.scaling_kind.per_tensor_scale(self)

    @property
    def gemm_scaling(self) -> str:
        """The scaled_mm ScalingType a GEMM resolves for either usage of its results
        (block_scaling.resolve_gemm_scalings): the blocks run along the contracted dimension both ways."""
        return self.scaling_kind.gemm_scaling(self)

    def data_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The shape of the data of a (rows, cols) tensor quantized rowwise (FP4: two values a byte)."""
        return (rows, cols // self.scaling_kind.values_per_element(self))

    def value_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tensor whose (rowwise, or stacked) data has ``data_shape``."""
        return (*data_shape[:-1], data_shape[-1] * self.scaling_kind.values_per_element(self))

    def block_for(self, cols: int) -> tuple[int, int]:
        """The (bm, bk) block of a tensor with ``cols`` columns (rowwise: the whole row)."""
        return block_for(self, cols)

    def scale_grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The 2-D shape of the scale_inv of a (rows, cols) tensor quantized rowwise with these blocks
        (a columnwise copy is such a tensor too: the transpose, with blocks along its rows)."""
        return self.scaling_kind.scale_grid(self, rows, cols)

    def scale_2d(self, scale_inv: Tensor, operand: Tensor) -> Tensor:
        """``scale_inv`` of the GEMM operand ``operand`` in the form the GEMM reads: block scales of an
        activation cross the graph 1-D (see :meth:`quantize_flat`); a per-tensor scale is as it is."""
        return self.scaling_kind.gemm_scale(self, scale_inv, operand)

    def transpose_copy(self, data: Tensor, scale_inv: Tensor) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """(data_t, scale_inv_t) from the rowwise copy (2-D, or experts stacked 3-D) where
        :attr:`columnwise_is_transpose`, as :meth:`quantize` / :meth:`quantize_experts` make them (None:
        a per-tensor copy the backend reads as a view, or a scale the copies share)."""
        return self.scaling_kind.transpose_copy(self, data, scale_inv)

    def quantize_experts(
        self, weight: Tensor, columnwise: bool, scale: Optional[Tensor] = None, records_amax: bool = False
    ) -> Quantized:
        """Each expert of a (experts, rows, cols) ``weight`` quantized, stacked: rowwise for the forward GEMM
        and (``columnwise``) columnwise for dgrad. One scale per tensor: each expert's own (or ``scale``, the
        delayed-scaling state's, for all), and the amax over all experts where ``records_amax``."""
        return self.scaling_kind.quantize_experts(self, weight.contiguous(), columnwise, scale, records_amax)

    def range_stats(self, x: Tensor, scale: Optional[Tensor] = None) -> dict[str, float]:
        """amax, scale, underflow and saturation of ``x`` as this quantizer casts it (rowwise); ``scale``: a
        per-tensor scale used (None: from ``x``'s amax)."""
        return self.scaling_kind.range_stats(self, x, scale)

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
        return self.scaling_kind.dequantize(self, data, scale_inv, dtype)

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

        One scale per tensor: ``scale`` (None: from ``global_amax`` where given, else from ``x``'s amax) and
        ``margin``; the rowwise data always, its transpose where the backend needs it (the usages asked for
        do not change the pass), and the bias gradient in ``dbias_dtype`` when given. Block scales: the
        usages asked for; ``scale`` and ``dbias_dtype`` do not apply. NVFP4: ``global_amax`` (a one-element
        float32 tensor) is the amax its global scale is computed from instead of ``x``'s (a shard quantized
        as part of a whole tensor; not with an RHT columnwise copy).

        Raises:
            ValueError: ``global_amax`` given to a kind whose scales are each block's own.
        """
        return self.scaling_kind.quantize(self, x, rowwise, columnwise, scale, dbias_dtype, global_amax)

    def quantize_gemm(
        self,
        x: Tensor,
        columnwise: bool,
        scale: Optional[Tensor],
        other: Tensor,
        other_scale_inv: Tensor,
        out_dtype: torch.dtype,
        bias: Optional[Tensor] = None,
    ) -> tuple[Quantized, Tensor]:
        """The forward GEMM's input: ``x`` quantized as :meth:`quantize` (rowwise, and ``columnwise`` where
        asked; ``scale`` as there), and the product of its rowwise usage with the weight ``other`` (whose
        ``other_scale_inv`` is in the form the GEMM reads, :meth:`scale_2d`) in ``out_dtype``, plus ``bias``.
        One op where the kind's kernels cast ``x`` inside the GEMM (one scale per tensor, on the CPU: the FP8
        copy is packed from cache, not read back from memory), else the quantize pass and the GEMM.

        Returns:
            (the quantized ``x``, the (rows, other's rows) product).
        """
        return self.scaling_kind.quantize_gemm(self, x, columnwise, scale, other, other_scale_inv, out_dtype, bias)

    def quantize_flat(
        self, x: Tensor, rowwise: bool = True, columnwise: bool = False, dbias_dtype: Optional[torch.dtype] = None
    ) -> Quantized:
        """:meth:`quantize` with 1-D scales (``scale_grid`` gives them back their shape), as one op: what a
        traced graph holds between ops (BlockKind.quantize_flat says why). A per-tensor scale and NVFP4's
        packed scales are 1-D already."""
        return self.scaling_kind.quantize_flat(self, x, rowwise, columnwise, dbias_dtype)
