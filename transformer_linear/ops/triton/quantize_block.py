"""Triton blockwise quantize: one scale per (bm, bk) block, the numerics of
reference.quantize_blockwise_ref bit for bit (1x128, 128x128, 1x32 E8M0, rowwise 1xK, any block).

One program quantizes a strip: TILE_M rows of 1-row blocks (each row its own
scale) or one block of bm > 1 rows, one block column wide. It reads the strip
twice (amax, then cast); the strip is small enough to stay in L2. The
columnwise copy is the same kernel run over x's transposed view.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

from transformer_linear.formats.block_scaling import (
    BlockQuantizeOutput,
    blockwise_outputs,
    check_quantize_blockwise_args,
    columnwise_block_shape,
)
from transformer_linear.formats.dtypes import E8M0_DTYPE, fp8_max
from transformer_linear.ops import library
from transformer_linear.ops.triton._fp8_bits import block_scales, e4m3_bits, e5m2_bits, saturate

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_launchable(op: str, tensors: dict[str, Optional[torch.Tensor]]) -> None:
    """Raise unless every tensor is where the Triton kernels run: on a GPU, or on the CPU under
    TRITON_INTERPRET=1. Fake and traced tensors pass (tracing launches no kernel).

    Raises:
        TypeError: naming the argument and its device.
    """
    for name, t in tensors.items():
        if t is None or is_fake(t):
            continue
        if not (t.device.type == "cuda" or (INTERPRETED and t.device.type == "cpu")):
            raise TypeError(f"{op}: argument '{name}' must be a CUDA tensor (a CPU one under TRITON_INTERPRET=1) "
                            f"for the Triton kernel, got one on {t.device}")


@triton.jit
def _load_float(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load as float32; bf16 arrives as int16 bits and is widened exactly by a shift
    (the interpreter's bf16 conversion flushes subnormals)."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0)
        return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _strip_amax(x_ptr, rows, cols_start, cols_end, stride_m, stride_k, M, K,
                PER_ROW: tl.constexpr, TILE_M: tl.constexpr, TILE_K: tl.constexpr, row_end,
                BF16_BITS: tl.constexpr):
    """(amax over finite values, non-finite flag) per row (PER_ROW) or of the whole strip."""
    amax = tl.zeros([TILE_M], dtype=tl.float32)
    bad = tl.zeros([TILE_M], dtype=tl.int32)
    for c0 in range(cols_start, cols_end, TILE_K):
        cols = c0 + tl.arange(0, TILE_K)
        mask = (rows[:, None] < row_end) & (cols[None, :] < cols_end)
        a = tl.abs(_load_float(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k, mask, BF16_BITS))
        finite = a < float("inf")  # False for inf and NaN
        amax = tl.maximum(amax, tl.max(tl.where(finite, a, 0.0), axis=1))
        bad = tl.maximum(bad, tl.max((~finite).to(tl.int32), axis=1))
    return amax, bad


@triton.jit
def _quantize_blockwise_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_sm, bm, bk, fp8_max,
    EMAX: tl.constexpr, PER_ROW: tl.constexpr, SCALE_KIND: tl.constexpr, E5M2: tl.constexpr,
    TILE_M: tl.constexpr, TILE_K: tl.constexpr, BF16_BITS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    col_start = pid_k * bk
    col_end = tl.minimum(col_start + bk, K)
    if PER_ROW:
        row_start = pid_m * TILE_M
        row_end = M
    else:
        row_start = pid_m * bm
        row_end = tl.minimum(row_start + bm, M)
    rows = row_start + tl.arange(0, TILE_M)
    if PER_ROW:
        amax, bad = _strip_amax(x_ptr, rows, col_start, col_end, stride_xm, stride_xk, M, K,
                                PER_ROW, TILE_M, TILE_K, row_end, BF16_BITS)
    else:
        amax = tl.zeros([TILE_M], dtype=tl.float32)
        bad = tl.zeros([TILE_M], dtype=tl.int32)
        for r0 in range(row_start, row_end, TILE_M):
            a, b = _strip_amax(x_ptr, r0 + tl.arange(0, TILE_M), col_start, col_end, stride_xm, stride_xk,
                               M, K, PER_ROW, TILE_M, TILE_K, row_end, BF16_BITS)
            amax = tl.maximum(amax, a)
            bad = tl.maximum(bad, b)
        amax = tl.zeros([TILE_M], dtype=tl.float32) + tl.max(amax, axis=0)
        bad = tl.zeros([TILE_M], dtype=tl.int32) + tl.max(bad, axis=0)
    scale, scale_inv = block_scales(amax, bad, fp8_max, EMAX, SCALE_KIND)
    if PER_ROW:
        tl.store(s_ptr + rows * stride_sm + pid_k, scale_inv, mask=rows < M)
    else:
        first = tl.arange(0, TILE_M) == 0
        tl.store(s_ptr + pid_m * stride_sm + pid_k + tl.arange(0, TILE_M) * 0, scale_inv, mask=first)
    if PER_ROW:
        loop_end = row_start + TILE_M
    else:
        loop_end = row_end
    for r0 in range(row_start, loop_end, TILE_M):
        r = r0 + tl.arange(0, TILE_M)
        for c0 in range(col_start, col_end, TILE_K):
            cols = c0 + tl.arange(0, TILE_K)
            mask = (r[:, None] < row_end) & (cols[None, :] < col_end)
            v = _load_float(x_ptr + r[:, None] * stride_xm + cols[None, :] * stride_xk, mask, BF16_BITS)
            y = saturate(v * scale[:, None], fp8_max)
            bits = e5m2_bits(y) if E5M2 else e4m3_bits(y)
            tl.store(q_ptr + r[:, None] * K + cols[None, :], bits, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tiles(bm: int, bk: int) -> tuple[int, int]:
    """(TILE_M, TILE_K): 32 one-row blocks or 32-row slices of a taller block, by up to 128 columns."""
    return (32 if bm == 1 else min(32, _next_pow2(bm))), min(128, _next_pow2(bk))


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block, dtype, scale_kind: int) -> None:
    m, k = x.shape
    bm, bk = min(block[0], max(m, 1)), min(block[1], max(k, 1))
    if m == 0 or k == 0:
        return
    per_row = bm == 1
    tile_m, tile_k = _tiles(bm, bk)
    grid = (triton.cdiv(m, tile_m) if per_row else triton.cdiv(m, bm), triton.cdiv(k, bk))
    limit = fp8_max(dtype)
    bf16 = x.dtype == torch.bfloat16
    wrap_triton(_quantize_blockwise_kernel)[grid](
        x.view(torch.int16) if bf16 else x, q.view(torch.uint8), s.view(torch.uint8) if s.dtype == E8M0_DTYPE else s,
        m, k, x.stride(0), x.stride(1), s.stride(0), bm, bk, limit,
        EMAX=15 if dtype == torch.float8_e5m2 else 8, PER_ROW=per_row, SCALE_KIND=scale_kind,
        E5M2=dtype == torch.float8_e5m2, TILE_M=tile_m, TILE_K=tile_k, BF16_BITS=bf16,
        num_warps=4,
    )


def quantize_blockwise_fused(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    e8m0_rounding: str = "ceil",
) -> BlockQuantizeOutput:
    """Same contract as ops.quantize_blockwise_fused; x may be a CUDA or (interpreter) CPU tensor."""
    block = check_quantize_blockwise_args(x, dtype, block_shape, scale_dtype, e8m0_rounding)
    return BlockQuantizeOutput(*_quantize_blockwise_op(
        x, dtype, list(block), scale_dtype, bool(power_2_scale), rowwise, columnwise, e8m0_rounding == "floor"
    ))


@library.triton_op("transformer_linear::triton_quantize_blockwise")
def _quantize_blockwise_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: list[int],
    scale_dtype: torch.dtype,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
    e8m0_floor: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_launchable("quantize_blockwise", {"x": x})
    block = (block_shape[0], block_shape[1])
    x = x.contiguous()
    if scale_dtype == E8M0_DTYPE:
        kind = 3 if e8m0_floor else 2
    else:
        kind = 1 if power_2_scale else 0
    q, s, q_t, s_t = blockwise_outputs(x, dtype, block, scale_dtype, rowwise, columnwise)
    if rowwise:
        _launch(x, q, s, block, dtype, kind)
    if columnwise:
        _launch(x.t(), q_t, s_t, columnwise_block_shape(block, *x.shape), dtype, kind)
    return q, s, q_t, s_t


def quantize_blockwise(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    e8m0_rounding: str = "ceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.quantize_blockwise: returns (q, scale_inv)."""
    out = quantize_blockwise_fused(x, dtype, block_shape, scale_dtype, power_2_scale, e8m0_rounding=e8m0_rounding)
    return out.data, out.scale_inv
