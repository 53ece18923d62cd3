"""Host CPU time of one tl.Linear forward+backward per recipe, against nn.Linear, and optionally against
another checkout of the package (an A/B of two versions with the same kernels).

The time is the calling thread's CPU time (``time.thread_time``) with one torch thread: on a shared
machine it leaves out the time the process waited for a core, so what it measures is the work the host
does per call (Python, dispatch, argument checks, kernels). A tiny layer shows the per-call overhead; a
256-wide one adds the kernels. Each figure is the best of ``--blocks`` blocks of ``--iters`` calls; with
``--compare-to`` the two checkouts run in turns, ``--rounds`` times, each in a fresh process.

    python benchmarks/bench_host_overhead.py
    python benchmarks/bench_host_overhead.py --compare-to ../old-checkout --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_kernels import cpu_model

SHAPES = {"16x64x64": (16, 64, 64), "256x256x256": (256, 256, 256)}
RECIPES = ("none", "current", "delayed", "block", "mxfp8", "rowwise")
# Checkouts older than recipe.from_name: the same recipes by their TE class names.
_CLASSES = {
    "current": "CurrentScaling",
    "delayed": "DelayedScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "rowwise": "Float8RowwiseScaling",
}


def _recipe(name: str):
    from transformer_linear import recipe  # noqa: PLC0415 (the checkout under test, imported in the worker)

    if name == "none":
        return None
    if hasattr(recipe, "from_name"):
        return recipe.from_name(name)
    return getattr(recipe, _CLASSES[name])()


def measure(iters_tiny: int, iters: int, blocks: int) -> list[dict]:
    """The figures of the package on sys.path: microseconds of thread CPU time per fwd+bwd."""
    import torch  # noqa: PLC0415 (after the worker's sys.path is set)

    import transformer_linear as tl  # noqa: PLC0415

    torch.set_num_threads(1)
    rows = []
    for shape, (m, k, n) in SHAPES.items():
        count = iters_tiny if m <= 16 else iters
        for name in RECIPES:
            torch.manual_seed(0)
            layer = tl.Linear(k, n, recipe=_recipe(name))
            x, grad = torch.randn(m, k, requires_grad=True), torch.randn(m, n)
            for _ in range(5):
                layer(x).backward(grad)
            best = float("inf")
            for _ in range(blocks):
                start = time.thread_time()
                for _ in range(count):
                    layer(x).backward(grad)
                best = min(best, (time.thread_time() - start) / count * 1e6)
            rows.append({"shape": shape, "recipe": name, "us": best})
    return rows


def _run_worker(tree: Path, args: argparse.Namespace) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, __file__, "--worker", "--iters", str(args.iters), "--blocks", str(args.blocks)]
    out = subprocess.run(cmd, env=env, cwd="/", check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare-to", type=Path, help="another checkout (its root folder, built in place)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=40, help="calls per block at 256 (x5 for the tiny layer)")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.iters * 5, args.iters, args.blocks)))
        return
    this = Path(__file__).resolve().parents[1]
    trees = {"this": this, **({"other": args.compare_to.resolve()} if args.compare_to else {})}
    best: dict[tuple[str, str, str], float] = {}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            for row in _run_worker(tree, args):
                key = (label, row["shape"], row["recipe"])
                best[key] = min(best.get(key, float("inf")), row["us"])
    print(f"# python {shlex.join(sys.argv)}")
    print(f"# {cpu_model()}, {os.cpu_count()} cores; 1 torch thread, thread CPU time")
    if args.compare_to:
        print(f"# this: {this}; other: {args.compare_to}")
    head = "| shape | recipe | this µs | vs nn.Linear |" + (" other µs | this / other |" if args.compare_to else "")
    print(head)
    print("|---|---|---:|---:|" + ("---:|---:|" if args.compare_to else ""))
    for shape in SHAPES:
        for name in RECIPES:
            mine = best[("this", shape, name)]
            line = f"| {shape} | {name} | {mine:.0f} | {mine / best[('this', shape, 'none')]:.2f}x |"
            if args.compare_to:
                other = best[("other", shape, name)]
                line += f" {other:.0f} | {mine / other:.2f} |"
            print(line)


if __name__ == "__main__":
    main()
