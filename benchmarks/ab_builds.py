"""What the before/after kernel benchmarks (ab_*.py) share: another build of the extension loaded next to
this tree's, their outputs compared bitwise, and calls timed interleaved with a memcpy of the input.

Each ab_*.py script takes the path of another build's ``_C*.so`` (e.g. main's, copied aside before
rebuilding), calls both builds' kernels on the same preallocated outputs (the op's output allocation and
its page faults are left out: this measures the kernel) round-robin with a memcpy, on one thread timed
with thread CPU time (``--threads N`` > 1: N threads, wall clock).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Optional

import torch


def thread_clock() -> float:
    """CPU time of the calling thread, in seconds."""
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every ab_*.py script takes: the other build, repeats, threads."""
    parser.add_argument("old_so", help="path of the other build's _C*.so")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="threads (more than 1: wall clock, not thread CPU time)")


def setup(args: argparse.Namespace) -> tuple[ModuleType, Callable[[], float]]:
    """Loads the other build and sets the thread count; returns (the other build's module, the clock)."""
    spec = importlib.util.spec_from_file_location("old_build._C", args.old_so)
    old_C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_C)
    torch.set_num_threads(args.threads)
    return old_C, (thread_clock if args.threads == 1 else time.perf_counter)


def outputs_agree(outs: Sequence[Optional[torch.Tensor]], call: Callable[[ModuleType], None], new_C: ModuleType,
                  old_C: ModuleType) -> bool:
    """Runs ``call`` with the new build, then the old one, on the same ``outs``; True if their bytes agree."""
    call(new_C)
    new_outs = [o.clone() if o is not None else None for o in outs]
    call(old_C)
    return all(a is None or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(outs, new_outs))


def training_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``module`` on ``x`` with output gradient ``grad``, gradients cleared first."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)
    return step


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float],
                     before: Callable[[], object] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` over ``repeats`` round-robin rounds after one untimed call each;
    ``before`` runs untimed ahead of every timed call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            before()
            start = clock()
            fn()
            times[k].append(clock() - start)
    return times


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """``name``'s time over ``baseline``'s: the median of the per-round ratios where both ran every
    round (a slow phase of a shared machine lands on both sides), else the ratio of the medians."""
    ours, theirs = times[name], times[baseline]
    if len(ours) == len(theirs) > 1:
        return statistics.median(a / b for a, b in zip(ours, theirs))
    return statistics.median(ours) / statistics.median(theirs)


def ab_columns(times: dict[str, list[float]], x: torch.Tensor, nbytes: int, same: bool) -> str:
    """old ms, new ms, the median of the rounds' old/new, each build's share of memcpy's rate (``nbytes``
    moved, against twice the input for the memcpy) and whether the outputs agree."""
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = paired_ratio(times, "old", "new")
    memcpy_gbs = 2 * x.numel() * x.element_size() / med["memcpy"]
    return (f"{med['old'] * 1e3:>8.2f}{med['new'] * 1e3:>8.2f}{ratio:>8.2f}x"
            f"{nbytes / med['old'] / memcpy_gbs:>15.0%}{nbytes / med['new'] / memcpy_gbs:>15.0%}  {same}")


HEADER = f"{'old ms':>8}{'new ms':>8}{'old/new':>9}{'old of memcpy':>15}{'new of memcpy':>15}  bitwise"
