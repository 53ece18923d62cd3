"""Amax and cast passes over inputs of many chunks, on several threads, held bitwise to the reference.

The CPU quantize of current scaling cuts its input into chunks (elements for the row-major cast, whole
rows for the cast + transpose; at most 2 MiB of input, about four per thread) that the threads claim
one at a time: the amax pass from the end, walking each chunk backward (so that it starts on the end of
a tensor just written), the cast that follows from the start (which is then in cache). NVFP4's global
amaxes claim groups of rows (or 16-row bands) from the end alike. These cases hold the results
to transformer_linear.reference where the largest magnitude (or a NaN) sits at chunk and thread
boundaries, for inputs whose length is a multiple of neither, on each CPU path, and with a busy process
competing for the cores (which changes which thread claims which chunk).
"""

from __future__ import annotations

import math
import subprocess
import sys

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
CHUNK_BYTES = 2 << 20  # the largest chunk of input (kChunkBytes in csrc/cpu/quantize_cpu.cpp)
GRAIN = 1 << 16  # the fewest elements of a chunk (kGrain there)
SHAPE = (1000, 3001)  # 3,001,000 elements: several chunks of every input dtype, rows of no round length


@pytest.fixture(params=QUANTIZE_ISAS)
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def claimed_chunk(n: int, threads: int, grain: int, max_chunk: int) -> int:
    """Items per chunk that the threads claim (claim_chunk in csrc/cpu/parallel.h)."""
    parts = 1 if threads <= 1 else threads * 4
    return max(1, grain, min(max_chunk, -(-n // parts)))


def boundary_positions(n: int, element_size: int, threads: int) -> list[int]:
    """Flat indices at the edges of the claimed chunks (element and row cuts), of the amax pass's 2 MiB
    pieces within them, and of an even split among threads."""
    rows, cols = SHAPE
    # chunking() in csrc/cpu/quantize_cpu.cpp: elements (whole cache lines), or whole rows.
    flat_chunk = -(-claimed_chunk(n, threads, GRAIN, max(GRAIN, CHUNK_BYTES // element_size)) // 64) * 64
    row_grain = max(64, GRAIN // cols)
    row_chunk = claimed_chunk(rows, threads, row_grain, max(row_grain, CHUNK_BYTES // (cols * element_size))) * cols
    piece = CHUNK_BYTES // element_size
    part = -(-n // threads)
    edges = {0, n - 1, piece - 1, piece, 2 * piece + 1, part - 1, part}
    for chunk in (flat_chunk, row_chunk):
        edges |= {chunk - 1, chunk, 2 * chunk - 1, 2 * chunk, n - n % chunk - 1, n - n % chunk}
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
    for i, pos in enumerate(boundary_positions(base.numel(), base.element_size(), threads)):
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
    for pos in boundary_positions(n, base.element_size(), threads):
        x = base.clone()
        x.view(-1)[pos] = math.nan
        x.view(-1)[(pos + n // 2) % n] = 1e4  # a larger finite value elsewhere must not hide the NaN
        check_current(x, f"{in_dtype} threads={threads} NaN at {pos}")
        assert torch.isnan(ops.amax(x)), f"amax op: NaN at {pos} lost"


def test_a_busy_process_beside_the_threads_changes_no_bits(restore_torch_threads):
    torch.set_num_threads(2)
    base = torch.rand(SHAPE) * 2 - 1
    positions = boundary_positions(base.numel(), base.element_size(), 2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i, pos in enumerate(positions):
            x = base.clone()
            x.view(-1)[pos] = -37.0 - i
            check_current(x, f"2 threads beside a busy process, max at {pos}")
    finally:
        busy.kill()
        busy.wait()


NVFP4_SHAPE = (1040, 2049)  # 65 bands of 16 rows; rows of 8,196 bytes in float32: chunks of 240 rows


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_amaxes_at_chunk_and_thread_edges(isa, in_dtype, threads, restore_torch_threads):
    torch.set_num_threads(threads)
    base = (torch.rand(NVFP4_SHAPE) * 2 - 1).to(in_dtype)
    m, k = NVFP4_SHAPE
    chunk_rows = max(16, CHUNK_BYTES // (k * base.element_size()) // 16 * 16)
    # The groups of rows (and of 16-row bands) that the threads claim from the end.
    group_rows = claimed_chunk(m, threads, 16, chunk_rows)
    group_bands = 16 * claimed_chunk(-(-m // 16), threads, 1, chunk_rows // 16)
    rows = {0, m - 1, chunk_rows - 1, chunk_rows}
    for group in (group_rows, group_bands):
        rows |= {group - 1, group, m - m % group - 1, m - m % group}
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
