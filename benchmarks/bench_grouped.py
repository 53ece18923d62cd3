"""Mixture-of-experts: the FP8 grouped GEMM and tl.GroupedLinear against dense and per-expert baselines.

Two tables, each over a skewed routing (one expert gets 4x the tokens of each other one) and a
uniform one:

* the grouped GEMM goal row: ``ops.fp8_grouped_gemm`` (tensorwise, one scale per expert) over G
  experts, against one dense FP8 GEMM (``ops.fp8_gemm``) of the same FLOPs (the goal: close to 1x),
  the fp32 per-expert loop of ``F.linear`` and ``torch._grouped_mm`` (fp32, where the CPU build runs it);
* tl.GroupedLinear forward+backward (current and delayed scaling, Float8BlockScaling, MXFP8,
  rowwise; ``m_splits`` a tensor) against a loop of nn.Linear in fp32 (and bf16).

The variants are timed in interleaved rounds (bench_linear.py), so on a shared machine every one
sees the same background load.

    python benchmarks/bench_grouped.py                          # 8 experts x 512 tokens, 2048 -> 1024
    python benchmarks/bench_grouped.py --threads 1 --iters 5
    python benchmarks/bench_grouped.py --threads 1 --cpu-time  # the thread's CPU time: a shared machine's load aside
    python benchmarks/bench_grouped.py --experts 4 --tokens 256 --in-features 1024 --out-features 512
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from ab_builds import paired_ratio
from bench_kernels import cpu_model
from bench_linear import _time_interleaved, cpu_path
from torch import nn

import transformer_linear as tl
from transformer_linear import ops, reference
from transformer_linear.ops.grouped import fp8_grouped_gemm

E4M3 = torch.float8_e4m3fn


def routing(pattern: str, total: int, groups: int) -> list[int]:
    """Tokens per expert: 'uniform', or 'skewed' (the first expert 4x each other one)."""
    if pattern == "uniform":
        sizes = [total // groups] * groups
    else:
        unit = total // (groups + 3)
        sizes = [4 * unit] + [unit] * (groups - 1)
    sizes[0] += total - sum(sizes)
    return sizes


def _offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _grouped_mm_works() -> bool:
    """Whether this torch build runs torch._grouped_mm on the CPU (fp32, 16-byte aligned)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.randn(8, 16), torch.randn(2, 16, 8), offs=_offsets([3, 5]))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def gemm_table(sizes: list[int], k: int, n: int, args: argparse.Namespace) -> None:
    total, groups = sum(sizes), len(sizes)
    torch.manual_seed(0)
    x = torch.randn(total, k)
    w = torch.randn(groups, n, k) / k**0.5
    xq, sx, _ = reference.quantize_current(x, E4M3)
    quantized = [reference.quantize_current(w[g], E4M3) for g in range(groups)]
    wq = torch.stack([q for q, _, _ in quantized])
    sw = torch.stack([s.reshape(()) for _, s, _ in quantized])
    # One dense weight of the same FLOPs: (total x k) @ (n x k)^T.
    wq_dense, sw_dense = wq[0], sw[0].reshape(1)
    offs = _offsets(sizes)
    splits = list(sizes)
    steps: dict[str, Callable[[], None]] = {
        "FP8 grouped GEMM (tensorwise, per-expert scales)":
            lambda: fp8_grouped_gemm(xq, sx, wq, sw, offs, torch.bfloat16),
        "FP8 dense GEMM, same FLOPs": lambda: ops.fp8_gemm(xq, sx, wq_dense, sw_dense, torch.bfloat16),
        "fp32 per-expert F.linear loop": lambda: torch.cat([F.linear(p, w[g]) for g, p in enumerate(x.split(splits))]),
    }
    if _grouped_mm_works():
        w_t = w.transpose(1, 2).contiguous()
        steps["torch._grouped_mm fp32"] = lambda: torch._grouped_mm(x, w_t, offs=offs)
    times, slow = _time_interleaved(steps, args.iters, max(args.warmup, 1), args.slow_call_s, args.clock)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    grouped = seconds["FP8 grouped GEMM (tensorwise, per-expert scales)"]
    dense, loop = seconds["FP8 dense GEMM, same FLOPs"], seconds["fp32 per-expert F.linear loop"]
    flops = 2 * total * k * n
    print("| variant | ms | GFLOP/s | grouped / this |")
    print("|---|---:|---:|---:|")
    for name, s in seconds.items():
        label = f"{name} (1 call)" if name in slow else name
        print(f"| {label} | {s * 1e3:.2f} | {flops / s / 1e9:.1f} | {grouped / s:.2f}x |")
    if "torch._grouped_mm fp32" not in seconds:
        print("| torch._grouped_mm fp32 | not run by this torch build on the CPU | | |")
    print(f"\ngoal row: grouped FP8 / dense FP8 of the same FLOPs = {grouped / dense:.2f}x; "
          f"grouped FP8 / fp32 per-expert loop = {grouped / loop:.2f}x")


def _fwd_bwd(module: Callable, x: torch.Tensor, splits, grad: torch.Tensor, params) -> Callable[[], None]:
    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        module(x, splits).backward(grad)

    return step


def linear_table(sizes: list[int], k: int, n: int, args: argparse.Namespace) -> None:
    total, groups = sum(sizes), len(sizes)
    torch.manual_seed(0)
    steps: dict[str, Callable[[], None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        linears = nn.ModuleList(nn.Linear(k, n, dtype=dtype) for _ in range(groups))
        x = torch.randn(total, k, dtype=dtype, requires_grad=True)
        grad = torch.randn(total, n, dtype=dtype)

        def loop(x, splits, linears=linears):
            return torch.cat([lin(p) for lin, p in zip(linears, x.split(splits))])

        name = f"nn.Linear loop {'fp32' if dtype == torch.float32 else 'bf16'}"
        steps[name] = _fwd_bwd(loop, x, list(sizes), grad, list(linears.parameters()))
    recipes = (("current", tl.recipe.Float8CurrentScaling), ("delayed", tl.recipe.DelayedScaling),
               ("Float8BlockScaling", tl.recipe.Float8BlockScaling), ("MXFP8", tl.recipe.MXFP8BlockScaling),
               ("rowwise", tl.recipe.Float8RowwiseScaling), ("NVFP4", tl.recipe.NVFP4BlockScaling))
    for name, make in recipes:
        if args.recipes and name not in args.recipes:
            continue
        module = tl.GroupedLinear(groups, k, n, recipe=make())
        x = torch.randn(total, k, requires_grad=True)
        grad = torch.randn(total, n)
        steps[f"tl.GroupedLinear {name} (m_splits tensor)"] = _fwd_bwd(
            module, x, torch.tensor(sizes), grad, list(module.parameters())
        )
    times, slow = _time_interleaved(steps, args.iters, max(args.warmup, 1), args.slow_call_s, args.clock)
    print("| variant | fwd+bwd ms | vs nn.Linear loop fp32 | vs nn.Linear loop bf16 |")
    print("|---|---:|---:|---:|")
    for name, t in times.items():
        label = f"{name} (1 call)" if name in slow else name
        vs_fp32, vs_bf16 = (paired_ratio(times, name, f"nn.Linear loop {b}") for b in ("fp32", "bf16"))
        print(f"| {label} | {statistics.median(t) * 1e3:.2f} | {vs_fp32:.2f}x | {vs_bf16:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per expert on average")
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=1024)
    parser.add_argument("--routings", type=lambda v: v.split(","), default=["skewed", "uniform"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-linear", action="store_true", help="skip the GroupedLinear fwd+bwd table")
    parser.add_argument("--recipes", type=lambda v: v.split(","), default=None,
                        help="GroupedLinear rows to time (current, delayed, Float8BlockScaling, MXFP8, rowwise, "
                             "NVFP4; default: all)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time (time.thread_time), with --threads 1 only")
    parser.add_argument(
        "--slow-call-s", type=float, default=10.0, help="a variant whose first call takes longer is timed from it alone"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("--cpu-time measures the calling thread only: give --threads 1")
    args.clock = time.thread_time if args.cpu_time else time.perf_counter
    g, k, n = args.experts, args.in_features, args.out_features
    print(f"# {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
    print(f"# {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# CPU path: {cpu_path()}")
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"# {clock}; load average {os.getloadavg()[0]:.1f} at the start")
    for pattern in args.routings:
        sizes = routing(pattern, g * args.tokens, g)
        print(f"\n### grouped GEMM, {pattern} routing {sizes}, K={k}, N={n}\n")
        gemm_table(sizes, k, n, args)
        if not args.no_linear:
            print(f"\n### GroupedLinear fwd+bwd, {pattern} routing {sizes}, {k} -> {n}\n")
            linear_table(sizes, k, n, args)


if __name__ == "__main__":
    main()
