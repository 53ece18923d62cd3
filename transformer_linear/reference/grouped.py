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

from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.formats.grouped_scaling import (
    TOKEN_BLOCKS,
    WHOLE,
    check_grouped_gemm_args,
    check_grouped_wgrad_args,
    check_grouped_wgrad_blockwise_args,
    resolve_grouped_scalings,
    token_scale_cols,
)
from transformer_linear.reference import e8m0_to_float, fp8_gemm_blockwise, quantize_blockwise_ref

__all__ = [
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_wgrad",
    "fp8_grouped_gemm_wgrad_blockwise",
    "group_bounds",
    "quantize_grouped_columnwise",
]


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


def _token_blocks(start: int, end: int, group: int, token_block: int) -> tuple[int, int, int]:
    """(token block, first scale column, block count) of one group's tokens in a grouped columnwise copy."""
    rows = end - start
    if token_block == WHOLE:
        return max(rows, 1), group, 1
    return token_block, start // token_block + group, -(-rows // token_block)


def quantize_grouped_columnwise(
    x: torch.Tensor,
    offs: torch.Tensor,
    dtype: torch.dtype,
    token_block: int,
    power_2_scale: bool = False,
    e8m0_rounding: str = "ceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped columnwise copy of ``x`` (grouped_scaling's layout): each group's rows transposed
    and quantized as ``quantize_blockwise_ref`` does with (1, token_block) blocks (the whole group for
    WHOLE), the blocks starting at the group's first token.

    Args:
        x: (total, C) float32, bfloat16 or float16.
        offs: int32 (G,) cumulative row ends.
        dtype: the FP8 dtype.
        token_block: 128, 32 or WHOLE; its scale dtype is TOKEN_BLOCKS[token_block].
        power_2_scale: round float32 scales down to powers of two.
        e8m0_rounding: E8M0 scales' rounding.

    Returns:
        (data_t, scale_inv_t): (C, total) FP8, 0 for tokens past offs[-1]; (C, token_scale_cols) scales,
        1 where no block is.
    """
    total, cols = x.shape
    bounds = group_bounds(offs, total)
    scale_dtype = TOKEN_BLOCKS[token_block]
    data_t = torch.zeros(cols, total, dtype=dtype)
    scale_inv_t = torch.ones(cols, token_scale_cols(total, len(bounds), token_block)).to(scale_dtype)
    for g, (start, end) in enumerate(bounds):
        if start == end or cols == 0:
            continue
        block, col0, count = _token_blocks(start, end, g, token_block)
        q, s = quantize_blockwise_ref(
            x[start:end].cpu().t().contiguous(), dtype, (1, block), scale_dtype, power_2_scale, e8m0_rounding
        )
        data_t[:, start:end] = q
        scale_inv_t[:, col0 : col0 + count] = s
    return data_t.to(x.device), scale_inv_t.to(x.device)


def _dequantized_group(data_t, scale_inv_t, start, end, group, token_block) -> torch.Tensor:
    """float64 (C, rows of the group) of a grouped columnwise copy."""
    block, col0, count = _token_blocks(start, end, group, token_block)
    s = scale_inv_t[:, col0 : col0 + count].cpu()
    s = e8m0_to_float(s) if s.dtype == E8M0_DTYPE else s.float()
    full = s.double().repeat_interleave(block, 1)[:, : end - start]
    return data_t[:, start:end].cpu().double() * full


def fp8_grouped_gemm_wgrad_blockwise(
    grad_t: torch.Tensor,
    grad_t_scale_inv: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    token_block: int,
) -> torch.Tensor:
    """out[g] = dequantized grad_t[:, tokens of g] @ dequantized x_t[:, tokens of g]ᵀ, in float64: the
    block-scaled weight gradient, from grouped columnwise copies (grouped_scaling's layout).

    Args:
        grad_t: FP8 (N, total), grad_output's grouped columnwise copy.
        grad_t_scale_inv: (N, token_scale_cols) its scales.
        x_t: FP8 (K, total), the input's grouped columnwise copy.
        x_t_scale_inv: (K, token_scale_cols) its scales.
        offs: int32 (G,) cumulative row ends.
        out_dtype: the dtype of the result.
        token_block: 128, 32 or WHOLE, both copies'.

    Returns:
        (G, N, K) of out_dtype; an empty group's gradient is 0.
    """
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, None, token_block)
    (n, total), k = grad_t.shape, x_t.shape[0]
    bounds = group_bounds(offs, total)
    out = torch.zeros(len(bounds), n, k, dtype=torch.float64)
    for g, (start, end) in enumerate(bounds):
        if start == end:
            continue
        gd = _dequantized_group(grad_t, grad_t_scale_inv, start, end, g, token_block)
        xd = _dequantized_group(x_t, x_t_scale_inv, start, end, g, token_block)
        out[g] = gd @ xd.t()
    return out.to(device=x_t.device, dtype=out_dtype)
