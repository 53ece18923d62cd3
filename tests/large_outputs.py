"""Outputs large enough for the CPU GEMMs' streamed epilogue, for the tests of each GEMM."""

from __future__ import annotations

import torch

# The CPU GEMMs write outputs of this many bytes or more with non-temporal stores where the path does
# (kStreamOutputBytes, csrc/cpu/gemm_cpu.h: the AMX path).
STREAMED_OUTPUT_BYTES = 8 << 20


def large_output_rows(n: int, out_dtype: torch.dtype) -> int:
    """Rows of an (M, n) output of out_dtype just over STREAMED_OUTPUT_BYTES."""
    return STREAMED_OUTPUT_BYTES // (n * torch.empty((), dtype=out_dtype).element_size()) + 7
