"""Command line: ``transformer-linear compare`` (also ``python -m transformer_linear compare``).

Trains a model with high-precision Linear layers and with each FP8 recipe
from the same init on the same data, flags the layers that are risky in
FP8, measures the loss gap with those layers kept in high precision, and
writes a markdown + JSON report and PNG plots. The model is the built-in
GPT (default), an importable factory (``--model pkg.module:factory``) or a
Hugging Face causal LM (``--hf PATH``). Exit status: 0 when every recipe's
loss gap (either sign) is within ``--max-gap``, 1 when one is not, 2 for bad input.

``transformer-linear monitor-report LOG_DIR`` plots what
``tl.numerics.monitor`` recorded during training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from transformer_linear.convert import conversion_plan
from transformer_linear.numerics import monitor_report
from transformer_linear.numerics.compare import RECIPE_NAMES, train_compare, train_run
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss
from transformer_linear.numerics.report import CompareReport
from transformer_linear.numerics.risk import RiskThresholds, filter_source, keep_high_precision, risky_layers
from transformer_linear.numerics.sources import Workload, hf_workload, parse_shape, user_workload

DEFAULT_OUT = "fp8_compare_report"
FILTERED = " +filter"  # suffix of the runs with the risky layers in high precision


class UsageError(ValueError):
    """A bad command line or input: reported on one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transformer-linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare", help="is FP8 safe for this model? train and compare FP8 recipes with high precision")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="built-in model size")
    src.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="factory returning model[, make_batch[, loss_fn]]")
    src.add_argument("--hf", metavar="PATH_OR_NAME", help="a transformers causal LM (config/checkpoint dir or hub name)")
    p.add_argument("--hf-random-init", action="store_true", help="build the --hf model from its config only")
    p.add_argument("--input-shape", help="synthetic inputs (--model without make_batch), or batch,seq for --hf (4,64)")
    p.add_argument("--input-dtype", default="float32", help="float32, bfloat16, float16 or long (token ids)")
    p.add_argument("--vocab", type=int, help="token ids are drawn below this (--input-dtype long)")
    p.add_argument("--data", metavar="FILE", help="--hf data: text (model's tokenizer, else bytes), .pt or .npy ids")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="built-in model's batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recipes", default="delayed,current", help=f"comma-separated: {', '.join(RECIPE_NAMES)}")
    p.add_argument("--layers", metavar="REGEX", help="report only layers whose name matches (re.search)")
    p.add_argument("--max-gap", type=float, default=1.0, help="exit 1 when a recipe's |loss gap| exceeds this percent (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    m = sub.add_parser("monitor-report", help="plot what tl.numerics.monitor recorded")
    m.add_argument("log_dir", help="the monitor's log_dir")
    m.add_argument("--out", help="where the PNGs go (default LOG_DIR)")
    return parser


class _Bars:
    """One tqdm bar per training run, on stderr."""

    def __init__(self) -> None:
        self.bar: Optional[tqdm] = None

    def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
        if self.bar is None or self.bar.desc != label:
            self.bar = tqdm(total=steps, desc=label, file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(1)
        if step == steps:
            self.bar.close()


def _builtin(args: argparse.Namespace) -> Workload:
    if args.batch_size < 1:
        raise UsageError("--batch-size must be positive")
    torch.manual_seed(args.seed)
    cfg = GPTConfig.named(args.size)
    data = SyntheticText(cfg, seed=args.seed)
    batches = [data.batch(args.batch_size) for _ in range(args.steps)]
    desc = (
        f"built-in GPT ({args.size}: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, seq "
        f"{cfg.seq_len}), synthetic bigram data, batch {args.batch_size}; loss floor {data.entropy_floor:.3f}, "
        f"uniform {data.uniform_loss:.3f}"
    )
    return Workload(TinyGPT(cfg), batches.__getitem__, lm_loss, desc)


def _workload(args: argparse.Namespace) -> Workload:
    shape = parse_shape(args.input_shape) if args.input_shape else None
    if args.hf is not None:
        if shape is not None and len(shape) != 2:
            raise UsageError(f"--input-shape for --hf is batch,seq; got {args.input_shape}")
        batch, seq = shape or (4, 64)
        return hf_workload(args.hf, args.hf_random_init, batch, seq, args.data, args.seed)
    if args.hf_random_init or args.data:
        raise UsageError("--hf-random-init and --data go with --hf")
    if args.model is not None:
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


def _narrow(report: CompareReport, pattern: Optional[re.Pattern]) -> CompareReport:
    if pattern is None:
        return report
    layers = [s for s in report.layers if pattern.search(s.name)]
    return CompareReport(report.recipes, layers, report.reference_loss, report.loss)


def _markdown(args, workload, plan, train, final, risky, thresholds, gaps) -> str:
    skipped = "".join(f"\n- `{n}`: {why}" for n, why in plan.skipped.items()) or " none"
    risk_lines = "".join(f"\n- `{n}`: " + "; ".join(why) for n, why in risky.items()) or "\nnone"
    lines = [
        "# FP8 numerics report",
        "",
        f"Model: {workload.description}. {args.steps} steps of AdamW (lr {args.lr}), seed {args.seed}, "
        f"device {args.device}.",
        "",
        f"Converted to tl.Linear: {len(plan.converted) + len(plan.existing)} layers. Skipped:{skipped}",
        "",
        "## Final loss (mean of the last 10 steps)",
        "",
        "```",
        train.summary(),
        "```",
        "",
        f"Worst gap: {100 * max(gaps.values(), key=abs):+.2f}% (limit {args.max_gap:g}% either way).",
        "",
        "## Risky layers",
        "",
        f"Thresholds: output SQNR < {thresholds.min_output_sqnr_db:g} dB, dX/dW SQNR < "
        f"{thresholds.min_grad_sqnr_db:g} dB, saturation > {100 * thresholds.max_saturation:g}%, underflow > "
        f"{100 * thresholds.max_underflow:g}%.{risk_lines}",
    ]
    if risky:
        lines += ["", "Suggested filter (its runs are the `+filter` rows above):", "", "```python", filter_source(risky), "```"]
    lines += [
        "",
        "## Per-layer comparison on the trained weights",
        "",
        "SQNR in dB (higher is better) of each layer's output, input gradient (dX) and weight gradient (dW)",
        "against the high-precision run; amax of input (x), weight (w) and grad_output (dy); percent of",
        "elements flushed to zero (uflow) or clamped at the format's max (sat).",
        "",
        final.markdown(),
    ]
    return "\n".join(lines) + "\n"


def run_compare(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UsageError("--steps must be positive")
    if not args.max_gap >= 0:
        raise UsageError(f"--max-gap must be a non-negative percentage, got {args.max_gap}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no GPU is available")
    try:
        pattern = re.compile(args.layers) if args.layers else None
    except re.error as e:
        raise UsageError(f"--layers: not a regular expression: {e}") from e
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r.lower() not in RECIPE_NAMES]
    if unknown or not recipes:
        raise UsageError(f"--recipes: unknown recipe {', '.join(unknown) or '(none)'}; expected {', '.join(RECIPE_NAMES)}")

    workload = _on_device(_workload(args), device)
    plan = conversion_plan(workload.model)
    if not plan.converted and not plan.existing:
        raise UsageError(f"the model ({type(workload.model).__name__}) has no nn.Linear layers: nothing to compare")
    _probe(workload)
    n_params = sum(p.numel() for p in workload.model.parameters())
    print(f"transformer_linear compare: {workload.description}; {n_params:,} params; {len(plan.converted) + len(plan.existing)} "
          f"layers to FP8, {len(plan.skipped)} skipped; {args.steps} steps x {len(recipes) + 1} runs on {device}")
    for name, why in plan.skipped.items():
        print(f"  skipped {name}: {why}")

    bars = _Bars()
    train = train_compare(workload.model, workload.make_batch, workload.loss_fn, args.steps, recipes, args.lr, progress=bars)
    thresholds = RiskThresholds()
    final = _narrow(train.final, pattern)
    risky = risky_layers(final, thresholds)
    if risky:
        batches = [workload.make_batch(i) for i in range(args.steps)]
        keep = keep_high_precision(risky)
        for label, recipe in zip(train.final.recipes, recipes):
            tick = lambda step, loss, label=label + FILTERED: bars(label, step, args.steps, loss)  # noqa: E731
            train.loss_curves[label + FILTERED] = train_run(
                workload.model, RECIPE_NAMES[recipe.lower()](), batches, workload.loss_fn, args.lr, keep, progress=tick
            )[0]
    plain_gaps = {n: g for n, g in train.loss_gap().items() if not n.endswith(FILTERED)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(_markdown(args, workload, plan, train, final, risky, thresholds, plain_gaps))
    payload = train.to_dict()
    payload["final_compare"] = final.to_dict()
    payload.update(converted=plan.converted + plan.existing, skipped=plan.skipped, risky_layers=risky,
                   thresholds=thresholds.__dict__, max_gap_percent=args.max_gap)
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    files = [out / "report.md", out / "report.json"]
    if not args.no_plots:
        files.append(train.plot(out / "loss_curves.png"))
        if final.layers:
            files.append(final.plot(out / "layer_sqnr.png"))

    print()
    print(train.summary())
    print()
    print(final.table())
    if risky:
        print("\nrisky layers:")
        for name, why in risky.items():
            print(f"  {name}: {'; '.join(why)}")
        print("suggested filter (the '+filter' runs above):\n" + filter_source(risky))
    worst = max(plain_gaps.values(), key=abs)
    verdict = "within" if abs(worst) <= args.max_gap / 100 else "exceeds"
    print(f"\nworst loss gap {100 * worst:+.2f}% {verdict} --max-gap {args.max_gap:g}% (either way)")
    print("wrote " + ", ".join(str(f) for f in files))
    return 0 if verdict == "within" else 1


def run_monitor_report(args: argparse.Namespace) -> int:
    files = monitor_report(args.log_dir, args.out)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
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
