"""GEMM operand layouts: where the backward's transposed operands come from, and what FP8 tensor cores take.

dgrad needs Wᵀ and wgrad needs xᵀ and grad_outputᵀ. The CPU GEMM takes
strided views, so the transposes are free ``.t()`` views of the row-major
FP8 data. cuBLASLt's FP8 GEMM wants both operands K-major
(:func:`fp8_tensor_cores_take`), so on CUDA the quantize pass also writes the
transposed (columnwise) copy, and that copy is what is kept for backward.
High-precision tensors are always row-major.
"""

from __future__ import annotations

import torch

from transformer_linear.formats.dtypes import FP8_DTYPES

__all__ = ["fp8_tensor_cores_take", "needs_columnwise", "saved_form", "transposed", "transposed_copy"]


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


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` with its last two dimensions swapped, by torch's strided copy (standard
    strides also for a dimension of size 1; a stack: each matrix transposed)."""
    return t.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def fp8_tensor_cores_take(a: torch.Tensor, b: torch.Tensor, *, aligned: bool) -> bool:
    """Whether FP8 tensor cores (cuBLASLt, torch._scaled_mm) take D = a @ b.T as the operands are laid out.

    The rule, the Python side of csrc/cuda/cublaslt_utils.h's: both operands K-major (row-major
    ``a`` (M, K) and ``b`` (N, K)), K and N multiples of 16 (M is free), not e5m2 x e5m2.

    Args:
        a: FP8 (M, K).
        b: FP8 (N, K).
        aligned: also require what cuBLASLt needs of operands it reads in place: leading
            dimensions and addresses multiples of 16 (torch._scaled_mm copies where they are not).
    """
    (_, k), n = a.shape, b.shape[0]
    both_e5m2 = a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2
    k_major = a.stride(-1) == 1 and b.stride(-1) == 1
    if both_e5m2 or not k_major or k % 16 != 0 or n % 16 != 0:
        return False
    return not aligned or all(t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))
