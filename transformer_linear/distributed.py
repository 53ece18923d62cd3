"""``tl.Linear`` with torch.distributed: amax reduction across ranks and the
checks that keep DDP / FSDP2 / tensor parallelism from going silently wrong.

What is reduced across ranks
----------------------------
* **DelayedScaling**: every amax recorded in the history (input and weight in
  forward, grad_output in backward) is all-reduced with MAX over the amax
  reduction group *before* the scale update, so every rank holds the same
  history and uses bitwise the same scales. Without it each rank would scale
  its own data-parallel shard differently and the replicas' FP8 numerics (not
  just their data) would drift apart.
* **CurrentScaling**: nothing. The weight amax is identical on all ranks by
  construction (DDP keeps replicas equal; FSDP2 all-gathers the full weight
  before forward). Input and grad_output amaxes are per-rank by design: each
  rank quantizes its own activations with its own scale, like any per-tensor
  scale computed "just in time"; reducing them would add a collective per
  GEMM and buy nothing, since gradients are reduced in high precision.

The group is a per-module knob (:func:`set_amax_reduction_group`); by default
it is the default process group when one is initialised with more than one
rank, and nothing otherwise. The reduction runs inside the
``transformer_linear::delayed_scaling_update`` custom op, whose body is
opaque to torch.compile: eager and compiled runs issue the same collective.
A ProcessGroup cannot be an op argument, so the op takes an int key into
:data:`_GROUPS`, resolved here.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DEFAULT_GROUP", "NO_GROUP", "all_reduce_amax_", "check_fsdp_compatible", "fully_shard", "set_amax_reduction_group"]

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


def all_reduce_amax_(amax: Tensor, key: int) -> None:
    """All-reduce ``amax`` in place with MAX over the group of ``key`` (no-op without one)."""
    group = _resolve(key)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def set_amax_reduction_group(model: nn.Module, group: Optional["dist.ProcessGroup"]) -> nn.Module:
    """Set the group every ``tl.Linear`` in ``model`` all-reduces its delayed-scaling amaxes over.

    Args:
        model: the model (or a single ``tl.Linear``).
        group: the data-parallel group; None turns the reduction off (each
            rank then keeps its own scales).

    Returns:
        ``model``.
    """
    from transformer_linear.linear import Linear

    key = group_key(group)
    for module in model.modules():
        if isinstance(module, Linear):
            module.amax_reduction_group = key
    return model


def check_fsdp_compatible(model: nn.Module) -> None:
    """Raise if a ``tl.Linear`` in ``model`` uses an option FSDP2 cannot honour.

    FSDP2 reduce-scatters ``weight.grad`` in its post-backward hook, so a weight
    gradient written later (``delay_wgrad_compute``'s ``backward_dw``) or
    elsewhere (``fuse_wgrad_accumulation``'s ``main_grad``) would never be
    reduced: the optimizer would silently step on an unreduced or missing gradient.
    """
    from transformer_linear.linear import Linear

    for fqn, module in model.named_modules():
        if isinstance(module, Linear):
            for option in ("delay_wgrad_compute", "fuse_wgrad_accumulation"):
                if getattr(module, option):
                    raise ValueError(
                        f"fully_shard: tl.Linear {fqn or '<root>'!r} has {option}=True, which FSDP2 does not support "
                        "(its gradient reduction only sees weight.grad at the end of backward); "
                        f"build the layer with {option}=False"
                    )


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` after :func:`check_fsdp_compatible`.

    Args:
        module: the module to shard.
        **kwargs: passed to ``torch.distributed.fsdp.fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    check_fsdp_compatible(module)
    return torch_fully_shard(module, **kwargs)
