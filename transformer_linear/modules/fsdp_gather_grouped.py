"""FP8 all-gather of a ``tl.GroupedLinear``'s experts under FSDP2 (``fully_shard(fp8_all_gather=True)``).

FSDP2 shards the (num_gemms, out_features, in_features) weight along dim 0, the experts. With num_gemms a
multiple of the shard group's size each rank holds whole experts, and the grouped forward quantizes each
expert on its own (one scale per expert, or blocks inside one expert: ``TensorQuantizer.quantize_experts``), so a rank
quantizing its experts produces bitwise the whole weight's quantized experts: no amax all-reduce, no block
straddling two shards, whatever the recipe's blocks. :class:`GroupedFP8AllGatherWeight` is the shard
(an :class:`FP8AllGatherWeight`: the high-precision master to every op but FSDP2's all-gather); what is
gathered is each expert's FP8 data and scales, concatenated along the experts, and the unsharded parameter
is a :class:`GatheredFP8Weight` that the GroupedLinear's forward reads as it reads a
``tl.quantized_model_init`` weight (the cached-weight path of the grouped op, no cast).

* One scale per expert (current scaling) or square blocks (``Float8BlockScaling``'s 128x128): the rowwise
  copy is gathered; the columnwise copy dgrad reads is the rowwise one transposed (exact), made after the
  gather.
* Blocks of their own in the columnwise copy (MXFP8's 1x32): as tl.Linear's (modules/fsdp_gather_usages.py),
  where the layer's FSDP2 group reshards after forward and backward reads the columnwise copy (a quantized
  dgrad), the forward's gather carries the rowwise copy and backward's the columnwise one (either fits
  FSDP2's buffers: the same numels); backward's is written into the tensors the forward saved for dgrad,
  and a forward recomputed after it (activation checkpointing) gathers the rowwise copy itself. Otherwise
  (no reshard after forward, a dequantized backward, or copies of other numels: ``Float8RowwiseScaling``'s
  whole-column scales) both copies are gathered in every pass, about 2 bytes an element.
* Not gathered in FP8 (``ValueError`` at wrap time, :func:`check_grouped_gatherable`): experts not a
  multiple of the ranks (a rank would hold FSDP2's padding), delayed scaling (all experts share the
  history's scale and the forward records the amax over all of them: it would take the layer's state and
  an amax all-reduce), NVFP4 (its grouped kernels keep their own layout), and
  ``backward_override="high_precision"`` (it reads the high-precision weight, which is not gathered).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_linear._handles import NO_HANDLE
from transformer_linear.modules.fp8_all_gather import (
    FP8AllGatherWeight,
    GatheredFP8Weight,
    quantize_weight,
    refill_or_build,
)
from transformer_linear.modules.fsdp_gather_usages import (
    BOTH,
    ROWWISE,
    GatheredUsages,
    RowwiseSource,
    rowwise_source_handle,
    set_missing_rowwise,
    usages_to_gather,
)
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe.kind import stacked
from transformer_linear.recipe.quantization import QuantizationSpec, Quantized

__all__ = ["GroupedFP8AllGatherWeight", "check_grouped_gatherable"]

_CACHED_FIELDS = tuple(f.name for f in dataclasses.fields(CachedWeight))


def check_grouped_gatherable(spec: QuantizationSpec, num_gemms: int, world_size: int, where: str) -> None:
    """Raise unless a GroupedLinear of ``num_gemms`` experts under ``spec`` can be all-gathered in FP8 over
    ``world_size`` ranks (each rank's experts quantized on their own: see the module docstring).

    Raises:
        ValueError: naming the experts and ranks, or the recipe's property that prevents it.
    """
    weight = spec.weight
    why = weight.scaling_kind.experts_gather_problem(weight)
    if why is not None:
        raise _not_gathered(where, why)
    if spec.history is not None or weight.scale_from_history:
        why = ("delayed scaling quantizes every expert with the layer's one history scale and records their "
               "amax (no per-expert scale each rank could compute alone)")
    elif spec.backward_operands == "high_precision":
        why = "backward_override='high_precision' reads the high-precision weight, which would not be gathered"
    elif world_size > 1 and num_gemms % world_size:
        why = (f"{num_gemms} experts over {world_size} ranks: each rank must hold whole experts (num_gemms a "
               "multiple of the ranks)")
    if why is not None:
        raise _not_gathered(where, why)


def _not_gathered(where: str, why: str) -> ValueError:
    return ValueError(
        f"{where}: fp8_all_gather cannot gather this GroupedLinear's experts in FP8: {why}; shard it with "
        "fp8_all_gather=False (an inner fully_shard call; its experts are then gathered in high precision)"
    )


class _GroupedGatherMetadata(NamedTuple):
    """What ``fsdp_pre_all_gather`` passes to ``fsdp_post_all_gather`` besides the gathered tensors."""

    usages: GatheredUsages
    """The copies gathered (a columnwise copy made from the rowwise one counts as gathered with it)."""
    separate_columnwise: bool
    """The columnwise copy has blocks of its own: gathered (else made from the rowwise one)."""
    per_pass: bool
    """The forward's gather carries the rowwise copy and backward's the columnwise one (else both, each time)."""
    group: Any
    """The shard group (a forward recomputed after a columnwise-only gather gathers the rowwise copy over it)."""
    one_rank: bool = False
    """A one-rank group: the experts were 'gathered' in high precision, quantized after."""


def _per_pass_fits(quantizer: Any, outer_size: torch.Size) -> bool:
    """Whether either copy of a separate columnwise copy fits FSDP2's all-gather buffers (fixed at the first
    gather: the same numels), so that each pass may gather its own (usages_to_gather decides)."""
    rows, cols = int(outer_size[1]), int(outer_size[2])
    return math.prod(quantizer.scale_grid(rows, cols)) == math.prod(quantizer.scale_grid(cols, rows))


def _quantize_experts(quantizer: Any, shard: Tensor, usages: GatheredUsages) -> list[Tensor]:
    """The shard's experts quantized one by one (as ``TensorQuantizer.quantize_experts``), the copies ``usages`` names:
    [data, scale_inv] of the rowwise copy and / or [data_t, scale_inv_t] of the columnwise one."""
    qs = [quantizer.quantize(shard[e], rowwise=usages.rowwise, columnwise=usages.columnwise)
          for e in range(shard.shape[0])]
    fields = ["data", "scale_inv"] if usages.rowwise else []
    fields += ["data_t", "scale_inv_t"] if usages.columnwise else []
    return [stacked([getattr(q, f) for q in qs]) for f in fields]


def _quantize_rowwise(quantizer: Any, shard: Tensor) -> Quantized:
    """The rowwise copy of a shard's experts (what a recomputed forward gathers: RowwiseSource)."""
    data, scale_inv = _quantize_experts(quantizer, shard, ROWWISE)
    empty = data.new_empty(0)
    return Quantized(data, scale_inv, empty, empty, None)


def _refill(dst: Tensor, src: Tensor) -> None:
    """Refill ``dst`` (owned by the gathered weight, which FSDP2 reallocated before this gather) from ``src``,
    keeping its version: backward's saved tensors are these."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
        dst.copy_(src)


class GroupedFP8AllGatherWeight(FP8AllGatherWeight):
    """A ``tl.GroupedLinear``'s high-precision (num_gemms, out, in) weight shard that FSDP2 all-gathers as
    its experts' FP8 data and scales (see the module docstring).

    Args:
        tensor: the high-precision weight (or a shard of whole experts).
        quantizer: the layer's weight quantizer, fixed at wrap time (checked by
            :func:`check_grouped_gatherable`).
        history: must be None (delayed scaling is not gathered in FP8).
    """

    def __init__(self, tensor: Tensor, quantizer: Any, history: Any = None) -> None:
        if history is not None or quantizer.scale_from_history:
            raise ValueError("GroupedFP8AllGatherWeight: a quantizer with scales from an amax history is not gathered")
        super().__init__(tensor, quantizer, None)

    def __repr__(self) -> str:
        return f"GroupedFP8AllGatherWeight({self._tensor!r}, quantizer={self.quantizer})"

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride) -> "GroupedFP8AllGatherWeight":
        return GroupedFP8AllGatherWeight(inner_tensors["_tensor"], *config)

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], _GroupedGatherMetadata]:
        """Quantize this rank's experts; return their FP8 data and scales (each with the experts first: FSDP2
        concatenates the ranks' along dim 0) and the metadata."""
        quantizer = self.quantizer
        world_size = dist.get_world_size(mesh.get_group(mesh.ndim - 1))
        if int(outer_size[0]) % world_size:
            raise ValueError(
                f"fsdp_pre_all_gather: {int(outer_size[0])} experts over {world_size} ranks: each rank must hold "
                "whole experts to gather them in FP8"
            )
        shard = self._shard_to_quantize(mp_policy)
        group = mesh.get_group(mesh.ndim - 1)
        if world_size == 1:  # as tl.Linear's (fp8_all_gather.gather_on_one_rank): the experts in high precision
            return (shard,), _GroupedGatherMetadata(BOTH, False, False, group, one_rank=True)
        separate = not quantizer.columnwise_is_transpose
        per_pass = separate and _per_pass_fits(quantizer, outer_size)
        with torch.no_grad():
            if not separate:
                usages = ROWWISE
                q = quantizer.quantize_experts(shard, columnwise=False)
                gathered = (q.data, q.scale_inv)
            else:
                usages = usages_to_gather(quantizer, module) if per_pass else BOTH
                per_pass = per_pass and usages != BOTH  # no reshard after forward: one gather serves both
                gathered = tuple(_quantize_experts(quantizer, shard, usages))
        return gathered, _GroupedGatherMetadata(usages, separate, per_pass, group)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: _GroupedGatherMetadata,
        param_dtype: torch.dtype,
        *,
        out: Optional[Tensor] = None,
    ) -> Optional[tuple[GatheredFP8Weight, tuple[Tensor, ...]]]:
        """The unsharded weight: the gathered copies as views of FSDP2's buffers, a columnwise copy made from
        the rowwise one in tensors of its own (freed by FSDP2 on reshard; ``out`` given: refilled in place)."""
        if metadata.one_rank:  # the experts in high precision, quantized here
            whole = quantize_weight(self.quantizer, all_gather_outputs[0])
            owned = [name for name in _CACHED_FIELDS if getattr(whole, name) is not None]
            return refill_or_build(whole, self.quantizer, param_dtype, owned, out)
        if metadata.per_pass:
            return self._post_all_gather_per_pass(all_gather_outputs, metadata, param_dtype, out)
        data, scale_inv = all_gather_outputs[0], all_gather_outputs[1]
        if out is not None:
            local = _gathered_of(out)
            if not metadata.separate_columnwise:  # the gathered copies are views of the refilled buffers
                data_t, scale_inv_t = self.quantizer.transpose_copy(data, scale_inv)
                _refill(local.weight_fp8_t, data_t)
                _refill(local.weight_scale_inv_t, scale_inv_t)
            return None
        if metadata.separate_columnwise:
            data_t, scale_inv_t = all_gather_outputs[2], all_gather_outputs[3]
            owned: tuple[Tensor, ...] = ()
        else:
            data_t, scale_inv_t = self.quantizer.transpose_copy(data, scale_inv)
            owned = (data_t, scale_inv_t)
        cached = CachedWeight(
            weight_fp8=data, weight_fp8_t=data_t, weight_scale_inv=scale_inv, weight_scale_inv_t=scale_inv_t,
            weight_amax=None,
        )
        return GatheredFP8Weight(cached, self.quantizer, param_dtype), owned

    def _post_all_gather_per_pass(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: _GroupedGatherMetadata,
        param_dtype: torch.dtype,
        out: Optional[Tensor],
    ) -> Optional[tuple[GatheredFP8Weight, tuple[Tensor, ...]]]:
        """A separate columnwise copy gathered by backward's pass alone (as tl.Linear's, fp8_all_gather.py): the
        rowwise copy as views of FSDP2's buffers (their shape fixed by the forward's first gather), the
        columnwise copy in tensors of the gathered weight, refilled by backward's gather (what the forward's
        autograd node saved) and otherwise freed; a forward recomputed after backward's gather gathers the
        rowwise copy itself (``missing_rowwise``)."""
        usages = metadata.usages
        if out is not None:
            gathered = _gathered_of(out)
            for dst, src in zip((gathered.weight_fp8_t, gathered.weight_scale_inv_t), all_gather_outputs):
                if usages.columnwise:
                    _refill(dst, src)  # FSDP2 views this pass's buffers in the columnwise copy's shapes
                else:
                    _free(dst)
        else:
            if not usages.rowwise:
                raise RuntimeError("fsdp_post_all_gather: a GroupedLinear's first FP8 all-gather must be a forward's")
            data, scale_inv = all_gather_outputs[0], all_gather_outputs[1]
            experts, rows, cols = data.shape
            data_t = data.new_empty((experts, cols, rows))
            scale_inv_t = scale_inv.new_empty((experts, *self.quantizer.scale_grid(cols, rows)))
            _free(data_t)
            _free(scale_inv_t)
            cached = CachedWeight(data, data_t, scale_inv, scale_inv_t, None)
            source = RowwiseSource(self, self.quantizer, param_dtype, metadata.group, experts,
                                   functools.partial(_quantize_rowwise, self.quantizer))
            gathered = GatheredFP8Weight(cached, self.quantizer, param_dtype,
                                         torch.full((), NO_HANDLE, dtype=torch.int64))
            gathered.rowwise_source = source  # kept alive with the weight: the handle refers to it weakly
            gathered.rowwise_source_handle = rowwise_source_handle(source)
        # Data, not metadata: a compiled forward runs the same graph whichever copy this gather carried.
        set_missing_rowwise(gathered.missing_rowwise, usages, gathered.rowwise_source_handle)
        if out is not None:
            return None
        return gathered, (gathered.weight_fp8_t, gathered.weight_scale_inv_t)


def _gathered_of(out: Tensor) -> GatheredFP8Weight:
    local = out.to_local() if hasattr(out, "to_local") else out
    if not isinstance(local, GatheredFP8Weight):
        raise TypeError(
            f"fsdp_post_all_gather: 'out' must be the GatheredFP8Weight built before, got {type(out).__name__}"
        )
    return local


def _free(t: Tensor) -> None:
    """Free ``t``'s storage (FSDP2's ``free_storage``; it reallocates it before the next gather)."""
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)
