"""Triton grouped FP8 GEMMs (mixture-of-experts): the forward GEMM and its weight gradient.

Forward: out[rows of g] = a[rows of g] @ b[g]ᵀ, block-scaled [+ bias[g]], with the per-K-block
promotion of ``fp8_gemm``. The groups are found on the device: the grid has one program per tile
of rows that any routing can need (ceil(total / BLOCK_M) + G: each group adds at most one partial
tile) and each program walks ``offs`` to find its group and rows; programs left over return. So
the launch never reads ``offs`` on the host. Weight gradient: one program per (group, N tile,
K tile) contracts that group's rows; the block-scaled form reads grouped columnwise copies and
promotes each chunk of BLOCK_R tokens (which divides the token block, and starts at a multiple of
it from the group's start) with its two scales. ``offs`` values are clamped into [previous end, total]:
invalid routings give wrong groups, never out-of-bounds accesses (the CPU op checks them).
Layouts and scalings: ``transformer_linear.formats.grouped_scaling``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.formats.grouped_scaling import (
    WHOLE,
    check_grouped_gemm_args,
    check_grouped_wgrad_args,
    check_grouped_wgrad_blockwise_args,
    resolve_grouped_scalings,
    token_scale_cols,
)
from transformer_linear.ops import library
from transformer_linear.ops.triton._fp8_bits import e8m0_to_float
from transformer_linear.ops.triton.quantize_block import INTERPRETED, _next_pow2, check_launchable

# A block spanning a whole dimension, as an int32 kernel argument: larger than any row or K index
# (rows are addressed by int32 offs).
_WHOLE_BLOCK = 2**31 - 1

_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
]


@triton.jit
def _scales(s_ptr, idx, block_rows, k_col, stride, valid, E8M0: tl.constexpr):
    """The scales of rows idx for the K-block column k_col (0 where not valid)."""
    ptrs = s_ptr + (idx // block_rows).to(tl.int64) * stride + k_col
    # One return: the compiler types every return statement of a function, even one a constexpr skips.
    if E8M0:
        scales = tl.where(valid, e8m0_to_float(tl.load(ptrs, mask=valid, other=127)), 0.0)
    else:
        scales = tl.load(ptrs, mask=valid, other=0.0)
    return scales


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, d_ptr, sa_ptr, sb_ptr, bias_ptr, offs_ptr, TOTAL, N, K, GROUPS,
    stride_sa, stride_sb_group, stride_sb, a_bm, a_bk, b_bn, b_bk, KB,
    HAS_BIAS: tl.constexpr, E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Find this program's group and rows: tiles are numbered group after group.
    zero = pid_m * 0
    start = zero
    tiles_before = zero
    group = zero - 1
    row0 = zero
    row_end = zero
    for g in range(0, GROUPS):
        end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), start), TOTAL)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (pid_m >= tiles_before) & (pid_m < tiles_before + tiles)
        group = tl.where(hit, g, group)
        row0 = tl.where(hit, start + (pid_m - tiles_before) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tiles_before += tiles
        start = end
    if group >= 0:
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < row_end
        col_ok = rn < N
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
        b_cols = b_ptr + group.to(tl.int64) * N * K + rn.to(tl.int64)[None, :] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g0 in range(0, K, KB):
            g_end = tl.minimum(g0 + KB, K)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(g0, g_end, BLOCK_K):
                k = k0 + rk
                a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < g_end), other=0.0)
                b = tl.load(b_cols + k[:, None], mask=(k[:, None] < g_end) & col_ok[None, :], other=0.0)
                part = tl.dot(a, b, part, out_dtype=tl.float32)
            sa = _scales(sa_ptr, rm, a_bm, g0 // a_bk, stride_sa, row_ok, E8M0)
            sb = _scales(sb_ptr + group.to(tl.int64) * stride_sb_group, rn, b_bn, g0 // b_bk, stride_sb, col_ok, E8M0)
            acc += part * (sa[:, None] * sb[None, :])
        if HAS_BIAS:
            acc += tl.load(bias_ptr + group * N + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(d_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(d_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    grad_ptr, x_ptr, d_ptr, sg_ptr, sx_ptr, offs_ptr, TOTAL, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    group = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + group - 1, mask=group > 0, other=0), 0), TOTAL)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + group), start), TOTAL)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        r = (r0 + rr).to(tl.int64)
        row_ok = r < end
        g_t = tl.load(grad_ptr + r[None, :] * N + rn[:, None], mask=row_ok[None, :] & (rn[:, None] < N), other=0.0)
        x = tl.load(x_ptr + r[:, None] * K + rk[None, :], mask=row_ok[:, None] & (rk[None, :] < K), other=0.0)
        acc = tl.dot(g_t, x, acc, out_dtype=tl.float32)
    acc *= tl.load(sg_ptr) * tl.load(sx_ptr)
    out = d_ptr + group.to(tl.int64) * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(out, acc.to(d_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


@triton.jit
def _grouped_wgrad_blockwise_kernel(
    grad_ptr, x_ptr, d_ptr, sg_ptr, sx_ptr, offs_ptr, TOTAL, N, K, SCALE_COLS, TOKEN_BLOCK,
    E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    group = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + group - 1, mask=group > 0, other=0), 0), TOTAL)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + group), start), TOTAL)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    n_ok = rn < N
    k_ok = rk < K
    col0 = start // TOKEN_BLOCK + group  # the group's first token block (TOKEN_BLOCK huge: the group's one scale)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        r = (r0 + rr).to(tl.int64)
        row_ok = r < end
        g = tl.load(grad_ptr + rn.to(tl.int64)[:, None] * TOTAL + r[None, :], mask=n_ok[:, None] & row_ok[None, :],
                    other=0.0)
        x_t = tl.load(x_ptr + r[:, None] + rk.to(tl.int64)[None, :] * TOTAL, mask=row_ok[:, None] & k_ok[None, :],
                      other=0.0)
        part = tl.dot(g, x_t, out_dtype=tl.float32)
        col = tl.minimum(col0 + (r0 - start) // TOKEN_BLOCK, SCALE_COLS - 1)
        sg = _scales(sg_ptr, rn, 1, col, SCALE_COLS, n_ok, E8M0)
        sx = _scales(sx_ptr, rk, 1, col, SCALE_COLS, k_ok, E8M0)
        acc += part * (sg[:, None] * sx[None, :])
    out = d_ptr + group.to(tl.int64) * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(out, acc.to(d_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


_autotuned = triton.autotune(configs=_GPU_CONFIGS, key=["N", "K", "GROUPS", "KB"])(_grouped_gemm_kernel)


def _kernel_block(size: int) -> int:
    return _WHOLE_BLOCK if size == WHOLE else size


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ops.grouped.fp8_grouped_gemm; CUDA or (interpreter) CPU tensors."""
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    scalings = resolve_grouped_scalings(a, a_scale_inv, b, b_scale_inv)
    return fp8_grouped_gemm_resolved(
        a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, scalings.a_block, scalings.b_block
    )


def fp8_grouped_gemm_resolved(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    a_block: tuple[int, int],
    b_block: tuple[int, int],
) -> torch.Tensor:
    """:func:`fp8_grouped_gemm` for operands already checked and blocks already resolved
    (grouped_scaling.resolve_grouped_scalings): what the grouped op runs on CUDA tensors."""
    return _grouped_gemm_op(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, list(a_block), list(b_block))


@library.triton_op("transformer_linear::triton_fp8_grouped_gemm")
def _grouped_gemm_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: list[int],
    b_block: list[int],
) -> torch.Tensor:
    check_launchable("fp8_grouped_gemm", {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv,
                                          "offs": offs, "bias": bias})
    (total, k), (groups, n, _) = a.shape, b.shape
    # Rows past the last group are zeros; the kernel writes every row of every group.
    d = torch.zeros((total, n), dtype=out_dtype, device=a.device)
    if total == 0 or n == 0 or groups == 0:
        return d
    a_bm, a_bk = (_kernel_block(s) for s in a_block)
    b_bn, b_bk = (_kernel_block(s) for s in b_block)
    kb = max(1, min(a_bk, b_bk, k))
    sa = a_scale_inv.reshape(1, 1) if a_block[0] == WHOLE else a_scale_inv.contiguous()
    sb = b_scale_inv.reshape(groups, 1, 1) if b_block[0] == WHOLE else b_scale_inv.contiguous()
    e8m0 = sa.dtype == E8M0_DTYPE
    if e8m0:
        sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
    args = (
        a.contiguous(), b.contiguous(), d, sa, sb, bias if bias is not None else d, offs.contiguous(),
        total, n, k, groups, sa.stride(0), sb.stride(0), sb.stride(1), a_bm, a_bk, b_bn, b_bk, kb,
    )
    block_k = min(128 if not INTERPRETED else 32, max(16, _next_pow2(kb)))
    if INTERPRETED:
        grid = (triton.cdiv(total, 16) + groups, triton.cdiv(n, 16))
        wrap_triton(_grouped_gemm_kernel)[grid](
            *args, HAS_BIAS=bias is not None, E8M0=e8m0, BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k
        )
    else:
        def grid(meta):
            return (triton.cdiv(total, meta["BLOCK_M"]) + groups, triton.cdiv(n, meta["BLOCK_N"]))

        wrap_triton(_autotuned)[grid](*args, HAS_BIAS=bias is not None, E8M0=e8m0, BLOCK_K=block_k)
    return d


@library.triton_op("transformer_linear::triton_fp8_grouped_gemm_wgrad")
def fp8_grouped_gemm_wgrad(
    grad: torch.Tensor,
    grad_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Same contract as ops.grouped.fp8_grouped_gemm_wgrad (tensorwise); CUDA or (interpreter) CPU tensors."""
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    check_launchable("fp8_grouped_gemm_wgrad", {"grad": grad, "grad_scale_inv": grad_scale_inv, "x": x,
                                                "x_scale_inv": x_scale_inv, "offs": offs})
    (total, n), k, groups = grad.shape, x.shape[1], offs.shape[0]
    d = torch.empty((groups, n, k), dtype=out_dtype, device=x.device)
    if d.numel() == 0:
        return d
    block = 16 if INTERPRETED else 64
    grid = (groups, triton.cdiv(n, block), triton.cdiv(k, block))
    wrap_triton(_grouped_wgrad_kernel)[grid](
        grad.contiguous(), x.contiguous(), d, grad_scale_inv.reshape(1).float(), x_scale_inv.reshape(1).float(),
        offs.contiguous(), total, n, k, BLOCK_N=block, BLOCK_K=block, BLOCK_R=32 if INTERPRETED else 64,
    )
    return d


@library.triton_op("transformer_linear::triton_fp8_grouped_gemm_wgrad_blockwise")
def fp8_grouped_gemm_wgrad_blockwise(
    grad_t: torch.Tensor,
    grad_t_scale_inv: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    token_block: int,
) -> torch.Tensor:
    """Same contract as ops.grouped.fp8_grouped_gemm_wgrad_blockwise; CUDA or (interpreter) CPU tensors."""
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block)
    check_launchable("fp8_grouped_gemm_wgrad_blockwise", {"grad_t": grad_t, "grad_t_scale_inv": grad_t_scale_inv,
                                                          "x_t": x_t, "x_t_scale_inv": x_t_scale_inv, "offs": offs})
    (n, total), k, groups = grad_t.shape, x_t.shape[0], offs.shape[0]
    d = torch.empty((groups, n, k), dtype=out_dtype, device=x_t.device)
    if d.numel() == 0:
        return d
    block = 16 if INTERPRETED else 64
    # A chunk of tokens must lie in one token block: 32 divides every block (and 16 <= 32 for tl.dot).
    chunk = 32 if INTERPRETED or token_block == 32 else 64
    e8m0 = grad_t_scale_inv.dtype == E8M0_DTYPE
    sg, sx = grad_t_scale_inv.contiguous(), x_t_scale_inv.contiguous()
    if e8m0:
        sg, sx = sg.view(torch.uint8), sx.view(torch.uint8)
    grid = (groups, triton.cdiv(n, block), triton.cdiv(k, block))
    wrap_triton(_grouped_wgrad_blockwise_kernel)[grid](
        grad_t.contiguous(), x_t.contiguous(), d, sg, sx, offs.contiguous(), total, n, k,
        token_scale_cols(total, groups, token_block), _kernel_block(token_block),
        E8M0=e8m0, BLOCK_N=block, BLOCK_K=block, BLOCK_R=chunk,
    )
    return d
