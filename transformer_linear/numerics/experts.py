"""Per-expert blame: the FP8 error of each expert of a mixture-of-experts layer, observed inside a run.

``tl.convert_to_fp8`` runs a ``transformers`` experts module's projections through
:class:`~transformer_linear.modules.hf_experts.ExpertsFP8State` modules (one per projection: gate_up / up,
down), called with the tokens sorted by expert, the 3-D weight and ``offs``. As numerics/blame.py does for
Linear layers, hooks on them record each call's input, weight, ``offs``, grad_output and delayed-scaling
state; afterwards each projection is replayed on exactly those in FP8 (from the recorded state) and in high
precision (a ``F.linear`` per expert). The whole grouped output, dX and dW give one :class:`LayerStats` row
per projection (named ``<experts module>.<projection>``, e.g. ``model.layers.0.mlp.experts.down_proj``);
its ``experts`` hold one :class:`ExpertStats` per expert: the SQNR of that expert's rows of the output and
dX and of its dW, with its token count. An expert that received fewer than ``min_expert_tokens`` tokens
(default :data:`~transformer_linear.numerics.report.MIN_EXPERT_TOKENS`) is flagged ``too_few_tokens``: its
figures come from too few rows to judge (an SQNR over a handful of rows swings by several dB from batch to
batch, and such an expert's dW is a sum of that many outer products); one with no tokens has no figures.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from transformer_linear.modules.grouped_linear_functional import high_precision_grouped_linear
from transformer_linear.modules.hf_experts import ExpertsFP8State
from transformer_linear.numerics.blame import (
    Recorder,
    err_or_nan,
    fresh_state,
    layer_stats,
    range_stats_for,
    scales_in_state,
)
from transformer_linear.numerics.report import MIN_EXPERT_TOKENS, ExpertStats, LayerStats
from transformer_linear.numerics.stats import sqnr
from transformer_linear.recipe.delayed_scaling import FWD_SCALE_KEY, STATE_KEYS

__all__ = ["GroupedCall", "GroupedRecorder", "observe_experts", "projection_name"]


def projection_name(state_fqn: str) -> str:
    """``model.layers.0.mlp.experts.fp8_down_proj`` (the state module) -> ``model.layers.0.mlp.experts.down_proj``."""
    parent, _, leaf = state_fqn.rpartition(".")
    leaf = leaf.removeprefix("fp8_")
    return f"{parent}.{leaf}" if parent else leaf


@dataclass
class GroupedCall:
    """What a grouped projection saw in one step: its last call's arguments, grad_output and state before it."""

    input: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    offs: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    grad_output: Optional[torch.Tensor] = None
    state: Optional[dict[str, torch.Tensor]] = None


class GroupedRecorder(Recorder):
    """Hooks that record a :class:`GroupedCall` per experts projection for one step (a context manager);
    as blame.Recorder, a projection called several times is recorded at its last call."""

    call_type = GroupedCall

    def record_args(self, call: GroupedCall, args: tuple) -> None:
        inp, weight, offs, *rest = args
        bias = rest[0] if rest else None
        call.input, call.weight, call.offs = inp.detach().clone(), weight.detach().clone(), offs.clone()
        call.bias = None if bias is None else bias.detach().clone()


@dataclass
class _Results:
    output: torch.Tensor
    dgrad: Optional[torch.Tensor]
    wgrad: Optional[torch.Tensor]


def _run(fn, call: GroupedCall) -> _Results:
    backward = call.grad_output is not None
    x = call.input.detach().requires_grad_(backward)
    w = call.weight.detach().requires_grad_(backward)
    with torch.enable_grad():
        out = fn(x, w)
        if not backward:
            return _Results(out.detach(), None, None)
        out.backward(call.grad_output)
    return _Results(out.detach(), x.grad, w.grad)


def _replay_fp8(module: ExpertsFP8State, recipe: Any, call: GroupedCall) -> _Results:
    """The projection's FP8 forward and backward on the recorded call, from the recorded state (the module's
    own state is put back afterwards)."""
    saved = {k: module._buffers[k] for k in (*STATE_KEYS, FWD_SCALE_KEY)}
    own_recipe = module.recipe
    try:
        for k, v in (call.state or {}).items():
            module._buffers[k] = v.clone()
        module._buffers[FWD_SCALE_KEY] = saved[FWD_SCALE_KEY].clone()
        module.recipe = recipe
        return _run(lambda x, w: module.forward(x, w, call.offs, call.bias), call)
    finally:
        module._buffers.update(saved)
        module.recipe = own_recipe


def _replay_high_precision(call: GroupedCall) -> _Results:
    return _run(lambda x, w: high_precision_grouped_linear(x, w, call.offs, call.bias), call)


def _rows(t: Optional[torch.Tensor], rows: Any) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


def _per_expert(fp8: _Results, exact: _Results, offs: torch.Tensor, min_tokens: int) -> list[ExpertStats]:
    """One :class:`ExpertStats` per expert: its rows of the output and dX, its slice of dW."""
    ends = [0, *(int(e) for e in offs.tolist())]
    out = []
    for g in range(len(ends) - 1):
        rows = slice(ends[g], ends[g + 1])
        tokens = ends[g + 1] - ends[g]
        figures = (math.nan, math.nan, math.nan)
        if tokens:
            figures = (
                sqnr(fp8.output[rows], exact.output[rows]),
                err_or_nan(sqnr, _rows(fp8.dgrad, rows), _rows(exact.dgrad, rows)),
                err_or_nan(sqnr, _rows(fp8.wgrad, g), _rows(exact.wgrad, g)),
            )
        out.append(ExpertStats(g, tokens, *figures, too_few_tokens=tokens < min_tokens))
    return out


def observe_experts(
    states: dict[str, ExpertsFP8State],
    recipe: Any,
    label: str,
    fp8_calls: dict[str, GroupedCall],
    high_precision_calls: Optional[dict[str, GroupedCall]],
    step: Optional[int],
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> list[LayerStats]:
    """One :class:`LayerStats` per experts projection (the whole grouped output, dX and dW; end-to-end
    figures against the high-precision pass; range statistics), with one :class:`ExpertStats` per expert.

    The end-to-end figures are NaN where the high-precision pass routed a different number of tokens to some
    expert (its rows are then other tokens). The weight's range statistics are those of all the experts under one scale (delayed scaling's; current
    scaling gives each expert its own, never smaller, so its underflow can only be lower).
    """
    out = []
    for name, module in states.items():
        call = fp8_calls[name]
        if call.input is None:
            continue
        fp8 = _replay_fp8(module, recipe, call)
        exact = _replay_high_precision(call)
        hp_call = (high_precision_calls or {}).get(name)
        # Rows are tokens sorted by expert: the high-precision pass's rows are the same tokens only where it
        # routed as the FP8 pass did (a token sent elsewhere shifts every row after it).
        same_routing = hp_call is not None and hp_call.input is not None and torch.equal(hp_call.offs, call.offs)
        e2e = _replay_high_precision(hp_call) if same_routing else None
        tensors = {"input": call.input, "weight": call.weight, "grad_output": call.grad_output}
        ranges = range_stats_for(recipe, tensors, scales_in_state(call.state, recipe))
        state = fresh_state(call.state, recipe, tensors)
        fresh = None if state is None else _replay_fp8(module, recipe, dataclasses.replace(call, state=state))
        out.append(layer_stats(projection_name(name), label, fp8, exact, e2e, ranges, step, fresh,
                               experts=_per_expert(fp8, exact, call.offs, min_expert_tokens)))
    return out
