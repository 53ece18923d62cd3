"""Element math of the Triton kernels: the same bit-level rules as fp8_math.h / block_math.h.

The FP8 casts are written with integer ops instead of ``.to(tl.float8e4nv)`` so
that the compiled kernel and the interpreter (numpy) round identically, bit
for bit like reference.quantize and the C++ kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLOAT_MAX = 3.4028234663852886e38
FLOAT_MIN_NORMAL = 1.1754943508222875e-38


@triton.jit
def saturate(x, fp8_max):
    """Clamp to [-fp8_max, fp8_max]; NaN passes through."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -fp8_max), fp8_max))


@triton.jit
def e4m3_bits(f):
    """float32 -> float8_e4m3fn bits (round to nearest even); saturate first."""
    u = f.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Subnormal range: a float addition of 2^14 rounds onto the fp8 subnormal grid.
    sub = (tl.abs(f) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    norm = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    r = tl.where(a >= (1087 << 20), 0x7F, tl.where(a < (121 << 23), sub, norm))
    return ((r & 0xFF) | sign).to(tl.uint8)


@triton.jit
def e5m2_bits(f):
    """float32 -> float8_e5m2 bits (round to nearest even); saturate first."""
    u = f.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    sub = (tl.abs(f) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
    norm = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
    big = tl.where(a > (255 << 23), 0x7F, 0x7C)
    r = tl.where(a >= (143 << 23), big, tl.where(a < (113 << 23), sub, norm))
    return ((r & 0xFF) | sign).to(tl.uint8)


@triton.jit
def exp2_int(e):
    """2^e as float32 for integer e in [-127, 127] (2^-127 is subnormal)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def block_scales(amax, bad, fp8_max, EMAX: tl.constexpr, SCALE_KIND: tl.constexpr):
    """(scale, scale_inv as stored) of blocks from their amax over finite values and a
    non-finite flag. SCALE_KIND: 0 float32, 1 float32 power of 2, 2 E8M0 ceil, 3 E8M0 floor.
    E8M0 scale_inv is returned as its uint8 bits."""
    valid = (amax > 0.0) & (bad == 0)
    if SCALE_KIND < 2:
        q = tl.math.div_rn(tl.zeros_like(amax) + fp8_max, tl.where(valid, amax, 1.0))
        q = tl.where(q == float("inf"), FLOAT_MAX, q)
        q = tl.maximum(q, FLOAT_MIN_NORMAL)
        scale = tl.where(valid, q, 1.0)
        if SCALE_KIND == 1:
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    else:
        if SCALE_KIND == 2:
            v = tl.math.div_rn(amax, tl.zeros_like(amax) + fp8_max).to(tl.int32, bitcast=True)
            biased = v >> 23
            mantissa = v & 0x7FFFFF
            # Round up when inexact; a subnormal quotient needs -126 above 2^-127.
            up = tl.where(biased > 0, mantissa != 0, mantissa > 0x400000)
            e = biased - 127 + up.to(tl.int32)
        else:
            biased = amax.to(tl.int32, bitcast=True) >> 23
            e = tl.where(biased == 0, -127, biased - 127 - EMAX)
        e = tl.minimum(tl.maximum(e, -127), 127)
        e = tl.where(valid, e, 0)
        return exp2_int(-e), (e + 127).to(tl.uint8)


@triton.jit
def e8m0_to_float(bits):
    """float32 value 2^(bits - 127) of E8M0 scale bits (uint8)."""
    return exp2_int(bits.to(tl.int32) - 127)
