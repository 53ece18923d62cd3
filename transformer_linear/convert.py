"""Swap ``nn.Linear`` (and ``transformers``' ``Conv1D``) layers for ``tl.Linear`` in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from transformer_linear.linear import Linear
from transformer_linear.recipe import Recipe

__all__ = ["ConversionPlan", "conversion_plan", "convert_to_fp8", "from_linear"]

FilterFn = Callable[[nn.Module, str], bool]


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


def is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): ``x @ W + b`` with W of shape (in, out).

    Recognised by name and shape, so this module does not import ``transformers``.
    """
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and weight.shape[1] == getattr(module, "nf", None)
    )


def from_conv1d(cls: type, conv: nn.Module, **kwargs: Any) -> nn.Module:
    """Build ``cls`` (tl.Linear) computing what ``conv`` (a ``Conv1D``) computes.

    The weight is a new Parameter holding the transposed (out, in) copy, so
    an optimizer built before the conversion no longer updates it: build the
    optimizer after converting. The bias Parameter is shared.
    """
    in_features, out_features = conv.weight.shape
    with torch.device("meta"):
        new = cls(in_features, out_features, bias=conv.bias is not None, **kwargs)
    new.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
    new.bias = conv.bias
    new.train(conv.training)
    new.reset_fp8_state()
    return new


def _skip_reason(module: nn.Module, fqn: str, module_filter_fn: Optional[FilterFn]) -> Optional[str]:
    """None when ``module`` is converted; else why not ('' for modules that are not Linear-like at all)."""
    if isinstance(module, Linear):
        return ""
    linear_like = type(module) is nn.Linear or is_conv1d(module)
    if not linear_like:
        if isinstance(module, nn.Linear):
            return f"{type(module).__name__} is a subclass of nn.Linear (its owner may call F.linear on its weight)"
        return ""
    if module_filter_fn is not None and not module_filter_fn(module, fqn):
        return "module_filter_fn returned False"
    return None


@dataclass(frozen=True)
class ConversionPlan:
    """What :func:`convert_to_fp8` converts in a model, and what it leaves alone.

    Attributes:
        converted: qualified names of the layers it swaps for ``tl.Linear``
            (``nn.Linear`` and ``Conv1D``).
        skipped: Linear-like layers it leaves alone, with the reason.
        existing: layers that already are ``tl.Linear``.
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    existing: list[str] = field(default_factory=list)


def _check_model(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: 'model' must be a torch.nn.Module, got {type(model).__name__}")


def conversion_plan(model: nn.Module, module_filter_fn: Optional[FilterFn] = None) -> ConversionPlan:
    """List the layers :func:`convert_to_fp8` would convert and those it skips (and why)."""
    _check_model("conversion_plan", model)
    plan = ConversionPlan()
    for fqn, module in model.named_modules():
        reason = _skip_reason(module, fqn, module_filter_fn)
        if reason is None:
            plan.converted.append(fqn)
        elif reason:
            plan.skipped[fqn] = reason
        elif isinstance(module, Linear):
            plan.existing.append(fqn)
    return plan


def convert_to_fp8(
    model: nn.Module,
    recipe: Optional[Recipe] = None,
    module_filter_fn: Optional[FilterFn] = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` and ``Conv1D`` in ``model`` by ``tl.Linear`` (in place; returns ``model``).

    A layer reachable under several names (``nn.Sequential(lin, act, lin)``)
    becomes one ``tl.Linear`` placed under all of them, so sharing survives.
    Subclasses of ``nn.Linear`` are left alone (their owner may use the
    weight directly, as ``nn.MultiheadAttention`` does); see
    :func:`conversion_plan` for what is converted and skipped.

    Args:
        model: the model; if it is itself a convertible layer the converted module is returned.
        recipe: the converted layers' recipe; None follows ``tl.autocast``.
        module_filter_fn: ``fn(module, fqn) -> bool``; layers for which it
            returns False are left alone (torchao's convention).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_model("convert_to_fp8", model)

    def convert(module: nn.Module) -> nn.Module:
        if is_conv1d(module):
            return from_conv1d(Linear, module, recipe=recipe)
        return Linear.from_linear(module, recipe=recipe)

    if _skip_reason(model, "", module_filter_fn) is None:
        return convert(model)
    done: dict[int, nn.Module] = {}  # id(original) -> its tl.Linear, for layers reached twice
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        # _modules, not named_children(): that skips a child's second name.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if id(child) in done:
                setattr(module, name, done[id(child)])
                continue
            child_fqn = f"{fqn}.{name}" if fqn else name
            if _skip_reason(child, child_fqn, module_filter_fn) is None:
                done[id(child)] = convert(child)
                setattr(module, name, done[id(child)])
    return model
