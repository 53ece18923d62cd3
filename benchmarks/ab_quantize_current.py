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

``--dbias`` also asks for the bias gradient (the input's column sums, in its dtype), as backward's
quantize of the output gradient does.

``--before`` sets what runs (untimed) before each timed call: ``write`` rewrites the input front to
back (as the op that produced it would have; default), ``flush`` writes a 64 MiB buffer (no input
in cache), ``none`` nothing (the input as the previous timed call left it).
"""

from __future__ import annotations

import argparse

import ab_builds
import torch

from transformer_linear import _C as new_C
from transformer_linear.ops import _quantize_outputs, _scalar
from transformer_linear.ops import nvfp4_quantize as nvfp4_ops
from transformer_linear.ops.descriptors import desc, stream_for

E4M3 = torch.float8_e4m3fn
SHAPES = [(2048, 4096), (4096, 4096), (8192, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_builds.add_arguments(parser)
    parser.add_argument("--rows", type=int, nargs="*", help="input rows (x 4096 columns); default 2048 4096 8192")
    parser.add_argument("--nvfp4", action="store_true", help="NVFP4's global amax + quantize instead")
    parser.add_argument("--dbias", action="store_true", help="also the bias gradient (column sums)")
    parser.add_argument("--before", choices=("write", "flush", "none"), default="write",
                        help="untimed step before each timed call (see above)")
    args = parser.parse_args()
    old_C, clock = ab_builds.setup(args)
    shapes = [(r, 4096) for r in args.rows] if args.rows else SHAPES
    flush_buffer = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"before each call: {args.before}; {args.threads} thread(s); bias gradient: {args.dbias}")
    print(f"{'shape':<11}{'dtype':<10}{'layouts':<9}{ab_builds.HEADER}")
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
                    dbias_dtype = dtype if args.dbias else None
                    q, q_t, scale_inv, amax, dbias = _quantize_outputs(x, E4M3, True, columnwise, dbias_dtype)
                    scale = _scalar(x)  # the kernel writes the scale here: it must outlive the call
                    outs = (q, q_t, scale_inv, amax, dbias)

                    def call(ext, x=x, q=q, q_t=q_t, scale=scale, scale_inv=scale_inv, amax=amax, dbias=dbias,
                             columnwise=columnwise):
                        ext.quantize(
                            desc(x, "ab", "input"), desc(scale, "ab", "scale"), desc(q, "ab", "output"),
                            desc(q_t, "ab", "output_t") if columnwise else None, desc(scale_inv, "ab", "scale_inv"),
                            desc(amax, "ab", "amax"), desc(dbias, "ab", "dbias") if args.dbias else None, True, 0,
                            stream_for(x),
                        )

                same = ab_builds.outputs_agree(outs, call, new_C, old_C)
                fns = {"old": lambda: call(old_C), "new": lambda: call(new_C),
                       "memcpy": lambda x=x, dst=copy_dst: dst.copy_(x)}
                times = ab_builds.time_interleaved(fns, args.repeats, clock, before)
                out_bytes = x.numel() // 2 if args.nvfp4 else x.numel() * (2 if columnwise else 1)
                nbytes = x.numel() * x.element_size() + out_bytes
                print(f"{'x'.join(map(str, shape)):<11}{str(dtype).removeprefix('torch.'):<10}"
                      f"{'nvfp4' if args.nvfp4 else 'row+col' if columnwise else 'row':<9}"
                      f"{ab_builds.ab_columns(times, x, nbytes, same)}", flush=True)

if __name__ == "__main__":
    main()
