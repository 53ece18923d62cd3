"""Forward+backward time and saved-activation memory of tl.Linear vs nn.Linear and torchao.

Rows: nn.Linear fp32 / bf16, tl.Linear under each recipe (eager and
torch.compile'd), and torchao's Float8Linear(emulate=True) (eager and
compiled) when torchao is installed. Columns: median fwd+bwd time, its ratio
to nn.Linear fp32, and the bytes autograd saves for backward (parameters
excluded; peak memory is reported on CUDA only). A tiny shape measures the
eager per-call overhead.

    python benchmarks/bench_linear.py                       # all shapes
    python benchmarks/bench_linear.py --shapes 512,1024 --iters 3 --no-compile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Optional

import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe

# (tokens M, in_features K, out_features N)
SQUARE = {f"{n}": (n, n, n) for n in (512, 1024, 2048, 4096)}
LLM = {"llama-qkv 2048x4096x12288": (2048, 4096, 12288), "llama-mlp-down 2048x11008x4096": (2048, 11008, 4096)}
TINY = {"tiny 16x64x64": (16, 64, 64)}


def _torchao_float8(linear: nn.Linear) -> Optional[nn.Module]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    model = nn.Sequential(linear)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    return model[0]


def _variants(base: nn.Linear, compile_: bool) -> dict[str, Optional[Callable[[], nn.Module]]]:
    """name -> factory of a module with ``base``'s parameters (None: not available)."""
    variants: dict[str, Optional[Callable[[], nn.Module]]] = {
        "nn.Linear fp32": lambda: copy.deepcopy(base),
        "nn.Linear bf16": lambda: copy.deepcopy(base).to(torch.bfloat16),
    }
    recipes = {"current": recipe.CurrentScaling(), "delayed": recipe.DelayedScaling()}
    for name, r in recipes.items():
        variants[f"tl.Linear {name}"] = lambda r=r: tl.Linear.from_linear(copy.deepcopy(base), recipe=r)
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


def _time_fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int, warmup: int) -> float:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_shape(label: str, shape: tuple[int, int, int], args: argparse.Namespace) -> None:
    m, k, n = shape
    torch.manual_seed(0)
    base = nn.Linear(k, n, device=args.device)
    print(f"\n### {label} (M={m}, K={k}, N={n}), {args.device}, {torch.get_num_threads()} threads\n")
    print("| variant | fwd+bwd ms | vs nn.Linear fp32 | saved bytes | vs nn.Linear fp32 | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline_time = baseline_bytes = None
    for name, make in _variants(base, not args.no_compile).items():
        if make is None:
            print(f"| {name} | not installed | | | | |")
            continue
        module = make()
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        x = torch.randn(m, k, device=args.device, dtype=dtype, requires_grad=True)
        grad = torch.randn(m, n, device=args.device, dtype=dtype)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = _time_fwd_bwd(module, x, grad, args.iters, args.warmup)
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f}" if args.device == "cuda" else "-"
        saved = _saved_bytes(module, x)
        baseline_time = baseline_time or seconds
        baseline_bytes = baseline_bytes or saved
        print(
            f"| {name} | {seconds * 1e3:.3f} | {seconds / baseline_time:.2f}x | {saved} | "
            f"{saved / baseline_bytes:.2f}x | {peak} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", help="comma list of square sizes and/or 'llm', 'tiny'; or 'all'")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parser.parse_args()
    wanted = args.shapes.split(",") if args.shapes != "all" else [*SQUARE, "llm", "tiny"]
    shapes: dict[str, tuple[int, int, int]] = {}
    for item in wanted:
        if item == "llm":
            shapes.update(LLM)
        elif item == "tiny":
            shapes.update(TINY)
        else:
            shapes[item] = SQUARE.get(item) or (int(item),) * 3
    for label, shape in shapes.items():
        run_shape(label, shape, args)


if __name__ == "__main__":
    main()
