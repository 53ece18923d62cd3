"""The dtypes the package's kernels read and write, and the FP8 formats' range.

The lowest layer: the ops, their backends (CPU, CUDA, Triton, the torch
fallback), the recipes and ``reference`` (which re-exports these names) all
import them from here.
"""

from __future__ import annotations

import torch

__all__ = ["E8M0_DTYPE", "FP8_DTYPES", "HIGH_PRECISION_DTYPES", "SCALE_DTYPES", "fp8_max"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E8M0_DTYPE = torch.float8_e8m0fnu
"""MX block scales: a biased power-of-two exponent per byte."""
SCALE_DTYPES = (torch.float32, E8M0_DTYPE)
"""The dtypes of block scales (scale_inv)."""


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2).

    Raises:
        TypeError: ``dtype`` is not an FP8 format.
    """
    if dtype not in FP8_DTYPES:
        raise TypeError(f"expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)
