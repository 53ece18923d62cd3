"""Amax passes over inputs of many chunks, on several threads, held bitwise to the reference.

The CPU amax pass of current scaling splits the input among threads as the cast that follows does
(elements for the row-major cast, whole rows for the cast + transpose) and walks each thread's part
backward in chunks of 2 MiB of input (so that it starts on the end of a tensor just written, and the
cast, which reads forward, starts on what is still in cache); NVFP4's global amaxes walk rows (or
16-row bands) backward alike. These cases hold the results to transformer_linear.reference where the
largest magnitude (or a NaN) sits at chunk and thread boundaries, for inputs whose length is a
multiple of neither, on each CPU path.
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_paths import QUANTIZE_ISAS
from tolerances import assert_bitwise_equal

from transformer_linear import _C, ops
from transformer_linear import reference as ref
from transformer_linear.ops import nvfp4 as nvfp4_ops
from transformer_linear.ops import nvfp4_quantize
from transformer_linear.reference import nvfp4 as nvfp4_ref

E4M3 = torch.float8_e4m3fn
CHUNK_BYTES = 2 << 20  # the amax pass's chunk of input (kAmaxChunkBytes in csrc/cpu/quantize_cpu.cpp)
SHAPE = (1000, 3001)  # 3,001,000 elements: several chunks of every input dtype, rows of no round length


@pytest.fixture(params=QUANTIZE_ISAS)
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def boundary_positions(n: int, chunk: int, threads: int) -> list[int]:
    """Flat indices at the edges of chunks and of the threads' parts (element and row splits)."""
    part = -(-n // threads)
    row_part = -(-SHAPE[0] // threads) * SHAPE[1]
    edges = {0, n - 1, chunk - 1, chunk, 2 * chunk + 1, part - 1, part, row_part - 1, row_part}
    return sorted(i for i in edges if 0 <= i < n)


def check_current(x: torch.Tensor, what: str) -> None:
    q_ref, scale_inv_ref, amax_ref = ref.quantize_current(x, E4M3, 0)
    for columnwise in (False, True):
        out = ops.quantize_fused(x, E4M3, None, columnwise=columnwise)
        where = f"{what} columnwise={columnwise}"
        assert_bitwise_equal(out.data, q_ref, f"{where} data")
        assert_bitwise_equal(out.scale_inv, scale_inv_ref, f"{where} scale_inv", any_nan=True)
        assert_bitwise_equal(out.amax, amax_ref, f"{where} amax", any_nan=True)
        if columnwise:
            assert_bitwise_equal(out.data_t, ref.transpose_2d(q_ref), f"{where} data_t")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_largest_magnitude_at_chunk_and_thread_edges(isa, in_dtype, threads, restore_torch_threads):
    torch.set_num_threads(threads)
    base = (torch.rand(SHAPE) * 2 - 1).to(in_dtype)
    n = base.numel()
    chunk = CHUNK_BYTES // base.element_size()
    for i, pos in enumerate(boundary_positions(n, chunk, threads)):
        x = base.clone()
        x.view(-1)[pos] = -37.0 - i  # the largest magnitude, once, and negative
        check_current(x, f"{in_dtype} threads={threads} max at {pos}")
        assert ops.amax(x).item() == 37.0 + i, f"amax op: max at {pos} lost"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_nan_at_chunk_and_thread_edges(isa, in_dtype, threads, restore_torch_threads):
    torch.set_num_threads(threads)
    base = (torch.rand(SHAPE) * 2 - 1).to(in_dtype)
    n = base.numel()
    chunk = CHUNK_BYTES // base.element_size()
    for pos in boundary_positions(n, chunk, threads):
        x = base.clone()
        x.view(-1)[pos] = math.nan
        x.view(-1)[(pos + n // 2) % n] = 1e4  # a larger finite value elsewhere must not hide the NaN
        check_current(x, f"{in_dtype} threads={threads} NaN at {pos}")
        assert torch.isnan(ops.amax(x)), f"amax op: NaN at {pos} lost"


NVFP4_SHAPE = (1040, 2049)  # 65 bands of 16 rows; rows of 8,196 bytes in float32: chunks of 240 rows


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_amaxes_at_chunk_and_thread_edges(isa, in_dtype, threads, restore_torch_threads):
    torch.set_num_threads(threads)
    base = (torch.rand(NVFP4_SHAPE) * 2 - 1).to(in_dtype)
    m, k = NVFP4_SHAPE
    chunk_rows = max(16, CHUNK_BYTES // (k * base.element_size()) // 16 * 16)
    part_rows = -(-m // threads)
    part_bands = -(-(m // 16) // threads) * 16
    rows = {0, m - 1, chunk_rows - 1, chunk_rows, part_rows - 1, part_rows, part_bands - 1, part_bands}
    for i, r in enumerate(sorted(r for r in rows if 0 <= r < m)):
        x = base.clone()
        x[r, (r * 7) % k] = -37.0 - i
        amax = x.float().abs().amax()
        amax_rht = nvfp4_ref.hadamard_transform(x.t()).abs().amax()
        assert_bitwise_equal(nvfp4_ops.nvfp4_amax(x), amax, f"amax, max in row {r}")
        assert_bitwise_equal(nvfp4_ops.nvfp4_amax(x, rht=True), amax_rht, f"rht amax, max in row {r}")
        both = nvfp4_quantize._amaxes(x, True, True)
        assert_bitwise_equal(both[0], amax, f"fused amax, max in row {r}")
        assert_bitwise_equal(both[1], amax_rht, f"fused rht amax, max in row {r}")
