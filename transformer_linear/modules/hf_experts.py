"""Hugging Face transformers' mixture-of-experts layers on the FP8 grouped GEMMs: an experts forward
for ``transformers.integrations.moe.ExpertsInterface``.

transformers' experts modules (``@use_experts_implementation``: Mixtral, Qwen-MoE, OLMoE, ...) hold
their weights as 3-D tensors (experts, out, in) and pick their forward by
``config._experts_implementation``. :func:`register_hf_experts` registers :func:`experts_forward`
under a name; ``model.set_experts_implementation(name)`` (or ``from_pretrained(...,
experts_implementation=name)``) then runs each projection as a grouped Linear on the model's own
weights. The routing is as transformers' ``grouped_mm`` forward computes it (tokens sorted by expert,
``offs`` by ``histc`` and cumsum on the device).

``tl.convert_to_fp8`` gives each experts module an :class:`ExpertsFP8State` per projection
(``fp8_gate_up_proj`` or ``fp8_up_proj``, and ``fp8_down_proj``): the recipe of that projection and,
under delayed scaling, its amax histories and scales (the buffers a ``tl.Linear`` has, saved in the
state dict beside the weights). The forward runs each projection through its state module (hooks see
its input, weight and ``offs``: the numerics tool observes the experts there). Experts modules without
them run under the recipe given to :func:`register_hf_experts`, else an active ``tl.autocast``'s,
else in high precision.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.delayed_scaling_module import DelayedScalingModule
from transformer_linear.modules.grouped_linear_functional import (
    check_grouped_linear_args,
    grouped_linear,
    high_precision_grouped_linear,
    run_grouped_linear,
)
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.recipe import Recipe

__all__ = [
    "DEFAULT_EXPERTS_IMPLEMENTATION",
    "ExpertsFP8State",
    "attach_fp8_states",
    "experts_forward",
    "experts_projections",
    "is_hf_experts",
    "register_hf_experts",
]

DEFAULT_EXPERTS_IMPLEMENTATION = "transformer_linear"

# The attributes ``@use_experts_implementation`` sets on an experts module: how one is recognised
# without importing transformers.
_EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``) with 3-D weights this forward runs."""
    if not all(hasattr(module, flag) for flag in _EXPERTS_FLAGS) or not hasattr(module, "num_experts"):
        return False
    names = experts_projections(module)
    return all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3 for n in names)


def experts_projections(module: nn.Module) -> tuple[str, str]:
    """The names of an experts module's two weights: (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


class ExpertsFP8State(DelayedScalingModule):
    """The FP8 recipe and delayed-scaling state of one projection of a transformers experts module.

    It holds no weight: the experts module's 3-D Parameter is passed to each call, so the weights stay
    where transformers keeps them (``save_pretrained`` writes them unchanged). The state's buffers
    (``fp8_amax_history``, ``fp8_scale``, ... as on a ``tl.Linear``: one history per role for all the
    experts) are in the state dict under the experts module (``experts.fp8_down_proj.fp8_scale``).

    Args:
        recipe: the projection's recipe; None follows ``tl.autocast`` (none there: high precision).
        device: where the state lives (the weight's device).

    Raises:
        NotImplementedError: a recipe the grouped GEMMs do not support (check_grouped_quantization).
    """

    def __init__(self, recipe: Optional[Recipe] = None, device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        if recipe is not None:
            check_grouped_quantization("ExpertsFP8State", recipe)
        self.recipe = recipe
        # The state follows this (empty) tensor's device: DelayedScalingState reads ``owner.weight.device``.
        self.register_buffer("_device_anchor", torch.empty(0, device=device), persistent=False)
        self._init_delayed_scaling()

    @property
    def weight(self) -> Tensor:
        """An empty tensor on the state's device (what DelayedScalingState places its buffers by)."""
        return self._device_anchor

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}"

    def forward(self, inp: Tensor, weight: Tensor, offs: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """The grouped Linear of ``inp`` (tokens sorted by expert) with ``weight`` (E, out, in) under this
        state's recipe (else ``tl.autocast``'s; none: high precision)."""
        check_grouped_linear_args("ExpertsFP8State", inp, weight, offs, bias)
        recipe = layer_recipe(self.recipe)
        if recipe is None:
            return high_precision_grouped_linear(inp, weight, offs, bias)
        spec = check_grouped_quantization("ExpertsFP8State", recipe)
        return run_grouped_linear(self, inp, weight, offs, bias, spec).out


def attach_fp8_states(module: nn.Module, recipe: Optional[Recipe]) -> list[str]:
    """Give the experts ``module`` one :class:`ExpertsFP8State` per projection under ``recipe`` (replacing
    any it had); returns their names (``fp8_gate_up_proj``, ``fp8_down_proj``)."""
    names = []
    for proj in experts_projections(module):
        setattr(module, f"fp8_{proj}", ExpertsFP8State(recipe, device=getattr(module, proj).device))
        names.append(f"fp8_{proj}")
    return names


def _projection(module: nn.Module, proj: str, x: Tensor, offs: Tensor, recipe: Optional[Recipe]) -> Tensor:
    """One grouped projection on transformers' weight layout ((E, out, in), or (E, in, out) transposed)."""
    weight = getattr(module, proj)
    bias = getattr(module, f"{proj}_bias", None) if module.has_bias else None
    if module.is_transposed:
        weight = weight.transpose(1, 2)
    x = x.to(weight.dtype)
    state = getattr(module, f"fp8_{proj}", None)
    if isinstance(state, ExpertsFP8State):
        return state(x, weight, offs, bias)
    return grouped_linear(x, weight, offs, bias, recipe=recipe)


def experts_forward(
    module: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    recipe: Optional[Recipe] = None,
) -> Tensor:
    """transformers' experts forward (``grouped_mm_experts_forward``'s contract) on grouped Linears.

    Args:
        module: the experts module (its ``gate_up_proj`` / ``up_proj``, ``down_proj``, optional biases,
            ``act_fn``, the flags ``use_experts_implementation`` sets, and the :class:`ExpertsFP8State`
            modules ``tl.convert_to_fp8`` gave it, if any).
        hidden_states: (tokens, hidden).
        top_k_index: (tokens, top_k) expert of each token's choices.
        top_k_weights: (tokens, top_k) routing weights.
        recipe: the FP8 recipe of experts modules without :class:`ExpertsFP8State` (None: follow
            ``tl.autocast``; none there either: high precision).

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
    up, down = experts_projections(module)
    out = _projection(module, up, x, offs, recipe)
    out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
    out = _projection(module, down, out, offs, recipe)
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
        recipe: the FP8 recipe of the experts modules run under ``name`` that have no
            :class:`ExpertsFP8State` (``tl.convert_to_fp8`` gives them one, with its own recipe); None:
            follow ``tl.autocast``. A recipe the grouped GEMMs do not support raises here.

    Returns:
        ``name``, for ``model.set_experts_implementation(name)``.

    Raises:
        ImportError: transformers is not installed (or has no ExpertsInterface).
        NotImplementedError: a recipe the grouped GEMMs do not support (check_grouped_quantization), or one
            taking its scales from an amax history (DelayedScaling: keeping its state takes ``tl.convert_to_fp8``).
    """
    from transformers.integrations.moe import ExpertsInterface  # noqa: PLC0415 (optional dependency)

    if recipe is not None:
        spec = check_grouped_quantization("register_hf_experts", recipe)
        if spec.scale_from_history:
            raise NotImplementedError(
                f"register_hf_experts: recipe {type(recipe).__name__} takes its scales from an amax history, which "
                "only the experts' ExpertsFP8State keeps: use tl.convert_to_fp8(model, recipe=...) (or Float8CurrentScaling)"
            )
    ExpertsInterface.register(name, functools.partial(experts_forward, recipe=recipe))
    return name
