"""Pure-PyTorch definition of the grouped FP8 GEMMs (mixture-of-experts): the oracle of their kernels.

Each group's GEMM is the block-scaled GEMM of ``reference.fp8_gemm_blockwise`` on that group's rows
and weight, computed in float64; the kernels accumulate in float32 and are compared with this
under tests/tolerances.py. The layout conventions (``offs``, the scales of each operand, rows past
the last group) are described in ``transformer_linear.formats.grouped_scaling``. Unlike the kernels, the
oracle reads ``offs`` on the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear.formats.grouped_scaling import (
    check_grouped_gemm_args,
    check_grouped_wgrad_args,
    resolve_grouped_scalings,
)
from transformer_linear.reference import fp8_gemm_blockwise

__all__ = ["fp8_grouped_gemm", "fp8_grouped_gemm_wgrad", "group_bounds"]


def group_bounds(offs: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of each group's rows from the cumulative row ends ``offs``.

    Raises:
        ValueError: ``offs`` decreases, is negative, or passes ``total``.
    """
    ends = [int(v) for v in offs.tolist()]
    bounds, start = [], 0
    for g, end in enumerate(ends):
        if end < start:
            raise ValueError(f"offs must be non-decreasing and non-negative, got offs[{g}] = {end} after {start}")
        if end > total:
            raise ValueError(f"offs must not pass the {total} rows of the tokens, got offs[{g}] = {end}")
        bounds.append((start, end))
        start = end
    return bounds


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[rows of g] = block-scaled a[rows of g] @ b[g]ᵀ [+ bias[g]], in float64; rows past offs[-1] are 0.

    Args:
        a: FP8 (total_tokens, K), quantized once for all groups.
        a_scale_inv: a's scales (grouped_scaling's table), over all its rows.
        b: FP8 (G, N, K), one weight per group.
        b_scale_inv: b's scales, one set per group.
        offs: int32 (G,) cumulative row ends.
        out_dtype: the dtype of the result.
        bias: (G, N) or None.

    Returns:
        (total_tokens, N) of out_dtype.
    """
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, None, bias)
    scalings = resolve_grouped_scalings(a, a_scale_inv, b, b_scale_inv)
    total, k, n = a.shape[0], a.shape[1], b.shape[1]
    out = torch.zeros(total, n, dtype=torch.float64)
    for g, (start, end) in enumerate(group_bounds(offs, total)):
        if start == end or n == 0:
            continue
        if k == 0:  # an empty contraction: the bias alone
            out[start:end] = 0.0 if bias is None else bias[g].cpu().double()
            continue
        # a's per-row scales follow its rows; one tensorwise scale serves every group.
        sa = a_scale_inv if scalings.a_scaling == "TensorWise" else a_scale_inv[start:end]
        out[start:end] = fp8_gemm_blockwise(
            a[start:end].cpu(), sa.cpu(), b[g].cpu(), b_scale_inv[g].cpu(), torch.float64,
            None if bias is None else bias[g].cpu(),
        )
    return out.to(device=a.device, dtype=out_dtype)


def fp8_grouped_gemm_wgrad(
    grad: torch.Tensor,
    grad_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out[g] = grad[rows of g]ᵀ @ x[rows of g] * grad_scale_inv * x_scale_inv, in float64: the weight
    gradient of each group's (N, K) weight. The groups split the contraction (token) dimension; an
    empty group's gradient is 0. Tensorwise scales only.

    Args:
        grad: FP8 (total_tokens, N), the output gradient.
        grad_scale_inv: one float32 element.
        x: FP8 (total_tokens, K), the input.
        x_scale_inv: one float32 element.
        offs: int32 (G,) cumulative row ends.
        out_dtype: the dtype of the result.

    Returns:
        (G, N, K) of out_dtype.
    """
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, None)
    total, n, k = grad.shape[0], grad.shape[1], x.shape[1]
    bounds = group_bounds(offs, total)
    out = torch.zeros(len(bounds), n, k, dtype=torch.float64)
    scale = grad_scale_inv.double().cpu().reshape(()) * x_scale_inv.double().cpu().reshape(())
    for g, (start, end) in enumerate(bounds):
        out[g] = (grad[start:end].cpu().double().t() @ x[start:end].cpu().double()) * scale
    return out.to(device=x.device, dtype=out_dtype)
