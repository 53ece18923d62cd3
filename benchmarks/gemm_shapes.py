"""FP8 GEMM throughput on the CPU against PyTorch baselines.

Times ``transformer_linear.fp8_gemm`` (each CPU instruction-set path asked
for) against fp32 ``torch.mm`` on the already dequantized operands and,
where cheap enough, ``torch._scaled_mm`` (very slow on the CPU, so only timed
up to ``--scaled-mm-max`` FLOPs). Prints GFLOP/s and the ratios.

    python benchmarks/gemm_shapes.py                      # squares + LLM shapes
    python benchmarks/gemm_shapes.py --shapes 2048x2048x2048 --isa avx512_bf16 avx512_bf16_no_amx avx512
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, List, Tuple

import torch

from transformer_linear import _C, ops

SQUARES = [512, 1024, 2048, 3072, 4096]
LLM_SHAPES = [(2048, 4096, 4096), (2048, 11008, 4096), (2048, 4096, 11008)]  # M x N x K


def best_time(fn: Callable[[], object], min_seconds: float = 0.5, max_reps: int = 50) -> float:
    """Shortest of several runs after one warm-up (seconds)."""
    fn()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < min_seconds or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def parse_shape(text: str) -> Tuple[int, int, int]:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return m, n, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=parse_shape, help="MxNxK shapes (default: squares + LLM)")
    parser.add_argument(
        "--isa", nargs="*", default=["auto"],
        help="CPU paths to time: set_cpu_isa names, or avx512_bf16_no_amx for vdpbf16ps without AMX tiles",
    )
    parser.add_argument("--scaled-mm-max", type=float, default=2 * 512**3, help="largest FLOPs for _scaled_mm")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or [(s, s, s) for s in SQUARES] + LLM_SHAPES
    one = torch.ones(1)
    print(f"threads={torch.get_num_threads()}")
    print(f"{'M x N x K':>20} {'path':>18} {'fp8 GF/s':>9} {'mm GF/s':>8} {'vs mm':>6} {'smm GF/s':>9} {'vs smm':>7}")
    for m, n, k in shapes:
        flops = 2.0 * m * n * k
        a = torch.randn(m, k).to(torch.float8_e4m3fn)
        b = torch.randn(n, k).to(torch.float8_e4m3fn)
        a32, b32 = a.float(), b.float()
        mm = flops / best_time(lambda: torch.mm(a32, b32.t())) / 1e9
        smm = float("nan")
        if flops <= args.scaled_mm_max:
            smm = flops / best_time(
                lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32), max_reps=3
            ) / 1e9
        for isa in args.isa:
            no_amx = isa.endswith("_no_amx")
            os.environ["TL_CPU_AMX"] = "0" if no_amx else "1"
            _C.set_cpu_isa(isa.removesuffix("_no_amx"))
            path = _C.cpu_isa() + ("-no-amx" if no_amx else "")
            fp8 = flops / best_time(lambda: ops.fp8_gemm(a, one, b, one, torch.float32)) / 1e9
            print(f"{f'{m}x{n}x{k}':>20} {path:>18} {fp8:9.1f} {mm:8.1f} {fp8 / mm:6.2f} {smm:9.2f} {fp8 / smm:7.1f}")
        _C.set_cpu_isa("auto")


if __name__ == "__main__":
    main()
