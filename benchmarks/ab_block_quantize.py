"""Before/after of the CPU blockwise quantize kernel: this tree's extension against another build of it.

Loads a second copy of the extension (``_C*.so`` of another commit, e.g. main's, copied aside before
rebuilding) next to this tree's and calls both kernels on the same preallocated outputs, interleaved
round-robin with a memcpy of the input in one process, on one thread, timed with thread CPU time.
Outputs are compared bitwise. The op's output allocation (and its page faults) is left out: this
measures the kernel.

    TL_CPU_ISA=avx2 python benchmarks/ab_block_quantize.py /tmp/old/_C.cpython-311-x86_64-linux-gnu.so

``--threads N`` (N > 1) runs the kernels (and torch's copy) on N threads and times them by wall clock.
"""

from __future__ import annotations

import argparse

import ab_builds
import torch

from transformer_linear import _C as new_C
from transformer_linear.formats.block_scaling import columnwise_block_shape
from transformer_linear.ops import block as blk
from transformer_linear.ops.descriptors import desc, stream_for

E4M3 = torch.float8_e4m3fn
# (name, block, scale dtype, power-of-two scales): as bench_kernels.BLOCK_QUANTIZE_CASES.
CASES = [
    ("1x128", (1, 128), torch.float32, True),
    ("128x128", (128, 128), torch.float32, True),
    ("1x32 e8m0", (1, 32), torch.float8_e8m0fnu, False),
    ("rowwise", (1, 4096), torch.float32, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_builds.add_arguments(parser)
    parser.add_argument("--rows", type=int, default=4096, help="input rows (x 4096 columns)")
    args = parser.parse_args()
    old_C, clock = ab_builds.setup(args)
    print(f"{'block':<10}{'dtype':<10}{'layouts':<9}{ab_builds.HEADER}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.rows, 4096).to(dtype)
        copy_dst = torch.empty_like(x)
        for name, block, scale_dtype, power_2 in CASES:
            for columnwise in (False, True):
                outs = blk.blockwise_outputs(x, E4M3, list(block), scale_dtype, True, columnwise)
                q, s, q_t, s_t = outs
                block_t = columnwise_block_shape(tuple(block), *x.shape)

                def call(ext, x=x, q=q, s=s, q_t=q_t, s_t=s_t, block=block, block_t=block_t,
                         columnwise=columnwise, power_2=power_2):
                    ext.quantize_blockwise(
                        desc(x, "ab", "x"), desc(q, "ab", "output"), desc(blk._kernel_scale(s), "ab", "scale_inv"),
                        desc(q_t, "ab", "output_t") if columnwise else None,
                        desc(blk._kernel_scale(s_t), "ab", "scale_inv_t") if columnwise else None,
                        block[0], block[1], block_t[0], block_t[1], power_2, False, stream_for(x),
                    )

                same = ab_builds.outputs_agree(outs, call, new_C, old_C)
                fns = {"old": lambda: call(old_C), "new": lambda: call(new_C),
                       "memcpy": lambda x=x, dst=copy_dst: dst.copy_(x)}
                times = ab_builds.time_interleaved(fns, args.repeats, clock)
                nbytes = x.numel() * x.element_size() + x.numel() * (2 if columnwise else 1)
                print(f"{name:<10}{str(dtype).removeprefix('torch.'):<10}{'row+col' if columnwise else 'row':<9}"
                      f"{ab_builds.ab_columns(times, x, nbytes, same)}", flush=True)

if __name__ == "__main__":
    main()
