"""The base of every module that holds a delayed-scaling state: ``tl.Linear``, ``tl.GroupedLinear`` and the
``transformers`` experts' ``ExpertsFP8State``.

The state's buffers (``fp8_amax_history``, ``fp8_scale``, ... ; recipe/delayed_scaling.py) are the module's:
saved in ``state_dict``, checked on load, kept in float32 by ``.to()``, brought up to date with the amax
reductions in flight before a checkpoint is taken. One implementation of that plumbing, here.
"""

from __future__ import annotations

import functools
from typing import Optional

from torch import nn

from transformer_linear.recipe import amax_reduction
from transformer_linear.recipe.delayed_scaling import DelayedScalingState

__all__ = ["DelayedScalingModule"]


def _finish_amax_reductions_hook(module: "DelayedScalingModule", prefix: str, keep_vars: bool) -> None:
    module.finish_amax_reductions()  # module level, so the module pickles


class DelayedScalingModule(nn.Module):
    """A module with a delayed-scaling state; a subclass calls :meth:`_init_delayed_scaling` in its
    ``__init__`` once ``self.weight`` and ``self.recipe`` exist (the state lives on the weight's device and
    its history is as long as the recipe's)."""

    recipe: Optional[object]

    def _init_delayed_scaling(self) -> None:
        # The amax all-reduce group, as an amax_reduction.py key (an int, so torch.compile guards on it
        # cheaply): set it with tl.distributed.set_amax_reduction_group.
        self.amax_reduction_group = amax_reduction.DEFAULT_GROUP
        self.delayed_scaling_state = DelayedScalingState()
        """The delayed-scaling state (delayed_scaling.py); its buffers are this module's."""
        self.reset_fp8_state()
        # A checkpoint holds the scales as of the last step, not lagging behind reductions still in flight
        # (tl.distributed).
        self.register_state_dict_pre_hook(_finish_amax_reductions_hook)

    def reset_fp8_state(self, amax_history_len: Optional[int] = None) -> None:
        """Start the delayed-scaling state fresh (empty history, scales 1), on the weight's device.

        Args:
            amax_history_len: rows of the new history; default: the module's
                own recipe's ``amax_history_len``, else ``DelayedScaling``'s
                default. A ``tl.autocast`` recipe with a longer history than
                the module holds needs this before ``torch.compile`` /
                ``torch.export`` (eagerly the history grows by itself).
        """
        self.delayed_scaling_state.reset(self, amax_history_len)

    def finish_amax_reductions(self) -> None:
        """Apply the amax reductions still in flight to the delayed-scaling state (see tl.distributed)."""
        self.delayed_scaling_state.finish_reductions(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        load_module = functools.partial(
            super()._load_from_state_dict, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs,
        )
        self.delayed_scaling_state.load(self, state_dict, prefix, missing_keys, load_module)

    def _apply(self, fn, recurse=True):
        with self.delayed_scaling_state.float32_buffers(self):
            super()._apply(fn, recurse)
        return self
