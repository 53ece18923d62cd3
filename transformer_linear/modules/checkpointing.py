"""Activation checkpointing of models built from ``tl.Linear``.

Eager ``torch.utils.checkpoint`` (reentrant or not) needs nothing: the layer
recognises the recompute (a forward run by backward), quantizes with the
delayed scales the original forward used and records no amax twice.

Inside ``torch.compile`` the compiler recomputes a checkpointed region itself,
including the functionalized delayed-scaling update and the read of the
scales, from buffers the forward has updated since. Under DelayedScaling, save
this package's ops instead of recomputing them, with selective activation
checkpointing::

    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=tl.selective_checkpoint_contexts)

Everything else in the region is still recomputed. What is saved is every
output of each layer's forward op: its result (in the activation dtype) and
its FP8 copies of input and weight, so the region saves more than plain
checkpointing would; the non-linear ops between the layers still recompute.
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["fp8_checkpoint_policy", "selective_checkpoint_contexts"]

_NAMESPACE = "transformer_linear"


def fp8_checkpoint_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save transformer_linear's ops, recompute the rest."""
    if getattr(op, "namespace", None) == _NAMESPACE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` applying :func:`fp8_checkpoint_policy`."""
    return create_selective_checkpoint_contexts(fp8_checkpoint_policy)
