"""Swap ``nn.Linear`` layers for ``tl.Linear`` in place, keeping their parameters."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from transformer_linear.recipe import Recipe

__all__ = ["convert_to_fp8", "from_linear"]


def from_linear(cls: type, linear: nn.Linear, **kwargs: Any) -> nn.Module:
    """Build ``cls`` (tl.Linear) around ``linear``'s own Parameter objects."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"from_linear: 'linear' must be a torch.nn.Linear, got {type(linear).__name__}")
    with torch.device("meta"):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
    # Sharing the Parameters keeps optimizer state and ties pointing at them valid.
    new.weight = linear.weight
    new.bias = linear.bias
    new.train(linear.training)
    new.reset_fp8_state()
    return new


def convert_to_fp8(
    model: nn.Module,
    recipe: Optional[Recipe] = None,
    module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by ``tl.Linear`` (in place; returns ``model``).

    Args:
        model: the model; if it is itself an ``nn.Linear`` the converted module is returned.
        recipe: the converted layers' recipe; None follows ``tl.autocast``.
        module_filter_fn: ``fn(module, fqn) -> bool``; layers for which it
            returns False are left alone (torchao's convention).
    """
    from transformer_linear.linear import Linear

    def keep(module: nn.Module, fqn: str) -> bool:
        return type(module) is nn.Linear and (module_filter_fn is None or module_filter_fn(module, fqn))

    if keep(model, ""):
        return Linear.from_linear(model, recipe=recipe)
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if keep(child, child_fqn):
                setattr(module, name, Linear.from_linear(child, recipe=recipe))
    return model
