"""Where the transposed GEMM operands of the backward come from: the one backend switch.

dgrad needs Wᵀ and wgrad needs xᵀ and grad_outputᵀ. The CPU GEMM takes
strided views, so the transposes are free ``.t()`` views of the row-major
FP8 data. cuBLASLt's FP8 GEMM wants both operands K-major, so on CUDA the
quantize pass also writes the transposed (columnwise) copy, and that copy is
what is kept for backward. High-precision tensors are always row-major.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from transformer_linear import ops
from transformer_linear.reference import FP8_DTYPES

__all__ = ["needs_columnwise", "quantize_tensorwise", "saved_form", "transposed"]


def needs_columnwise(device: torch.device) -> bool:
    """Whether quantize must also write the transposed copy on ``device``."""
    return device.type == "cuda"


def saved_form(rowwise: torch.Tensor, columnwise: torch.Tensor) -> torch.Tensor:
    """What to keep of a quantized 2-D tensor whose transpose a backward GEMM needs."""
    return columnwise if needs_columnwise(rowwise.device) else rowwise


def transposed(saved: torch.Tensor) -> torch.Tensor:
    """The 2-D transpose, as a GEMM operand, of what :func:`saved_form` kept."""
    if saved.dtype in FP8_DTYPES and needs_columnwise(saved.device):
        return saved
    return saved.t()


def quantize_tensorwise(
    x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], margin: int, **kwargs: Any
) -> ops.QuantizeOutput:
    """``ops.quantize_fused`` (``scale`` None: current scaling) with the transposed copy where the backend
    needs it."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=needs_columnwise(x.device), **kwargs)
