"""The fused forward (ops.quantize_fp8_gemm: the input's cast inside the CPU GEMM) against the quantize pass
followed by the GEMM, in one process and one build, timed in interleaved rounds (medians), next to the
baselines a user would pick instead: fp32 and bf16 ``torch.mm`` / ``nn.Linear``.

Two tables per shape: the ops (current and delayed scaling, each input dtype asked for), and a
``tl.Linear`` step of the one-scale recipes, forward alone (``torch.no_grad``) and forward + backward,
with the fused forward and with the input quantizer's default (the quantize op, then the GEMM: what every
other kind runs). One thread (default): thread CPU time; ``--threads N``: wall clock.

    python benchmarks/ab_fused_forward.py --shapes 2048,4096x1024x4096 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

import ab_builds
import transformer_linear as tl
from bench_kernels import cpu_model
from transformer_linear import ops, recipe
from transformer_linear.recipe.kind import ScalingKind
from transformer_linear.recipe.kind_tensorwise import TensorwiseKind

E4M3 = torch.float8_e4m3fn
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """The tensorwise kind's forward as every other kind's: the quantize op, then the GEMM."""
    fused = TensorwiseKind.quantize_gemm
    TensorwiseKind.quantize_gemm = ScalingKind.quantize_gemm
    try:
        yield
    finally:
        TensorwiseKind.quantize_gemm = fused


def _unfused_call(fn: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        with unfused():
            fn()
    return call


def _report(times: dict[str, list[float]], base: str, flop: float) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.2f} | {flop / t / 1e9:.1f} | {t / med[base]:.2f}x |")


def op_rows(shape: tuple[int, int, int], in_dtypes: list[str], repeats: int, clock: Callable[[], float]) -> None:
    m, k, n = shape
    torch.manual_seed(0)
    w_hp = torch.randn(n, k)
    w, w_scale_inv, _ = ops.quantize_current(w_hp, E4M3)
    fns: dict[str, Callable[[], object]] = {}
    for dtype_name in in_dtypes:
        x = torch.randn(m, k).to(DTYPES[dtype_name])
        fns[f"{dtype_name} torch.mm"] = lambda x=x, w=w_hp.to(x.dtype): torch.mm(x, w.t())
        for scaling, scale in (("current", None), ("delayed", torch.tensor([8.0]))):
            def two_ops(x=x, scale=scale):
                q = ops.quantize_fused(x, E4M3, scale)
                return ops.fp8_gemm(q.data, q.scale_inv, w, w_scale_inv, torch.bfloat16)

            fns[f"{dtype_name} in, {scaling}: quantize + fp8_gemm"] = two_ops
            fns[f"{dtype_name} in, {scaling}: quantize_fp8_gemm"] = (
                lambda x=x, scale=scale: ops.quantize_fp8_gemm(x, E4M3, scale, w, w_scale_inv, torch.bfloat16))
    print(f"\n### The ops, M x K x N = {m} x {k} x {n} (bf16 out)\n")
    print("| variant | ms | GFLOP/s | / first row |\n|---|---:|---:|---:|")
    _report(ab_builds.time_interleaved(fns, repeats, clock), next(iter(fns)), 2.0 * m * k * n)


def _forward(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def forward() -> None:
        with torch.no_grad():
            module(x)
    return forward


def linear_rows(shape: tuple[int, int, int], recipes: list[str], bf16: bool, repeats: int,
                clock: Callable[[], float]) -> None:
    m, k, n = shape
    torch.manual_seed(0)
    base = nn.Linear(k, n)
    x, grad = torch.randn(m, k, requires_grad=True), torch.randn(m, n)
    for what, make, flop in (("forward (no_grad)", lambda mod, x, g: _forward(mod, x), 2.0),
                             ("forward + backward", ab_builds.training_step, 6.0)):
        fns: dict[str, Callable[[], None]] = {"nn.Linear fp32": make(copy.deepcopy(base), x, grad)}
        if bf16:
            x_bf16 = x.detach().bfloat16().requires_grad_()
            fns["nn.Linear bf16"] = make(copy.deepcopy(base).bfloat16(), x_bf16, grad.bfloat16())
        for name in recipes:
            layer = tl.Linear.from_linear(copy.deepcopy(base), recipe=recipe.from_name(name))
            fns[f"{name}, quantize + GEMM"] = _unfused_call(make(layer, x, grad))
            fns[f"{name}, fused"] = make(layer, x, grad)
        print(f"\n### tl.Linear {what}, M x K x N = {m} x {k} x {n}\n")
        print("| variant | ms | GFLOP/s | / fp32 nn.Linear |\n|---|---:|---:|---:|")
        _report(ab_builds.time_interleaved(fns, repeats, clock), "nn.Linear fp32", flop * m * k * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048", help="M x K x N, comma-separated (one number: a cube)")
    parser.add_argument("--recipes", default="current,delayed")
    parser.add_argument("--in-dtypes", default="fp32,bf16", help="input dtypes of the op table")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the bf16 nn.Linear (slow without bf16 units)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="threads (more than 1: wall clock)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = ab_builds.thread_clock if args.threads == 1 else time.perf_counter
    print(f"CPU: {cpu_model()}; path {tl._C.cpu_isa_info()}; {args.threads} thread(s); "
          f"load {os.getloadavg()[0]:.2f}")
    for spec in args.shapes.split(","):
        dims = [int(d) for d in spec.split("x")]
        shape = (dims[0],) * 3 if len(dims) == 1 else tuple(dims)
        op_rows(shape, args.in_dtypes.split(","), args.repeats, clock)
        linear_rows(shape, args.recipes.split(","), not args.no_bf16, args.repeats, clock)


if __name__ == "__main__":
    main()
