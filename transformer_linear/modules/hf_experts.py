"""Hugging Face transformers' mixture-of-experts layers on the FP8 grouped GEMMs: an experts forward
for ``transformers.integrations.moe.ExpertsInterface``.

transformers' experts modules (``@use_experts_implementation``: Mixtral, Qwen-MoE, OLMoE, ...) hold
their weights as 3-D tensors (experts, out, in) and pick their forward by
``config._experts_implementation``. :func:`register_hf_experts` registers :func:`experts_forward`
under a name; ``model.set_experts_implementation(name)`` (or ``from_pretrained(...,
experts_implementation=name)``) then runs each projection as ``tl.grouped_linear`` on the model's own
weights: FP8 under the registered recipe or an active ``tl.autocast``, else high precision. The
routing is as transformers' ``grouped_mm`` forward computes it (tokens sorted by expert, ``offs`` by
``histc`` and cumsum on the device).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from transformer_linear.modules.grouped_linear_ops import check_grouped_quantization, grouped_linear
from transformer_linear.recipe import Recipe

__all__ = ["DEFAULT_EXPERTS_IMPLEMENTATION", "experts_forward", "register_hf_experts"]

DEFAULT_EXPERTS_IMPLEMENTATION = "transformer_linear"


def _projection(module: nn.Module, x: Tensor, weight: Tensor, bias: Optional[Tensor], offs: Tensor, recipe) -> Tensor:
    """One grouped projection on transformers' weight layout ((E, out, in), or (E, in, out) transposed)."""
    if module.is_transposed:
        weight = weight.transpose(1, 2)
    return grouped_linear(x.to(weight.dtype), weight, offs, bias, recipe=recipe)


def experts_forward(
    module: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    recipe: Optional[Recipe] = None,
) -> Tensor:
    """transformers' experts forward (``grouped_mm_experts_forward``'s contract) on ``tl.grouped_linear``.

    Args:
        module: the experts module (its ``gate_up_proj`` / ``up_proj``, ``down_proj``, optional biases,
            ``act_fn`` and the flags ``use_experts_implementation`` sets).
        hidden_states: (tokens, hidden).
        top_k_index: (tokens, top_k) expert of each token's choices.
        top_k_weights: (tokens, top_k) routing weights.
        recipe: the FP8 recipe (None: follow ``tl.autocast``; none there either: high precision).

    Returns:
        (tokens, hidden) in hidden_states' dtype.

    Raises:
        NotImplementedError: expert parallelism (sentinel experts) is not supported.
    """
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError("transformer_linear experts forward: expert parallelism is not supported")
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // num_top_k]
    sample_weights = top_k_weights.reshape(-1)[perm]
    # histc: as transformers' grouped_mm forward (bincount's output size depends on the values).
    counts_input = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    tokens_per_expert = torch.histc(counts_input, bins=module.num_experts, min=0, max=module.num_experts - 1)
    offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    if module.has_gate:
        weight, bias = module.gate_up_proj, getattr(module, "gate_up_proj_bias", None) if module.has_bias else None
        out = module._apply_gate(_projection(module, x, weight, bias, offs, recipe))
    else:
        weight, bias = module.up_proj, getattr(module, "up_proj_bias", None) if module.has_bias else None
        out = module.act_fn(_projection(module, x, weight, bias, offs, recipe))
    down_bias = getattr(module, "down_proj_bias", None) if module.has_bias else None
    out = _projection(module, out, module.down_proj, down_bias, offs, recipe)
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    weighted = out * sample_weights.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    return weighted[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def register_hf_experts(name: str = DEFAULT_EXPERTS_IMPLEMENTATION, recipe: Optional[Recipe] = None) -> str:
    """Register :func:`experts_forward` in transformers' ``ExpertsInterface`` under ``name``.

    Args:
        name: the ``experts_implementation`` name to register.
        recipe: the FP8 recipe of every experts forward run under ``name`` (None: follow
            ``tl.autocast``). A recipe the grouped GEMMs do not support raises here.

    Returns:
        ``name``, for ``model.set_experts_implementation(name)``.

    Raises:
        ImportError: transformers is not installed (or has no ExpertsInterface).
        NotImplementedError: a recipe with block scales, or one taking its scales from an amax
            history (DelayedScaling: the functional grouped Linear keeps no state).
    """
    from transformers.integrations.moe import ExpertsInterface  # noqa: PLC0415 (optional dependency)

    if recipe is not None:
        spec = check_grouped_quantization("register_hf_experts", recipe)
        if spec.scale_from_history:
            raise NotImplementedError(
                f"register_hf_experts: recipe {type(recipe).__name__} takes its scales from an amax history, which "
                "the experts forward does not keep: use Float8CurrentScaling"
            )
    ExpertsInterface.register(name, functools.partial(experts_forward, recipe=recipe))
    return name
