"""Run a model with nn.Linear and with each FP8 recipe, and compare layer by layer and by loss."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from transformer_linear.modules.autocast import outside_autocast
from transformer_linear.modules.convert import conversion_plan, convert_to_fp8
from transformer_linear.modules.hf_experts import ExpertsFP8State, experts_projections, is_hf_experts
from transformer_linear.modules.linear import Linear
from transformer_linear.numerics import blame, experts, limits, verdict
from transformer_linear.numerics.report import MIN_EXPERT_TOKENS, CompareReport, LayerStats, TrainReport
from transformer_linear.recipe import Recipe, available_names, from_name
from transformer_linear.recipe.quantization import is_recipe

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


# Recipe names accepted by compare, train_compare and ``--recipes``: the recipe package's table of built-in recipes.
RECIPE_NAMES: tuple[str, ...] = available_names()


def recipe_label(recipe: Any) -> str:
    """A short name for tables: ``DelayedScaling(HYBRID)``; the data format of an FP4 recipe and the
    features it turns off: ``NVFP4BlockScaling(E2M1, disable_rht)``; a backward override:
    ``CurrentScaling(HYBRID, backward_override=dequantized)``."""
    fmt = getattr(recipe, "fp4_format", None) or getattr(recipe, "fp8_format", None)
    parts = [fmt.value] if fmt is not None else []
    if dataclasses.is_dataclass(recipe):
        parts += [f.name for f in dataclasses.fields(recipe)
                  if f.name.startswith("disable_") and getattr(recipe, f.name)]
    override = getattr(recipe, "backward_override", None)
    if override is not None:
        parts.append(f"backward_override={override}")
    return f"{type(recipe).__name__}({', '.join(parts)})" if parts else type(recipe).__name__


def resolve_recipe(r: Any) -> Recipe:
    """A recipe object, or the recipe a name in :data:`RECIPE_NAMES` stands for (case-insensitive, recipe.from_name).

    Raises:
        ValueError: an unknown name.
        TypeError: something that is neither a name nor a recipe.
    """
    if isinstance(r, str):
        return from_name(r)
    if not is_recipe(r):
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
    Run the copy under ``outside_autocast()`` so an enclosing
    ``tl.autocast`` does not reach its layers.

    ``transformers`` experts modules (mixture of experts) run their
    projections as grouped GEMMs under ``recipe`` (``convert_to_fp8``'s
    ExpertsFP8State). A layer or projection ``recipe`` cannot run (a
    shape its quantizers refuse, a recipe the grouped GEMMs do not take:
    numerics/limits.py) stays in high precision;
    ``limits.refused_layers`` names them.
    """
    copied = convert_to_fp8(copy.deepcopy(model))
    for fqn, module in copied.named_modules():
        chosen = recipe is not None and (module_filter_fn is None or module_filter_fn(module, fqn))
        if isinstance(module, Linear):
            module.recipe = recipe if chosen and limits.linear_refusal(module, recipe) is None else None
            module.delay_wgrad_compute = False
            module.fuse_wgrad_accumulation = False
            module.reset_fp8_state()
        elif is_hf_experts(module):
            for projection in experts_projections(module):
                state = getattr(module, f"fp8_{projection}", None)
                if isinstance(state, ExpertsFP8State):
                    takes = chosen and limits.experts_refusal(module, projection, recipe) is None
                    state.recipe = recipe if takes else None
                    state.reset_fp8_state()
    return copied


def _check_min_expert_tokens(where: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: 'min_expert_tokens' must be a non-negative integer, got {value!r}")


def _linear_names(model: nn.Module) -> list[str]:
    """The layers compare reports on: every Linear-like layer convert_to_fp8 handles."""
    plan = conversion_plan(model)
    names = [n for n, _ in model.named_modules() if n in set(plan.converted) | set(plan.existing) | set(plan.experts)]
    if not names:
        raise ValueError(
            f"the model ({type(model).__name__}) has no nn.Linear layers (nor Conv1D or tl.Linear): nothing to compare"
        )
    return names


def _fp8_layers(run_model: nn.Module) -> dict[str, Linear]:
    """The run copy's layers that run in FP8 (module_filter_fn may keep some in high precision)."""
    return {n: m for n, m in run_model.named_modules() if isinstance(m, Linear) and m.recipe is not None}


def _fp8_experts(run_model: nn.Module) -> dict[str, ExpertsFP8State]:
    """The run copy's experts projections that run in FP8, by the name of their ExpertsFP8State."""
    return {n: m for n, m in run_model.named_modules() if isinstance(m, ExpertsFP8State) and m.recipe is not None}


def _loss_step(model: nn.Module, inputs: tuple, loss_fn: LossFn, seed: int, autocast_dtype: Optional[torch.dtype] = None) -> float:
    """One forward + backward; returns the loss. Gradients land in ``.grad`` (zeroed first).

    The random state is seeded with ``seed`` for the step (and restored
    after it), so dropout draws the same masks in every run compared.
    """
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if autocast_dtype is None:
            loss = _call_loss(loss_fn, model(*inputs), inputs)
        else:
            device = next((p.device.type for p in model.parameters()), "cpu")
            with torch.autocast(device, dtype=autocast_dtype):
                loss = _call_loss(loss_fn, model(*inputs), inputs)
        loss.backward()
    return float(loss.detach())


def _observed_step(
    model: nn.Module, recipe: Any, label: str, inputs: tuple, loss_fn: LossFn, seed: int, step: Optional[int],
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> tuple[float, float, list[LayerStats]]:
    """A training step of ``model`` with its FP8 layers observed (numerics/blame.py; experts projections:
    numerics/experts.py).

    First the same weights run the batch with every layer in high precision
    (the end-to-end reference), then the FP8 step itself, whose gradients
    stay in ``.grad`` for the optimizer.

    Returns:
        (FP8 loss, high-precision loss, one :class:`LayerStats` per FP8 layer and experts projection).
    """
    layers = _fp8_layers(model)
    grouped = _fp8_experts(model)
    every = [m for m in model.modules() if isinstance(m, (Linear, ExpertsFP8State))]
    own = [m.recipe for m in every]
    for m in every:
        m.recipe = None
    try:
        with blame.Recorder(layers, state=False) as hp, experts.GroupedRecorder(grouped, state=False) as hp_grouped:
            hp_loss = _loss_step(model, inputs, loss_fn, seed)
    finally:
        for m, r in zip(every, own):
            m.recipe = r
    with blame.Recorder(layers, state=True) as fp8, experts.GroupedRecorder(grouped, state=True) as fp8_grouped:
        loss = _loss_step(model, inputs, loss_fn, seed)
    stats = blame.observe_layers(layers, recipe, label, fp8.calls, hp.calls, step)
    stats += experts.observe_experts(grouped, recipe, label, fp8_grouped.calls, hp_grouped.calls, step,
                                     min_expert_tokens)
    return loss, hp_loss, stats


def compare(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Optional[LossFn] = None,
    recipes: Optional[Iterable[Any]] = None,
    reference_dtype: torch.dtype = torch.float32,
    calibration_steps: int = 1,
    module_filter_fn: Optional[FilterFn] = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> CompareReport:
    """Compare each FP8 recipe with the model's own nn.Linear layers, layer by layer.

    For each recipe, a copy of the model whose ``nn.Linear`` / ``Conv1D``
    layers are ``transformer_linear.Linear`` under that recipe runs one
    step on ``example_inputs``. Each layer's figures are its own error: its
    FP8 output, dX and dW against the high-precision layer on the same input
    and grad_output; the ``e2e_*`` figures compare with the whole model run
    in high precision on the same weights (all upstream FP8 error included).
    Layers that already are ``tl.Linear`` run under the requested recipe,
    not the one they carry. Delayed scaling needs amax history, so each copy
    first runs ``calibration_steps`` forward+backward passes on the same
    inputs (no weight update); :func:`train_compare` observes delayed scaling
    with the history of a real training run.

    Args:
        model: any module containing nn.Linear, Conv1D or tl.Linear layers (left unchanged).
        example_inputs: a tensor or a tuple of positional inputs.
        loss_fn: ``loss_fn(output, *example_inputs) -> scalar``; default the
            output's ``.loss``, else half the mean square of the output.
        recipes: recipe objects or names (:data:`RECIPE_NAMES`); default
            delayed and current scaling (HYBRID).
        reference_dtype: dtype the copies run in (the high-precision side).
        calibration_steps: passes that fill delayed scaling's amax history.
        module_filter_fn: ``fn(layer, fqn) -> bool``; layers where it is
            False stay in high precision (and are left out of the report).
        min_expert_tokens: a mixture-of-experts expert with fewer tokens is
            flagged too few to judge (numerics/experts.py).

    Returns:
        A :class:`CompareReport` (prints as a table, ``to_json``, ``plot``).
        ``transformers`` experts modules report one row per projection
        (``<experts>.gate_up_proj``, ``<experts>.down_proj``) with one
        :class:`ExpertStats` per expert.

    Raises:
        ValueError: no Linear layers, or the model fails on ``example_inputs``.
        TypeError: an unknown recipe object.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compare: 'model' must be an nn.Module, got {type(model).__name__}")
    _check_min_expert_tokens("compare", min_expert_tokens)
    _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    loss_fn = loss_fn or _default_loss
    inputs = tuple(
        x.to(reference_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in _as_tuple(example_inputs)
    )
    layers: list[LayerStats] = []
    losses: dict[str, float] = {}
    ref_loss = math.nan
    for label, recipe in recipe_list:
        run_model = with_recipe(model, recipe, module_filter_fn).to(reference_dtype)
        try:
            with outside_autocast():
                for _ in range(calibration_steps):
                    _loss_step(run_model, inputs, loss_fn, 0)
                losses[label], ref_loss, stats = _observed_step(
                    run_model, recipe, label, inputs, loss_fn, 0, None, min_expert_tokens
                )
        except (RuntimeError, ValueError, IndexError) as e:
            raise ValueError(f"compare: the model failed on example_inputs: {e}") from e
        layers += stats
    return CompareReport([label for label, _ in recipe_list], layers, ref_loss, losses,
                         min_expert_tokens=min_expert_tokens)


@dataclass(frozen=True)
class RunSpec:
    """One training run of :func:`train_run`.

    Attributes:
        label: its name in reports.
        recipe: the FP8 recipe, or None for high precision.
        module_filter_fn: layers where it returns False stay in high precision.
        autocast_dtype: run the forward under ``torch.autocast`` to this dtype
            (the bf16 noise-floor run).
        perturb_seed: multiply every initial parameter element by
            ``1 + 2**-9 * N(0, 1)`` drawn with this seed (the size of one bf16
            rounding; a perturbed-init noise-floor run).
    """

    label: str
    recipe: Optional[Any] = None
    module_filter_fn: Optional[FilterFn] = None
    autocast_dtype: Optional[torch.dtype] = None
    perturb_seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"RunSpec: 'label' must be a non-empty string, got {self.label!r}")
        if self.recipe is not None and (self.autocast_dtype is not None or self.perturb_seed is not None):
            raise ValueError("RunSpec: autocast_dtype and perturb_seed describe high-precision noise-floor runs (recipe=None)")


class RunResult(typing.NamedTuple):
    """What :func:`train_run` returns: the loss per step, the observed layer statistics, the trained copy."""

    curve: list[float]
    observations: list[LayerStats]
    model: nn.Module


FIRST_TRAINING_STEP = 1
"""The first step the summaries describe. Step 0 runs on the random init, and delayed scaling quantizes it
with just-in-time scales (as current scaling does); it is observed, kept in ``observations``, and left out of
the per-layer summary unless nothing else was observed."""


def observed_steps(steps: int, every: Optional[int] = None) -> list[int]:
    """The steps a run observes its layers at: 0, every, 2*every, ... and the last; by default 0 and 5 evenly
    spaced over the rest of the run (1/5, 2/5, 3/5, 4/5 and the last), past the first steps' transients."""
    if every is None:
        return sorted({0} | {round(i * (steps - 1) / 5) for i in range(1, 6)})
    return sorted(set(range(0, steps, every)) | {steps - 1})


def training_observations(observations: Sequence[LayerStats]) -> list[LayerStats]:
    """The observations the summaries describe: those from :data:`FIRST_TRAINING_STEP` on (all of them when
    there are no others, a one-step run)."""
    training = [s for s in observations if s.steps and s.steps[0] >= FIRST_TRAINING_STEP]
    return training or list(observations)


def _perturb(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
                p.mul_(1 + 2.0**-9 * noise)


def train_run(
    model: nn.Module,
    spec: Any,
    batches: Sequence[Any],
    loss_fn: Optional[LossFn] = None,
    lr: float = 3e-3,
    observe_at: Iterable[int] = (),
    progress: Optional[Callable[[int, float], None]] = None,
    compile: bool = False,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> RunResult:
    """Train a copy of ``model`` as ``spec`` says with AdamW on ``batches``.

    ``spec`` is a :class:`RunSpec`, or just a recipe (None: high precision).

    At the steps in ``observe_at`` an FP8 run's layers are observed
    (:func:`_observed_step`: isolated and end-to-end errors, range
    statistics under the scales the run used). ``compile`` runs the other
    steps through ``torch.compile`` (observed steps run eagerly: they need
    hooks).
    """
    loss_fn = loss_fn or _default_loss
    if not isinstance(spec, RunSpec):
        spec = RunSpec("reference" if spec is None else recipe_label(spec), resolve_recipe(spec) if spec is not None else None)
    run_model = with_recipe(model, spec.recipe, spec.module_filter_fn)
    if spec.perturb_seed is not None:
        _perturb(run_model, spec.perturb_seed)
    step_model = torch.compile(run_model) if compile else run_model
    opt = torch.optim.AdamW(run_model.parameters(), lr=lr)
    observe = set(observe_at) if spec.recipe is not None else set()
    curve: list[float] = []
    observations: list[LayerStats] = []
    with outside_autocast():
        for step, inputs in enumerate(batches):
            inputs = _as_tuple(inputs)
            if step in observe:
                loss, _, stats = _observed_step(run_model, spec.recipe, spec.label, inputs, loss_fn, step, step,
                                                min_expert_tokens)
                observations += stats
            else:
                loss = _loss_step(step_model, inputs, loss_fn, step, spec.autocast_dtype)
            opt.step()
            curve.append(loss)
            if progress is not None:
                progress(step + 1, loss)
    return RunResult(curve, observations, run_model)


def _progress_tick(progress: Callable[[str, int, int, float], None], label: str, steps: int, step: int, loss: float) -> None:
    progress(label, step, steps, loss)


def _summarise(report: TrainReport, recipes: list[str], min_expert_tokens: int = MIN_EXPERT_TOKENS) -> CompareReport:
    """The worst (and median) figures of each recipe's layers over its observed training steps, with the final
    losses."""
    labels = [r for r in recipes if r in report.observations]
    rows = blame.worst_over_steps([s for r in labels for s in training_observations(report.observations[r])])
    return CompareReport(
        labels,
        rows,
        report.final_loss(report.reference),
        {r: report.final_loss(r) for r in labels},
        loss_label=f"final loss (mean of the last {report.window} steps)",
        min_expert_tokens=min_expert_tokens,
    )


def run_into(
    report: TrainReport,
    model: nn.Module,
    specs: Sequence[RunSpec],
    batches: Sequence[Any],
    loss_fn: Optional[LossFn] = None,
    lr: float = 3e-3,
    observe_at: Iterable[int] = (),
    progress: Optional[Callable[[str, int, int, float], None]] = None,
    compile: bool = False,
    on_run: Optional[Callable[[TrainReport], None]] = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> TrainReport:
    """Train each run of ``specs`` (:func:`train_run`) and add its curve and observations to ``report``.

    ``on_run(report)`` is called after each finished run (write partial results there).
    """
    observe_at = list(observe_at)
    for spec in specs:
        tick = None if progress is None else functools.partial(_progress_tick, progress, spec.label, len(batches))
        result = train_run(model, spec, batches, loss_fn, lr, observe_at, tick, compile, min_expert_tokens)
        report.loss_curves[spec.label] = result.curve
        if result.observations:
            report.observations[spec.label] = result.observations
            report.final = _summarise(report, list(report.observations), min_expert_tokens)
        if on_run is not None:
            on_run(report)
    return report


def train_compare(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    loss_fn: Optional[LossFn] = None,
    steps: int = 200,
    recipes: Optional[Iterable[Any]] = None,
    lr: float = 3e-3,
    stats_every: Optional[int] = None,
    progress: Optional[Callable[[str, int, int, float], None]] = None,
    module_filter_fn: Optional[FilterFn] = None,
    noise_floor: str = "auto",
    seeds: int = 1,
    window: int = 10,
    compile: bool = False,
    on_run: Optional[Callable[[TrainReport], None]] = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> TrainReport:
    """Train the same model from the same init in high precision, beside it the noise-floor runs, and with each recipe.

    Every run sees the same batches (``make_batch(step)`` must be
    deterministic) and uses AdamW with the same hyper-parameters. Each
    recipe's layers are observed at several steps of its own run (delayed
    scaling with the history that run built): their own error (isolated),
    the end-to-end error, and range statistics (numerics/blame.py).

    Args:
        model: the initial model (left unchanged; each run trains a copy).
        make_batch: step -> example inputs (a tensor or tuple).
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default as in :func:`compare`.
        steps: optimizer steps per run.
        recipes: as in :func:`compare`.
        lr: AdamW learning rate.
        stats_every: observe the layers at steps 0, stats_every, ... and the
            last; default steps 0, 1 and 5 evenly spaced (:func:`observed_steps`).
        progress: called as ``progress(run_label, step, steps, loss)`` after each step.
        module_filter_fn: ``fn(layer, fqn) -> bool``; layers where it is False
            stay in high precision in the FP8 runs.
        noise_floor: "auto" (a bf16 autocast run where bf16 is fast, else a
            perturbed-init run), "bf16", "seeds" or "none" (numerics/verdict.py).
        seeds: reference runs in all: ``seeds - 1`` perturbed-init runs join the floor.
        window: the final loss is the mean of the last ``window`` steps.
        compile: run the steps through ``torch.compile`` (observed steps run eagerly).
        on_run: called with the report so far after each finished run.
        min_expert_tokens: a mixture-of-experts expert with fewer tokens (in
            every observed step) is flagged too few to judge.

    Returns:
        A :class:`TrainReport`; its ``final`` holds each recipe's layers' worst
        and median figures over the observed steps from
        :data:`FIRST_TRAINING_STEP` on (``observations``: every step observed).
    """
    _check_min_expert_tokens("train_compare", min_expert_tokens)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"train_compare: 'steps' must be >= 1, got {steps}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"train_compare: 'window' must be a positive integer, got {window!r}")
    _linear_names(model)
    recipe_list = resolve_recipes(recipes)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    floors, note = verdict.floor_runs(noise_floor, seeds, device)
    batches = [_as_tuple(make_batch(i)) for i in range(steps)]
    specs = [RunSpec("reference")]
    specs += [RunSpec(f.label, autocast_dtype=f.autocast_dtype, perturb_seed=f.perturb_seed) for f in floors]
    specs += [RunSpec(label, recipe, module_filter_fn) for label, recipe in recipe_list]
    report = TrainReport(steps, {}, floor_runs=[f.label for f in floors], floor_note=note, window=min(window, steps))
    return run_into(report, model, specs, batches, loss_fn, lr, observed_steps(steps, stats_every), progress, compile, on_run,
                    min_expert_tokens)
