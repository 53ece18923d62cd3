"""Command line: ``transformer-linear compare`` (also ``python -m transformer_linear compare``).

Trains a model with high-precision Linear layers, beside it the noise-floor
runs (bf16 autocast and/or perturbed-init fp32), and with each FP8 recipe,
from the same init on the same data; observes each recipe's layers during
its own run and blames each layer for its own error; flags the layers that
are risky in FP8, measures the loss gap with those layers kept in high
precision, and writes a markdown + JSON report (after every run) and PNG
plots. The model is the built-in GPT (default), an importable factory
(``--model pkg.module:factory``) or a Hugging Face causal LM (``--hf PATH``).
Exit status: 0 when every recipe passes the gate (numerics/verdict.py:
|gap| <= max(--max-gap, --noise-factor x noise floor)), 3 when each recipe
that fails passes with the suggested filter, 1 otherwise, 2 for bad input.

``transformer-linear monitor-report LOG_DIR`` plots what
``tl.numerics.monitor`` recorded during training.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from transformer_linear.modules.convert import ConversionPlan, conversion_plan, convert_to_fp8
from transformer_linear.numerics import monitor_report
from transformer_linear.numerics.compare import FIRST_TRAINING_STEP, RunSpec, observed_steps, recipe_label, run_into
from transformer_linear.numerics.limits import refused_layers
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss
from transformer_linear.numerics.report import MIN_EXPERT_TOKENS, CompareReport, TrainReport
from transformer_linear.numerics.risk import RiskThresholds, filter_source, keep_high_precision, risky_layers
from transformer_linear.numerics.sources import Workload, hf_workload, parse_shape, user_workload
from transformer_linear.numerics.verdict import FILTERED, NOISE_FLOOR_CHOICES, Gate, Verdict, floor_runs, judge
from transformer_linear.recipe import Recipe, available_names, from_name

DEFAULT_OUT = "fp8_compare_report"


class UsageError(ValueError):
    """A bad command line or input: reported on one line, exit status 2."""


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="transformer-linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "compare",
        help="is FP8 safe for this model? train and compare FP8 recipes with high precision",
        description="Is FP8 safe for this model? Trains it in fp32, in the noise-floor runs and with each FP8 recipe "
        "from the same init on the same batches. Gate: a recipe passes when |gap| <= max(--max-gap, --noise-factor x "
        "noise floor), gap = its final loss (mean of the last --window steps) relative to fp32's, noise floor = the "
        "largest |gap| of the floor runs. Exit status: 0 every recipe passes; 3 each failing recipe passes with the "
        "suggested filter; 1 otherwise; 2 bad input.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="built-in model size (default small)")
    src.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="factory returning model[, make_batch[, loss_fn]]")
    src.add_argument("--hf", metavar="PATH_OR_NAME", help="a transformers causal LM (config/checkpoint dir or hub name)")
    p.add_argument("--hf-random-init", action="store_true", help="build the --hf model from its config only")
    p.add_argument("--input-shape", help="synthetic inputs (--model without make_batch), or batch,seq for --hf (default 4,64)")
    p.add_argument("--input-dtype", default="float32", help="float32, bfloat16, float16 or long (token ids) (default float32)")
    p.add_argument("--vocab", type=int, help="token ids are drawn below this (--input-dtype long)")
    p.add_argument("--data", metavar="FILE", help="--hf data: text (model's tokenizer, else bytes), .pt or .npy ids")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--batch-size", type=int, help="batch size: built-in GPT (default 16) and --hf (default 4; or --input-shape)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--recipes", default="delayed,current",
                   help=f"comma-separated, from: {', '.join(available_names())} (default delayed,current)")
    p.add_argument("--layers", metavar="REGEX", help="report only layers whose name matches (re.search)")
    p.add_argument("--min-expert-tokens", type=int, default=MIN_EXPERT_TOKENS,
                   help="mixture-of-experts models: an expert with fewer tokens in every observed step is flagged too "
                   f"few to judge in the per-expert table (default {MIN_EXPERT_TOKENS})")
    p.add_argument("--max-gap", type=float, default=1.0, help="allowed |loss gap| in percent, either way (default 1)")
    p.add_argument("--noise-floor", default="auto", choices=NOISE_FLOOR_CHOICES,
                   help="high-precision runs that measure the noise floor: auto = a bf16 autocast run where bf16 is "
                   "fast (CUDA, CPUs with AVX512-BF16/AMX), else one perturbed-init fp32 run (default auto)")
    p.add_argument("--seeds", type=int, default=1,
                   help="reference runs in all: N-1 fp32 runs from the init perturbed by one bf16 rounding join the floor (default 1)")
    p.add_argument("--noise-factor", type=float, default=2.0, help="a gap may reach this many times the noise floor (default 2)")
    p.add_argument("--window", type=int, default=10, help="final loss = mean of the last N steps (default 10)")
    p.add_argument("--compile", action="store_true", help="run every model (FP8 and high precision) under torch.compile")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    m = sub.add_parser("monitor-report", help="plot what tl.numerics.monitor recorded")
    m.add_argument("log_dir", help="the monitor's log_dir")
    m.add_argument("--out", help="where the PNGs go (default LOG_DIR)")
    for child in (p, m):  # --traceback works after the subcommand too
        child.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error")
    return parser, {"compare": p, "monitor-report": m}


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse; an unknown option is reported by its subcommand, with the closest option when there is one."""
    parser, subs = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = subs[args.command]
        known = [o for a in sub._actions for o in a.option_strings]
        guess = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1)
        hint = f" (did you mean {guess[0]}?)" if guess else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


class _Bars:
    """One tqdm bar per training run, on stderr, labelled with the run's number out of all runs."""

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.index = 0
        self.bar: Optional[tqdm] = None

    def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
        if step == 1 or self.bar is None:
            self.index += 1
            self.bar = tqdm(total=steps, desc=f"[{self.index}/{self.runs}] {label}", file=sys.stderr, mininterval=0.5,
                            dynamic_ncols=True)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(1)
        if step == steps:
            self.bar.close()


def _builtin(args: argparse.Namespace) -> Workload:
    batch_size = 16 if args.batch_size is None else args.batch_size
    torch.manual_seed(args.seed)
    cfg = GPTConfig.named(args.size)
    data = SyntheticText(cfg, seed=args.seed)
    batches = [data.batch(batch_size) for _ in range(args.steps)]
    desc = (
        f"built-in GPT ({args.size}: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, seq "
        f"{cfg.seq_len}), synthetic bigram data, batch {batch_size}; loss floor {data.entropy_floor:.3f}, "
        f"uniform {data.uniform_loss:.3f}"
    )
    return Workload(TinyGPT(cfg), batches.__getitem__, lm_loss, desc)


def _workload(args: argparse.Namespace) -> Workload:
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError("--batch-size must be positive")
    shape = parse_shape(args.input_shape) if args.input_shape else None
    if args.hf is not None:
        if shape is not None and len(shape) != 2:
            raise UsageError(f"--input-shape for --hf is batch,seq; got {args.input_shape}")
        batch, seq = shape or (4, 64)
        if args.batch_size is not None:
            if shape is not None and args.batch_size != batch:
                raise UsageError(f"--batch-size {args.batch_size} contradicts --input-shape {args.input_shape} (batch,seq)")
            batch = args.batch_size
        return hf_workload(args.hf, args.hf_random_init, batch, seq, args.data, args.seed)
    if args.hf_random_init or args.data:
        raise UsageError("--hf-random-init and --data go with --hf")
    if args.model is not None:
        if args.batch_size is not None:
            raise UsageError("--batch-size goes with the built-in GPT and --hf; a --model factory's batches are its own "
                             "(or --input-shape)")
        return user_workload(args.model, shape, args.input_dtype, args.vocab, args.seed)
    return _builtin(args)


def _on_device(workload: Workload, device: torch.device) -> Workload:
    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def make_batch(step: int):
        batch = workload.make_batch(step)
        return tuple(move(x) for x in batch) if isinstance(batch, tuple) else move(batch)

    return Workload(workload.model.to(device), make_batch, workload.loss_fn, workload.description)


def _probe(workload: Workload) -> None:
    """Run the first batch once so a wrong input shape is one clear line, not a traceback mid-training."""
    batch = workload.make_batch(0)
    inputs = batch if isinstance(batch, tuple) else (batch,)
    shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs)
    try:
        with torch.no_grad():
            workload.model(*inputs)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"the model fails on the first batch ({shapes}): {first}") from e


def _narrow(report: Optional[CompareReport], pattern: Optional[re.Pattern]) -> Optional[CompareReport]:
    if pattern is None or report is None:
        return report
    layers = [s for s in report.layers if pattern.search(s.name)]
    return CompareReport(report.recipes, layers, report.reference_loss, report.loss, report.loss_label,
                         report.min_expert_tokens)


@dataclass
class _Outcome:
    """Everything the report files show; filled in as the runs finish."""

    train: TrainReport
    final: Optional[CompareReport] = None
    risky: dict[str, list[str]] = field(default_factory=dict)
    verdict: Optional[Verdict] = None
    complete: bool = False
    refused: dict[str, dict[str, str]] = field(default_factory=dict)
    """Recipe label -> the layers it cannot run (left in high precision in its runs), with the reason."""


def _markdown(args, workload, plan: ConversionPlan, outcome: _Outcome, thresholds: RiskThresholds, seconds: float) -> str:
    train, final, risky = outcome.train, outcome.final, outcome.risky
    left = plan.left_in_high_precision()
    kept = "".join(f"\n- `{n}`: {why}" for n, why in left.items()) or " none"
    kept += "".join(f"\n- `{n}`, under {label} only: {why}" for label, refused in outcome.refused.items()
                    for n, why in refused.items())
    risk_lines = "".join(f"\n- `{n}`: " + "; ".join(why) for n, why in risky.items()) or "\nnone"
    state = "" if outcome.complete else " (partial: runs still to come)"
    lines = [
        f"# FP8 numerics report{state}",
        "",
        f"Model: {workload.description}. {args.steps} steps of AdamW (lr {args.lr}), seed {args.seed}, "
        f"device {args.device}{', compiled' if args.compile else ''}; {seconds:.0f} s so far.",
        "",
        f"Converted to tl.Linear: {len(plan.converted) + len(plan.existing)} layers"
        + (f"; experts on the FP8 grouped GEMMs: {len(plan.experts)} modules" if plan.experts else "")
        + f". Left in high precision:{kept}",
        "",
        f"## Final loss (mean of the last {train.window} steps)",
        "",
        f"{train.floor_note}.",
        "",
        "```",
        train.summary(),
        "```",
    ]
    if outcome.verdict is not None:
        lines += ["", "## Verdict", "", "```", *outcome.verdict.lines(), f"exit status {outcome.verdict.exit_code}", "```"]
    if final is not None:
        lines += [
            "",
            "## Risky layers",
            "",
            f"Judged on each layer's own (isolated) error, worst over steps {_summarised(args.steps)} of each "
            "recipe's run. "
            f"Thresholds: output SQNR < {thresholds.min_output_sqnr_db:g} dB, dX/dW SQNR < "
            f"{thresholds.min_grad_sqnr_db:g} dB, saturation > {100 * thresholds.max_saturation:g}%, underflow > "
            f"{100 * thresholds.max_underflow:g}%.{risk_lines}",
        ]
        if risky:
            lines += ["", *_filter_advice(risky, outcome.verdict, code_fence=True)]
        lines += [
            "",
            "## Per-layer comparison, observed during each recipe's own run",
            "",
            f"Steps {_summarised(args.steps)} of each run (step 0, the random init, is in report.json only). SQNR in dB",
            "(higher is better) of each layer's output, input gradient (dX) and weight gradient (dW), median (med) and",
            "worst (min) over those steps: the FP8 layer against the high-precision layer on the same input and",
            "grad_output (the layer's own error). `stale dB` (delayed scaling): the most dB a result lost to scales",
            "from the amax history against the scales the same tensors' own amaxes give, and where (`dX@30`: dX at",
            "step 30). `e2e out` (worst): against the whole model in high precision on the same weights and batch",
            "(upstream FP8 layers included). amax of input (x), weight (w) and grad_output (dy); percent of elements",
            "flushed to zero (uflow) or clamped at the format's max (sat), under the scales the run used (worst).",
            "",
            final.markdown(),
        ]
    return "\n".join(lines) + "\n"


def _to_fp8(plan: ConversionPlan) -> str:
    """What the conversion runs in FP8, in words: the layers, and the experts modules where there are any (each
    with its two grouped projections)."""
    layers = len(plan.converted) + len(plan.existing)
    words = f"{layers} layer{'s' if layers != 1 else ''}"
    if plan.experts:
        n = len(plan.experts)
        words += f" and {n} experts module{'s' if n != 1 else ''} ({2 * n} grouped projections)"
    return words


def _summarised(steps: int) -> str:
    """The observed steps the per-layer summary describes, as a list."""
    observed = observed_steps(steps)
    return ", ".join(str(s) for s in [s for s in observed if s >= FIRST_TRAINING_STEP] or observed)


def _filter_advice(risky: dict[str, list[str]], verdict: Optional[Verdict], code_fence: bool = False) -> list[str]:
    """What to do about the risky layers: the filter to paste, only for the recipes it helped beyond the noise."""
    code = filter_source(risky)
    if code_fence:
        code = f"```python\n{code}\n```"
    if verdict is None:
        return ["Filter under test (keeps the risky layers in high precision; its runs are the `+filter` rows):", code]
    helped = verdict.filter_suggested_for
    if not helped:
        return [
            "No filter suggested: keeping the risky layers in high precision did not narrow any recipe's loss gap "
            f"by more than {verdict.gate.noise_factor:g} x the noise floor ({100 * verdict.resolution:.4f}%); "
            "see the verdict."
        ]
    return [f"Suggested filter for {', '.join(helped)} (it narrowed the loss gap beyond the noise; the '+filter' runs):",
            code]


def _write(out: Path, args, workload, plan, outcome: _Outcome, thresholds, started: float) -> list[Path]:
    """Write report.md and report.json (after every run: an interrupted comparison keeps what it finished)."""
    out.mkdir(parents=True, exist_ok=True)
    seconds = time.perf_counter() - started
    (out / "report.md").write_text(_markdown(args, workload, plan, outcome, thresholds, seconds))
    payload = outcome.train.to_dict()
    payload["final_compare"] = outcome.final.to_dict() if outcome.final is not None else None
    payload.update(
        complete=outcome.complete, seconds=seconds, converted=plan.converted + plan.existing, skipped=plan.skipped,
        high_precision=plan.high_precision, refused_by_recipe=outcome.refused, risky_layers=outcome.risky, thresholds=thresholds.__dict__,
        max_gap_percent=args.max_gap, verdict=outcome.verdict.to_dict() if outcome.verdict else None,
    )
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    return [out / "report.md", out / "report.json"]


def _check_args(args: argparse.Namespace) -> tuple[Optional[re.Pattern], list[str]]:
    for name in ("steps", "seeds", "window"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.min_expert_tokens < 0:
        raise UsageError(f"--min-expert-tokens must be non-negative, got {args.min_expert_tokens}")
    for name in ("max_gap", "noise_factor"):
        if not getattr(args, name) >= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be non-negative, got {getattr(args, name)}")
    try:
        pattern = re.compile(args.layers) if args.layers else None
    except re.error as e:
        raise UsageError(f"--layers: not a regular expression: {e}") from e
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r.lower() not in available_names()]
    if unknown or not recipes:
        raise UsageError(f"--recipes: unknown recipe {', '.join(unknown) or '(none)'}; expected {', '.join(available_names())}")
    return pattern, recipes


def _refused_by_recipe(model: torch.nn.Module, plan: ConversionPlan, recipes: dict[str, Recipe]) -> dict[str, dict[str, str]]:
    """Each recipe's layers it cannot run (numerics/limits.py), found before any run; a recipe that can run none
    of them is bad input."""
    converted = convert_to_fp8(copy.deepcopy(model))
    out = {}
    for label, recipe in recipes.items():
        refused = refused_layers(converted, recipe)
        layers = len(plan.converted) + len(plan.existing) + 2 * len(plan.experts)
        if refused and len(refused) == layers:
            first = next(iter(refused.items()))
            raise UsageError(f"--recipes: {label} cannot run any of the model's layers ({first[0]}: {first[1]})")
        if refused:
            out[label] = refused
    return out


def run_compare(args: argparse.Namespace) -> int:
    pattern, recipe_names = _check_args(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no GPU is available")
    started = time.perf_counter()
    workload = _on_device(_workload(args), device)
    plan = conversion_plan(workload.model)
    if not plan.converted and not plan.existing and not plan.experts:
        raise UsageError(f"the model ({type(workload.model).__name__}) has no nn.Linear layers: nothing to compare")
    _probe(workload)
    floors, note = floor_runs(args.noise_floor, args.seeds, device)
    recipes = [(name, from_name(name)) for name in recipe_names]
    labels = [recipe_label(r) for _, r in recipes]
    refused = _refused_by_recipe(workload.model, plan, dict(zip(labels, (r for _, r in recipes))))
    runs = 1 + len(floors) + len(recipes)
    n_params = sum(p.numel() for p in workload.model.parameters())
    left = plan.left_in_high_precision()
    print(f"transformer_linear compare: {workload.description}; {n_params:,} params; "
          f"{_to_fp8(plan)} to FP8, "
          f"{len(left)} left in high precision; "
          f"{args.steps} steps x {runs} runs (reference, {len(floors)} noise floor, {len(recipes)} FP8; "
          f"+1 per recipe with the suggested filter if a layer is risky) on {device}; {note}")
    for name, why in left.items():
        print(f"  high precision {name}: {why}")
    for label, layers in refused.items():
        for name, why in layers.items():
            print(f"  high precision under {label} only: {name}: {why}")

    thresholds = RiskThresholds()
    gate = Gate(args.max_gap / 100, args.noise_factor)
    out = Path(args.out)
    batches = [workload.make_batch(i) for i in range(args.steps)]
    train = TrainReport(args.steps, {}, floor_runs=[f.label for f in floors], floor_note=note,
                        window=min(args.window, args.steps))
    outcome = _Outcome(train, refused=refused)
    bars = _Bars(runs)

    def finished(report: TrainReport) -> None:
        outcome.final = _narrow(report.final, pattern)
        outcome.risky = risky_layers(outcome.final, thresholds) if outcome.final is not None else {}
        _write(out, args, workload, plan, outcome, thresholds, started)

    specs = [RunSpec("reference")]
    specs += [RunSpec(f.label, autocast_dtype=f.autocast_dtype, perturb_seed=f.perturb_seed) for f in floors]
    specs += [RunSpec(label, recipe) for label, (_, recipe) in zip(labels, recipes)]
    common = dict(loss_fn=workload.loss_fn, lr=args.lr, progress=bars, compile=args.compile, on_run=finished,
                  min_expert_tokens=args.min_expert_tokens)
    run_into(train, workload.model, specs, batches, observe_at=observed_steps(args.steps), **common)
    if outcome.risky:
        keep = keep_high_precision(outcome.risky)
        bars.runs += len(recipes)
        filtered = [RunSpec(label + FILTERED, recipe, keep) for label, (_, recipe) in zip(labels, recipes)]
        run_into(train, workload.model, filtered, batches, **common)
    outcome.verdict = judge(train, labels, gate)
    outcome.complete = True
    files = _write(out, args, workload, plan, outcome, thresholds, started)
    if not args.no_plots:
        files.append(train.plot(out / "loss_curves.png", gate=gate, verdict=outcome.verdict))
        if outcome.final is not None and outcome.final.layers:
            files.append(outcome.final.plot(out / "layer_sqnr.png", thresholds=thresholds, risky=outcome.risky,
                                                   verdict=outcome.verdict))

    print()
    print(train.summary())
    print()
    print(outcome.final.table())
    if outcome.risky:
        print(f"\nrisky layers (their own error, worst over steps {_summarised(args.steps)}):")
        for name, why in outcome.risky.items():
            print(f"  {name}: {'; '.join(why)}")
        print("\n".join(_filter_advice(outcome.risky, outcome.verdict)))
    print("\nverdict:")
    for line in outcome.verdict.lines():
        print(f"  {line}")
    print(f"exit status {outcome.verdict.exit_code}; {time.perf_counter() - started:.0f} s")
    print("wrote " + ", ".join(str(f) for f in files))
    return outcome.verdict.exit_code


def run_monitor_report(args: argparse.Namespace) -> int:
    files = monitor_report(args.log_dir, args.out)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    run = {"compare": run_compare, "monitor-report": run_monitor_report}[args.command]
    try:
        return run(args)
    except (ValueError, TypeError, ImportError, OSError) as e:
        if args.traceback:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"transformer-linear {args.command}: error: {first}", file=sys.stderr)
        return 2
    except SystemExit as e:
        # User code (a --model factory, its make_batch, its model) ended the process: no report was
        # written, so neither 0 ("every gap within --max-gap") nor 1 may be the exit status.
        if args.traceback:
            raise
        source = f"--model {args.model}" if getattr(args, "model", None) else "the model's code"
        print(f"transformer-linear {args.command}: error: {source} called sys.exit({e.code!r}); no report written",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
