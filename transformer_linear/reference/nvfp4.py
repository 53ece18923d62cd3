"""Pure-PyTorch definition of NVFP4 quantization and the NVFP4 block-scaled GEMM (the oracle).

The CPU kernels (csrc/cpu/quantize_nvfp4_cpu.cpp, gemm_nvfp4_cpu.cpp) follow
these definitions operation for operation; tests hold quantize bitwise to them.
The format itself is described in :mod:`transformer_linear.formats.nvfp4`.

Scales, as Transformer Engine computes them (``core_nvfp4.cuh``), in float32:

* global encode scale ``S_enc = min(448 * 6 / amax, FLT_MAX)``, and 1 when
  amax is 0 or the quotient is 0 (amax = inf); the global decode scale is
  ``1 / S_enc``;
* block decode scale ``s = e4m3(block_amax * (S_enc * fl(1/6)))``, rounded to
  nearest even and saturated at 448 (NaN stays NaN);
* the encode factor of a block ``min(1 / (float(s) * (1 / S_enc)), FLT_MAX)``
  (C ``fminf``: a NaN scale gives FLT_MAX); each element becomes
  ``e2m1(x * factor)``.

E2M1 rounding saturates at ±6 and keeps the sign (small negatives become
-0, code 8). A NaN becomes code 7 (+6): E2M1 has no NaN; its block scale is
NaN and dequantizes it back to NaN. Round-to-nearest-even by default.
Stochastic rounding (defined here; TE uses the GPU's ``cvt.rs``, whose
use of the random bits differs) takes 32 random bits ``r`` per element and
rounds ``|v|`` between its neighbours ``lo <= |v| < hi`` up iff
``(|v| - lo) / (hi - lo) * 2^32 > r`` (exact in float64), so it rounds up
with probability ``(|v| - lo) / (hi - lo)`` and is unbiased.

Random bits are counter-based: Philox4x32-10 with key ``(seed mod 2^32,
seed >> 32 mod 2^32)`` and counter ``(g mod 2^32, g >> 32, offset mod 2^32,
(offset >> 32) | usage << 31)``, ``g = index // 4``; element ``index`` (its
row-major index in the output it is rounded for) takes word ``index % 4``.
``usage`` is 0 for the rowwise copy and 1 for the columnwise one. The bits
depend on nothing but (seed, offset, usage, index): not on threads or tiling.

Usages: the rowwise copy quantizes x (M, K) along rows; the columnwise copy
quantizes x.T (K, M) along its rows, after the RHT when ``rht`` is set (TE
applies it to the wgrad operands' columnwise copies; their ``amax_t`` is the
amax of the transformed copy). With 16x16 (2D) scaling one scale covers a
16x16 tile, stored repeated for each of its rows so the scale layout is
always (rows, cols / 16); the columnwise copy is then exactly the rowwise
codes and tile scales transposed (RHT is not allowed with 2D scaling).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_linear.formats.nvfp4 import (
    BLOCK,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    FP4_DTYPE,
    check_quantize_shape,
    hadamard_transform,
)

__all__ = [
    "NVFP4Quantized",
    "dequantize_nvfp4",
    "e2m1_round",
    "global_encode_scale",
    "hadamard_transform",
    "nvfp4_gemm",
    "pack_e2m1",
    "philox4x32",
    "quantize_nvfp4",
    "random_bits",
    "unpack_e2m1",
]

_FLOAT_MAX = torch.finfo(torch.float32).max
_MASK32 = 0xFFFFFFFF
# Philox4x32 multipliers and Weyl key increments (Salmon et al., Random123).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
# The E2M1 magnitudes in code order, and the rounding thresholds between neighbours:
# (threshold, ties round up) -- up where the upper neighbour's code is even.
_E2M1_GRID = E2M1_VALUES[:8]
_RNE_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class NVFP4Quantized(NamedTuple):
    """One tensor's NVFP4 copies; the fields of a usage not asked for are None.

    data: (M, K/2) float4_e2m1fn_x2; scale: (M, K/16) float8_e4m3fn; global_scale: () float32
    decode scale. The ``_t`` fields are the columnwise copy: (K, M/2), (K, M/16), ().
    """

    data: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    global_scale: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_t: Optional[torch.Tensor]
    global_scale_t: Optional[torch.Tensor]


def _f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """TE's global encode scale ``448 * 6 / amax`` in float32 (1 for amax 0 or inf; FLT_MAX at most)."""
    amax = amax.float()
    scale = torch.fmin(_f32(E4M3_MAX * E2M1_MAX, amax.device) / amax, _f32(_FLOAT_MAX, amax.device))
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a 32-bit constant a and uint32 values b in int64 (no overflow)."""
    lo_part = b * (a & 0xFFFF)  # < 2^48
    hi_part = b * (a >> 16)  # < 2^48
    lo = (lo_part + ((hi_part & 0xFFFF) << 16)) & _MASK32
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi & _MASK32, lo


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[int, int], rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32 (Random123) on int64 tensors holding uint32 words; returns the 4 output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_bits(shape: tuple[int, ...], seed: int, offset: int, usage: int, device=None) -> torch.Tensor:
    """32 random bits (as int64 in [0, 2^32)) for each row-major index of ``shape`` (see the module doc)."""
    if not 0 <= offset < 2**63:
        raise ValueError(f"random_bits: offset must be in [0, 2^63), got {offset}")
    n = 1
    for s in shape:
        n *= s
    index = torch.arange(n, dtype=torch.int64, device=device)
    g = index >> 2
    seed &= 2**64 - 1
    words = philox4x32(
        (
            g & _MASK32,
            g >> 32,
            torch.full_like(g, offset & _MASK32),
            torch.full_like(g, (offset >> 32) | (usage << 31)),
        ),
        (seed & _MASK32, seed >> 32),
    )
    lane = index & 3
    bits = torch.where(lane == 0, words[0], words[1])
    bits = torch.where(lane == 2, words[2], bits)
    bits = torch.where(lane == 3, words[3], bits)
    return bits.reshape(shape)


def e2m1_round(v: torch.Tensor, rbits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8, one per element): nearest-even, or stochastic with ``rbits``."""
    a = v.abs()
    if rbits is None:
        code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
        for threshold, ties_up in _RNE_THRESHOLDS:
            code += (a >= threshold if ties_up else a > threshold).to(torch.uint8)
    else:
        grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=v.device)
        lo_code = torch.bucketize(a.clamp(max=E2M1_MAX), grid, right=True) - 1  # largest code with value <= a
        lo_code = lo_code.clamp(0, 7)
        hi_code = (lo_code + 1).clamp(max=7)
        lo, hi = grid[lo_code], grid[hi_code]
        frac = torch.where(hi > lo, (a - lo) / torch.where(hi > lo, hi - lo, 1.0), 0.0)
        up = frac.double() * 2.0**32 > rbits.double()
        code = torch.where(up, hi_code, lo_code).to(torch.uint8)
    sign = (torch.signbit(v)).to(torch.uint8) << 3
    return torch.where(torch.isnan(v), torch.full_like(code, 7), code | sign)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes -> (..., n) float4_e2m1fn_x2, the first of each pair in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(FP4_DTYPE)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """(..., n) float4_e2m1fn_x2 -> (..., 2n) uint8 codes."""
    b = data.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def _e4m3(s: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, nearest-even, saturating at 448, NaN as 0x7f."""
    q = s.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(s), torch.full_like(q, 0x7F), q).view(torch.float8_e4m3fn)


def _block_amax(v: torch.Tensor, scaling_2d: bool) -> torch.Tensor:
    """Per-block amax (NaN-propagating), repeated to one value per (row, 16-column block)."""
    rows, cols = v.shape
    a = v.abs().reshape(rows, cols // BLOCK, BLOCK).amax(dim=-1)
    if scaling_2d:
        bands = -(-rows // BLOCK)
        padded = torch.zeros(bands * BLOCK, cols // BLOCK, dtype=a.dtype, device=a.device)
        padded[:rows] = a
        tile = padded.reshape(bands, BLOCK, cols // BLOCK).amax(dim=1)
        a = tile.repeat_interleave(BLOCK, dim=0)[:rows]
    return a


def _quantize_rows(v: torch.Tensor, s_enc: torch.Tensor, scaling_2d: bool, rbits: Optional[torch.Tensor]):
    """Quantize the rows of float32 v (rows, cols): (uint8 codes, e4m3 scales)."""
    rows, cols = v.shape
    block_amax = _block_amax(v, scaling_2d)
    scale = _e4m3(block_amax * (s_enc * _f32(1.0 / E2M1_MAX, v.device)))
    s_dec = _f32(1.0, v.device) / s_enc
    factor = torch.fmin(_f32(1.0, v.device) / (scale.float() * s_dec), _f32(_FLOAT_MAX, v.device))
    scaled = v.reshape(rows, cols // BLOCK, BLOCK) * factor.unsqueeze(-1)
    return e2m1_round(scaled.reshape(rows, cols), rbits), scale


def quantize_nvfp4(
    x: torch.Tensor,
    amax: Optional[torch.Tensor],
    amax_t: Optional[torch.Tensor] = None,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    scaling_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> NVFP4Quantized:
    """NVFP4 copies of a 2-D tensor (see the module doc for every rule).

    Args:
        x: (M, K) float32, bfloat16 or float16.
        amax: the global amax of the rowwise copy (and of the 2D columnwise copy), () float32.
        amax_t: the global amax of the 1D columnwise copy (of the transformed copy with ``rht``);
            defaults to ``amax``.
        rowwise / columnwise: which copies to produce.
        scaling_2d: one scale per 16x16 tile instead of per 1x16 block.
        rht: random Hadamard transform of the columnwise copy (1D only).
        stochastic_rounding: round with counter-based random bits from (seed, offset).

    Returns:
        NVFP4Quantized.
    """
    check_quantize_shape("quantize_nvfp4", tuple(x.shape), rowwise, columnwise, scaling_2d, rht)
    v = x.float()
    m, k = v.shape
    amax_t = amax if amax_t is None else amax_t
    data = scale = g = data_t = scale_t = g_t = None
    if rowwise or scaling_2d:
        s_enc = global_encode_scale(amax)
        rbits = random_bits((m, k), seed, offset, 0, v.device) if stochastic_rounding else None
        codes, scale_rows = _quantize_rows(v, s_enc, scaling_2d, rbits)
        if rowwise:
            data, scale, g = pack_e2m1(codes), scale_rows, _f32(1.0, v.device) / s_enc
        if columnwise and scaling_2d:
            data_t = pack_e2m1(codes.t().contiguous())
            scale_t = scale_rows[::BLOCK].t().repeat_interleave(BLOCK, dim=0).contiguous()
            g_t = _f32(1.0, v.device) / s_enc
    if columnwise and not scaling_2d:
        s_enc_t = global_encode_scale(amax_t)
        vt = hadamard_transform(v.t()) if rht else v.t()
        rbits = random_bits((k, m), seed, offset, 1, v.device) if stochastic_rounding else None
        codes_t, scale_t = _quantize_rows(vt.contiguous(), s_enc_t, False, rbits)
        data_t, g_t = pack_e2m1(codes_t), _f32(1.0, v.device) / s_enc_t
    return NVFP4Quantized(data, scale, g, data_t, scale_t, g_t)


def dequantize_nvfp4(
    data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``e2m1 * float(scale) * global_scale`` in float32, then cast to ``dtype``."""
    codes = unpack_e2m1(data)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)[codes.long()]
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // BLOCK, BLOCK) * scale.float().unsqueeze(-1)
    return (blocks.reshape(rows, cols) * global_scale.float()).to(dtype)


def nvfp4_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_global_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_global_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``d = (a @ b.T) * (a_global_scale * b_global_scale) [+ bias]`` of NVFP4 operands (a: (M, K/2), b: (N, K/2)).

    Each 16-element K block's products, with both block scales folded into the
    operands, sum exactly in float32 (every partial sum is an integer below
    2^24 times a power of two), so the only rounding is the float32
    accumulation over K blocks, done here in block order as the CPU kernel
    does, then the float32 epilogue and the cast.
    """
    a_val = dequantize_nvfp4(a, a_scale, _f32(1.0, a.device))
    b_val = dequantize_nvfp4(b, b_scale, _f32(1.0, b.device))
    m, k = a_val.shape
    n = b_val.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        acc += a_val[:, cols] @ b_val[:, cols].T
    out = acc * (a_global_scale.float() * b_global_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
