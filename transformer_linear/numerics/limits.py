"""Which layers a recipe cannot run, found before any training.

A recipe's quantizers constrain a layer's shape (NVFP4 quantizes in blocks of
16 along each copy's rows, so ``in_features`` and ``out_features`` must be
multiples of 16; the grouped GEMMs of mixture-of-experts projections take
only some recipes). Rather than restate each recipe's rules here, each
distinct layer shape is tried once: a forward and backward of a fresh
``tl.Linear`` (or :class:`~transformer_linear.modules.hf_experts.ExpertsFP8State`)
of that shape under the recipe, on :data:`PROBE_ROWS` rows, a multiple of every
block size, so only the layer's own dimensions can be refused. What the
recipe's quantize or GEMM raises is the reason, naming no layer; the caller
names it. ``compare`` leaves such a layer in high precision for that recipe,
and ``transformer-linear compare`` lists it before the first run.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from transformer_linear.modules.autocast import outside_autocast
from transformer_linear.modules.convert import linear_weight
from transformer_linear.modules.hf_experts import ExpertsFP8State, experts_projections, is_hf_experts
from transformer_linear.modules.linear import Linear

__all__ = ["PROBE_ROWS", "experts_refusal", "linear_refusal", "refused_layers"]

PROBE_ROWS = 128
"""Rows (tokens) of a probe: a multiple of every block a recipe quantizes in (16, 32, 128)."""

_REFUSALS = (ValueError, RuntimeError, NotImplementedError)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _refusal(build: Any, in_features: int, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Run ``build()(x)`` forward and backward on a random (PROBE_ROWS, in_features) ``x``; the first line of
    what it raises, else None. The global random state is left as it was (the runs that follow draw from it)."""
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                outside_autocast():
            torch.manual_seed(0)
            x = torch.randn(PROBE_ROWS, in_features, device=device, dtype=dtype, requires_grad=True)
            build()(x).float().sum().backward()
    except _REFUSALS as e:
        return _first_line(e)
    return None


@functools.lru_cache(maxsize=None)
def _linear(recipe: Any, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
            device: torch.device) -> Optional[str]:
    def build():
        return Linear(in_features, out_features, bias=bias, device=device, dtype=dtype, recipe=recipe)

    return _refusal(build, in_features, device, dtype)


@functools.lru_cache(maxsize=None)
def _grouped(recipe: Any, in_features: int, out_features: int, dtype: torch.dtype,
             device: torch.device) -> Optional[str]:
    def build():
        state = ExpertsFP8State(recipe, device=device)  # refuses a recipe the grouped GEMMs do not take
        weight = torch.randn(1, out_features, in_features, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([PROBE_ROWS], dtype=torch.int32, device=device)
        return lambda x: state(x, weight, offs)

    return _refusal(build, in_features, device, dtype)


def linear_refusal(layer: Linear, recipe: Any) -> Optional[str]:
    """Why ``recipe`` cannot run ``layer`` (its in/out features), or None when it can."""
    weight = linear_weight(layer)
    out_features, in_features = weight.shape
    return _linear(recipe, in_features, out_features, layer.bias is not None, weight.dtype, weight.device)


def experts_refusal(module: nn.Module, projection: str, recipe: Any) -> Optional[str]:
    """Why ``recipe`` cannot run the ``projection`` (``down_proj``, ...) of the experts ``module`` on the grouped
    GEMMs, or None when it can."""
    weight = getattr(module, projection)
    _, out_features, in_features = weight.transpose(1, 2).shape if module.is_transposed else weight.shape
    return _grouped(recipe, in_features, out_features, weight.dtype, weight.device)


def refused_layers(converted: nn.Module, recipe: Any) -> dict[str, str]:
    """Layer name -> why ``recipe`` cannot run it, over a model ``convert_to_fp8`` converted (its ``tl.Linear``
    layers by name, experts projections as ``<experts module>.<projection>``); empty when it runs them all."""
    out = {}
    for fqn, module in converted.named_modules():
        if isinstance(module, Linear):
            why = linear_refusal(module, recipe)
            if why is not None:
                out[fqn] = why
        elif is_hf_experts(module):
            for projection in experts_projections(module):
                why = experts_refusal(module, projection, recipe)
                if why is not None:
                    out[f"{fqn}.{projection}" if fqn else projection] = why
    return out
