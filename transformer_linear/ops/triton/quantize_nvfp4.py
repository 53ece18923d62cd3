"""Triton NVFP4 quantize: reference/nvfp4.py's quantize_nvfp4 bit for bit (1x16 and 16x16 blocks,
E4M3 block scales, the float32 global scale, the random Hadamard transform, stochastic rounding).

One program quantizes a tile of 16 rows by ``TILE_B`` 16-element blocks of the copy it writes (x for
the rowwise copy, x's transposed view for the columnwise one). Every step is the reference's float32
operation in the same order: the RHT as the same four-stage butterfly, the block scale's E4M3 cast and
E2M1 rounding as integer/threshold rules (no ``.to(float8)``, so the interpreter and the GPU round
alike), the encode factor's division as ``div_rn``, the stochastic-rounding bits from the same
Philox4x32-10 counters (``triton.language.random.philox_impl`` is that generator), compared in float64
as the reference does. The global scales are computed by torch on the device (a few scalar ops).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.language.random import philox_impl

from transformer_linear.formats.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, RHT_SIGNS, check_quantize_shape
from transformer_linear.ops import library
from transformer_linear.ops.triton._fp8_bits import FLOAT_MAX, e4m3_bits
from transformer_linear.ops.triton.quantize_block import INTERPRETED, check_launchable

__all__ = ["quantize_nvfp4"]

_RHT_NEGATIVE = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)
"""Bit i set where the RHT sign vector's element i is -1."""
_MASK32 = 0xFFFFFFFF


@triton.jit
def _load_float(ptrs, mask, BF16_BITS: tl.constexpr):
    """float32 of x; bf16 arrives as int16 bits, widened exactly by a shift."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0)
        return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _butterfly_stage(v, H: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """(a, b) -> (a + b, a - b) on the pairs H apart within each group of 2H columns."""
    pairs = tl.permute(tl.reshape(v, [R * C // (2 * H), 2, H]), (0, 2, 1))
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [R, C])


@triton.jit
def _rht(v, cols, R: tl.constexpr, C: tl.constexpr, NEG: tl.constexpr):
    """formats.nvfp4.hadamard_transform of each 16-column block: signs, four butterfly stages, * 0.25."""
    negative = ((NEG >> (cols % 16)) & 1) != 0
    v = v * tl.where(negative, -1.0, 1.0)[None, :]
    v = _butterfly_stage(v, 1, R, C)
    v = _butterfly_stage(v, 2, R, C)
    v = _butterfly_stage(v, 4, R, C)
    v = _butterfly_stage(v, 8, R, C)
    return v * 0.25


@triton.jit
def e4m3_to_float(bits):
    """float32 value of float8_e4m3fn bits (uint8); 0x7f / 0xff are NaN."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_to_float(code):
    """float32 value of E2M1 codes (int32, 0-15): bit 3 the sign, bits 0-2 the magnitude's index."""
    m = code & 7
    e = m >> 1
    normal = ((e + 126) << 23) | ((m & 1) << 22)
    bits = tl.where(m >= 2, normal, tl.where(m == 1, 0x3F000000, 0)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_rne(a):
    """Nearest-even E2M1 magnitude index of |v| (NaN gives 0; the caller fixes it)."""
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))


@triton.jit
def _e2m1_sr(a, rbits):
    """Stochastic E2M1 magnitude index: up from the lower neighbour iff frac * 2^32 > rbits (float64)."""
    lo_code = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
               + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
               + (a >= 6.0).to(tl.int32))
    hi_code = tl.minimum(lo_code + 1, 7)
    lo = e2m1_to_float(lo_code)
    gap = e2m1_to_float(hi_code) - lo  # 0.5, 1 or 2 (0 at the top): dividing by it is exact as a product
    inv_gap = tl.where(gap == 0.5, 2.0, tl.where(gap == 1.0, 1.0, 0.5))  # no fp32 division (approximate on GPU)
    frac = tl.where(gap > 0, (a - lo) * inv_gap, 0.0)
    up = frac.to(tl.float64) * 4294967296.0 > rbits.to(tl.float64)
    return tl.where(up, hi_code, lo_code)


@triton.jit
def _random_bits(rows, cols, n_cols, key_ptr):
    """The reference's random_bits for output elements (rows, cols) of a copy with n_cols columns."""
    index = rows.to(tl.int64)[:, None] * n_cols + cols.to(tl.int64)[None, :]
    g = index >> 2
    zero = tl.zeros(g.shape, dtype=tl.int64)
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    c2 = (zero + tl.load(key_ptr + 2)).to(tl.uint32)
    c3 = (zero + tl.load(key_ptr + 3)).to(tl.uint32)
    w0, w1, w2, w3 = philox_impl((g & 0xFFFFFFFF).to(tl.uint32), (g >> 32).to(tl.uint32), c2, c3, k0, k1)
    lane = index & 3
    bits = tl.where(lane == 0, w0, w1)
    bits = tl.where(lane == 2, w2, bits)
    return tl.where(lane == 3, w3, bits)


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, q_ptr, s_ptr, g_ptr, key_ptr, n_rows, n_cols, stride_r, stride_c,
    RHT: tl.constexpr, SCALING_2D: tl.constexpr, SR: tl.constexpr, BF16_BITS: tl.constexpr,
    NEG: tl.constexpr, TILE_R: tl.constexpr, TILE_B: tl.constexpr,
):
    TILE_C: tl.constexpr = TILE_B * 16
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    v = _load_float(x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c,
                    mask, BF16_BITS)
    if RHT:
        v = _rht(v, cols, TILE_R, TILE_C, NEG)
    blocks = tl.reshape(v, [TILE_R, TILE_B, 16])
    a = tl.abs(blocks)
    block_amax = tl.max(tl.where(a == a, a, 0.0), axis=2)
    has_nan = tl.max((a != a).to(tl.int32), axis=2)
    if SCALING_2D:  # TILE_R == 16 and tiles start at multiples of 16: one amax per 16x16 tile
        tile_amax = tl.max(block_amax, axis=0)
        tile_nan = tl.max(has_nan, axis=0)
        block_amax = tl.zeros([TILE_R, TILE_B], dtype=tl.float32) + tile_amax[None, :]
        has_nan = tl.zeros([TILE_R, TILE_B], dtype=tl.int32) + tile_nan[None, :]
    block_amax = tl.where(has_nan != 0, float("nan"), block_amax)
    scale_enc = tl.load(g_ptr)  # s_enc * fl(1/6)
    global_dec = tl.load(g_ptr + 1)  # 1 / s_enc
    s = block_amax * scale_enc
    s = tl.where(s != s, s, tl.minimum(s, 448.0))
    scale_bits = tl.where(s != s, 0x7F, e4m3_bits(s).to(tl.int32)).to(tl.uint8)
    block_cols = tl.program_id(1) * TILE_B + tl.arange(0, TILE_B)
    s_mask = (rows[:, None] < n_rows) & (block_cols[None, :] < n_cols // 16)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * (n_cols // 16) + block_cols[None, :], scale_bits, mask=s_mask)
    # fminf(1 / (scale * s_dec), FLT_MAX): a NaN quotient (NaN scale) gives FLT_MAX.
    q = tl.math.div_rn(tl.zeros([TILE_R, TILE_B], dtype=tl.float32) + 1.0, e4m3_to_float(scale_bits) * global_dec)
    factor = tl.where(q != q, 3.4028234663852886e38, tl.minimum(q, 3.4028234663852886e38))
    scaled = tl.reshape(blocks * factor[:, :, None], [TILE_R, TILE_C])
    mag = tl.abs(scaled)
    if SR:
        code = _e2m1_sr(mag, _random_bits(rows, cols, n_cols, key_ptr))
    else:
        code = _e2m1_rne(mag)
    sign = ((scaled.to(tl.int32, bitcast=True) >> 28) & 8)
    code = tl.where(scaled != scaled, 7, code | sign)
    lo, hi = tl.split(tl.reshape(code, [TILE_R, TILE_C // 2, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    half_cols = tl.program_id(1) * (TILE_C // 2) + tl.arange(0, TILE_C // 2)
    p_mask = (rows[:, None] < n_rows) & (half_cols[None, :] < n_cols // 2)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * (n_cols // 2) + half_cols[None, :], packed, mask=p_mask)


def _global_scales(amax: torch.Tensor) -> torch.Tensor:
    """[s_enc * fl(1/6), 1 / s_enc] in float32 (reference.nvfp4.global_encode_scale's rules)."""
    amax = amax.float().reshape(())
    s_enc = torch.fmin(torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax, torch.full_like(amax, FLOAT_MAX))
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    sixth = torch.full_like(amax, 1.0 / E2M1_MAX)
    return torch.stack([s_enc * sixth, torch.ones_like(s_enc) / s_enc])


def _key(seed: int, offset: int, usage: int, device) -> torch.Tensor:
    """[key0, key1, counter word 2, counter word 3] of the reference's random_bits, as int64."""
    seed &= 2**64 - 1
    words = [seed & _MASK32, seed >> 32, offset & _MASK32, (offset >> 32) | (usage << 31)]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _launch(view: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, scales: torch.Tensor,
            key: torch.Tensor, rht: bool, scaling_2d: bool, sr: bool) -> None:
    rows, cols = view.shape
    if rows == 0 or cols == 0:
        return
    tile_b = 4 if INTERPRETED else 8
    grid = (triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK * tile_b))
    bf16 = view.dtype == torch.bfloat16
    wrap_triton(_quantize_nvfp4_kernel)[grid](
        view.view(torch.int16) if bf16 else view, data.view(torch.uint8), scale.view(torch.uint8), scales, key,
        rows, cols, view.stride(0), view.stride(1),
        RHT=rht, SCALING_2D=scaling_2d, SR=sr, BF16_BITS=bf16, NEG=_RHT_NEGATIVE,
        TILE_R=BLOCK, TILE_B=tile_b, num_warps=4,
    )


@library.triton_op("transformer_linear::triton_quantize_nvfp4")
def quantize_nvfp4(
    x: torch.Tensor,
    amax: torch.Tensor,
    amax_t: Optional[torch.Tensor],
    rowwise: bool,
    columnwise: bool,
    scaling_2d: bool,
    rht: bool,
    stochastic_rounding: bool,
    seed: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``transformer_linear::quantize_nvfp4`` op's six outputs (uint8 data, E4M3 scales, float32 global
    decode scales; a copy not asked for empty, its global scale 0) for a CUDA or (interpreter) CPU ``x``."""
    check_quantize_shape("quantize_nvfp4", tuple(x.shape), rowwise, columnwise, scaling_2d, rht)
    check_launchable("quantize_nvfp4", {"x": x, "amax": amax, "amax_t": amax_t})
    m, k = x.shape
    dev = x.device
    empty = (0, 0)
    data = x.new_empty((m, k // 2) if rowwise else empty, dtype=torch.uint8)
    scale = x.new_empty((m, k // BLOCK) if rowwise else empty, dtype=torch.float8_e4m3fn)
    data_t = x.new_empty((k, m // 2) if columnwise else empty, dtype=torch.uint8)
    scale_t = x.new_empty((k, m // BLOCK) if columnwise else empty, dtype=torch.float8_e4m3fn)
    g = x.new_zeros((), dtype=torch.float32)
    g_t = x.new_zeros((), dtype=torch.float32)
    if rowwise or (columnwise and scaling_2d):
        scales = _global_scales(amax)
        if rowwise:
            _launch(x, data, scale, scales, _key(seed, offset, 0, dev), False, scaling_2d, stochastic_rounding)
            g = scales[1].clone()
        if columnwise and scaling_2d:
            # The 2D columnwise copy is the rowwise codes and tile scales transposed (same amax, same bits).
            full_data = data if rowwise else x.new_empty((m, k // 2), dtype=torch.uint8)
            full_scale = scale if rowwise else x.new_empty((m, k // BLOCK), dtype=torch.float8_e4m3fn)
            if not rowwise:
                _launch(x, full_data, full_scale, scales, _key(seed, offset, 0, dev), False, True,
                        stochastic_rounding)
            codes = torch.stack((full_data & 0xF, full_data >> 4), dim=-1).reshape(m, k).t()
            data_t.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
            tile_scales = full_scale.view(torch.uint8)[::BLOCK].t()
            scale_t.view(torch.uint8).copy_(tile_scales.repeat_interleave(BLOCK, dim=0))
            g_t = scales[1].clone()
    if columnwise and not scaling_2d:
        scales_t = _global_scales(amax if amax_t is None else amax_t)
        _launch(x.t(), data_t, scale_t, scales_t, _key(seed, offset, 1, dev), rht, False, stochastic_rounding)
        g_t = scales_t[1].clone()
    return data, scale, g, data_t, scale_t, g_t
