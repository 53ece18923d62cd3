"""Cost of ``tl.numerics.monitor``: a training step without it, with it between recordings, and a recording step.

    python benchmarks/bench_monitor.py [--width 1024] [--layers 4] [--rows 2048] [--every 100]

Prints milliseconds per step and the overhead amortized over ``every`` steps.
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe


def _steps(model, x, mon, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        model(x).sum().backward()
        if mon is not None:
            mon.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2048, help="tokens per step")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    tl.convert_to_fp8(model, recipe=recipe.DelayedScaling())
    watched = copy.deepcopy(model)
    x = torch.randn(args.rows, args.width)
    _steps(model, x, None, 2)
    base, quiet, recording = [], [], []
    with tl.numerics.monitor(watched, every=10**9) as mon:
        _steps(watched, x, mon, 2)
        # Interleaved, so the load of a shared machine hits all three alike.
        for _ in range(args.repeat):
            base += _steps(model, x, None, 1)
            quiet += _steps(watched, x, mon, 1)
            recording.append(_record_step(watched, x, mon))
    base, quiet, recording = (statistics.median(t) for t in (base, quiet, recording))
    amortized = (recording - base + (args.every - 1) * (quiet - base)) / args.every
    print(f"{args.layers} x Linear({args.width}, {args.width}), {args.rows} rows, DelayedScaling, {torch.get_num_threads()} threads")
    print(f"step without monitor     {1e3 * base:8.2f} ms")
    print(f"step between recordings  {1e3 * quiet:8.2f} ms ({100 * (quiet / base - 1):+.1f}%)")
    print(f"recording step           {1e3 * recording:8.2f} ms ({100 * (recording / base - 1):+.1f}%)")
    print(f"amortized, every={args.every:<6}  {100 * amortized / base:+.2f}% per step")


def _record_step(model, x, mon):
    """Time one step that records: force the flag on, as step() does every N steps."""
    mon._flag.recording = True
    (t,) = _steps(model, x, mon, 1)
    return t


if __name__ == "__main__":
    main()
