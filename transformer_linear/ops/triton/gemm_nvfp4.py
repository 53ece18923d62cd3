"""Triton NVFP4 GEMM: ``d = (a @ b.T) * (a_global_scale * b_global_scale) [+ bias]`` (reference.nvfp4.nvfp4_gemm).

The kernel reads the packed E2M1 bytes and the E4M3 block scales, decodes each code to its value and
multiplies it by its 16-element K block's scale in float32, and feeds the products to ``tl.dot`` as
bfloat16 with float32 accumulation. The conversion is exact: an E2M1 value (at most 2 significant
bits) times an E4M3 scale (at most 4) has at most 6 significant bits and lies within bfloat16's
range, so every tensor-core product is the exact product of the dequantized operands; only the
float32 accumulation order differs from the reference (within tests/tolerances.py). The global
scales and the bias are applied in the float32 epilogue.

``tl.dot_scaled`` is not used: its FP4 ("e2m1") operands take E8M0 scales per 32 elements (MXFP4),
which cannot express NVFP4's E4M3 scales per 16 elements.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from transformer_linear.formats.checks import check_hp_dtype
from transformer_linear.formats.nvfp4 import BLOCK
from transformer_linear.ops import library
from transformer_linear.ops.triton.quantize_block import INTERPRETED, check_launchable
from transformer_linear.ops.triton.quantize_nvfp4 import e2m1_to_float, e4m3_to_float

__all__ = ["nvfp4_gemm"]

_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
]


@triton.jit
def _decode_tile(data_ptr, scale_ptr, rows, k0, n_rows, K, BR: tl.constexpr, BK: tl.constexpr):
    """(BR, BK) float32 values e2m1 * block scale of rows ``rows`` and K columns [k0, k0 + BK) (0 outside)."""
    half = k0 // 2 + tl.arange(0, BK // 2)
    row_ok = rows[:, None] < n_rows
    packed = tl.load(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + half[None, :],
                     mask=row_ok & (half[None, :] < K // 2), other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BR, BK])
    kb = k0 // 16 + tl.arange(0, BK // 16)
    scale_bits = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * (K // 16) + kb[None, :],
                         mask=row_ok & (kb[None, :] < K // 16), other=0)
    values = tl.reshape(e2m1_to_float(codes), [BR, BK // 16, 16]) * e4m3_to_float(scale_bits)[:, :, None]
    return tl.reshape(values, [BR, BK])


@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr, sa_ptr, ga_ptr, b_ptr, sb_ptr, gb_ptr, bias_ptr, d_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _decode_tile(a_ptr, sa_ptr, rm, k0, M, K, BLOCK_M, BLOCK_K)
        b = _decode_tile(b_ptr, sb_ptr, rn, k0, N, K, BLOCK_N, BLOCK_K)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(b).to(DOT_DTYPE), acc, out_dtype=tl.float32)
    acc = acc * (tl.load(ga_ptr) * tl.load(gb_ptr))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(d_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_autotuned = triton.autotune(configs=_GPU_CONFIGS, key=["M", "N", "K"])(_nvfp4_gemm_kernel)


@library.triton_op("transformer_linear::triton_nvfp4_gemm")
def nvfp4_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_global_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_global_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The ``transformer_linear::nvfp4_gemm`` op for operands it checked: a (M, K/2) and b (N, K/2) uint8 (or
    float4_e2m1fn_x2), (rows, K/16) float8_e4m3fn scales, one-element float32 global decode scales;
    CUDA or (interpreter) CPU tensors."""
    check_hp_dtype("nvfp4_gemm", "out_dtype", out_dtype)
    check_launchable("nvfp4_gemm", {"a": a, "a_scale": a_scale, "a_global_scale": a_global_scale, "b": b,
                                    "b_scale": b_scale, "b_global_scale": b_global_scale, "bias": bias})
    a, b = a.view(torch.uint8).contiguous(), b.view(torch.uint8).contiguous()
    sa, sb = a_scale.view(torch.uint8).contiguous(), b_scale.view(torch.uint8).contiguous()
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    d = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return d
    if k == 0:
        d.zero_()
        return d if bias is None else d.add_(bias)
    ga, gb = a_global_scale.float().reshape(1), b_global_scale.float().reshape(1)
    args = (a, sa, ga, b, sb, gb, bias if bias is not None else d, d, m, n, k)
    if INTERPRETED:
        grid = (triton.cdiv(m, 16), triton.cdiv(n, 16))
        # The interpreter's bfloat16 tl.dot is wrong (numpy has no bfloat16); float32 holds the values exactly too.
        wrap_triton(_nvfp4_gemm_kernel)[grid](
            *args, HAS_BIAS=bias is not None, DOT_DTYPE=tl.float32, BLOCK_M=16, BLOCK_N=16, BLOCK_K=2 * BLOCK
        )
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        wrap_triton(_autotuned)[grid](*args, HAS_BIAS=bias is not None, DOT_DTYPE=tl.bfloat16)
    return d
