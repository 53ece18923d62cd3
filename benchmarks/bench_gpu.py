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
* ``block-quantize``: GB/s of the Triton blockwise quantize per block shape
  (1x128, 128x128, 1x32 E8M0, rowwise), rowwise copy alone and with the
  columnwise copy, vs a device memcpy of the input.
* ``block-gemm``: TFLOP/s of the block-scaled GEMM per scaling pair
  (1x128 x 128x128, 1x128 x 1x128, MXFP8 1x32, rowwise): cuBLASLt's
  block-scaled matmul (where it runs on this GPU, scale relayout included),
  the Triton kernel, ``ops.fp8_gemm`` (the routed path), ``torch._scaled_mm``
  with the same scalings where torch has them, and bf16 ``torch.mm``.

    python benchmarks/bench_gpu.py all
    python benchmarks/bench_gpu.py gemm --graph     # replay CUDA graphs: no host dispatch
    python benchmarks/bench_gpu.py quantize --sizes 8192x8192 16384x8192
    python benchmarks/bench_gpu.py gemm --shapes 8192x8192x8192 4096x14336x4096
    python benchmarks/bench_gpu.py linear --shapes 8192x8192x8192
    python benchmarks/bench_gpu.py block-gemm --shapes 4096x4096x4096
    python benchmarks/bench_gpu.py block-gemm --dry-run   # the rows and the path each would take; no GPU needed

Timing: ``--calls`` back-to-back calls between one pair of CUDA events, no
host sync in between, median of ``--repeats``; with ``--graph`` the calls are
captured once in a CUDA graph and the graph is replayed, so host dispatch
(argument checks, descriptor setup, allocations) is off the clock too.

Exits with a message when no GPU (or no CUDA build) is present (``--dry-run``
lists what would be measured instead).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch
from torch import nn

import transformer_linear
from transformer_linear import _C, ops, reference
from transformer_linear.ops import gemm_block_cuda, torch_cuda

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


# ---------------------------------------------------------------------------
# Block-scaled recipes: Triton quantize, cuBLASLt / Triton GEMM
# ---------------------------------------------------------------------------

# name -> (block shape (None: the row), scale dtype)
BLOCK_QUANTIZE = {
    "1x128": ((1, 128), torch.float32),
    "128x128": ((128, 128), torch.float32),
    "1x32 e8m0": ((1, 32), torch.float8_e8m0fnu),
    "rowwise": ((1, None), torch.float32),
}
# name -> (a's quantize name, b's quantize name, a's ScalingType, b's ScalingType)
BLOCK_GEMMS = {
    "1x128 x 128x128": ("1x128", "128x128", "BlockWise1x128", "BlockWise128x128"),
    "1x128 x 1x128": ("1x128", "1x128", "BlockWise1x128", "BlockWise1x128"),
    "MXFP8 1x32": ("1x32 e8m0", "1x32 e8m0", "BlockWise1x32", "BlockWise1x32"),
    "rowwise": ("rowwise", "rowwise", "RowWise", "RowWise"),
}


def _block_quantize(x: torch.Tensor, name: str, columnwise: bool = False) -> ops.BlockQuantizeOutput:
    block, scale_dtype = BLOCK_QUANTIZE[name]
    return ops.quantize_blockwise_fused(
        x, E4M3, (block[0], block[1] or x.shape[1]), scale_dtype, power_2_scale=True, columnwise=columnwise
    )


def bench_block_quantize(sizes: list[tuple[int, int]], graph: bool) -> None:
    print(f"{'rows x cols (bf16)':>20} {'block':>10} {'copies':>20} {'GB/s':>8} {'vs memcpy':>10}")
    for rows, cols in sizes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        n = x.numel()
        copy_target = torch.empty_like(x)
        memcpy = 4 * n / cuda_time(lambda: copy_target.copy_(x), graph=graph)
        for name in BLOCK_QUANTIZE:
            # Bytes each must move at least: bf16 in, 1 byte per FP8 output element (scales are
            # 1/32 to 1/16384 of that and not counted).
            for copies, columnwise, nbytes in (("rowwise", False, 3 * n), ("rowwise+columnwise", True, 4 * n)):
                gbps = nbytes / cuda_time(lambda: _block_quantize(x, name, columnwise), graph=graph)
                print(f"{f'{rows}x{cols}':>20} {name:>10} {copies:>20} {gbps / 1e9:8.1f} {gbps / memcpy:9.0%}")


def _torch_scaled_mm(a, sa, b, sb, a_scaling: str, b_scaling: str) -> Optional[Callable[[], torch.Tensor]]:
    """torch._scaled_mm with the same scalings (scales in its layouts), or None where torch or this
    GPU lacks the pair."""
    m, n = a.shape[0], b.shape[0]
    if a_scaling == "RowWise":
        scale_a, scale_b = sa, sb.reshape(1, n)
    else:
        lt_a = gemm_block_cuda.cublaslt_scale(sa, a_scaling, m)
        lt_b = gemm_block_cuda.cublaslt_scale(sb, b_scaling, n)
        if a_scaling == "BlockWise1x32":
            scale_a, scale_b = lt_a.view(sa.dtype), lt_b.view(sb.dtype)
        else:
            scale_a = lt_a[:, :m].t() if a_scaling == "BlockWise1x128" else lt_a[:, : sa.shape[1]]
            scale_b = lt_b[:, :n] if b_scaling == "BlockWise1x128" else lt_b[:, : sb.shape[1]].t()

    def run() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

    try:
        run()
    except RuntimeError:
        return None
    return run


def bench_block_gemm(shapes: list[tuple[int, int, int]], graph: bool) -> None:
    from transformer_linear.ops.triton import fp8_gemm as triton_fp8_gemm  # triton: the optional 'cuda' extra

    print(f"{'M x N x K':>20} {'scaling':>16} {'cuBLASLt':>9} {'Triton':>7} {'fp8_gemm':>9} {'_scaled_mm':>11} "
          f"{'bf16 mm':>8}  (TFLOP/s; '-': not on this GPU / build)")
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        mm = flops / cuda_time(lambda: torch.mm(x, w.t()), graph=graph)
        for name, (qa, qb, a_scaling, b_scaling) in BLOCK_GEMMS.items():
            a, sa = _block_quantize(x, qa)[:2]
            b, sb = _block_quantize(w, qb)[:2]

            def cublaslt() -> Optional[torch.Tensor]:
                return gemm_block_cuda.fp8_gemm_cublaslt(a, sa, b, sb, torch.bfloat16, None, a_scaling, b_scaling)

            cells = {}
            cells["cuBLASLt"] = flops / cuda_time(cublaslt, graph=graph) if cublaslt() is not None else None
            cells["Triton"] = flops / cuda_time(lambda: triton_fp8_gemm(a, sa, b, sb, torch.bfloat16), graph=graph)
            cells["fp8_gemm"] = flops / cuda_time(lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16), graph=graph)
            theirs = _torch_scaled_mm(a, sa, b, sb, a_scaling, b_scaling)
            cells["_scaled_mm"] = flops / cuda_time(theirs, graph=graph) if theirs is not None else None
            row = " ".join(
                f"{'-' if v is None else f'{v / 1e12:.1f}':>{w}}"
                for v, w in zip(cells.values(), (9, 7, 9, 11))
            )
            print(f"{f'{m}x{n}x{k}':>20} {name:>16} {row} {mm / 1e12:8.1f}")


def dry_run(modes: list[str], sizes, shapes) -> None:
    """What would be measured, and the block GEMM path on an H100 and a B200 with this build."""
    info = _C.cuda_build_info()
    print(f"bench_gpu --dry-run: CUDA build info {info}")
    if "block-quantize" in modes:
        for rows, cols in sizes:
            print(f"  block-quantize {rows}x{cols}: {', '.join(BLOCK_QUANTIZE)} (rowwise; rowwise+columnwise)")
    if "block-gemm" in modes:
        for name, (_, _, a_scaling, b_scaling) in BLOCK_GEMMS.items():
            applies = {gpu: gemm_block_cuda.cublaslt_block_applies(a_scaling, b_scaling, cc, info)
                       for gpu, cc in (("sm_90", (9, 0)), ("sm_100", (10, 0)))}
            paths = [f"{gpu}: {'cuBLASLt' if lt else 'Triton'}" for gpu, lt in applies.items()]
            print(f"  block-gemm {name:>16} at {', '.join('x'.join(map(str, s)) for s in shapes)}: {'; '.join(paths)}")
    for mode in modes:
        if mode not in ("block-quantize", "block-gemm"):
            print(f"  {mode}: see --help (needs a GPU)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["quantize", "gemm", "linear", "block-quantize", "block-gemm", "all"])
    parser.add_argument("--sizes", nargs="+", type=lambda s: parse_dims(s, 2), default=[(8192, 8192), (16384, 8192)])
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=lambda s: parse_dims(s, 3),
        default=[(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096)],
    )
    parser.add_argument("--graph", action="store_true", help="replay CUDA graphs (quantize, gemm modes)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be measured; no GPU needed")
    args = parser.parse_args(argv)
    modes = ["quantize", "gemm", "linear", "block-quantize", "block-gemm"] if args.mode == "all" else [args.mode]
    if args.dry_run:
        dry_run(modes, args.sizes, args.shapes)
        return 0
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine; nothing to measure (--dry-run lists what would be).",
              file=sys.stderr)
        return 1
    if not _C.built_with_cuda():
        print(f"bench_gpu: built without the CUDA kernels; build them: {torch_cuda.BUILD_HINT}", file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.mode in ("quantize", "all"):
        bench_quantize(args.sizes, args.graph)
    if args.mode in ("gemm", "all"):
        bench_gemm(args.shapes, args.graph)
    if args.mode in ("linear", "all"):
        bench_linear(args.shapes)
    if args.mode in ("block-quantize", "all"):
        bench_block_quantize(args.sizes, args.graph)
    if args.mode in ("block-gemm", "all"):
        bench_block_gemm(args.shapes, args.graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
