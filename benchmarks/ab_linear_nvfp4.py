"""tl.Linear under NVFP4BlockScaling (the default recipe: RHT wgrad operands, stochastic rounding on gradients,
16x16 weight blocks), forward + backward, against fp32 nn.Linear: interleaved runs in one process, one thread,
thread CPU time, medians and their ratio.

For a before/after, run it on each tree (PYTHONPATH=<tree>, its extension built) alternately:

    TL_CPU_ISA=avx2 PYTHONPATH=. python benchmarks/ab_linear_nvfp4.py --shapes 1024,2048 --iters 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import transformer_linear as tl
from transformer_linear.recipe import NVFP4BlockScaling


def _thread_time(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.thread_time()
    module(x).backward(grad)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1024,2048", help="comma list of square sizes (M = K = N)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU path {tl._C.cpu_isa()}, one thread, thread CPU time, median of {args.iters}")
    for n in (int(s) for s in args.shapes.split(",")):
        torch.manual_seed(0)
        fp32 = torch.nn.Linear(n, n, bias=False)
        nvfp4 = tl.Linear(n, n, bias=False, recipe=NVFP4BlockScaling())
        x, grad = torch.randn(n, n, requires_grad=True), torch.randn(n, n)
        for module in (fp32, nvfp4, nvfp4):  # warm-up
            _thread_time(module, x, grad)
        fp32_s, nvfp4_s = [], []
        for _ in range(args.iters):
            fp32_s.append(_thread_time(fp32, x, grad))
            nvfp4_s.append(_thread_time(nvfp4, x, grad))
        base, ours = statistics.median(fp32_s), statistics.median(nvfp4_s)
        print(f"{n}^3: fp32 nn.Linear {base * 1e3:.1f} ms, tl.Linear NVFP4 {ours * 1e3:.1f} ms, "
              f"ratio {ours / base:.2f}x")


if __name__ == "__main__":
    main()
