"""Per-layer blame: each FP8 layer's own error, observed inside a run.

At an observed step the run's model does its step as usual, while hooks
record, for every FP8 layer, the input it received, the gradient that
reached its output (grad_output) and its delayed-scaling state just before
the call. Afterwards each layer is replayed on exactly that input and
grad_output twice: in FP8 with that state (what the run computed) and in
high precision (``F.linear``). Their difference is the layer's own error,
free of what the layers before it did (TE's debug tools and torchao's
``compute_error`` measure the same). Before the FP8 step, the same model
runs the same batch once more with every layer in high precision; comparing
the FP8 layer's results with that pass gives the end-to-end effect (every
FP8 layer upstream included) as a separate figure.

Under delayed scaling a third replay runs the same call with the scales
current scaling would give its tensors (each from its own amax): what the
call lost to scales from a stale amax history is the difference
(``stale_loss_db``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from transformer_linear import reference
from transformer_linear.modules.convert import linear_weight
from transformer_linear.modules.linear import Linear
from transformer_linear.numerics.report import LayerStats, worst_experts
from transformer_linear.numerics.stats import max_relative_error, quantizer_range_stats, sqnr
from transformer_linear.recipe.delayed_scaling import FWD_SCALE_KEY, STATE_KEYS
from transformer_linear.recipe.quantization import quantization_spec
from transformer_linear.recipe.scaling import FP8_STATES, no_amax_yet

__all__ = [
    "LayerCall", "Recorder", "err_or_nan", "fresh_state", "layer_stats", "observe_layers", "worst_over_steps",
]


@dataclass
class LayerCall:
    """What a layer saw in one step: its last call's input and grad_output, and its FP8 state before that call."""

    input: Optional[torch.Tensor] = None
    grad_output: Optional[torch.Tensor] = None
    state: Optional[dict[str, torch.Tensor]] = None


class Recorder:
    """Hooks that record a :class:`LayerCall` per named layer for one step (use as a context manager).

    A layer called several times in a step is recorded at its last call: its
    input, its state before that call, and the first grad_output backward
    delivers (the last call's, as backward runs in reverse). Subclasses record
    other calls by overriding ``call_type`` and :meth:`record_args`.
    """

    call_type: type = LayerCall

    def __init__(self, layers: dict[str, nn.Module], state: bool) -> None:
        self.calls = {name: self.call_type() for name in layers}
        self._handles = []
        for name, layer in layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(name, state)))
            self._handles.append(layer.register_forward_hook(self._hook(name)))

    def record_args(self, call: Any, args: tuple) -> None:
        """Keep what replaying the call needs of its positional arguments (a Linear's: its input)."""
        call.input = args[0].detach().clone()

    def _pre_hook(self, name: str, state: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            call = self.calls[name]
            self.record_args(call, args)
            call.grad_output = None
            if state:
                call.state = {k: module._buffers[k].clone() for k in STATE_KEYS}

        return hook

    def _hook(self, name: str):
        def keep_grad(grad: torch.Tensor) -> None:
            call = self.calls[name]
            if call.grad_output is None:
                call.grad_output = grad.detach().clone()

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(keep_grad)

        return hook

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []




@dataclass
class _Results:
    output: torch.Tensor
    dgrad: Optional[torch.Tensor]
    wgrad: Optional[torch.Tensor]


def _run_layer(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
               grad_output: Optional[torch.Tensor]) -> _Results:
    x = x.detach().requires_grad_(grad_output is not None)
    w = w.detach().requires_grad_(grad_output is not None)
    with torch.enable_grad():
        out = fn(x, w)
        if grad_output is None:
            return _Results(out.detach(), None, None)
        out.backward(grad_output)
    return _Results(out.detach(), x.grad, w.grad)


def _replay_fp8(layer: Linear, recipe: Any, call: LayerCall) -> _Results:
    """The layer's FP8 forward and backward on the recorded input and grad_output, from the recorded state.

    The layer's own state is put back afterwards.
    """
    saved = {k: layer._buffers[k] for k in (*STATE_KEYS, FWD_SCALE_KEY)}
    own_recipe = layer.recipe
    try:
        for k, v in (call.state or {}).items():
            layer._buffers[k] = v.clone()
        layer._buffers["fp8_fwd_scale"] = saved["fp8_fwd_scale"].clone()
        layer.recipe = recipe
        bias = None if layer.bias is None else layer.bias.detach()
        return _run_layer(lambda x, w: layer._forward(None, x, w, bias), call.input,
                          linear_weight(layer).contiguous(), call.grad_output)
    finally:
        layer._buffers.update(saved)
        layer.recipe = own_recipe


def _replay_high_precision(layer: Linear, call: LayerCall) -> _Results:
    bias = None if layer.bias is None else layer.bias.detach()
    return _run_layer(lambda x, w: F.linear(x, w, bias), call.input, linear_weight(layer), call.grad_output)


def scales_in_state(state: Optional[dict[str, torch.Tensor]], recipe: Any) -> dict[str, torch.Tensor]:
    """The tensorwise scales a delayed-scaling call quantized with, from its state before the call.

    Current scaling keeps no state, and neither does a delayed-scaling tensor
    whose history holds no amax yet under ``first_step_just_in_time``: each
    such tensor's scale comes from its own amax (see :func:`range_stats_for`).
    """
    history_config = quantization_spec(recipe).history
    if history_config is None or state is None:
        return {}
    used = {}
    for fp8_state in FP8_STATES.values():
        history, scale = state[fp8_state.history_key], state[fp8_state.scale_key]
        empty = no_amax_yet(history[: history_config.amax_history_len], scale).tolist()
        for c, tensor in enumerate(fp8_state.columns):
            if not (history_config.first_step_just_in_time and empty[c]):
                used[tensor] = scale[c].clone()
    return used


def _own_scale(x: torch.Tensor, quantizer: Any) -> torch.Tensor:
    """The tensorwise scale of ``x`` from its own amax (current scaling's; delayed scaling's first step)."""
    return reference.compute_scale(reference.amax(x), reference.fp8_max(quantizer.dtype), quantizer.margin, 1.0)


def range_stats_for(recipe: Any, tensors: dict[str, torch.Tensor], used: dict) -> dict[str, dict[str, float]]:
    """amax, scale, underflow and saturation of input, weight and grad_output as ``recipe`` quantizes them."""
    spec = quantization_spec(recipe)
    out = {}
    for key in ("input", "weight", "grad_output"):
        x = tensors.get(key)
        if x is None:
            continue
        quantizer = getattr(spec, key)
        # The scale the call used (delayed scaling's), else the kind's from the tensor (its amax, or per block).
        out[key] = quantizer_range_stats(x, quantizer, used.get(key))
    return out


def fresh_state(state: Optional[dict[str, torch.Tensor]], recipe: Any,
                tensors: dict[str, Optional[torch.Tensor]]) -> Optional[dict[str, torch.Tensor]]:
    """A recorded delayed-scaling ``state`` with each scale replaced by the one its tensor's own amax gives:
    the call as it would have run had the amax history been up to date. None where ``recipe`` keeps no
    history (its scales are fresh already) or no state was recorded."""
    spec = quantization_spec(recipe)
    if spec.history is None or state is None:
        return None
    fresh = {k: v.clone() for k, v in state.items()}
    for fp8_state in FP8_STATES.values():
        for c, role in enumerate(fp8_state.columns):
            x = tensors.get(role)
            if x is not None:
                fresh[fp8_state.scale_key][c] = _own_scale(x, getattr(spec, role)).to(fresh[fp8_state.scale_key].dtype)
    return fresh


def _db_lost(fresh: float, actual: float) -> float:
    """dB lost to stale scales: the fresh replay's SQNR minus the run's (NaN where either is not finite)."""
    return fresh - actual if math.isfinite(fresh) and math.isfinite(actual) else math.nan


def err_or_nan(fn, actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> float:
    """``fn(actual, expected)``, NaN where either is missing (no gradient asked for)."""
    return math.nan if actual is None or expected is None else fn(actual, expected)


def _sqnrs(fp8: Any, exact: Any) -> dict[str, float]:
    return {
        "output": sqnr(fp8.output, exact.output),
        "dgrad": err_or_nan(sqnr, fp8.dgrad, exact.dgrad),
        "wgrad": err_or_nan(sqnr, fp8.wgrad, exact.wgrad),
    }


def layer_stats(
    name: str, label: str, fp8: Any, exact: Any, e2e: Optional[Any], ranges: dict[str, dict[str, float]],
    step: Optional[int], fresh: Optional[Any] = None, **extra: Any,
) -> LayerStats:
    """One LayerStats row from the FP8 replay, the high-precision replay of the same call and, where
    given, the end-to-end high-precision run's call and the replay with fresh scales (:func:`fresh_state`;
    each with ``output``, ``dgrad``, ``wgrad``)."""
    own = _sqnrs(fp8, exact)
    stale = {} if fresh is None else {k: _db_lost(v, own[k]) for k, v in _sqnrs(fresh, exact).items()}
    return LayerStats(
        name=name,
        recipe=label,
        output_sqnr=own["output"],
        output_max_rel=max_relative_error(fp8.output, exact.output),
        dgrad_sqnr=own["dgrad"],
        dgrad_max_rel=err_or_nan(max_relative_error, fp8.dgrad, exact.dgrad),
        wgrad_sqnr=own["wgrad"],
        wgrad_max_rel=err_or_nan(max_relative_error, fp8.wgrad, exact.wgrad),
        stale_loss_db=stale,
        input=ranges.get("input", {}),
        weight=ranges.get("weight", {}),
        grad_output=ranges.get("grad_output", {}),
        e2e_output_sqnr=math.nan if e2e is None else sqnr(fp8.output, e2e.output),
        e2e_dgrad_sqnr=math.nan if e2e is None else err_or_nan(sqnr, fp8.dgrad, e2e.dgrad),
        e2e_wgrad_sqnr=math.nan if e2e is None else err_or_nan(sqnr, fp8.wgrad, e2e.wgrad),
        steps=[] if step is None else [step],
        **extra,
    )


def observe_layers(
    layers: dict[str, Linear],
    recipe: Any,
    label: str,
    fp8_calls: dict[str, LayerCall],
    high_precision_calls: Optional[dict[str, LayerCall]],
    step: Optional[int],
) -> list[LayerStats]:
    """One :class:`LayerStats` per layer: isolated errors, end-to-end errors, range statistics.

    Args:
        layers: the FP8 layers by name (their weights as in the step observed).
        recipe: the recipe they ran under.
        label: the recipe's name in reports.
        fp8_calls: what a :class:`Recorder` recorded in the FP8 step.
        high_precision_calls: the same layers recorded in a high-precision
            pass on the same weights and batch (None: no end-to-end figures).
        step: the training step observed (None outside training).
    """
    out = []
    for name, layer in layers.items():
        call = fp8_calls[name]
        if call.input is None:
            continue  # not called in this step
        fp8 = _replay_fp8(layer, recipe, call)
        exact = _replay_high_precision(layer, call)
        hp_call = (high_precision_calls or {}).get(name)
        e2e = _replay_high_precision(layer, hp_call) if hp_call is not None and hp_call.input is not None else None
        tensors = {"input": call.input, "weight": linear_weight(layer).detach(), "grad_output": call.grad_output}
        ranges = range_stats_for(recipe, tensors, scales_in_state(call.state, recipe))
        state = fresh_state(call.state, recipe, tensors)
        fresh = None if state is None else _replay_fp8(layer, recipe, LayerCall(call.input, call.grad_output, state))
        out.append(layer_stats(name, label, fp8, exact, e2e, ranges, step, fresh))
    return out


def _nanmin(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


def _nanmax(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _nanmedian(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _worst_ranges(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    dicts = [d for d in dicts if d]
    if not dicts:
        return {}
    return {
        "amax": max(d["amax"] for d in dicts),
        "scale": min(d["scale"] for d in dicts),
        "underflow": max(d["underflow"] for d in dicts),
        "saturation": max(d["saturation"] for d in dicts),
    }


def _worst_stale(group: Sequence[LayerStats]) -> tuple[dict[str, float], Optional[int]]:
    """Per result, the most dB lost to stale scales over the steps, and the step of the largest loss."""
    rows = [s for s in group if s.stale_loss_db]
    if not rows:
        return {}, None
    worst = {k: _nanmax([s.stale_loss_db.get(k, math.nan) for s in rows]) for k in rows[0].stale_loss_db}
    losses = [(v, s.steps[0] if s.steps else None) for s in rows for v in s.stale_loss_db.values() if not math.isnan(v)]
    return worst, (max(losses, key=lambda t: t[0])[1] if losses else None)


def worst_over_steps(observations: Sequence[LayerStats]) -> list[LayerStats]:
    """One row per (recipe, layer), in first-seen order: the worst of each figure over the observed steps.

    SQNRs take their minimum (``median`` holds their median), relative
    errors, amax, underflow and saturation their maximum, scales their
    minimum, ``stale_loss_db`` its maximum (``stale_step``: where the largest
    was); ``steps`` lists the steps observed.
    """
    groups: dict[tuple[str, str], list[LayerStats]] = {}
    for s in observations:
        groups.setdefault((s.recipe, s.name), []).append(s)
    rows = []
    for (label, name), group in groups.items():
        stale, stale_step = _worst_stale(group)
        rows.append(
            LayerStats(
                name=name,
                recipe=label,
                **{f: _nanmin([getattr(s, f) for s in group]) for f in LayerStats.SQNR_FIELDS},
                **{f: _nanmax([getattr(s, f) for s in group]) for f in LayerStats.MAX_REL_FIELDS},
                input=_worst_ranges([s.input for s in group]),
                weight=_worst_ranges([s.weight for s in group]),
                grad_output=_worst_ranges([s.grad_output for s in group]),
                steps=sorted({step for s in group for step in s.steps}),
                experts=worst_experts([s.experts for s in group if s.experts]),
                median={f: _nanmedian([getattr(s, f) for s in group]) for f in LayerStats.SQNR_FIELDS},
                stale_loss_db=stale,
                stale_step=stale_step,
            )
        )
    return rows
