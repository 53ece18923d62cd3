"""Delayed scaling's amax reduction across ranks: the plumbing below the Linear.

Process groups as int keys the custom ops can take, and the all-reduces
themselves, blocking or launched in the background (the layer's
``DelayedScalingState``, delayed_scaling.py, keeps a launched one until the
flush applies it). The user-facing knobs (``set_amax_reduction_group``, ``finish_amax_reductions``)
are in distributed.py.

What is reduced, and why, is told in distributed.py.

The group is a per-module knob (``tl.distributed.set_amax_reduction_group``); by default
it is the default process group when one is initialised with more than one
rank, and nothing otherwise. A ProcessGroup cannot be an op argument, so the
ops take an int key into :data:`_GROUPS`, resolved here.

When the reduction
------------------
The ``transformer_linear::delayed_scaling_update`` custom op launches the
all-reduce asynchronously and returns; ``delayed_scaling_flush`` applies it
(wait, record, update the scales) before the state is next updated: the
forward state (input, weight) at the start of the layer's next forward, the
grad_output state at the start of its next backward (each direction's state
is mutated by that direction only, see delayed_scaling.py). The next forward
reads the grad_output scale its backward will use with the pending updates
applied to a copy (``delayed_scaling.flushed_state``). The scales are the same as
a blocking reduction's, but no rank waits for the others in the middle of
forward or backward (on a GPU, the compute stream does not wait behind the
gradient collectives queued on the same group). Until then the layer's
state buffers lag by the pending updates: ``state_dict()`` applies them
first, and so does ``tl.distributed.finish_amax_reductions``. The ops are
opaque to torch.compile, so eager and compiled runs issue the same
collectives.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_GROUP", "NO_GROUP", "all_reduce_amax", "group_key", "launch_amax_reduction", "reduces_amax"]

NO_GROUP = -1
"""Key: no amax reduction."""
DEFAULT_GROUP = 0
"""Key: the default process group, resolved when the op runs (nothing if uninitialised or one rank)."""

_GROUPS: dict[int, Any] = {}
_KEYS: dict[int, int] = {}  # id(group) -> key; _GROUPS keeps the group alive, so ids are not reused
_NEXT_KEY = itertools.count(1)


def group_key(group: Optional["dist.ProcessGroup"]) -> int:
    """The int key the custom op takes for ``group`` (None: no reduction)."""
    if group is None:
        return NO_GROUP
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"set_amax_reduction_group: 'group' must be a ProcessGroup or None, got {group!r}")
    key = _KEYS.get(id(group))
    if key is None:
        key = next(_NEXT_KEY)
        _KEYS[id(group)] = key
        _GROUPS[key] = group
    return key


def _resolve(key: int) -> Optional["dist.ProcessGroup"]:
    if key == NO_GROUP or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.group.WORLD if key == DEFAULT_GROUP else _GROUPS[key]
    return group if dist.get_world_size(group) > 1 else None


def all_reduce_amax(amax: Tensor, key: int) -> Tensor:
    """``amax`` all-reduced with MAX over the group of ``key``: a new tensor, or ``amax`` itself without a group."""
    group = _resolve(key)
    if group is None:
        return amax
    reduced = amax.detach().clone()  # ``amax`` may be saved or returned elsewhere
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced


def reduces_amax(key: int) -> bool:
    """Whether the group of ``key`` is live: initialised, more than one rank."""
    return _resolve(key) is not None


def launch_amax_reduction(amax: Tensor, key: int) -> Optional[tuple[Any, Tensor]]:
    """Start an async MAX all-reduce of a copy of ``amax`` over the group of ``key``.

    Returns:
        (the collective's work handle, the copy being reduced), or None
        (nothing started) without a live group. The caller keeps both until
        it waits for the work (delayed_scaling.py keeps them with the layer's
        state).
    """
    group = _resolve(key)
    if group is None:
        return None
    reduced = amax.detach().clone()  # ``amax`` may be saved or returned elsewhere
    return dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group, async_op=True), reduced
