"""Forward+backward time and saved-activation memory of tl.Linear vs nn.Linear and torchao.

Rows: nn.Linear fp32 / bf16 / fp32 under bf16 autocast, tl.Linear under each recipe (eager and
torch.compile'd): the tensorwise ones (current, delayed) and the block-scaled
ones (Float8BlockScaling 1x128/128x128, MXFP8BlockScaling 1x32 E8M0,
Float8RowwiseScaling, NVFP4BlockScaling ``nvfp4``), and torchao's Float8Linear(emulate=True) (eager and
compiled) when torchao is installed. Columns: median fwd+bwd time, its ratio
to nn.Linear fp32 and to nn.Linear bf16 (what a CPU user would pick instead: the median over the
rounds of the two steps' time within one round, so a slow phase of a shared machine lands on both sides
of a ratio), and the bytes autograd saves for backward (parameters excluded; peak memory
is reported on CUDA only). The variants are timed in interleaved rounds, so
on a shared machine every one sees the same background load. A tiny shape
measures the eager per-call overhead. The CPU path of the FP8 kernels, and
why it was chosen, is printed first, with the command and the CPU model.

    python benchmarks/bench_linear.py                       # all shapes
    python benchmarks/bench_linear.py --shapes 1024 --recipes current,block,mxfp8,rowwise
    python benchmarks/bench_linear.py --shapes 1024 --recipes nvfp4 --threads 1
    python benchmarks/bench_linear.py --shapes 512,1024 --iters 3 --no-compile
    python benchmarks/bench_linear.py --shapes 2048,4096x1024x4096   # M x K x N
    python benchmarks/bench_linear.py --shapes 2048 --model-dtype bfloat16   # tl.Linear in a bf16 model
    python benchmarks/bench_linear.py --shapes 2048 --threads 1 --clock thread --no-bf16   # AVX2-only CPU
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from torch import nn

import transformer_linear as tl
import ab_builds
from ab_builds import paired_ratio
from bench_kernels import cpu_model
from transformer_linear import _C, recipe

# (tokens M, in_features K, out_features N)
SQUARE = {f"{n}": (n, n, n) for n in (512, 1024, 2048, 4096)}
LLM = {"llama-qkv 2048x4096x12288": (2048, 4096, 12288), "llama-mlp-down 2048x11008x4096": (2048, 11008, 4096)}
TINY = {"tiny 16x64x64": (16, 64, 64)}
# Row name -> recipe of the tl.Linear rows: tensorwise, then block-scaled, then NVFP4.
RECIPES = {name: recipe.from_name(name) for name in ("current", "delayed", "block", "mxfp8", "rowwise", "nvfp4")}


def _torchao_float8(linear: nn.Linear) -> Optional[nn.Module]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    model = nn.Sequential(linear)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    return model[0]


class _Bf16Autocast(nn.Module):
    """An fp32 module whose forward runs under ``torch.autocast("cpu", torch.bfloat16)``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.module(x)


def _variants(
    base: nn.Linear, compile_: bool, recipes: list[str], bf16: bool = True, model_dtype: torch.dtype = torch.float32
) -> dict[str, Optional[Callable[[], nn.Module]]]:
    """name -> factory of a module with ``base``'s parameters (None: not available); the tl.Linear rows'
    parameters in ``model_dtype``."""
    variants: dict[str, Optional[Callable[[], nn.Module]]] = {"nn.Linear fp32": lambda: copy.deepcopy(base)}
    if bf16:
        variants["nn.Linear bf16"] = lambda: copy.deepcopy(base).to(torch.bfloat16)
        variants["nn.Linear fp32, bf16 autocast"] = lambda: _Bf16Autocast(copy.deepcopy(base))
    for name in recipes:
        r = RECIPES[name]
        variants[f"tl.Linear {name}"] = lambda r=r: tl.Linear.from_linear(copy.deepcopy(base).to(model_dtype), recipe=r)
    has_torchao = _torchao_float8(copy.deepcopy(base)) is not None
    variants["torchao emulate"] = (lambda: _torchao_float8(copy.deepcopy(base))) if has_torchao else None
    if compile_:
        for name in [n for n in variants if n.startswith(("tl.", "torchao"))]:
            make = variants[name]
            variants[f"{name} compiled"] = (lambda make=make: torch.compile(make(), fullgraph=True)) if make else None
    return variants


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def _fwd_bwd_step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    return step


def _time_interleaved(
    steps: dict[str, Callable[[], None]], iters: int, warmup: int, slow_call_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[float]], set[str]]:
    """Seconds of each step in each of ``iters`` rounds that run every step once, in turn.

    ``warmup`` warm-up rounds come first, at least two (the timed rounds are ab_builds.time_interleaved's,
    which begins with an untimed one). The first warm-up round is timed: a step slower than ``slow_call_s``
    there (bf16 matmuls on a CPU without native bf16 take minutes) keeps that one time and sits out the
    other rounds. Returns
    the times (a list per step, one entry per round) and the names timed from that one call.
    ``clock``: wall time, or ``time.thread_time`` (the calling thread's CPU time: on a shared machine,
    what a one-thread step itself spent).
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    slow: set[str] = set()
    for name, step in steps.items():
        start = clock()
        step()
        took = clock() - start
        if took > slow_call_s:
            slow.add(name)
            times[name].append(took)
    fast = {name: step for name, step in steps.items() if name not in slow}
    for _ in range(warmup - 2):  # the last warm-up round is time_interleaved's untimed one
        for step in fast.values():
            step()
    times.update(ab_builds.time_interleaved(fast, iters, clock))
    return times, slow


def run_shape(label: str, shape: tuple[int, int, int], args: argparse.Namespace) -> None:
    m, k, n = shape
    torch.manual_seed(0)
    base = nn.Linear(k, n, device=args.device)
    print(f"\n### {label} (M={m}, K={k}, N={n}), {args.device}, {torch.get_num_threads()} threads\n")
    print("| variant | fwd+bwd ms | vs nn.Linear fp32 | vs nn.Linear bf16 | saved bytes | vs nn.Linear fp32 | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    steps, saved, missing = {}, {}, []
    variants = _variants(base, not args.no_compile, args.recipes, bf16=not args.no_bf16, model_dtype=args.model_dtype)
    for name, make in variants.items():
        if make is None:
            missing.append(name)
            continue
        module = make()
        # The input in the dtype of the module's parameters; the output gradient in its output's.
        x_dtype = args.model_dtype if name.startswith("tl.") else next(module.parameters()).dtype
        grad_dtype = torch.bfloat16 if "autocast" in name else x_dtype
        x = torch.randn(m, k, device=args.device, dtype=x_dtype, requires_grad=True)
        grad = torch.randn(m, n, device=args.device, dtype=grad_dtype)
        steps[name] = _fwd_bwd_step(module, x, grad)
        saved[name] = _saved_bytes(module, x)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    times, slow = _time_interleaved(steps, args.iters, max(args.warmup, 1), args.slow_call_s, clock)
    peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f} (all variants)" if args.device == "cuda" else "-"
    for name, t in times.items():
        label = f"{name} (1 call)" if name in slow else name
        vs_bf16 = f"{paired_ratio(times, name, 'nn.Linear bf16'):.2f}x" if "nn.Linear bf16" in times else "-"
        print(
            f"| {label} | {statistics.median(t) * 1e3:.3f} | {paired_ratio(times, name, 'nn.Linear fp32'):.2f}x | "
            f"{vs_bf16} | {saved[name]} | "
            f"{saved[name] / saved['nn.Linear fp32']:.2f}x | {peak} |"
        )
    for name in missing:
        print(f"| {name} | not installed | | | | | |")
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def cpu_path() -> str:
    """The CPU path of the FP8 kernels and why (builds before cpu_isa_info() give the name only)."""
    if hasattr(_C, "cpu_isa_info"):
        info = _C.cpu_isa_info()
        return f"{info['isa']} ({info['reason']})"
    return _C.cpu_isa()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="all", help="comma list of square sizes, MxKxN shapes and/or 'llm', 'tiny'; or 'all'"
    )
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument(
        "--recipes",
        type=lambda v: v.split(","),
        default=list(RECIPES),
        help=f"comma list of tl.Linear recipes to time (default: all of {','.join(RECIPES)})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--clock", choices=("wall", "thread"), default="wall",
        help="thread: the calling thread's CPU time (what a step spent on a shared machine), needs --threads 1",
    )
    parser.add_argument(
        "--no-bf16", action="store_true",
        help="leave out bf16 nn.Linear (a CPU without bf16 units runs it at a fraction of fp32's rate: minutes a call)",
    )
    parser.add_argument(
        "--model-dtype", type=lambda v: getattr(torch, v), default=torch.float32,
        help="dtype of the tl.Linear rows' parameters, input and gradient (bfloat16: like for like with the bf16 "
             "nn.Linear row, as in a bf16 model; default float32, fp32 master weights)",
    )
    parser.add_argument(
        "--slow-call-s", type=float, default=10.0, help="a variant whose first call takes longer is timed from it alone"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {list(RECIPES)}")
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = args.shapes.split(",") if args.shapes != "all" else [*SQUARE, "llm", "tiny"]
    shapes: dict[str, tuple[int, int, int]] = {}
    for item in wanted:
        if item == "llm":
            shapes.update(LLM)
        elif item == "tiny":
            shapes.update(TINY)
        elif "x" in item:
            shapes[item] = tuple(int(v) for v in item.split("x"))  # M x K x N
        else:
            shapes[item] = SQUARE.get(item) or (int(item),) * 3
    print(f"# {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
    print(f"# {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# CPU path: {cpu_path()}")
    print(f"# clock: {'CPU time of the calling thread' if args.clock == 'thread' else 'wall clock'}; "
          f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"# tl.Linear rows: parameters, input and gradient in {args.model_dtype}")
    for name in args.recipes:
        print(f"# tl.Linear {name}: {RECIPES[name]!r}")
    for label, shape in shapes.items():
        run_shape(label, shape, args)


if __name__ == "__main__":
    main()
