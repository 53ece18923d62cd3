"""Before/after of the CPU tensorwise quantize kernels: this tree's extension against another build of it.

As ab_block_quantize.py for the one-pass quantize op (``_C.quantize``): loads a second copy of the
extension (``_C*.so`` of another commit, e.g. main's, copied aside before rebuilding) next to this
tree's and calls both on the same preallocated outputs, interleaved round-robin with a memcpy of the
input in one process, on one thread, timed with thread CPU time. Outputs are compared bitwise.

    TL_CPU_ISA=avx2 python benchmarks/ab_quantize.py /tmp/old/_C.cpython-311-x86_64-linux-gnu.so

Cases: the cast with a given scale and the fused amax (delayed scaling), current scaling (amax pass,
then the cast), and the cast with the transposed copy, for float32 and bfloat16 inputs.
"""

from __future__ import annotations

import argparse

import ab_builds
import torch

from transformer_linear import _C as new_C
from transformer_linear.ops import _quantize_outputs
from transformer_linear.ops.descriptors import desc, stream_for

# (name, current scaling, rowwise, columnwise)
CASES = [
    ("with_amax", False, True, False),
    ("current", True, True, False),
    ("cast+transpose", False, True, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_builds.add_arguments(parser)
    parser.add_argument("--rows", type=int, default=4096, help="input rows (x 4096 columns)")
    parser.add_argument("--fp8", choices=["e4m3", "e5m2", "both"], default="e4m3")
    args = parser.parse_args()
    old_C, clock = ab_builds.setup(args)
    fp8s = {"e4m3": [torch.float8_e4m3fn], "e5m2": [torch.float8_e5m2],
            "both": [torch.float8_e4m3fn, torch.float8_e5m2]}[args.fp8]
    print(f"{'case':<16}{'dtype':<10}{'fp8':<6}{ab_builds.HEADER}")
    for fp8 in fp8s:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(args.rows, 4096).to(dtype)
            copy_dst = torch.empty_like(x)
            scale = torch.tensor([3.7], dtype=torch.float32)
            for name, current, rowwise, columnwise in CASES:
                outs = _quantize_outputs(x, fp8, rowwise, columnwise, None)
                q, q_t, scale_inv, x_amax, _ = outs
                scale_arg = torch.empty(1, dtype=torch.float32) if current else scale

                def call(ext, x=x, q=q, q_t=q_t, scale_inv=scale_inv, x_amax=x_amax, scale_arg=scale_arg,
                         current=current, rowwise=rowwise, columnwise=columnwise):
                    ext.quantize(
                        desc(x, "ab", "input"), desc(scale_arg, "ab", "scale"),
                        desc(q, "ab", "output") if rowwise else None,
                        desc(q_t, "ab", "output_t") if columnwise else None,
                        desc(scale_inv, "ab", "scale_inv"), desc(x_amax, "ab", "amax"), None,
                        current, 0, stream_for(x),
                    )

                same = ab_builds.outputs_agree((q, q_t, scale_inv, x_amax), call, new_C, old_C)
                fns = {"old": lambda: call(old_C), "new": lambda: call(new_C),
                       "memcpy": lambda x=x, dst=copy_dst: dst.copy_(x)}
                times = ab_builds.time_interleaved(fns, args.repeats, clock)
                nbytes = x.numel() * x.element_size() + x.numel() * (int(rowwise) + int(columnwise))
                fp8_name = "e4m3" if fp8 == torch.float8_e4m3fn else "e5m2"
                print(f"{name:<16}{str(dtype).removeprefix('torch.'):<10}{fp8_name:<6}"
                      f"{ab_builds.ab_columns(times, x, nbytes, same)}", flush=True)

if __name__ == "__main__":
    main()
