"""Run a model with nn.Linear and with each FP8 recipe, and compare layer by layer."""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from transformer_linear import reference
from transformer_linear.numerics.report import CompareReport, LayerStats, TrainReport
from transformer_linear.numerics.stats import max_relative_error, range_stats, sqnr

LossFn = Callable[..., torch.Tensor]


def _default_loss(output: torch.Tensor, *inputs: Any) -> torch.Tensor:
    """Half the mean square of the output: every output element gets a gradient."""
    return 0.5 * output.float().square().mean()


def _as_tuple(example_inputs: Any) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def _named_recipes() -> dict[str, Any]:
    from transformer_linear.recipe import CurrentScaling, DelayedScaling, Format

    return {
        "delayed": DelayedScaling(),
        "current": CurrentScaling(),
        "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3),
        "current-e4m3": CurrentScaling(fp8_format=Format.E4M3),
    }


def recipe_label(recipe: Any) -> str:
    """A short name for tables: ``DelayedScaling(HYBRID)``."""
    return f"{type(recipe).__name__}({recipe.fp8_format.value})"


def resolve_recipes(recipes: Optional[Iterable[Any]]) -> list[tuple[str, Any]]:
    """Turn recipe objects or names into (label, recipe) pairs.

    Names: ``delayed``, ``current`` (HYBRID formats), ``delayed-e4m3``,
    ``current-e4m3``.

    Raises:
        ValueError: an unknown name, or no recipe at all.
        TypeError: something that is neither a name nor a recipe.
    """
    from transformer_linear.recipe import CurrentScaling, DelayedScaling

    named = _named_recipes()
    if recipes is None:
        recipes = ("delayed", "current")
    resolved = []
    for r in recipes:
        if isinstance(r, str):
            if r not in named:
                raise ValueError(f"unknown recipe {r!r}; expected one of {', '.join(named)}")
            r = named[r]
        if not isinstance(r, (DelayedScaling, CurrentScaling)):
            raise TypeError(f"recipes: expected recipe names or transformer_linear.recipe objects, got {r!r}")
        resolved.append((recipe_label(r), r))
    if not resolved:
        raise ValueError("recipes: at least one recipe is required")
    return resolved


def _linear_names(model: nn.Module) -> list[str]:
    from transformer_linear.linear import Linear

    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Linear))]
    if not names:
        raise ValueError(f"the model ({type(model).__name__}) has no nn.Linear layers: nothing to compare")
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


def _step(model: nn.Module, inputs: tuple, loss_fn: LossFn, names: Sequence[str]) -> tuple[float, dict]:
    """One forward + backward with capture; returns (loss, per-layer records incl. weight grads)."""
    model.zero_grad(set_to_none=True)
    # The first layer's input gradient is only defined when the input needs one.
    inputs = tuple(
        x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs
    )
    capture = _Capture(model, names)
    try:
        loss = loss_fn(model(*inputs), *inputs)
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

    Current scaling keeps no state: each tensor's scale comes from its own
    amax, computed in :func:`_range_stats_for`.
    """
    from transformer_linear.recipe import DelayedScaling
    from transformer_linear.scaling import FP8_STATE_COLUMNS

    if not isinstance(recipe, DelayedScaling):
        return {}
    used = {}
    for name in names:
        state = getattr(modules[name], "fp8_scale", None)
        # A layer that has not run yet starts from scale 1.
        used[name] = {k: (state[c].clone() if state is not None else 1.0) for k, c in FP8_STATE_COLUMNS.items()}
    return used


def _range_stats_for(recipe: Any, rec: dict, used: dict) -> dict[str, dict[str, float]]:
    """amax, scale, underflow and saturation of input, weight and grad_output under ``recipe``."""
    fmt = recipe.fp8_format
    out = {}
    for key, dtype in (("input", fmt.fwd_dtype), ("weight", fmt.fwd_dtype), ("grad_output", fmt.bwd_dtype)):
        if key not in rec:
            continue
        x = rec[key]
        scale = used.get(key)
        if scale is None:
            scale = reference.compute_scale(reference.amax(x), reference.fp8_max(dtype), recipe.margin, 1.0)
        out[key] = range_stats(x, dtype, scale)
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
) -> CompareReport:
    """Compare each FP8 recipe with the model's own nn.Linear layers, layer by layer.

    The model runs once with its nn.Linear layers (in ``reference_dtype``)
    and once per recipe with every nn.Linear swapped for
    ``transformer_linear.Linear`` (identical weights and inputs). Delayed
    scaling needs amax history, so each FP8 copy first runs
    ``calibration_steps`` forward+backward passes on the same inputs.

    Args:
        model: any module containing nn.Linear layers (left unchanged).
        example_inputs: a tensor or a tuple of positional inputs.
        loss_fn: ``loss_fn(output, *example_inputs) -> scalar``; default half
            the mean square of the output.
        recipes: recipe objects or names ("delayed", "current", "delayed-e4m3",
            "current-e4m3"); default delayed and current scaling (HYBRID).
        reference_dtype: dtype of the reference run.
        calibration_steps: passes that fill delayed scaling's amax history.

    Returns:
        A :class:`CompareReport` (prints as a table, ``to_json``, ``plot``).

    Raises:
        ValueError: no Linear layers, or the model fails on ``example_inputs``.
        TypeError: an unknown recipe object.
    """
    from transformer_linear import convert_to_fp8

    if not isinstance(model, nn.Module):
        raise TypeError(f"compare: 'model' must be an nn.Module, got {type(model).__name__}")
    names = _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    loss_fn = loss_fn or _default_loss
    inputs = _as_tuple(example_inputs)

    ref_model = copy.deepcopy(model).to(reference_dtype)
    ref_inputs = tuple(x.to(reference_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    try:
        ref_loss, ref_records = _step(ref_model, ref_inputs, loss_fn, names)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise ValueError(f"compare: the model failed on example_inputs: {e}") from e

    layers: list[LayerStats] = []
    losses: dict[str, float] = {}
    for label, recipe in recipe_list:
        fp8_model = convert_to_fp8(copy.deepcopy(model), recipe=recipe)
        for _ in range(calibration_steps):
            _step(fp8_model, inputs, loss_fn, [])
        modules = dict(fp8_model.named_modules())
        used = _scales_before_step(modules, names, recipe)
        losses[label], records = _step(fp8_model, inputs, loss_fn, names)
        for name in names:
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


def train_compare(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    loss_fn: LossFn,
    steps: int = 200,
    recipes: Optional[Iterable[Any]] = None,
    lr: float = 3e-3,
    stats_every: int = 25,
    progress: Optional[Callable[[str, int, int, float], None]] = None,
) -> TrainReport:
    """Train the same model from the same init with nn.Linear and with each recipe.

    Every run sees the same batches (``make_batch(step)`` must be
    deterministic) and uses AdamW with the same hyper-parameters.

    Args:
        model: the initial model (left unchanged; each run trains a copy).
        make_batch: step -> example inputs (a tensor or tuple).
        loss_fn: ``loss_fn(output, *inputs) -> scalar``.
        steps: optimizer steps per run.
        recipes: as in :func:`compare`.
        lr: AdamW learning rate.
        stats_every: record per-layer amax / scale / underflow / saturation every this many steps.
        progress: called as ``progress(run_label, step, steps, loss)`` after each step.

    Returns:
        A :class:`TrainReport`; its ``final`` is a :func:`compare` of the
        recipes on the reference-trained weights.
    """
    from transformer_linear import convert_to_fp8

    if steps < 1:
        raise ValueError(f"train_compare: 'steps' must be >= 1, got {steps}")
    names = _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    batches = [_as_tuple(make_batch(i)) for i in range(steps)]
    runs: list[tuple[str, Any]] = [("reference", None)] + recipe_list
    curves: dict[str, list[float]] = {}
    history: dict[str, list[dict[str, Any]]] = {}
    trained_reference = None
    for label, recipe in runs:
        run_model = copy.deepcopy(model)
        if recipe is not None:
            convert_to_fp8(run_model, recipe=recipe)
        opt = torch.optim.AdamW(run_model.parameters(), lr=lr)
        curves[label], history[label] = [], []
        modules = dict(run_model.named_modules())
        for step, inputs in enumerate(batches):
            record = recipe is not None and (step % stats_every == 0 or step == steps - 1)
            used = _scales_before_step(modules, names, recipe) if record else {}
            loss, records = _step(run_model, inputs, loss_fn, names if record else [])
            if record:
                history[label].append(
                    {"step": step, "layers": {n: _range_stats_for(recipe, records[n], used.get(n, {})) for n in names}}
                )
            opt.step()
            curves[label].append(loss)
            if progress is not None:
                progress(label, step + 1, steps, loss)
        if recipe is None:
            trained_reference = run_model
    final = compare(trained_reference, batches[-1], loss_fn, [r for _, r in recipe_list])
    return TrainReport(steps, curves, history, final)
