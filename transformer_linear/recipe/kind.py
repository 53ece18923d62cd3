"""Scaling kinds: what one way of scaling a tensor does, asked by everything that handles its quantized form.

A :class:`~transformer_linear.recipe.tensor_quantizer.TensorQuantizer` is the small frozen description that
op schemas carry (dtypes, blocks, margin, switches, and the name of its kind). Its :class:`ScalingKind` is the
behaviour: how the tensor is quantized and dequantized, how a GEMM reads each usage, whether the columnwise
copy is the rowwise one transposed (and making it so), what FSDP2 all-gathers of a weight shard and how the
gathered tensors become the whole weight's copies, how experts' weights are stacked, and the range statistics
``numerics`` reports. The Linear, the grouped Linear, FSDP2's FP8 all-gather, FP8 primary weights and the
numerics tools ask the kind; none of them asks which format a quantizer is.

Built in (each in its own module): ``"tensorwise"`` (one scale per tensor: delayed and current scaling,
kind_tensorwise.py), ``"block"`` (float32 or E8M0 scales per block: 128x128, 1x128, 1x32 MX, rowwise;
kind_block.py) and ``"nvfp4"`` (FP4 data with E4M3 block scales and a float32 global scale; kind_nvfp4.py).
A new kind is a subclass registered with :func:`register_scaling_kind` and named by its quantizers'
``kind`` field: no package file changes (tests/test_outside_scaling_kind.py defines one).

The methods take the quantizer as their first argument (kinds are stateless, one instance each), typed on
:class:`QuantizerFields`, what a kind reads of it.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
from torch import Tensor

from transformer_linear import ops

__all__ = [
    "GatheredShard",
    "Quantized",
    "QuantizerFields",
    "ScalingKind",
    "register_scaling_kind",
    "scaling_kind",
    "scaling_kind_names",
    "no_usages",
    "stack_experts",
    "stacked",
]


class Quantized(NamedTuple):
    """What a quantizer returns, for every kind: a 2-D tensor in the usages it produced (an unproduced one is
    empty); experts' weights stacked along a leading dimension (:meth:`ScalingKind.quantize_experts`).

    NVFP4: each usage is its own copy, uint8 data (two E2M1 codes a byte, (M, K/2) and (K, M/2)) and 1-D
    packed scales: the float32 global decode scale (8 elements of 4 bits), then the E4M3 block scales
    (ops.nvfp4.pack_scales), so the one scale tensor a usage has carries both and every op of the Linear
    passes it along unchanged; ops.fp8_gemm unpacks it.

    One scale per tensor: ``data_t`` is ``data`` transposed where the backend's GEMM wants it materialized
    (layout.needs_columnwise), sharing ``scale_inv``; ``scale_inv_t`` is empty. Block scales: ``data_t`` is
    the columnwise copy, quantized with blocks along the other dimension, with its own ``scale_inv_t``.
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


class QuantizerFields(Protocol):
    """What a scaling kind reads of its quantizer (TensorQuantizer's fields)."""

    dtype: torch.dtype
    block_shape: list[int]
    scale_dtype: torch.dtype
    power_2_scale: bool
    e8m0_rounding: str
    margin: int
    scale_from_history: bool
    rht: bool
    stochastic_rounding: bool
    kind: str


class GatheredShard(NamedTuple):
    """A weight shard's quantized form as FSDP2 all-gathers it (:meth:`ScalingKind.gather_form`)."""

    tensors: tuple[Tensor, ...]
    """What is all-gathered, each with the shard's rows first (FSDP2 concatenates dim 0)."""
    scale_inv: Optional[Tensor]
    """A scale the same on every rank (the whole weight's), which travels as metadata; None if none."""


class ScalingKind:
    """The behaviour of one way of scaling a tensor (see the module docstring). Subclass it, set ``name``,
    override what differs from these defaults, and register an instance with :func:`register_scaling_kind`.

    The defaults describe block scales whose columnwise copy is its own quantization (non-square blocks):
    a kind that only quantizes and reads its copies needs :meth:`quantize`, :meth:`dequantize` and
    :meth:`gemm_scaling` (and :meth:`gemm_scale` if the GEMM reads its scales in another form).
    """

    name: str = ""

    # ------------------------------------------------------------------ description

    def check(self, q: QuantizerFields) -> None:
        """Raise ValueError unless ``q``'s fields are ones this kind quantizes with (by default: no NVFP4
        switches)."""
        if q.rht or q.stochastic_rounding:
            raise ValueError("TensorQuantizer: 'rht' and 'stochastic_rounding' apply to FP4 (NVFP4) data only")

    def per_tensor_scale(self, q: QuantizerFields) -> bool:
        """One scale for the whole tensor: it can be handed in (delayed scaling), its results carry the amax,
        and a weight's shards agree on it through an amax all-reduce (:meth:`whole_tensor_amax`)."""
        return False

    def gemm_scaling(self, q: QuantizerFields) -> str:
        """The scaled_mm ScalingType a GEMM resolves for either usage (formats/block_scaling.py)."""
        raise NotImplementedError(f"scaling kind {self.name!r}: gemm_scaling")

    def values_per_element(self, q: QuantizerFields) -> int:
        """Values per element of the data (FP4: two a byte)."""
        return 1

    def scale_grid(self, q: QuantizerFields, rows: int, cols: int) -> tuple[int, int]:
        """The 2-D shape of the rowwise scale_inv of a (rows, cols) tensor."""
        bm, bk = block_for(q, cols)
        return -(-rows // bm), -(-cols // bk)

    # ------------------------------------------------------------------ quantize / dequantize

    def quantize(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, scale: Optional[Tensor] = None,
        dbias_dtype: Optional[torch.dtype] = None, global_amax: Optional[Tensor] = None,
    ) -> Quantized:
        """A contiguous 2-D ``x`` quantized into the usages asked for, in one pass (TensorQuantizer.quantize)."""
        raise NotImplementedError(f"scaling kind {self.name!r}: quantize")

    def quantize_flat(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, dbias_dtype: Optional[torch.dtype]
    ) -> Quantized:
        """:meth:`quantize` with 1-D scales (what a traced graph holds between ops: TensorQuantizer.quantize_flat)."""
        return self.quantize(q, x, rowwise, columnwise, dbias_dtype=dbias_dtype)

    def dequantize(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
        """The rowwise usage (``data``, its ``scale_inv`` 2-D or 1-D) back in high precision: each value times
        its scales in float32, rounded once to ``dtype``."""
        raise NotImplementedError(f"scaling kind {self.name!r}: dequantize")

    def gemm_scale(self, q: QuantizerFields, scale_inv: Tensor, operand: Tensor) -> Tensor:
        """``scale_inv`` of the GEMM operand ``operand`` (either usage; 2-D, or 1-D as :meth:`quantize_flat`
        leaves it) in the form ops.fp8_gemm reads: by default its 2-D grid."""
        # dim() is static: a 2-D scale passes as it is, with no reshape (which would guard on symbolic sizes).
        return scale_inv if scale_inv.dim() == 2 else scale_inv.reshape(self.scale_grid(q, *operand.shape))

    # ------------------------------------------------------------------ the columnwise copy

    def columnwise_is_copy(self, q: QuantizerFields) -> bool:
        """Backward's GEMMs read a columnwise copy of its own (``data_t``, ``scale_inv_t``); otherwise the
        rowwise data transposed (layout.py), sharing its scale."""
        return True

    def columnwise_is_transpose(self, q: QuantizerFields) -> bool:
        """The columnwise copy is exactly the rowwise one transposed (:meth:`transpose_copy` makes it without
        quantizing again): a stored or gathered weight then carries the rowwise copy alone."""
        return False

    def transpose_copy(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor) -> tuple[Tensor, Tensor]:
        """(data_t, scale_inv_t) made from the rowwise copy (2-D, or experts stacked 3-D), as :meth:`quantize`
        (or :meth:`quantize_experts`) makes them, where :meth:`columnwise_is_transpose`."""
        raise NotImplementedError(f"scaling kind {self.name!r}: its columnwise copy is quantized on its own")

    def quantize_gemm(
        self, q: QuantizerFields, x: Tensor, columnwise: bool, scale: Optional[Tensor], other: Tensor,
        other_scale_inv: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> tuple[Quantized, Tensor]:
        """The forward's input quantize and GEMM: ``x`` quantized as :meth:`quantize` quantizes it (rowwise,
        and ``columnwise`` where asked), and ``ops.fp8_gemm`` of its rowwise usage with the weight ``other``
        (``other_scale_inv`` in the form the GEMM reads) in ``out_dtype``, plus ``bias``. By default the
        two in turn; a kind whose kernels can cast the input inside the GEMM overrides it."""
        qx = self.quantize(q, x, True, columnwise, scale)
        x_scale_inv = self.gemm_scale(q, qx.scale_inv, qx.data)
        return qx, ops.fp8_gemm(qx.data, x_scale_inv, other, other_scale_inv, out_dtype, bias)

    # ------------------------------------------------------------------ experts

    def quantize_experts(
        self, q: QuantizerFields, weight: Tensor, columnwise: bool, scale: Optional[Tensor] = None,
        records_amax: bool = False,
    ) -> Quantized:
        """Each expert of a contiguous (experts, rows, cols) ``weight`` quantized, the copies stacked
        (an absent usage empty); ``scale`` and ``records_amax`` apply to one scale per tensor."""
        return stack_experts([self.quantize(q, w, rowwise=True, columnwise=columnwise) for w in weight],
                             rowwise=True, columnwise=columnwise)

    # ------------------------------------------------------------------ the grouped (experts') GEMMs

    def grouped_problem(self, input: QuantizerFields, weight: QuantizerFields,
                        grad_output: QuantizerFields) -> Optional[str]:
        """Why the grouped GEMMs cannot take operands quantized by these three quantizers (all of this kind),
        or None where they can."""
        return f"the grouped GEMMs take no operands of the {self.name!r} scaling kind"

    def grouped_gemm(
        self, q_a: QuantizerFields, a: Tensor, a_scale_inv: Tensor, q_b: QuantizerFields, b: Tensor,
        b_scale_inv: Tensor, offs: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> Tensor:
        """out[rows of g] = a[rows of g] @ b[g].T (+ bias[g]): the forward (a the tokens' rowwise copy, b the
        experts' rowwise weights) and dgrad (a grad_output's rowwise copy, b the experts' columnwise weights)."""
        raise NotImplementedError(f"scaling kind {self.name!r}: grouped_gemm")

    def grouped_columnwise(
        self, q: QuantizerFields, t: Tensor, offs: Tensor, rowwise: Optional[Quantized]
    ) -> tuple[Tensor, Tensor]:
        """(data, scale_inv) of the tokens ``t`` (total, C) as the grouped weight gradient reads them, each
        group's blocks its own; ``rowwise``: ``t`` quantized rowwise, where the caller has it (a kind whose
        columnwise usage is not a copy reads it)."""
        raise NotImplementedError(f"scaling kind {self.name!r}: grouped_columnwise")

    def grouped_wgrad(
        self, q: QuantizerFields, grad: Tensor, grad_scale_inv: Tensor, x: Tensor, x_scale_inv: Tensor,
        offs: Tensor, out_dtype: torch.dtype,
    ) -> Tensor:
        """(G, N, K): grad[rows of g].T @ x[rows of g] per group, from :meth:`grouped_columnwise`'s copies."""
        raise NotImplementedError(f"scaling kind {self.name!r}: grouped_wgrad")

    # ------------------------------------------------------------------ FSDP2 all-gather of a weight

    def shard_problem(self, q: QuantizerFields, rows: int, world_size: int) -> Optional[str]:
        """Why a weight of ``rows`` rows cannot be all-gathered quantized over ``world_size`` ranks (each rank
        quantizing its dim-0 shard), or None where it can: no block may straddle two shards. The text follows
        "cannot shard a weight of R rows over W ranks with" in the error: what, then why."""
        bm, bk = q.block_shape
        spans = [bm] if bm == bk else [bm, bk]  # a separate columnwise copy has blocks along the rows too
        per_shard, even = -(-rows // world_size), rows % world_size == 0
        if 0 in spans or not even or any(per_shard % span for span in spans):
            need = "the whole column" if 0 in spans else max(spans)
            return (f"{list(q.block_shape)} blocks: each rank's rows must be a whole number of the blocks' rows "
                    f"({need}) so that no block straddles two shards")
        return None

    def experts_gather_problem(self, q: QuantizerFields) -> Optional[str]:
        """Why experts' stacked weights of this kind are not all-gathered quantized (each rank quantizing its
        whole experts, modules/fsdp_gather_grouped.py), or None where they are."""
        return None

    def whole_tensor_amax(self, q: QuantizerFields, shard: Tensor) -> Optional[Tensor]:
        """The amax of this shard that the ranks all-reduce (MAX) so each quantizes its shard as part of the
        whole tensor (a one-element float32 tensor), or None where a shard's scales are its own."""
        return None

    def gather_form(self, q: QuantizerFields, shard: Quantized, padded_rows: int) -> GatheredShard:
        """What FSDP2 all-gathers of a shard's quantized rowwise copy (data and scales, rows first)."""
        return GatheredShard((shard.data, shard.scale_inv), None)

    def from_gathered(
        self, q: QuantizerFields, tensors: Sequence[Tensor], rows: int, scale_inv: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(data, scale_inv) of the whole weight's rowwise copy from the gathered tensors (views of them where
        they are it already; FSDP2 refills those in place)."""
        return tensors[0][:rows], tensors[1]

    # ------------------------------------------------------------------ numerics

    def range_stats(self, q: QuantizerFields, x: Tensor, scale: Optional[Tensor]) -> dict[str, float]:
        """amax, scale, underflow and saturation of ``x`` as ``q`` casts it (numerics.stats); ``scale``: the
        per-tensor scale used, where one applies (None: from ``x``)."""
        raise NotImplementedError(f"scaling kind {self.name!r}: range_stats")


def block_for(q: QuantizerFields, cols: int) -> tuple[int, int]:
    """The (bm, bk) block of a tensor with ``cols`` columns (``bk == 0``: the whole row)."""
    bm, bk = q.block_shape
    # int(): the ops take a concrete block; a Linear's row length (in/out_features) is static anyway.
    return bm, (bk if bk > 0 else max(int(cols), 1))


def no_usages(q: QuantizerFields, x: Tensor) -> Quantized:
    """What a quantize asked for no usage returns: empty data and scales of the quantizer's dtypes (distinct
    tensors: outputs of one op may not alias each other)."""
    empty_data, empty_scale = x.new_empty(0, dtype=q.dtype), x.new_empty(0, dtype=q.scale_dtype)
    return Quantized(empty_data, empty_scale, empty_data.clone(), empty_scale.clone())


def stack_experts(qs: Sequence[Quantized], rowwise: bool, columnwise: bool) -> Quantized:
    """The experts' copies in one tensor per field, experts first (an absent usage empty)."""
    if not qs:
        raise ValueError("stack_experts: no experts")

    def field(name: str, present: bool) -> Tensor:
        return stacked([getattr(e, name) for e in qs]) if present else getattr(qs[0], name).new_empty(0)

    return Quantized(field("data", rowwise), field("scale_inv", rowwise), field("data_t", columnwise),
                     field("scale_inv_t", columnwise))


def stacked(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` (one shape, at least one) in one tensor, first dimension new: copied rather than stacked,
    since torch.autocast's stack rejects FP8 data and scales."""
    out = parts[0].new_empty((len(parts), *parts[0].shape))
    for g, part in enumerate(parts):
        out[g].copy_(part)
    return out


_KINDS: dict[str, ScalingKind] = {}
_LOCK = threading.Lock()


def register_scaling_kind(kind: ScalingKind) -> ScalingKind:
    """Register ``kind`` under its ``name`` (what a quantizer's ``kind`` field names); returns it.

    Raises:
        TypeError: ``kind`` is not a ScalingKind.
        ValueError: its name is empty, or another kind has it.
    """
    if not isinstance(kind, ScalingKind):
        raise TypeError(f"register_scaling_kind: 'kind' must be a ScalingKind instance, got {kind!r}")
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"register_scaling_kind: the kind needs a non-empty 'name', got {kind.name!r}")
    with _LOCK:
        known = _KINDS.get(kind.name)
        if known is not None and type(known) is not type(kind):
            raise ValueError(f"register_scaling_kind: {kind.name!r} is already {type(known).__name__}")
        _KINDS[kind.name] = kind
    return kind


def scaling_kind(name: str) -> ScalingKind:
    """The registered kind called ``name``.

    Raises:
        ValueError: no kind has that name (the message lists those that do).
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"no scaling kind {name!r}; registered: {scaling_kind_names()} (recipe.register_scaling_kind)")
    return kind


def scaling_kind_names() -> list[str]:
    """The registered kinds' names."""
    return sorted(_KINDS)
