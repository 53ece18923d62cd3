"""Which copies of a block-scaled weight an FSDP2 all-gather carries, from the layer's FSDP2 state.

A weight whose columnwise copy is the rowwise one transposed (one scale per tensor, square blocks) gathers
its rowwise copy only (the transpose is made after the gather). A non-square block's (MXFP8's 1x32)
columnwise copy has its own blocks and must be gathered: where the layer's FSDP2 parameter group reshards
after forward, backward gathers again (training state ``PRE_BACKWARD``), so the forward's gather carries the
rowwise copy only and backward's the columnwise copy only (as Transformer Engine's MXFP8Tensor does);
otherwise one gather serves both passes and carries both. The choice is made at the parameter's first
gather and kept: FSDP2 fixes its all-gather buffers then (:mod:`transformer_linear.modules.fp8_all_gather`
explains why either copy fits them).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

from torch import nn
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from transformer_linear.recipe.quantization import TensorQuantizer

__all__ = ["BOTH", "COLUMNWISE", "ROWWISE", "GatheredUsages", "separate_columnwise_copy", "usages_to_gather"]


def separate_columnwise_copy(quantizer: TensorQuantizer) -> bool:
    """Whether ``quantizer``'s columnwise copy of a weight has blocks of its own (a non-square block: MXFP8's
    1x32), so that it is gathered rather than made from the gathered rowwise copy (its transpose)."""
    return quantizer.blockwise and quantizer.block_shape[0] != quantizer.block_shape[1]


class GatheredUsages(NamedTuple):
    """Which copies of a weight one all-gather carries (a columnwise copy that is the rowwise one transposed
    is made after the gather and counts as carried with it)."""

    rowwise: bool
    columnwise: bool


ROWWISE = GatheredUsages(True, False)
COLUMNWISE = GatheredUsages(False, True)
BOTH = GatheredUsages(True, True)


# The FSDP parameter group of each tl.Linear whose weight FSDP2 gathers, and the usages of its gathers
# fixed at its first one (FSDP2's all-gather buffers are fixed then).
_PARAM_GROUPS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_PER_PASS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _param_group(module: nn.Module) -> Any:
    """The FSDP2 parameter group holding ``module``'s weight (FSDP2 hands ``fsdp_pre_all_gather`` the
    parameter's module, which need not be the ``fully_shard``-ed one), or None."""
    ref = _PARAM_GROUPS.get(module)
    if ref is not None and ref() is not None:
        return ref()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        for group in getattr(state, "_fsdp_param_groups", ()):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                if info.module is module and info.param_name == "weight":
                    _PARAM_GROUPS[module] = weakref.ref(group)
                    return group
    return None


def usages_to_gather(quantizer: TensorQuantizer, module: nn.Module) -> GatheredUsages:
    """The copies of a block-scaled weight this all-gather carries.

    A separate columnwise copy is gathered by backward's gather only where FSDP2 gathers again before
    backward (the parameter group's ``reshard_after_forward``, read at the first gather); the forward's
    gather then carries the rowwise copy only. Otherwise one gather serves both passes: both copies.

    Raises:
        RuntimeError: ``reshard_after_forward`` was turned off after the first gather gathered per pass
            (``set_reshard_after_forward(False)``): backward would then find no columnwise copy.
    """
    if not separate_columnwise_copy(quantizer):
        return ROWWISE
    group = _param_group(module)
    reshards = group is not None and group._reshard_after_forward
    per_pass = _PER_PASS.setdefault(module, reshards)
    if not per_pass:
        return BOTH
    if not reshards:
        raise RuntimeError(
            "fsdp_pre_all_gather: this tl.Linear's weight is all-gathered one copy per pass (its FSDP2 group "
            "resharded after forward at its first all-gather), but reshard_after_forward is now off, so backward "
            "would not gather the columnwise copy; keep reshard_after_forward on (also for evaluation), or set it "
            "before the first forward"
        )
    return COLUMNWISE if group._training_state == TrainingState.PRE_BACKWARD else ROWWISE
