"""GPU benchmarks of the CUDA kernels against named PyTorch baselines.

Modes (issue 4 targets on H100 in brackets):

* ``quantize``: GB/s of quantize, quantize with amax, current scaling and the
  fused cast + transpose, vs a device memcpy of the input [>= 80%] and vs
  ``torch.compile`` of the reference.
* ``gemm``: TFLOP/s of ``ops.fp8_gemm`` vs ``torch._scaled_mm`` [>= 0.95x]
  and bf16 ``torch.mm``.
* ``linear``: fwd+bwd time of ``transformer_linear.Linear`` vs bf16
  ``nn.Linear`` [>= 1.5x faster at 8192^3] and torchao ``Float8Linear``
  when torchao is installed.

    python benchmarks/bench_gpu.py all
    python benchmarks/bench_gpu.py gemm --graph     # replay CUDA graphs: no host dispatch
    python benchmarks/bench_gpu.py quantize --sizes 8192x8192 16384x8192
    python benchmarks/bench_gpu.py gemm --shapes 8192x8192x8192 4096x14336x4096
    python benchmarks/bench_gpu.py linear --shapes 8192x8192x8192

Timing: ``--calls`` back-to-back calls between one pair of CUDA events, no
host sync in between, median of ``--repeats``; with ``--graph`` the calls are
captured once in a CUDA graph and the graph is replayed, so host dispatch
(argument checks, descriptor setup, allocations) is off the clock too.

Exits with a message when no GPU (or no CUDA build) is present.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch
from torch import nn

import transformer_linear
from transformer_linear import _C, _cuda_fallback, ops, reference

E4M3 = torch.float8_e4m3fn


def cuda_time(fn: Callable[[], object], calls: int = 20, repeats: int = 5, graph: bool = False) -> float:
    """Median seconds per call of ``fn`` on the current stream.

    Each sample is ``calls`` back-to-back calls between one pair of events
    (or one replay of a graph holding them), divided by ``calls``.
    """
    fn()  # warm-up: lazy initialisation, heuristic caches, allocator pools
    torch.cuda.synchronize()
    run: Callable[[], object]
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(calls):
                fn()
        run = captured.replay
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def parse_dims(text: str, count: int) -> tuple[int, ...]:
    dims = tuple(int(v) for v in text.lower().split("x"))
    if len(dims) != count:
        raise argparse.ArgumentTypeError(f"expected {count} sizes joined by 'x', got {text!r}")
    return dims


# ---------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------


def bench_quantize(sizes: list[tuple[int, int]], graph: bool) -> None:
    compiled_ref = torch.compile(reference.quantize)
    print(f"{'rows x cols (bf16)':>20} {'op':>32} {'GB/s':>8} {'vs memcpy':>10}")
    for rows, cols in sizes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([2.0], device="cuda")
        n = x.numel()
        copy_target = torch.empty_like(x)
        memcpy = 2 * 2 * n / cuda_time(lambda: copy_target.copy_(x), graph=graph)
        # Bytes each op must move at least: bf16 in (2 bytes, read twice by
        # current scaling: amax, then the cast), 1 byte per FP8 output element.
        # On CUDA quantize always records amax in its pass: one row covers
        # quantize and quantize_with_amax.
        cases = {
            "memcpy (bf16 -> bf16)": (lambda: copy_target.copy_(x), 4 * n),
            "quantize (+ amax, delayed)": (lambda: ops.quantize_with_amax(x, scale, E4M3), 3 * n),
            "quantize_current (2 reads)": (lambda: ops.quantize_current(x, E4M3), 5 * n),
            "cast+transpose": (lambda: ops.quantize_fused(x, E4M3, scale, columnwise=True), 4 * n),
            "cast+transpose+dbias": (
                lambda: ops.quantize_fused(x, E4M3, scale, columnwise=True, dbias_dtype=torch.bfloat16),
                4 * n,
            ),
            "compiled reference quantize": (lambda: compiled_ref(x, scale, E4M3), 3 * n),
        }
        for name, (fn, nbytes) in cases.items():
            # torch.compile'd code is not captured here (its own graphs): events only.
            gbps = nbytes / cuda_time(fn, graph=graph and "compiled" not in name)
            print(f"{f'{rows}x{cols}':>20} {name:>32} {gbps / 1e9:8.1f} {gbps / memcpy:9.0%}")


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------


def bench_gemm(shapes: list[tuple[int, int, int]], graph: bool) -> None:
    print(f"{'M x N x K':>20} {'fp8_gemm':>10} {'_scaled_mm':>11} {'bf16 mm':>9} {'vs _scaled_mm':>14}  (TFLOP/s)")
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda").to(E4M3)
        b = torch.randn(n, k, device="cuda").to(E4M3)
        sa = torch.tensor([1.0], device="cuda")
        sb = torch.tensor([1.0], device="cuda")
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        flops = 2.0 * m * n * k
        ours = flops / cuda_time(lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16), graph=graph)
        scaled = flops / cuda_time(
            lambda: torch._scaled_mm(a, b.t(), sa.reshape(()), sb.reshape(()), out_dtype=torch.bfloat16,
                                     use_fast_accum=True),
            graph=graph,
        )
        mm = flops / cuda_time(lambda: torch.mm(a16, b16.t()), graph=graph)
        print(f"{f'{m}x{n}x{k}':>20} {ours / 1e12:10.1f} {scaled / 1e12:11.1f} {mm / 1e12:9.1f} {ours / scaled:13.2f}x")


# ---------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        module(x).backward(grad)

    return step


def _float8_linear(layer: nn.Linear) -> Optional[nn.Module]:
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    return convert_to_float8_training(nn.Sequential(layer))


def bench_linear(shapes: list[tuple[int, int, int]]) -> None:
    linear_cls = getattr(transformer_linear, "Linear", None)
    print(f"{'M x N x K':>20} {'module':>28} {'ms':>8} {'speed-up vs bf16':>17}")
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bf16 = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        modules = {"bf16 nn.Linear": bf16}
        if linear_cls is not None:
            modules["transformer_linear.Linear"] = linear_cls(
                k, n, device="cuda", dtype=torch.bfloat16, recipe=transformer_linear.recipe.DelayedScaling()
            )
        ao = _float8_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
        if ao is not None:
            modules["torchao Float8Linear"] = ao
        base = None
        for name, module in modules.items():
            t = cuda_time(_fwd_bwd(module, x, grad), calls=5)
            base = base or t
            print(f"{f'{m}x{n}x{k}':>20} {name:>28} {t * 1e3:8.2f} {base / t:16.2f}x")
        if linear_cls is None:
            print("  (transformer_linear.Linear not in this build of the package)")
        if ao is None:
            print("  (torchao not installed: no Float8Linear baseline)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["quantize", "gemm", "linear", "all"])
    parser.add_argument("--sizes", nargs="+", type=lambda s: parse_dims(s, 2), default=[(8192, 8192), (16384, 8192)])
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=lambda s: parse_dims(s, 3),
        default=[(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096)],
    )
    parser.add_argument("--graph", action="store_true", help="replay CUDA graphs (quantize, gemm modes)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine; nothing to measure.", file=sys.stderr)
        return 1
    if not _C.built_with_cuda():
        print(f"bench_gpu: built without the CUDA kernels; build them: {_cuda_fallback.BUILD_HINT}", file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.mode in ("quantize", "all"):
        bench_quantize(args.sizes, args.graph)
    if args.mode in ("gemm", "all"):
        bench_gemm(args.shapes, args.graph)
    if args.mode in ("linear", "all"):
        bench_linear(args.shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
