"""The blocked CPU GEMMs' K passes (csrc/cpu/gemm_passes.h): each unit of work runs its passes in order
whichever thread takes it, so the bits do not depend on the thread count, also with more passes than the
ring of packed-B buffers holds (a unit may run ahead of others by less than that), several NC blocks, a
single block of A rows split across threads, and a busy process competing for the cores (threads then get
descheduled in the middle of a pass). One-thread results are checked against the reference by each
family's own tests; here every thread count must give those bits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from blockwise_cases import block_operands
from tolerances import assert_bitwise_equal

from transformer_linear import _C, ops
from transformer_linear.ops import nvfp4

E4M3 = torch.float8_e4m3fn
THREADS = (2, 3, 5)
# K of 11 passes of 256: more than the 4 packed-B buffers. N of two NC blocks (2048 columns on the AVX
# paths, 1024 on the portable one) and a ragged edge. The AMX path takes 2048 k a pass, so its ring is
# filled by the last shape's K (6 passes).
SHAPES = {
    "rows_in_many_blocks": (200, 2100, 2608),
    "one_block_of_rows": (5, 700, 2608),  # the threads split the B panels of one A block
    "k_of_many_amx_passes": (70, 300, 10304),
}


def _tensorwise(m, n, k):
    torch.manual_seed(0)
    a, a_scale_inv = ops.quantize(torch.randn(m, k), torch.tensor([8.0]), E4M3)
    b, b_scale_inv = ops.quantize(torch.randn(n, k), torch.tensor([16.0]), E4M3)
    return lambda: ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32)


def _blockwise(scaling):
    def make(m, n, k):
        torch.manual_seed(0)
        a, sa, b, sb = block_operands(m, n, k, E4M3, E4M3, scaling)
        return lambda: ops.fp8_gemm(a, sa, b, sb, torch.float32)

    return make


def _nvfp4(m, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    a, b = nvfp4.quantize_nvfp4(x, nvfp4.nvfp4_amax(x)), nvfp4.quantize_nvfp4(w, nvfp4.nvfp4_amax(w))
    return lambda: nvfp4.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale)


FAMILIES = {
    "tensorwise": _tensorwise,
    "1x128_x_128x128": _blockwise("1x128_x_128x128"),
    "1x32_x_1x32_e8m0": _blockwise("1x32_x_1x32_e8m0"),
    "nvfp4": _nvfp4,
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_thread_counts_give_the_same_bits(gemm_isa, family, shape, restore_torch_threads):
    gemm = FAMILIES[family](*SHAPES[shape])
    torch.set_num_threads(1)
    expected = gemm()
    for threads in THREADS:
        torch.set_num_threads(threads)
        assert_bitwise_equal(gemm(), expected, f"{family} {shape}, {threads} threads vs 1")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_busy_process_beside_the_threads_changes_no_bits(family, restore_torch_threads):
    gemm = FAMILIES[family](*SHAPES["rows_in_many_blocks"])
    torch.set_num_threads(1)
    expected = gemm()
    torch.set_num_threads(2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(3):
            assert_bitwise_equal(gemm(), expected, f"{family}, 2 threads beside a busy process vs 1 thread")
    finally:
        busy.kill()
        busy.wait()
