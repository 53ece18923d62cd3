"""FP8 all-gather under FSDP2: a ``tl.Linear``'s weight shard is quantized before FSDP2 gathers it.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a parameter's local shard be a tensor subclass with
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: what the first returns is all-gathered instead of the
shard, and the second builds the unsharded parameter from the gathered tensors. :class:`FP8AllGatherWeight`
is that shard (torchao's ``WeightWithDynamicFloat8CastTensor`` is the model): the high-precision master,
which the optimizer updates and ``state_dict`` saves, that quantizes itself with the layer's weight
quantizer when FSDP2 gathers it. The unsharded parameter is a :class:`GatheredFP8Weight`, a tensor of the
weight's shape and dtype holding only the quantized weight (a ``CachedWeight``: data and scale_inv of
every usage backward reads), which ``tl.Linear`` hands to its GEMMs as it is, without casting again.

Nothing here branches on the recipe or the format; the weight quantizer's scaling kind (recipe/kind.py)
says what one weight is made of and how it is gathered:

* Scales that span the whole weight (``ScalingKind.whole_tensor_amax``: one scale per tensor, NVFP4's
  global scale) must be the ones the whole weight gets, so the amax of each shard is all-reduced (MAX) over
  the shard group and each shard quantized with it, or, where the quantizer takes its scale from the
  layer's delayed-scaling history, with the scale read from the layer's state (identical on all ranks).
  The gathered copy is then bitwise the whole weight quantized.
* What is gathered and what travels as FSDP2 metadata (``ScalingKind.gather_form``): one scale per
  tensor gathers its FP8 data alone (1 byte per element), the scale is metadata; block scales gather data
  and scales; NVFP4 gathers the FP4 data (uint8, two codes a byte) and the E4M3 block scales, and its global
  decode scale is metadata. The whole weight's copies are made from them after the gather
  (``ScalingKind.from_gathered``: NVFP4 packs its scales there).
* Blocks may not straddle a shard boundary (``ScalingKind.shard_problem``): FSDP2 shards dim 0, so the rows
  per shard must be a multiple of the rows a block spans, in either usage; otherwise
  ``fsdp_pre_all_gather`` raises (see :func:`check_shardable`; NVFP4 also refuses 1x16 weight blocks and
  stochastic rounding of the weight).
* Where the columnwise copy is the rowwise one transposed (``TensorQuantizer.columnwise_is_transpose``:
  one scale per tensor, square blocks, NVFP4's 16x16 tiles) only the rowwise copy is gathered and the
  columnwise one is made after the gather (``TensorQuantizer.transpose_copy``; one scale per tensor only
  where the backend's GEMM wants it materialized). Otherwise (MXFP8's 1x32, rowwise scaling) the
  columnwise copy has its own blocks: it cannot be made from the gathered rowwise copy without quantizing
  twice, so it is gathered too, but only by the pass that reads it where FSDP2 gathers again before
  backward (see below).

Gathering each usage in its own pass. FSDP2 (torch 2.13) allocates a parameter's all-gather outputs once,
at its first gather, from the numels and dtypes ``fsdp_pre_all_gather`` returned
(``FSDPParam.init_all_gather_outputs``), re-reads the input sizes at each gather to view them
(``_unflatten_all_gather_outputs``) and refills the unsharded parameter in place after the first
(``init_unsharded_param``: ``fsdp_post_all_gather(..., out=...)``). A non-square block's two copies have
the same numel and dtypes (N x K data, N x K / 32 scales for 1x32 blocks), so either fits the buffers of
the other. Where the layer's FSDP parameter group reshards after forward (``reshard_after_forward``; the
root never does), backward gathers again (training state ``PRE_BACKWARD``): the forward's gather then
carries the rowwise copy only and backward's the columnwise copy only (as Transformer Engine's
MXFP8Tensor does), half the bytes. The choice is made at the parameter's first gather and kept
(the buffers are fixed then); without ``reshard_after_forward`` both copies are gathered every time,
since backward reuses the forward's gather (:mod:`transformer_linear.modules.fsdp_gather_usages` makes the choice).

The gathered weight has the same fields in every pass (torch.compile runs one graph of the layer); a
0-d tensor says whether its rowwise fields hold the rowwise copy (:attr:`GatheredFP8Weight.missing_rowwise`).
The columnwise copy (contiguous (K, N) tensors, what dgrad reads and what the forward's autograd node saves)
is owned by the gathered weight, not a view of FSDP2's buffers: after a rowwise-only gather its storage is
freed (it holds nothing and costs nothing until backward), and backward's gather refills it in
place (the version counter kept), so the forward's saved tensors hold the backward's gather; they never
alias the buffers, which then hold the rowwise copy of the next forward. A forward that runs after
backward's columnwise-only gather (activation checkpointing's recompute) all-gathers the rowwise copy
itself from the current shard (bitwise the forward's: the same shard, the same quantizer). Traced, that is
a functional op in every forward's graph, which returns a copy of the held rowwise copy where nothing is
missing: one graph for every pass, right also where a compiled checkpointed region recomputes the forward
inside its backward graph, at the cost of one copy of the FP8 weight per compiled forward
(:func:`~transformer_linear.modules.fsdp_gather_usages.rowwise_copies`).

Backward all-gathers a resharded weight again; it is quantized with the scale its forward used (kept on
the layer), so dgrad reads bitwise the forward's FP8 weight, also under delayed scaling, whose scales
move on after each forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from transformer_linear._handles import NO_HANDLE
from transformer_linear.modules.fsdp_gather_usages import (
    BOTH,
    COLUMNWISE,
    ROWWISE,
    GatheredUsages,
    RowwiseSource,
    rowwise_copies,
    rowwise_source_handle,
    set_missing_rowwise,
    usages_to_gather,
)
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe import HistoryConfig
from transformer_linear.recipe.delayed_scaling import delayed_scaling_flush
from transformer_linear.recipe.kind_tensorwise import transposed
from transformer_linear.recipe.quantization import TensorQuantizer
from transformer_linear.recipe.scaling import FP8_STATE_COLUMNS, no_amax_yet
from transformer_linear.reference import compute_scale, fp8_max

__all__ = [
    "BOTH",
    "COLUMNWISE",
    "ROWWISE",
    "GatheredUsages",
    "FP8AllGatherWeight",
    "GatheredFP8Weight",
    "check_shardable",
    "checked_cached_weight",
    "gathered_weight",
    "gather_on_one_rank",
    "is_fp8_all_gathered",
    "quantize_weight",
    "refill_or_build",
    "weight_for_op",
    "whole_weight_of_gathered",
]

_WEIGHT_COLUMN = FP8_STATE_COLUMNS["weight"]
_CACHED_FIELDS = tuple(f.name for f in dataclasses.fields(CachedWeight))

# Ops whose result is still the shard (views, copies, FSDP2's chunking and padding): the rest unwrap.
_OPS_KEEPING_SHARD = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


def _in_backward() -> bool:
    """Whether autograd is running a backward (FSDP2's pre-backward all-gather, or a recompute)."""
    return torch._C._current_graph_task_id() != -1


def check_shardable(quantizer: TensorQuantizer, rows: int, world_size: int, where: str = "fully_shard") -> None:
    """Raise unless ``quantizer``'s weight of ``rows`` rows can be all-gathered quantized over ``world_size``
    ranks, each quantizing its dim-0 shard of ceil(rows / world_size) rows: its scaling kind says what
    prevents it (ScalingKind.shard_problem: a block straddling two shards, NVFP4's 1x16 blocks, ...).

    Raises:
        ValueError: naming the weight's rows, the world size and what prevents it.
    """
    if world_size == 1:
        return
    problem = quantizer.scaling_kind.shard_problem(quantizer, rows, world_size)
    if problem is not None:
        raise ValueError(
            f"{where}: fp8_all_gather cannot shard a weight of {rows} rows over {world_size} ranks with {problem}; "
            "use fp8_all_gather=False for this layer (its weight is then gathered in high precision)"
        )


class _ShardQuantization(NamedTuple):
    """The whole weight's amax (all-reduced) and, from a delayed-scaling history, the scale a forward's
    all-gather used, which backward's all-gather reuses (the weight has not changed since)."""

    scale: Optional[Tensor]
    amax: Tensor


class _GatherMetadata(NamedTuple):
    """What ``fsdp_pre_all_gather`` passes to ``fsdp_post_all_gather`` besides the gathered tensors."""

    rows: int
    """The whole weight's rows (the gathered ones include FSDP2's padding of uneven shards)."""
    usages: GatheredUsages
    """The copies gathered: for a separate columnwise copy, the rowwise and / or the columnwise one."""
    group: Any
    """The shard group (a forward after a columnwise-only gather gathers the rowwise copy over it)."""
    scale_inv: Optional[Tensor]
    """The scale the ranks share, which travels as metadata (GatheredShard.scale_inv): one scale per tensor's
    scale_inv, NVFP4's global decode scale; None where the scales are gathered."""
    amax: Optional[Tensor]
    """The whole weight's amax, where the kind's results carry one (delayed scaling records it)."""
    whole: Optional["_ShardQuantization"] = None
    """One rank: the high-precision weight was 'gathered' (see :func:`gather_on_one_rank`), quantized after
    with this amax and scale (or by its own where None)."""
    one_rank: bool = False


def gather_on_one_rank(
    shard: Tensor, quantizer: TensorQuantizer, whole: Optional["_ShardQuantization"], rows: int, group: Any
) -> tuple[tuple[Tensor, ...], _GatherMetadata]:
    """What ``fsdp_pre_all_gather`` returns on a one-rank shard group: FSDP2 (torch 2.13) gathers nothing
    there and builds the unsharded parameter from the first tensor returned alone
    (``FSDPParamGroup.wait_for_unshard``), so that tensor is the high-precision weight itself, which
    ``fsdp_post_all_gather`` quantizes whole (bitwise what the forward would)."""
    return (shard,), _GatherMetadata(rows, BOTH, group, None, None, whole, True)


def quantize_weight(quantizer: TensorQuantizer, weight: Tensor, whole: Optional["_ShardQuantization"] = None
                    ) -> CachedWeight:
    """``weight`` in both usages ``quantizer`` produces, as the forward reads a cached weight; a 3-D
    (num_gemms, out, in) one expert by expert, stacked, as the GroupedLinear's forward quantizes it. ``whole``:
    the delayed-scaling scale and all-reduced amax of a gathered weight (fsdp_pre_all_gather), where given."""
    with torch.no_grad():
        if weight.dim() == 3:
            q = quantizer.quantize_experts(weight.detach(), columnwise=True, records_amax=quantizer.records_amax)
        else:
            q = quantizer.quantize(weight.detach().contiguous(), rowwise=True, columnwise=True,
                                   scale=whole and whole.scale, global_amax=whole and whole.amax.reshape(()))
    return CachedWeight(
        weight_fp8=q.data,
        weight_fp8_t=q.data_t if q.data_t.numel() else None,
        weight_scale_inv=q.scale_inv,
        weight_scale_inv_t=q.scale_inv_t if q.scale_inv_t.numel() else None,
        weight_amax=q.amax.reshape(()) if q.amax is not None else None,
    )


def refill_or_build(
    cached: CachedWeight, quantizer: TensorQuantizer, param_dtype: torch.dtype, owned: list[str],
    out: Optional[Tensor],
) -> Optional[tuple["GatheredFP8Weight", tuple[Tensor, ...]]]:
    """What ``fsdp_post_all_gather`` returns for ``cached``: (``out`` given) its ``owned`` fields refilled in
    place into ``out``'s (which FSDP2 reallocated before this gather), None; else the unsharded weight and
    the tensors it owns (FSDP2 frees them on reshard)."""
    if out is not None:
        previous = _gathered_of(out).cached_weight
        for name in owned:
            _refill(getattr(previous, name), getattr(cached, name))
        return None
    return GatheredFP8Weight(cached, quantizer, param_dtype), tuple(getattr(cached, name) for name in owned)


class FP8AllGatherWeight(torch.Tensor):
    """A ``tl.Linear``'s high-precision weight (shard) that FSDP2 all-gathers quantized.

    To every op but FSDP2's all-gather it is the plain tensor it wraps (the optimizer updates that tensor,
    ``state_dict`` saves it); views and copies stay wrapped so that FSDP2's sharding keeps the subclass.

    Args:
        tensor: the high-precision weight (or shard).
        quantizer: the layer's weight quantizer (its recipe's), fixed at wrap time: every all-gather of the
            parameter must produce the same tensors.
        history: the recipe's amax-history config where the quantizer takes its scale from the layer's
            delayed-scaling state (``QuantizationSpec.history``), else None.
    """

    @staticmethod
    def __new__(
        cls, tensor: Tensor, quantizer: TensorQuantizer, history: Optional[HistoryConfig] = None
    ) -> "FP8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: Tensor, quantizer: TensorQuantizer, history: Optional[HistoryConfig] = None) -> None:
        if quantizer.scale_from_history and history is None:
            raise ValueError("FP8AllGatherWeight: a quantizer with 'scale_from_history' needs the recipe's 'history'")
        self._tensor = tensor
        self.quantizer = quantizer
        self.history = history

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._tensor!r}, quantizer={self.quantizer})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        configs = []

        def unwrap(t: "FP8AllGatherWeight") -> Tensor:
            configs.append((t.quantizer, t.history))
            return t._tensor

        args, kwargs = pytree.tree_map_only(FP8AllGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _OPS_KEEPING_SHARD:
            return out
        # cls: a subclass (a GroupedLinear's weight, fsdp_gather_grouped.py) stays that subclass.
        return pytree.tree_map_only(Tensor, lambda t: cls(t, *configs[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], (self.quantizer, self.history)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride) -> "FP8AllGatherWeight":
        return FP8AllGatherWeight(inner_tensors["_tensor"], *config)

    # ------------------------------------------------------------------
    # FSDP2 extension points
    # ------------------------------------------------------------------

    def _shard_to_quantize(self, mp_policy: Any) -> Tensor:
        """This shard as the forward would quantize it without FP8 all-gather: in the mixed-precision
        policy's parameter dtype, contiguous."""
        param_dtype = getattr(mp_policy, "param_dtype", None)
        shard = self._tensor if param_dtype is None else self._tensor.to(param_dtype)
        return shard.contiguous()

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], _GatherMetadata]:
        """Quantize this shard; return what to all-gather (FP8 data, block scales) and the metadata."""
        quantizer = self.quantizer
        group = mesh.get_group(mesh.ndim - 1)
        world_size = dist.get_world_size(group)
        rows = int(outer_size[0])
        check_shardable(quantizer, rows, world_size, "fsdp_pre_all_gather")
        shard = self._shard_to_quantize(mp_policy)
        padded_rows = -(-rows // world_size)
        with torch.no_grad():
            if world_size == 1:
                whole = _whole_weight_quantization(quantizer, self.history, shard, module, group)
                return gather_on_one_rank(shard, quantizer, whole, rows, group)
            if not quantizer.columnwise_is_transpose:
                usages = usages_to_gather(quantizer, module)
                q = quantizer.quantize(shard, rowwise=usages.rowwise, columnwise=usages.columnwise)
                gathered = [q.data, q.scale_inv] if usages.rowwise else []
                if usages.columnwise:
                    # The columnwise copy (cols, shard rows) gathers along its columns: transposed to rows,
                    # the rowwise copy's shape (the numel and dtypes of FSDP2's buffers either way).
                    gathered += [transposed(q.data_t), transposed(q.scale_inv_t)]
                return tuple(gathered), _GatherMetadata(rows, usages, group, None, None)
            # The rowwise copy alone (the columnwise one is its transpose, made after the gather), quantized as
            # part of the whole weight where the kind's scales span it (an amax all-reduce).
            whole = _whole_weight_quantization(quantizer, self.history, shard, module, group)
            amax = None if whole is None else whole.amax.reshape(())
            q = quantizer.quantize(shard, rowwise=True, columnwise=False, scale=whole and whole.scale, global_amax=amax)
            form = quantizer.scaling_kind.gather_form(quantizer, q, padded_rows)
            recorded = amax if q.amax is not None else None
            return form.tensors, _GatherMetadata(rows, ROWWISE, group, form.scale_inv, recorded)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: _GatherMetadata,
        param_dtype: torch.dtype,
        *,
        out: Optional[Tensor] = None,
    ) -> Optional[tuple["GatheredFP8Weight", tuple[Tensor, ...]]]:
        """The unsharded weight from the gathered tensors: views of them, and the copies made here
        (the transposed usages, the per-tensor scale), which FSDP2 frees on reshard and
        reallocates before the next gather (``out`` given: refilled in place)."""
        quantizer = self.quantizer
        if metadata.one_rank:  # the high-precision weight, quantized here: every field is the weight's own
            whole = quantize_weight(quantizer, all_gather_outputs[0], metadata.whole)
            owned = [name for name in _CACHED_FIELDS if getattr(whole, name) is not None]
            return refill_or_build(whole, quantizer, param_dtype, owned, out)
        if not quantizer.columnwise_is_transpose:
            return self._post_all_gather_separate(all_gather_outputs, metadata, param_dtype, out)
        whole = whole_weight_of_gathered(quantizer, all_gather_outputs, metadata.rows, metadata.scale_inv,
                                         metadata.amax)
        # The fields that are not views of FSDP2's buffers are the gathered weight's own: FSDP2 frees them on
        # reshard, and (``out`` given) they are refilled in place, as FSDP2 refills its buffers.
        owned = [name for name in _CACHED_FIELDS if getattr(whole, name) is not None and name not in _VIEW_FIELDS]
        if metadata.scale_inv is None:
            owned.remove("weight_scale_inv")  # gathered: a view of a buffer
        return refill_or_build(whole, quantizer, param_dtype, owned, out)

    def _post_all_gather_separate(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: _GatherMetadata,
        param_dtype: torch.dtype,
        out: Optional[Tensor],
    ) -> Optional[tuple["GatheredFP8Weight", tuple[Tensor, ...]]]:
        """:meth:`fsdp_post_all_gather` of a weight whose columnwise copy has its own blocks: the rowwise
        copy as views of the gathered tensors, the columnwise copy (contiguous (cols, rows)) in tensors of its
        own, refilled from this gather where it carries that copy and otherwise emptied (storage freed)."""
        usages, rows = metadata.usages, metadata.rows
        # The gathered tensors of either copy are in the rowwise copy's (rows, ...) form.
        columnwise = all_gather_outputs[-2:] if usages.columnwise else None
        if out is not None:
            gathered = _gathered_of(out)
            for dst, src in zip((gathered.weight_fp8_t, gathered.weight_scale_inv_t), columnwise or (None, None)):
                if src is None:
                    _free(dst)  # FSDP2 reallocated it before this gather; this pass does not read it
                else:
                    _refill(dst, transposed(src))
        else:
            data = all_gather_outputs[0][:rows]
            cols = data.shape[1]
            grid_t = self.quantizer.scale_grid(cols, rows)  # the columnwise copy's blocks: (cols, rows) rowwise
            data_t = data.new_empty((cols, rows))
            scale_inv_t = all_gather_outputs[1].new_empty(grid_t)
            for dst, src in zip((data_t, scale_inv_t), columnwise or (None, None)):
                if src is None:
                    _free(dst)
                else:
                    with torch.no_grad():
                        dst.copy_(transposed(src))
            cached = CachedWeight(data, data_t, all_gather_outputs[1], scale_inv_t, None)
            source = RowwiseSource(self, self.quantizer, param_dtype, metadata.group, rows)
            missing_rowwise = torch.full((), NO_HANDLE, dtype=torch.int64)
            gathered = GatheredFP8Weight(cached, self.quantizer, param_dtype, missing_rowwise)
            gathered.rowwise_source = source  # kept alive with the weight: the handle refers to it weakly
            gathered.rowwise_source_handle = rowwise_source_handle(source)
        # Data, not metadata: a compiled forward runs the same graph whichever copies this gather carried.
        set_missing_rowwise(gathered.missing_rowwise, usages, gathered.rowwise_source_handle)
        if out is not None:
            return None
        return gathered, (gathered.weight_fp8_t, gathered.weight_scale_inv_t)


def _refill(dst: Tensor, src: Tensor) -> None:
    """Refill ``dst`` (a tensor of the gathered weight FSDP2 reallocated before this gather) from ``src``.

    Backward's saved tensors are these: refilled with what this pass reads (FSDP2 refills its own gathered
    buffers the same way), so their version stays."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
        dst.copy_(src)


def _free(t: Tensor) -> None:
    """Free ``t``'s storage (FSDP2's ``free_storage``; it reallocates it before the next gather)."""
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


_VIEW_FIELDS = ("weight_fp8",)
"""The CachedWeight fields of a gathered weight that view FSDP2's buffers (the rowwise data; its scales too
where they are gathered rather than made from metadata)."""


def whole_weight_of_gathered(
    quantizer: TensorQuantizer, tensors: tuple[Tensor, ...], rows: int, scale_inv: Optional[Tensor],
    amax: Optional[Tensor] = None,
) -> CachedWeight:
    """The whole weight's quantized copies from the all-gathered rowwise copy (ScalingKind.from_gathered) and
    ``scale_inv`` (the shared scale that travelled as metadata, or None), the columnwise copy made from it
    (its transpose: TensorQuantizer.transpose_copy); ``amax`` (the whole weight's, or None) copied in."""
    data, whole_scale_inv = quantizer.scaling_kind.from_gathered(quantizer, tensors, rows, scale_inv)
    data_t, scale_inv_t = quantizer.transpose_copy(data, whole_scale_inv)
    return CachedWeight(data, data_t, whole_scale_inv, scale_inv_t, None if amax is None else amax.clone())


def _whole_weight_quantization(
    quantizer: TensorQuantizer, history: Optional[HistoryConfig], shard: Tensor, module: nn.Module, group: Any
) -> Optional[_ShardQuantization]:
    """The whole weight's amax (the MAX of the shards', where the kind's scales span the weight:
    ScalingKind.whole_tensor_amax) and the scale its delayed-scaling history gives; what the forward's gather
    used, in backward. None where each shard's scales are its own."""
    if _in_backward():
        used: Optional[_ShardQuantization] = getattr(module, "_fp8_all_gather_scale", None)
        if used is not None:
            return used
    amax = quantizer.scaling_kind.whole_tensor_amax(quantizer, shard)
    if amax is None:
        return None
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    used = _ShardQuantization(None, amax)
    if quantizer.scale_from_history:
        # The layer's delayed-scaling state: its scale for the weight, as the forward would read it
        # (reductions in flight applied), or, before any amax was recorded, one from the weight's own
        # amax (first_step_just_in_time), bitwise what the forward op would compute.
        state = module.delayed_scaling_state.op_args(module, history)
        if state.reduction_handle != NO_HANDLE:
            delayed_scaling_flush(module.fp8_amax_history, state.scale, state.reduction_handle)
        fallback = state.scale[_WEIGHT_COLUMN : _WEIGHT_COLUMN + 1]
        just_in_time = state.just_in_time and bool(no_amax_yet(state.amax_history, state.scale)[_WEIGHT_COLUMN])
        scale = fallback.clone() if not just_in_time else compute_scale(
            amax, fp8_max(quantizer.dtype), quantizer.margin, fallback=fallback)
        used = _ShardQuantization(scale, amax)
    module._fp8_all_gather_scale = used
    return used


class GatheredFP8Weight(torch.Tensor):
    """The unsharded weight FSDP2 gathered in FP8: the weight's shape and dtype, only its quantized form.

    ``tl.Linear`` reads :attr:`cached_weight` (the GEMMs' operands) and gives the weight gradient to this
    parameter through :func:`weight_for_op`; any other use raises (there is no high-precision weight).
    """

    source = "all-gathered in FP8 by fully_shard(fp8_all_gather=...)"
    """Where the weight's quantized form comes from, for error messages (a subclass says its own)."""

    @staticmethod
    def __new__(
        cls, cached_weight: CachedWeight,
        quantizer: TensorQuantizer,
        dtype: torch.dtype,
        missing_rowwise: Optional[Tensor] = None,
    ) -> "GatheredFP8Weight":
        shape = quantizer.value_shape(tuple(cached_weight.weight_fp8.shape))  # FP4: two values a byte
        data = cached_weight.weight_fp8
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(
        self, cached_weight: CachedWeight,
        quantizer: TensorQuantizer,
        dtype: torch.dtype,
        missing_rowwise: Optional[Tensor] = None,
    ) -> None:
        # One attribute per CachedWeight field: what __tensor_flatten__ names (torch.compile reads them).
        for name in _CACHED_FIELDS:
            setattr(self, name, getattr(cached_weight, name))
        self.quantizer = quantizer
        self.missing_rowwise = missing_rowwise
        """A weight gathered one copy per pass (MXFP8 under ``reshard_after_forward``): a 0-d int64 tensor,
        :data:`NO_HANDLE` where the rowwise fields hold the rowwise copy, else (after backward's columnwise-only
        gather, when they view buffers holding the columnwise copy) the handle a recomputed forward gathers the
        rowwise copy with (:func:`~transformer_linear.modules.fsdp_gather_usages.rowwise_copies`). None where the
        rowwise copy is always held."""
        self.rowwise_source: Optional[RowwiseSource] = None
        self.rowwise_source_handle = NO_HANDLE

    @property
    def cached_weight(self) -> CachedWeight:
        """The gathered quantized weight, as the Linear's forward op takes it."""
        return CachedWeight(**{name: getattr(self, name) for name in _CACHED_FIELDS})

    @property
    def stored_copies(self) -> CachedWeight:
        """The copies the weight holds, with none made now (a forward without autograd reads these, as no
        GEMM then reads a columnwise copy): a gathered weight's are :attr:`cached_weight`."""
        return self.cached_weight

    def __repr__(self) -> str:
        return f"GatheredFP8Weight(shape={list(self.shape)}, dtype={self.dtype}, quantizer={self.quantizer})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        this = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, GatheredFP8Weight))
        # FSDP2's own handling of the unsharded parameter: nn.Parameter's detach, its as_strided to the
        # weight's shape; the same weight again.
        same = func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or (
            func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default)
            and list(args[1]) == list(this.shape)
        )
        if same and args[0] is this:
            again = GatheredFP8Weight(this.cached_weight, this.quantizer, this.dtype, this.missing_rowwise)
            again.rowwise_source, again.rowwise_source_handle = this.rowwise_source, this.rowwise_source_handle
            return again
        raise RuntimeError(  # not a TypeError: Tensor's operators would turn that into NotImplemented
            f"a weight {this.source} (a tl.Linear's or a tl.GroupedLinear's) holds only its quantized form "
            f"({this.quantizer}); {func} cannot read it. Run the layer under its recipe, or shard with "
            "fp8_all_gather=False"
        )

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # The same fields in every pass (a copy this gather did not carry is present, its storage freed or
        # holding the other copy) and metadata that does not say which copies it holds: one compiled graph.
        names = [name for name in (*_CACHED_FIELDS, "missing_rowwise") if getattr(self, name) is not None]
        return names, (self.quantizer, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride) -> "GatheredFP8Weight":
        cached = CachedWeight(**{name: inner_tensors.get(name) for name in _CACHED_FIELDS})
        return GatheredFP8Weight(cached, *meta, inner_tensors.get("missing_rowwise"))


def _gathered_of(t: Tensor) -> "GatheredFP8Weight":
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, GatheredFP8Weight):
        raise TypeError(f"fsdp_post_all_gather: 'out' must be the GatheredFP8Weight built before, got {type(t).__name__}")
    return local


def is_fp8_all_gathered(weight: Tensor) -> bool:
    """Whether ``weight`` (a parameter, or an FSDP2 DTensor shard of one) is an :class:`FP8AllGatherWeight`."""
    return isinstance(getattr(weight, "_local_tensor", weight), FP8AllGatherWeight)


def gathered_weight(weight: Tensor) -> Optional[GatheredFP8Weight]:
    """``weight`` if it holds only its quantized form (a :class:`GatheredFP8Weight`: FSDP2 gathered it in FP8,
    or quantized_model_init keeps it so), else None."""
    return weight if isinstance(weight, GatheredFP8Weight) else None


def checked_cached_weight(weight: GatheredFP8Weight, quantizer: TensorQuantizer) -> CachedWeight:
    """``weight``'s quantized form, for a forward whose recipe quantizes the weight with ``quantizer``.

    Raises:
        ValueError: ``quantizer`` is not the one the weight was gathered with.
    """
    if quantizer != weight.quantizer:
        raise ValueError(
            f"Linear: the weight was {weight.source} as {weight.quantizer}; "
            f"the forward's recipe quantizes it as {quantizer}"
        )
    # Without autograd no GEMM reads the columnwise copy: a weight that would make it now does not.
    cached = weight.cached_weight if torch.is_grad_enabled() else weight.stored_copies
    if weight.missing_rowwise is not None:
        # A forward recomputed after backward's columnwise-only gather gathers the rowwise copy (traced, an
        # opaque op in every pass: the forward's graph is the same in every pass).
        weight_fp8, weight_scale_inv = rowwise_copies(weight.missing_rowwise, cached.weight_fp8,
                                                      cached.weight_scale_inv)
        cached = dataclasses.replace(cached, weight_fp8=weight_fp8, weight_scale_inv=weight_scale_inv)
    return cached


class _WeightForOp(torch.autograd.Function):
    """A plain stand-in of the gathered weight for ``linear_fwd`` (which reads only its shape and dtype
    when given the quantized weight), passing the weight gradient back to the gathered parameter."""

    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def weight_for_op(weight: GatheredFP8Weight) -> Tensor:
    """What ``linear_fwd`` takes as its weight in place of the gathered one (its gradient reaches ``weight``)."""
    return _WeightForOp.apply(weight)


