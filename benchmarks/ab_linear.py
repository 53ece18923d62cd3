"""tl.Linear forward + backward and its GEMMs with two builds of the extension in one process: this tree's
and another (e.g. main's ``_C*.so``, copied aside before rebuilding), next to fp32 ``nn.Linear`` and fp32
``torch.mm``, timed in interleaved rounds (medians), so on a shared machine every candidate sees the same
background load.

The other build is swapped in by pointing every loaded ``transformer_linear`` module's ``_C`` at it for
the duration of its calls: the Python layer is this tree's for both, so the difference is the kernels.
One thread (default): thread CPU time; ``--threads N``: wall clock.

    python benchmarks/ab_linear.py /tmp/old/_C.cpython-311-x86_64-linux-gnu.so --shapes 2048,4096x1024x4096
    python benchmarks/ab_linear.py /tmp/old/_C*.so --what gemm --shapes 2048 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

import ab_builds
import transformer_linear as tl
from bench_kernels import cpu_model
from transformer_linear import _C as new_C
from transformer_linear import ops, recipe

RECIPES = ("current", "delayed", "block", "mxfp8", "rowwise", "nvfp4")
E4M3 = torch.float8_e4m3fn
# (name, a block, b block, scale dtype): the block-scaled GEMMs the recipes run (rowwise: whole rows).
BLOCK_GEMMS = [
    ("1x128 x 128x128", (1, 128), (128, 128), torch.float32),
    ("1x32 x 1x32 e8m0", (1, 32), (1, 32), torch.float8_e8m0fnu),
    ("rowwise", None, None, torch.float32),
]


def _modules_holding(ext: ModuleType) -> list[ModuleType]:
    """The loaded transformer_linear modules whose ``_C`` is ``ext``."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("transformer_linear") and getattr(m, "_C", None) is ext]


def _with_build(ext: ModuleType, holders: list[ModuleType], fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run with every holder's ``_C`` pointing at ``ext``, put back to this tree's build after."""
    def call() -> None:
        for m in holders:
            m._C = ext
        try:
            fn()
        finally:
            for m in holders:
                m._C = new_C
    return call


def _report(times: dict[str, list[float]], base: str, flop: float) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, t in med.items():
        ratio = "" if name == base else f"{t / med[base]:.2f}x"
        print(f"| {name} | {t * 1e3:.1f} | {flop / t / 1e9:.1f} | {ratio} |")


def linear_rows(shape: tuple[int, int, int], recipes: list[str], old_C: ModuleType, repeats: int,
                clock: Callable[[], float]) -> None:
    m, k, n = shape
    torch.manual_seed(0)
    base = nn.Linear(k, n)
    x, grad = torch.randn(m, k, requires_grad=True), torch.randn(m, n)
    fns: dict[str, Callable[[], None]] = {"nn.Linear fp32": ab_builds.training_step(copy.deepcopy(base), x, grad)}
    layers = {name: tl.Linear.from_linear(copy.deepcopy(base), recipe=recipe.from_name(name)) for name in recipes}
    holders = _modules_holding(new_C)
    for name, layer in layers.items():
        fns[f"{name} old"] = _with_build(old_C, holders, ab_builds.training_step(layer, x, grad))
        fns[f"{name} new"] = ab_builds.training_step(layer, x, grad)
    print(f"\n### tl.Linear fwd+bwd, M x K x N = {m} x {k} x {n}\n")
    print("| variant | ms | GFLOP/s (3 GEMMs) | / fp32 nn.Linear |\n|---|---:|---:|---:|")
    _report(ab_builds.time_interleaved(fns, repeats, clock), "nn.Linear fp32", 6.0 * m * k * n)


def gemm_rows(shape: tuple[int, int, int], old_C: ModuleType, repeats: int, clock: Callable[[], float]) -> None:
    m, n, k = shape
    a_hp, b_hp = torch.randn(m, k), torch.randn(n, k)
    holders = _modules_holding(new_C)
    fns: dict[str, Callable[[], object]] = {"fp32 torch.mm": lambda: torch.mm(a_hp, b_hp.t())}
    a, sa, _ = ops.quantize_current(a_hp, E4M3)
    b, sb, _ = ops.quantize_current(b_hp, E4M3)
    cases = [("tensorwise", a, sa, b, sb)]
    for name, a_block, b_block, scale_dtype in BLOCK_GEMMS:
        qa, qsa = ops.quantize_blockwise(a_hp, E4M3, a_block or (1, k), scale_dtype, True)
        qb, qsb = ops.quantize_blockwise(b_hp, E4M3, b_block or (1, k), scale_dtype, True)
        cases.append((name, qa, qsa, qb, qsb))
    for name, qa, qsa, qb, qsb in cases:
        def gemm(qa=qa, qsa=qsa, qb=qb, qsb=qsb):
            return ops.fp8_gemm(qa, qsa, qb, qsb, torch.bfloat16)
        fns[f"{name} old"] = _with_build(old_C, holders, gemm)
        fns[f"{name} new"] = gemm
    # NVFP4 (16-element E4M3 block scales, per-tensor global scales): the GEMM of the nvfp4 recipe.
    fa = ops.nvfp4.quantize_nvfp4(a_hp, ops.nvfp4.nvfp4_amax(a_hp))
    fb = ops.nvfp4.quantize_nvfp4(b_hp, ops.nvfp4.nvfp4_amax(b_hp))

    def nvfp4_gemm():
        return ops.nvfp4.nvfp4_gemm(fa.data, fa.scale, fa.global_scale, fb.data, fb.scale, fb.global_scale,
                                    torch.bfloat16)
    fns["nvfp4 old"] = _with_build(old_C, holders, nvfp4_gemm)
    fns["nvfp4 new"] = nvfp4_gemm
    print(f"\n### FP8 and NVFP4 GEMMs, M x N x K = {m} x {n} x {k}, bf16 out\n")
    print("| variant | ms | GFLOP/s | / fp32 torch.mm |\n|---|---:|---:|---:|")
    _report(ab_builds.time_interleaved(fns, repeats, clock), "fp32 torch.mm", 2.0 * m * n * k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab_builds.add_arguments(parser)
    parser.add_argument("--what", choices=("linear", "gemm"), default="linear")
    parser.add_argument("--shapes", default="2048", help="comma list of square sizes or MxKxN (gemm: MxNxK)")
    parser.add_argument("--recipes", type=lambda v: v.split(","), default=list(RECIPES))
    args = parser.parse_args()
    old_C, clock = ab_builds.setup(args)
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"# {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'thread CPU time' if args.threads == 1 else 'wall clock'}, median of {args.repeats} rounds")
    print(f"# CPU path: new {new_C.cpu_isa()}, old {old_C.cpu_isa()}; "
          f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for item in args.shapes.split(","):
        shape = tuple(int(v) for v in item.split("x")) if "x" in item else (int(item),) * 3
        if args.what == "linear":
            linear_rows(shape, args.recipes, old_C, args.repeats, clock)
        else:
            gemm_rows(shape, old_C, args.repeats, clock)
        print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
