"""Triton block-scaled FP8 GEMM with DeepGEMM-style promotion.

D = sum over K-blocks of (A_blk @ B_blk^T) * a_scale * b_scale [+ bias]: each
K-block's partial sum is accumulated by tl.dot (FP8 tensor cores, whose
internal accumulation is narrower than fp32 on Hopper) and then promoted into
an fp32 total with its two block scales. The K-block G is the smaller of the
operands' block widths (128 for Float8BlockScaling, 32 for MXFP8, K for
tensorwise/rowwise). Scalings follow ops.fp8_gemm_scalings.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from transformer_linear.formats.block_scaling import resolve_gemm_scalings
from transformer_linear.formats.checks import check_hp_dtype
from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.ops import library
from transformer_linear.ops.triton._fp8_bits import e8m0_to_float
from transformer_linear.ops.triton.quantize_block import INTERPRETED, _next_pow2, check_launchable

_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
]


@triton.jit
def _load_scales(s_ptr, idx, block_rows, k_col, stride, n, E8M0: tl.constexpr):
    """The scale of rows idx for the K-block column k_col (0 past n)."""
    ptrs = s_ptr + (idx // block_rows) * stride + k_col
    if E8M0:
        return tl.where(idx < n, e8m0_to_float(tl.load(ptrs, mask=idx < n, other=127)), 0.0)
    return tl.load(ptrs, mask=idx < n, other=0.0)


@triton.jit
def _fp8_gemm_block_kernel(
    a_ptr, b_ptr, d_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_dm,
    stride_sa, stride_sb, a_bm, a_bk, b_bn, b_bk, G,
    HAS_BIAS: tl.constexpr, E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, K, G):
        g_end = tl.minimum(g0 + G, K)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(g0, g_end, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (k[None, :] < g_end), other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(k[:, None] < g_end) & (rn[None, :] < N), other=0.0)
            part = tl.dot(a, b, part, out_dtype=tl.float32)
        sa = _load_scales(sa_ptr, rm, a_bm, g0 // a_bk, stride_sa, M, E8M0)
        sb = _load_scales(sb_ptr, rn, b_bn, g0 // b_bk, stride_sb, N, E8M0)
        acc += part * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(d_ptr + rm[:, None] * stride_dm + rn[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_autotuned = triton.autotune(configs=_GPU_CONFIGS, key=["M", "N", "K", "G"])(_fp8_gemm_block_kernel)


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ops.fp8_gemm (tensorwise and block scales); CUDA or (interpreter) CPU tensors."""
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    scalings = resolve_gemm_scalings(a, a_scale_inv, b, b_scale_inv)
    return fp8_gemm_resolved(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, scalings.a_block, scalings.b_block)


def fp8_gemm_resolved(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    a_block: tuple[int, int],
    b_block: tuple[int, int],
) -> torch.Tensor:
    """:func:`fp8_gemm` for operands already checked and blocks already resolved
    (block_scaling.resolve_gemm_scalings): what the block-GEMM ops run on CUDA tensors."""
    return _fp8_gemm_block_op(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, list(a_block), list(b_block))


@library.triton_op("transformer_linear::triton_fp8_gemm_block")
def _fp8_gemm_block_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: list[int],
    b_block: list[int],
) -> torch.Tensor:
    check_launchable("fp8_gemm", {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv,
                                  "bias": bias})
    (m, k), n = a.shape, b.shape[0]
    d = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return d
    if k == 0:
        d.zero_()
        return d if bias is None else d.add_(bias)
    g = max(1, min(a_block[1], b_block[1], k))
    e8m0 = a_scale_inv.dtype == E8M0_DTYPE
    sa = a_scale_inv.reshape(-(-m // a_block[0]), -(-k // a_block[1])).contiguous()
    sb = b_scale_inv.reshape(-(-n // b_block[0]), -(-k // b_block[1])).contiguous()
    if e8m0:
        sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
    args = (
        a, b, d, sa, sb, bias if bias is not None else d, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), d.stride(0),
        sa.stride(0), sb.stride(0), a_block[0], a_block[1], b_block[0], b_block[1], g,
    )
    block_k = min(128 if not INTERPRETED else 32, max(16, _next_pow2(g)))
    if INTERPRETED:
        grid = (triton.cdiv(m, 16), triton.cdiv(n, 16))
        wrap_triton(_fp8_gemm_block_kernel)[grid](
            *args, HAS_BIAS=bias is not None, E8M0=e8m0, BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k
        )
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        wrap_triton(_autotuned)[grid](*args, HAS_BIAS=bias is not None, E8M0=e8m0, BLOCK_K=block_k)
    return d
