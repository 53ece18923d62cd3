"""Run a model with nn.Linear and with each FP8 recipe, and compare layer by layer."""

from __future__ import annotations

import copy
import functools
import typing
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from transformer_linear import reference
from transformer_linear.autocast import autocast
from transformer_linear.convert import conversion_plan, convert_to_fp8
from transformer_linear.linear import Linear
from transformer_linear.numerics.report import CompareReport, LayerStats, TrainReport
from transformer_linear.numerics.stats import max_relative_error, quantizer_range_stats, sqnr
from transformer_linear.quantization import quantization_spec
from transformer_linear.recipe import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
)
from transformer_linear.scaling import FP8_STATES, no_amax_yet

LossFn = Callable[..., torch.Tensor]
FilterFn = Callable[[nn.Module, str], bool]


def _default_loss(output: Any, *inputs: Any) -> torch.Tensor:
    """The output's ``.loss`` when it has one (Hugging Face models), else half its mean square.

    A tuple or list output counts by its first element.
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output = logits
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"the default loss needs a tensor output (or a tuple starting with one, or one with .loss/.logits), "
            f"got {type(output).__name__}: pass loss_fn"
        )
    return 0.5 * output.float().square().mean()


def _call_loss(loss_fn: LossFn, output: Any, inputs: tuple) -> torch.Tensor:
    loss = loss_fn(output, *inputs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {list(loss.shape)}"
        raise TypeError(f"loss_fn must return a scalar tensor, got {what}")
    return loss.reshape(())


def _as_tuple(example_inputs: Any) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


# Recipe names accepted by compare, train_compare and ``--recipes``: one row per name.
RECIPE_NAMES: dict[str, Callable[[], Recipe]] = {
    "delayed": lambda: DelayedScaling(),
    "current": lambda: CurrentScaling(),
    "delayed-e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3),
    "current-e4m3": lambda: CurrentScaling(fp8_format=Format.E4M3),
    "block": lambda: Float8BlockScaling(),
    "mxfp8": lambda: MXFP8BlockScaling(),
    "rowwise": lambda: Float8RowwiseScaling(),
}


def recipe_label(recipe: Any) -> str:
    """A short name for tables: ``DelayedScaling(HYBRID)``."""
    fmt = getattr(recipe, "fp8_format", None)
    return f"{type(recipe).__name__}({fmt.value})" if fmt is not None else type(recipe).__name__


def resolve_recipe(r: Any) -> Recipe:
    """A recipe object, or the recipe a name in :data:`RECIPE_NAMES` stands for (case-insensitive).

    Raises:
        ValueError: an unknown name.
        TypeError: something that is neither a name nor a recipe.
    """
    if isinstance(r, str):
        factory = RECIPE_NAMES.get(r.strip().lower())
        if factory is None:
            raise ValueError(f"unknown recipe {r!r}; expected one of {', '.join(RECIPE_NAMES)}")
        return factory()
    if not isinstance(r, typing.get_args(Recipe)):
        raise TypeError(f"recipes: expected recipe names or transformer_linear.recipe objects, got {r!r}")
    return r


def resolve_recipes(recipes: Optional[Iterable[Any]]) -> list[tuple[str, Any]]:
    """Turn recipe objects or names (:data:`RECIPE_NAMES`) into (label, recipe) pairs; default delayed and current.

    Raises:
        ValueError: an unknown name, or no recipe at all.
        TypeError: something that is neither a name nor a recipe.
    """
    resolved = [resolve_recipe(r) for r in (("delayed", "current") if recipes is None else recipes)]
    if not resolved:
        raise ValueError("recipes: at least one recipe is required")
    return [(recipe_label(r), r) for r in resolved]


def with_recipe(model: nn.Module, recipe: Optional[Any], module_filter_fn: Optional[FilterFn] = None) -> nn.Module:
    """A copy of ``model`` whose Linear layers all run under ``recipe`` (None: high precision).

    Every ``nn.Linear`` / ``Conv1D`` becomes a ``tl.Linear``; layers that
    already are ``tl.Linear`` get ``recipe`` in place of the one they carry
    (their deferred/fused weight-gradient options are turned off so each
    step's gradients land in ``.grad``). Layers for which
    ``module_filter_fn(layer, fqn)`` is False stay in high precision.
    Run the copy under ``tl.autocast(enabled=False)`` so an enclosing
    autocast does not reach the high-precision layers.
    """
    copied = convert_to_fp8(copy.deepcopy(model))
    for fqn, module in copied.named_modules():
        if isinstance(module, Linear):
            keep = recipe is not None and (module_filter_fn is None or module_filter_fn(module, fqn))
            module.recipe = recipe if keep else None
            module.delay_wgrad_compute = False
            module.fuse_wgrad_accumulation = False
            module.reset_fp8_state()
    return copied


def _linear_names(model: nn.Module) -> list[str]:
    """The layers compare reports on: every Linear-like layer convert_to_fp8 handles."""
    plan = conversion_plan(model)
    names = [n for n, _ in model.named_modules() if n in set(plan.converted) | set(plan.existing)]
    if not names:
        raise ValueError(
            f"the model ({type(model).__name__}) has no nn.Linear layers (nor Conv1D or tl.Linear): nothing to compare"
        )
    return names


class _Capture:
    """Hooks that record every Linear's input, output and gradients for one step."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.records: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        self._handles = []
        modules = dict(model.named_modules())
        for name in names:
            module = modules[name]
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            self.records[name]["input"] = args[0].detach().clone()
            self.records[name]["output"] = output.detach().clone()

        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            self.records[name]["grad_output"] = grad_output[0].detach().clone()
            if grad_input[0] is not None:
                self.records[name]["grad_input"] = grad_input[0].detach().clone()

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _step(model: nn.Module, inputs: tuple, loss_fn: LossFn, names: Sequence[str], seed: int = 0) -> tuple[float, dict]:
    """One forward + backward with capture; returns (loss, per-layer records incl. weight grads).

    The random state is seeded with ``seed`` for the step (and restored
    after it), so dropout draws the same masks in every run compared.
    """
    model.zero_grad(set_to_none=True)
    # The first layer's input gradient is only defined when the input needs one.
    inputs = tuple(
        x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs
    )
    capture = _Capture(model, names)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            loss = _call_loss(loss_fn, model(*inputs), inputs)
            loss.backward()
    finally:
        capture.close()
    modules = dict(model.named_modules())
    for name in names:
        w = modules[name].weight
        capture.records[name]["weight"] = w.detach().clone()
        grad = getattr(w, "main_grad", None) if w.grad is None else w.grad
        if grad is not None:
            capture.records[name]["wgrad"] = grad.detach().clone()
    return float(loss.detach()), capture.records


def _scales_before_step(modules: dict[str, nn.Module], names: Sequence[str], recipe: Any) -> dict[str, dict]:
    """The scales a delayed-scaling step is about to use (its state before the step).

    Current scaling keeps no state, and neither does a delayed-scaling tensor
    whose history holds no amax yet under ``first_step_just_in_time``: each
    such tensor's scale comes from its own amax, computed in
    :func:`_range_stats_for`, so it is left out here.
    """
    if not isinstance(recipe, DelayedScaling):
        return {}
    used = {}
    for name in names:
        layer = modules[name]
        used[name] = {}
        for state in FP8_STATES.values():
            history, scale = getattr(layer, state.history_key), getattr(layer, state.scale_key)
            empty = no_amax_yet(history[: recipe.amax_history_len], scale).tolist()
            for c, tensor in enumerate(state.columns):
                if not (recipe.first_step_just_in_time and empty[c]):
                    used[name][tensor] = scale[c].clone()
    return used


def _range_stats_for(recipe: Any, rec: dict, used: dict) -> dict[str, dict[str, float]]:
    """amax, scale, underflow and saturation of input, weight and grad_output under ``recipe``."""
    fmt = recipe.fp8_format
    spec = quantization_spec(recipe)
    out = {}
    for key, dtype in (("input", fmt.fwd_dtype), ("weight", fmt.fwd_dtype), ("grad_output", fmt.bwd_dtype)):
        if key not in rec:
            continue
        x = rec[key]
        quantizer = getattr(spec, key)
        scale = used.get(key)
        if scale is None and not quantizer.blockwise:
            scale = reference.compute_scale(reference.amax(x), reference.fp8_max(dtype), recipe.margin, 1.0)
        out[key] = quantizer_range_stats(x, quantizer, scale)
    return out


def _error(fn, rec: dict, ref: dict, key: str) -> float:
    if key not in rec or key not in ref:
        return float("nan")
    return fn(rec[key], ref[key])


def compare(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Optional[LossFn] = None,
    recipes: Optional[Iterable[Any]] = None,
    reference_dtype: torch.dtype = torch.float32,
    calibration_steps: int = 1,
    module_filter_fn: Optional[FilterFn] = None,
) -> CompareReport:
    """Compare each FP8 recipe with the model's own nn.Linear layers, layer by layer.

    The model runs once in high precision (``reference_dtype``) and once
    per recipe, each on a copy whose ``nn.Linear`` / ``Conv1D`` layers are
    ``transformer_linear.Linear`` (identical weights and inputs). Layers
    that already are ``tl.Linear`` run under the requested recipe, not the
    one they carry (and in high precision for the reference). Delayed
    scaling needs amax history, so each FP8 copy first runs
    ``calibration_steps`` forward+backward passes on the same inputs.

    Args:
        model: any module containing nn.Linear, Conv1D or tl.Linear layers (left unchanged).
        example_inputs: a tensor or a tuple of positional inputs.
        loss_fn: ``loss_fn(output, *example_inputs) -> scalar``; default half
            the mean square of the output.
        recipes: recipe objects or names ("delayed", "current", "delayed-e4m3",
            "current-e4m3"); default delayed and current scaling (HYBRID).
        reference_dtype: dtype of the reference run.
        calibration_steps: passes that fill delayed scaling's amax history.
        module_filter_fn: ``fn(layer, fqn) -> bool``; layers where it is
            False stay in high precision (and are left out of the report).

    Returns:
        A :class:`CompareReport` (prints as a table, ``to_json``, ``plot``).

    Raises:
        ValueError: no Linear layers, or the model fails on ``example_inputs``.
        TypeError: an unknown recipe object.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compare: 'model' must be an nn.Module, got {type(model).__name__}")
    names = _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    loss_fn = loss_fn or _default_loss
    inputs = _as_tuple(example_inputs)

    ref_model = with_recipe(model, None).to(reference_dtype)
    ref_inputs = tuple(x.to(reference_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    try:
        with autocast(enabled=False):
            ref_loss, ref_records = _step(ref_model, ref_inputs, loss_fn, names)
    except (RuntimeError, ValueError, IndexError) as e:
        raise ValueError(f"compare: the model failed on example_inputs: {e}") from e

    layers: list[LayerStats] = []
    losses: dict[str, float] = {}
    for label, recipe in recipe_list:
        fp8_model = with_recipe(model, recipe, module_filter_fn)
        modules = dict(fp8_model.named_modules())
        with autocast(enabled=False):
            for _ in range(calibration_steps):
                _step(fp8_model, inputs, loss_fn, [])
            used = _scales_before_step(modules, names, recipe)
            losses[label], records = _step(fp8_model, inputs, loss_fn, names)
        for name in names:
            if modules[name].recipe is None:
                continue  # kept in high precision by module_filter_fn
            rec, ref = records[name], ref_records[name]
            ranges = _range_stats_for(recipe, rec, used.get(name, {}))
            layers.append(
                LayerStats(
                    name=name,
                    recipe=label,
                    output_sqnr=_error(sqnr, rec, ref, "output"),
                    output_max_rel=_error(max_relative_error, rec, ref, "output"),
                    dgrad_sqnr=_error(sqnr, rec, ref, "grad_input"),
                    dgrad_max_rel=_error(max_relative_error, rec, ref, "grad_input"),
                    wgrad_sqnr=_error(sqnr, rec, ref, "wgrad"),
                    wgrad_max_rel=_error(max_relative_error, rec, ref, "wgrad"),
                    input=ranges.get("input", {}),
                    weight=ranges.get("weight", {}),
                    grad_output=ranges.get("grad_output", {}),
                )
            )
    return CompareReport([label for label, _ in recipe_list], layers, ref_loss, losses)


def train_run(
    model: nn.Module,
    recipe: Optional[Any],
    batches: Sequence[Any],
    loss_fn: Optional[LossFn] = None,
    lr: float = 3e-3,
    module_filter_fn: Optional[FilterFn] = None,
    stats_every: int = 25,
    progress: Optional[Callable[[int, float], None]] = None,
) -> tuple[list[float], list[dict[str, Any]], nn.Module]:
    """Train a copy of ``model`` under ``recipe`` (None: high precision) with AdamW on ``batches``.

    ``batches`` holds each step's inputs (a tensor or tuple); ``loss_fn``
    defaults as in :func:`compare`.

    Returns:
        (loss per step, per-layer range statistics every ``stats_every``
        steps, the trained copy).
    """
    loss_fn = loss_fn or _default_loss
    run_model = with_recipe(model, recipe, module_filter_fn)
    modules = dict(run_model.named_modules())
    names = [n for n in _linear_names(run_model) if modules[n].recipe is not None]
    opt = torch.optim.AdamW(run_model.parameters(), lr=lr)
    curve: list[float] = []
    history: list[dict[str, Any]] = []
    steps = len(batches)
    with autocast(enabled=False):
        for step, inputs in enumerate(batches):
            record = recipe is not None and (step % stats_every == 0 or step == steps - 1)
            used = _scales_before_step(modules, names, recipe) if record else {}
            loss, records = _step(run_model, _as_tuple(inputs), loss_fn, names if record else [], seed=step)
            if record:
                history.append(
                    {"step": step, "layers": {n: _range_stats_for(recipe, records[n], used.get(n, {})) for n in names}}
                )
            opt.step()
            curve.append(loss)
            if progress is not None:
                progress(step + 1, loss)
    return curve, history, run_model


def _progress_tick(progress: Callable[[str, int, int, float], None], label: str, steps: int, step: int, loss: float) -> None:
    progress(label, step, steps, loss)


def train_compare(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    loss_fn: Optional[LossFn] = None,
    steps: int = 200,
    recipes: Optional[Iterable[Any]] = None,
    lr: float = 3e-3,
    stats_every: int = 25,
    progress: Optional[Callable[[str, int, int, float], None]] = None,
    module_filter_fn: Optional[FilterFn] = None,
) -> TrainReport:
    """Train the same model from the same init with nn.Linear and with each recipe.

    Every run sees the same batches (``make_batch(step)`` must be
    deterministic) and uses AdamW with the same hyper-parameters.

    Args:
        model: the initial model (left unchanged; each run trains a copy).
        make_batch: step -> example inputs (a tensor or tuple).
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default as in :func:`compare`.
        steps: optimizer steps per run.
        recipes: as in :func:`compare`.
        lr: AdamW learning rate.
        stats_every: record per-layer amax / scale / underflow / saturation every this many steps.
        progress: called as ``progress(run_label, step, steps, loss)`` after each step.
        module_filter_fn: ``fn(layer, fqn) -> bool``; layers where it is False
            stay in high precision in the FP8 runs.

    Returns:
        A :class:`TrainReport`; its ``final`` is a :func:`compare` of the
        recipes on the reference-trained weights.
    """
    if steps < 1:
        raise ValueError(f"train_compare: 'steps' must be >= 1, got {steps}")
    _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    batches = [_as_tuple(make_batch(i)) for i in range(steps)]
    curves: dict[str, list[float]] = {}
    history: dict[str, list[dict[str, Any]]] = {}
    trained_reference = None
    for label, recipe in [("reference", None)] + recipe_list:
        tick = None if progress is None else functools.partial(_progress_tick, progress, label, steps)
        curves[label], history[label], trained = train_run(
            model, recipe, batches, loss_fn, lr, module_filter_fn, stats_every, tick
        )
        if recipe is None:
            trained_reference = trained
    final = compare(trained_reference, batches[-1], loss_fn, [r for _, r in recipe_list], module_filter_fn=module_filter_fn)
    return TrainReport(steps, curves, history, final)
