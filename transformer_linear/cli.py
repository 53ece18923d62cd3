"""Command line: ``python -m transformer_linear compare`` (also ``transformer-linear compare``).

Trains the built-in GPT-style model with fp32 nn.Linear and with each FP8
recipe from the same init on the same synthetic data, then writes a
markdown + JSON report and PNG plots to an output directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

DEFAULT_OUT = "fp8_compare_report"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m transformer_linear", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare", help="is FP8 safe for this model? train and compare FP8 recipes with nn.Linear")
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="built-in model size")
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--recipes", default="delayed,current", help="comma-separated: delayed, current, delayed-e4m3, current-e4m3"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
        if not self.tty and step not in (1, steps) and step % max(1, steps // 4):
            return
        width = 30
        filled = width * step // steps
        bar = "#" * filled + "." * (width - filled)
        line = f"{label:<24} [{bar}] {step:>5}/{steps} loss {loss:.4f} ({time.perf_counter() - self.start:.0f}s)"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and step == steps:
            self.stream.write("\n")
        self.stream.flush()


def _markdown(train, cfg, args) -> str:
    lines = [
        "# FP8 numerics report",
        "",
        f"Model: built-in GPT ({args.size}: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
        f"seq {cfg.seq_len}); {args.steps} steps of AdamW (lr {args.lr}), batch {args.batch_size}, seed {args.seed}, "
        f"device {args.device}.",
        "",
        "## Final loss (mean of the last 10 steps)",
        "",
        "```",
        train.summary(),
        "```",
        "",
        "## Per-layer comparison on the trained weights",
        "",
        "SQNR in dB (higher is better) of each layer's output, input gradient (dX) and weight gradient (dW)",
        "against the fp32 nn.Linear run; amax of input (x), weight (w) and grad_output (dy); percent of",
        "elements flushed to zero (uflow) or clamped at the format's max (sat).",
        "",
        "```",
        train.final.table(),
        "```",
    ]
    return "\n".join(lines) + "\n"


def run_compare(args: argparse.Namespace) -> int:
    from transformer_linear.numerics import train_compare
    from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss

    if args.steps < 1 or args.batch_size < 1:
        raise SystemExit("compare: --steps and --batch-size must be positive")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("compare: --device cuda asked for, but no GPU is available")
    torch.manual_seed(args.seed)
    cfg = GPTConfig.named(args.size)
    model = TinyGPT(cfg).to(device)
    data = SyntheticText(cfg, seed=args.seed)
    batches = [data.batch(args.batch_size).to(device) for _ in range(args.steps)]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]

    print(
        f"transformer_linear compare: GPT {args.size} ({sum(p.numel() for p in model.parameters()):,} params), "
        f"{args.steps} steps x {len(recipes) + 1} runs on {device}; loss floor {data.entropy_floor:.3f}, "
        f"uniform {data.uniform_loss:.3f}"
    )
    train = train_compare(
        model, lambda i: batches[i], lm_loss, steps=args.steps, recipes=recipes, lr=args.lr, progress=_Progress()
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(_markdown(train, cfg, args))
    (out / "report.json").write_text(__import__("json").dumps(train.to_dict(), indent=2))
    files = [out / "report.md", out / "report.json"]
    if not args.no_plots:
        files.append(train.plot(out / "loss_curves.png"))
        files.append(train.final.plot(out / "layer_sqnr.png"))

    print()
    print(train.summary())
    print()
    print(train.final.table())
    print()
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return run_compare(args)
    return 2  # unreachable: argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
