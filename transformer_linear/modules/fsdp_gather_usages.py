"""Which copies of a block-scaled weight an FSDP2 all-gather carries, from the layer's FSDP2 state.

A weight whose columnwise copy is the rowwise one transposed (one scale per tensor, square blocks) gathers
its rowwise copy only (the transpose is made after the gather). A non-square block's (MXFP8's 1x32)
columnwise copy has its own blocks and must be gathered: where the layer's FSDP2 parameter group reshards
after forward, backward gathers again (training state ``PRE_BACKWARD``), so the forward's gather carries the
rowwise copy only and backward's the columnwise copy only (as Transformer Engine's MXFP8Tensor does);
otherwise one gather serves both passes and carries both. The choice is made at the parameter's first
gather and kept: FSDP2 fixes its all-gather buffers then (:mod:`transformer_linear.modules.fp8_all_gather`
explains why either copy fits them). A forward recomputed after backward's columnwise-only gather
(activation checkpointing) gathers the rowwise copy itself (:func:`rowwise_copies`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from transformer_linear._handles import NO_HANDLE, HandleTable
from transformer_linear.formats.checks import check_host_tensor, check_same_device
from transformer_linear.ops import library
from transformer_linear.recipe.quantization import TensorQuantizer

__all__ = [
    "BACKWARD_READS_COLUMNWISE",
    "BOTH",
    "COLUMNWISE",
    "ROWWISE",
    "GatheredUsages",
    "RowwiseSource",
    "rowwise_copies",
    "rowwise_copy",
    "rowwise_source_handle",
    "set_missing_rowwise",
    "usages_to_gather",
]


class GatheredUsages(NamedTuple):
    """Which copies of a weight one all-gather carries (a columnwise copy that is the rowwise one transposed
    is made after the gather and counts as carried with it)."""

    rowwise: bool
    columnwise: bool


ROWWISE = GatheredUsages(True, False)
COLUMNWISE = GatheredUsages(False, True)
BOTH = GatheredUsages(True, True)


BACKWARD_READS_COLUMNWISE = "_fp8_all_gather_backward_reads_columnwise"
"""The layer attribute (set by ``fully_shard`` at wrap time, from the recipe's ``backward_override``) saying
whether backward reads the weight's columnwise copy (a quantized dgrad). A dequantized dgrad reads the
rowwise copy, which backward's gather must then carry too: both copies are gathered in every pass."""


# The FSDP parameter group of each tl.Linear whose weight FSDP2 gathers, and the usages of its gathers
# fixed at its first one (FSDP2's all-gather buffers are fixed then).
_PARAM_GROUPS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_PER_PASS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _param_group(module: nn.Module) -> Any:
    """The FSDP2 parameter group holding ``module``'s weight (FSDP2 hands ``fsdp_pre_all_gather`` the
    parameter's module, which need not be the ``fully_shard``-ed one), or None. Any parameter of ``module``
    finds it: a module's parameters are in one group, and a torchtitan experts module's weights are
    ``w1_EFD``, ``w2_EDF``, ``w3_EFD``."""
    ref = _PARAM_GROUPS.get(module)
    if ref is not None and ref() is not None:
        return ref()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        for group in getattr(state, "_fsdp_param_groups", ()):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                if info.module is module:
                    _PARAM_GROUPS[module] = weakref.ref(group)
                    return group
    return None


def usages_to_gather(quantizer: TensorQuantizer, module: nn.Module) -> GatheredUsages:
    """The copies of a block-scaled weight this all-gather carries.

    A separate columnwise copy is gathered by backward's gather only where FSDP2 gathers again before
    backward (the parameter group's ``reshard_after_forward``, read at the first gather) and backward reads
    only that copy (:data:`BACKWARD_READS_COLUMNWISE`); the forward's gather then carries the rowwise copy
    only. Otherwise both copies, in every gather.

    Raises:
        RuntimeError: ``reshard_after_forward`` was turned off after the first gather gathered per pass
            (``set_reshard_after_forward(False)``): backward would then find no columnwise copy.
    """
    if quantizer.columnwise_is_transpose:
        return ROWWISE
    group = _param_group(module)
    reshards = group is not None and group._reshard_after_forward
    per_pass = _PER_PASS.setdefault(module, reshards and getattr(module, BACKWARD_READS_COLUMNWISE, True))
    if not per_pass:
        return BOTH
    if not reshards:
        raise RuntimeError(
            "fsdp_pre_all_gather: this layer's weight is all-gathered one copy per pass (its FSDP2 group "
            "resharded after forward at its first all-gather), but reshard_after_forward is now off, so backward "
            "would not gather the columnwise copy; keep reshard_after_forward on (also for evaluation), or set it "
            "before the first forward"
        )
    return COLUMNWISE if group._training_state == TrainingState.PRE_BACKWARD else ROWWISE


# ---------------------------------------------------------------------------
# A recomputed forward's rowwise copy
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class RowwiseSource:
    """Where a gathered weight holding only its columnwise copy gets its rowwise copy (a forward recomputed in
    backward, after backward's columnwise-only gather)."""

    shard: Any
    """The FP8AllGatherWeight shard of this rank (its ``_tensor`` is the current high-precision shard)."""
    quantizer: TensorQuantizer
    dtype: torch.dtype
    """The gathered weight's dtype (FSDP2's ``param_dtype``), which the shard is cast to before quantizing."""
    group: Any
    rows: int
    quantize_rowwise: Optional[Callable[[Tensor], Any]] = None
    """How the shard's rowwise copy is made (its ``data`` and ``scale_inv``), where not by
    ``quantizer.quantize``: a GroupedLinear's experts, each on its own (fsdp_gather_grouped.py)."""


_ROWWISE_SOURCES: HandleTable[RowwiseSource] = HandleTable()


def rowwise_source_handle(source: RowwiseSource) -> int:
    """A handle of ``source`` for :func:`rowwise_copy` (the caller keeps ``source`` alive)."""
    return _ROWWISE_SOURCES.add(source)


def set_missing_rowwise(missing_rowwise: Tensor, usages: GatheredUsages, handle: int) -> None:
    """Record in a gathered weight's ``missing_rowwise`` whether this gather carried its rowwise copy
    (:data:`NO_HANDLE`) or not (``handle``, its :class:`RowwiseSource`'s).

    Its version is kept: a compiled checkpointed region saves the tensor in forward and reads it when its
    backward recomputes the forward, after backward's gather wrote it, which is the value that recompute
    must read (FSDP2 refills the gathered parameter's storage the same way).
    """
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(missing_rowwise):
        missing_rowwise.fill_(NO_HANDLE if usages.rowwise else handle)


# The handle travels as a tensor, not as an int of the schema: torch.compile would guard on an int's value,
# specializing the layer's graph per layer and per pass; a tensor's value it does not guard on, so every pass
# (forward, recompute) and every layer of one shape runs one graph.
#
# The op is functional (it returns the copy, it does not write FSDP2's buffers): Inductor cannot lower an
# in-place write to a float8_e8m0fnu tensor (its decompose_auto_functionalized pass skips nodes reading that
# dtype, then asserts the node is gone), and a compiled activation-checkpointed region recomputes the forward
# inside the backward graph from the forward's inputs, which only a functional op reads right: there the
# buffers hold the columnwise copy backward gathered, and the op, recomputed, gathers the rowwise one.
@library.custom_op("transformer_linear::fsdp_rowwise_copy", mutates_args=())
def rowwise_copy(missing_rowwise: Tensor, weight_fp8: Tensor, weight_scale_inv: Tensor) -> tuple[Tensor, Tensor]:
    """A gathered weight's rowwise copy (its data and scales), for a forward.

    ``missing_rowwise`` (0-d int64) is :data:`NO_HANDLE` where ``weight_fp8`` / ``weight_scale_inv`` (views of
    FSDP2's all-gather buffers) hold the rowwise copy: the copy is theirs, copied. Else it is the handle of the
    weight's :class:`RowwiseSource` (backward's gather carried only the columnwise copy, and this forward is a
    recompute): the rowwise copy is all-gathered from the current shard, bitwise the forward's (the same shard
    and quantizer). Every rank recomputes the same layers in the same order, so the collectives match.

    Returns:
        The rowwise data and scales, new tensors of ``weight_fp8``'s and ``weight_scale_inv``'s shapes.

    Raises:
        RuntimeError: the handle names no live source.
    """
    _check_gather_args(missing_rowwise, weight_fp8, weight_scale_inv)
    handle = int(missing_rowwise)
    if handle == NO_HANDLE:
        return weight_fp8.clone(), weight_scale_inv.clone()
    source = _ROWWISE_SOURCES.get(handle)
    if source is None:
        raise RuntimeError(
            "Linear: the weight holds only the columnwise copy FSDP2 gathered for backward and its shard is gone, "
            "so its rowwise copy cannot be gathered for this forward"
        )
    return gather_rowwise(source, weight_fp8, weight_scale_inv)


def gather_rowwise(source: RowwiseSource, weight_fp8: Tensor, weight_scale_inv: Tensor) -> tuple[Tensor, Tensor]:
    """All-gather the rowwise copy of ``source``'s weight from its current shard (of the shapes and dtypes of
    ``weight_fp8`` / ``weight_scale_inv``, the gathered weight's rowwise fields)."""
    shard = source.shard._tensor.contiguous()
    if shard.dtype != source.dtype:
        shard = shard.to(source.dtype)  # FSDP2's param_dtype, as fsdp_pre_all_gather casts it
    world_size = dist.get_world_size(source.group)
    with torch.no_grad():
        if source.quantize_rowwise is not None:
            q = source.quantize_rowwise(shard)
        else:
            q = source.quantizer.quantize(shard, rowwise=True, columnwise=False)
        data, scale_inv = (_all_gather_rows(t, world_size, source.group) for t in (q.data, q.scale_inv))
    return data[: source.rows].contiguous(), scale_inv


def rowwise_copies(missing_rowwise: Tensor, weight_fp8: Tensor, weight_scale_inv: Tensor) -> tuple[Tensor, Tensor]:
    """The rowwise data and scales a forward reads of a weight gathered one copy per pass.

    Eager: the weight's own tensors where they hold the rowwise copy (the host handle says so; no copy), else
    the copy gathered now. Traced: always :func:`rowwise_copy`, an op that decides when the graph runs, so a
    layer's forward and its recompute run one graph.
    """
    if torch.compiler.is_compiling():
        return rowwise_copy(missing_rowwise, weight_fp8, weight_scale_inv)
    _check_gather_args(missing_rowwise, weight_fp8, weight_scale_inv)
    if int(missing_rowwise) == NO_HANDLE:
        return weight_fp8, weight_scale_inv
    return rowwise_copy(missing_rowwise, weight_fp8, weight_scale_inv)


@rowwise_copy.register_fake
def _(missing_rowwise: Tensor, weight_fp8: Tensor, weight_scale_inv: Tensor) -> tuple[Tensor, Tensor]:
    _check_gather_args(missing_rowwise, weight_fp8, weight_scale_inv)
    return torch.empty_like(weight_fp8), torch.empty_like(weight_scale_inv)


def _check_gather_args(missing_rowwise: Tensor, weight_fp8: Tensor, weight_scale_inv: Tensor) -> None:
    """The weight's copies on one device, the handle there or on the CPU (it is read on the host); the fake
    implementation checks too (a meta argument would route a call to it: silent garbage)."""
    op = "fsdp_rowwise_copy"
    check_same_device(op, {"weight_fp8": weight_fp8, "weight_scale_inv": weight_scale_inv})
    check_host_tensor(op, "missing_rowwise", missing_rowwise, weight_fp8, "weight_fp8")
    if missing_rowwise.dtype != torch.int64 or missing_rowwise.dim() != 0:
        raise ValueError(f"{op}: argument 'missing_rowwise' must be a 0-d int64 tensor (a handle), got "
                         f"{missing_rowwise.dtype} of shape {list(missing_rowwise.shape)}")


def _all_gather_rows(shard: Tensor, world_size: int, group: Any) -> Tensor:
    """``shard`` of every rank of ``group``, concatenated along rows (as raw bytes: any collective backend)."""
    out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_single(out.view(torch.uint8), shard.contiguous().view(torch.uint8), group=group)
    return out
