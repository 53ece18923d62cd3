"""Before/after of the CPU tensorwise current-scaling quantize: this tree's extension against another build.

Loads a second copy of the extension (``_C*.so`` of another commit, e.g. main's, copied aside before
rebuilding) next to this tree's and calls both kernels (``quantize`` with current scaling: the amax pass,
then the cast, with or without the transposed copy) on the same preallocated outputs, interleaved
round-robin with a memcpy of the input in one process, on one thread, timed with thread CPU time.
Outputs (q, q_t, scale_inv, amax) are compared bitwise. The op's output allocation is left out: this
measures the kernel.

    cp /work/main/transformer_linear/_C*.so /tmp/old_C.so   # before rebuilding
    TL_CPU_ISA=avx2 python benchmarks/ab_quantize_current.py /tmp/old_C.so

Columns: median ms of each build, the median of the per-round ratios old/new, and each build's
throughput as a share of memcpy's (bytes moved: the input plus the outputs, against twice the input
for the memcpy). ``--threads N`` (N > 1) runs the kernels (and torch's copy) on N threads and times
them by wall clock.

``--nvfp4`` times NVFP4's global amax (``nvfp4_amax``) and then the quantize of the rowwise copy with
it (``quantize_nvfp4`` into preallocated outputs), the pair current scaling runs; its byte count is the
input plus the packed data.

``--before`` sets what runs (untimed) before each timed call: ``write`` rewrites the input front to
back (as the op that produced it would have; default), ``flush`` writes a 64 MiB buffer (no input
in cache), ``none`` nothing (the input as the previous timed call left it).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from transformer_linear import _C as new_C
from transformer_linear.ops import _quantize_outputs, _scalar
from transformer_linear.ops import nvfp4 as nvfp4_ops
from transformer_linear.ops.descriptors import desc, stream_for

E4M3 = torch.float8_e4m3fn
SHAPES = [(2048, 4096), (4096, 4096), (8192, 4096)]


def thread_clock() -> float:
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


def load_extension(path: str):
    spec = importlib.util.spec_from_file_location("old_build._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_so", help="path of the other build's _C*.so")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", type=int, nargs="*", help="input rows (x 4096 columns); default 2048 4096 8192")
    parser.add_argument("--threads", type=int, default=1, help="threads (more than 1: wall clock, not thread CPU time)")
    parser.add_argument("--nvfp4", action="store_true", help="NVFP4's global amax + quantize instead")
    parser.add_argument("--before", choices=("write", "flush", "none"), default="write",
                        help="untimed step before each timed call (see above)")
    args = parser.parse_args()
    old_C = load_extension(args.old_so)
    torch.set_num_threads(args.threads)
    clock = thread_clock if args.threads == 1 else time.perf_counter
    shapes = [(r, 4096) for r in args.rows] if args.rows else SHAPES
    flush_buffer = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"before each call: {args.before}; {args.threads} thread(s)")
    print(f"{'shape':<11}{'dtype':<10}{'layouts':<9}{'old ms':>8}{'new ms':>8}{'old/new':>9}"
          f"{'old of memcpy':>15}{'new of memcpy':>15}  bitwise")
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape).to(dtype)
            x_src = x.clone()
            before = {"write": lambda x=x, x_src=x_src: x.copy_(x_src), "flush": lambda: flush_buffer.fill_(1),
                      "none": lambda: None}[args.before]
            copy_dst = torch.empty_like(x)
            for columnwise in (False,) if args.nvfp4 else (False, True):
                if args.nvfp4:
                    copies = nvfp4_ops._quantize_outputs(x, True, False)
                    outs = tuple(copies)

                    def call(ext, x=x, copies=copies):
                        nvfp4_ops._C = ext  # the module's extension, for both of its calls
                        try:
                            amax, _ = nvfp4_ops._amaxes(x, True, False)
                            nvfp4_ops._run_quantize_kernel("ab", x, amax, None, copies, True, False, False, False,
                                                           False, 0, 0)
                        finally:
                            nvfp4_ops._C = new_C
                else:
                    q, q_t, scale_inv, amax, _ = _quantize_outputs(x, E4M3, True, columnwise, None)
                    scale = _scalar(x)  # the kernel writes the scale here: it must outlive the call
                    outs = (q, q_t, scale_inv, amax)

                    def call(ext, x=x, q=q, q_t=q_t, scale=scale, scale_inv=scale_inv, amax=amax,
                             columnwise=columnwise):
                        ext.quantize(
                            desc(x, "ab", "input"), desc(scale, "ab", "scale"), desc(q, "ab", "output"),
                            desc(q_t, "ab", "output_t") if columnwise else None, desc(scale_inv, "ab", "scale_inv"),
                            desc(amax, "ab", "amax"), None, True, 0, stream_for(x),
                        )

                call(new_C)
                new_outs = [o.clone() for o in outs]
                call(old_C)
                same = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(outs, new_outs))
                fns = {"old": lambda: call(old_C), "new": lambda: call(new_C),
                       "memcpy": lambda x=x, dst=copy_dst: dst.copy_(x)}
                times: dict[str, list[float]] = {k: [] for k in fns}
                for fn in fns.values():
                    fn()
                for _ in range(args.repeats):
                    for k, fn in fns.items():
                        before()
                        start = clock()
                        fn()
                        times[k].append(clock() - start)
                med = {k: statistics.median(v) for k, v in times.items()}
                ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
                out_bytes = x.numel() // 2 if args.nvfp4 else x.numel() * (2 if columnwise else 1)
                nbytes = x.numel() * x.element_size() + out_bytes
                memcpy_gbs = 2 * x.numel() * x.element_size() / med["memcpy"]
                print(f"{'x'.join(map(str, shape)):<11}{str(dtype).removeprefix('torch.'):<10}"
                      f"{'nvfp4' if args.nvfp4 else 'row+col' if columnwise else 'row':<9}"
                      f"{med['old'] * 1e3:>8.2f}{med['new'] * 1e3:>8.2f}{ratio:>8.2f}x"
                      f"{nbytes / med['old'] / memcpy_gbs:>15.0%}{nbytes / med['new'] / memcpy_gbs:>15.0%}  {same}",
                      flush=True)


if __name__ == "__main__":
    main()
