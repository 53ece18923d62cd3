/*!
 * \file block_math.h
 * \brief Per-block scale math of the block-scaled recipes (1x128, 128x128, 1x32 E8M0, rowwise).
 *
 * Host and device code, like fp8_math.h. transformer_linear/reference/__init__.py
 * (block_scale, e8m0_exponent) defines the same functions in torch; the
 * tests hold the kernels bitwise to it.
 */
#pragma once

#include <cstdint>

#include "transformer_linear/fp8_math.h"

namespace tl {
namespace fp8 {

/*! \brief Bias of the E8M0 exponent encoding: bits = e + 127 stands for 2^e. */
constexpr int kE8M0Bias = 127;

/*!
 * \brief float32 scale of one block: compute_scale(amax, fp8_max, margin 0, fallback 1),
 *        rounded down to a power of two (mantissa bits cleared) when `power_2`.
 *
 * amax = 0 or non-finite gives 1; the result is always finite, positive and normal.
 */
TL_HD float block_scale(float amax, float fp8_max, bool power_2) {
  const float scale = compute_scale(amax, fp8_max, 1.0f, 1.0f);
  return power_2 ? float_of(bits_of(scale) & 0xff800000u) : scale;
}

/*!
 * \brief Unbiased exponent e of a block's E8M0 scale_inv 2^e, in [-127, 127].
 *
 * Ceil rule (default, TE/cuBLAS): e = ceil(log2(amax / fp8_max)), the quotient
 * rounded to float32. Floor rule (OCP MX): e = floor(log2(amax)) - floor(log2(fp8_max)).
 * amax = 0 or non-finite gives 0.
 *
 * \param emax floor(log2(fp8_max)): 8 for e4m3, 15 for e5m2.
 */
TL_HD int e8m0_exponent(float amax, float fp8_max, int emax, bool floor_rule) {
  if (!(amax > 0.0f) || !is_finite(amax)) return 0;
  int e;
  if (!floor_rule) {
    const uint32_t v = bits_of(amax / fp8_max);
    const int biased = static_cast<int>(v >> 23);
    const uint32_t mantissa = v & 0x7fffffu;
    // Round up when inexact; a subnormal quotient (biased 0) needs -126 above 2^-127.
    e = biased - kE8M0Bias + ((biased > 0 ? mantissa != 0 : mantissa > 0x400000u) ? 1 : 0);
  } else {
    const uint32_t v = bits_of(amax);
    int biased = static_cast<int>(v >> 23);
    int log2 = biased - kE8M0Bias;
    if (biased == 0) {  // subnormal amax: floor(log2) from the leading mantissa bit
      uint32_t m = v & 0x7fffffu;
      log2 = -127;
      while (!(m & 0x400000u)) {
        m <<= 1;
        --log2;
      }
    }
    e = log2 - emax;
  }
  return e < -kE8M0Bias ? -kE8M0Bias : (e > kE8M0Bias ? kE8M0Bias : e);
}

/*! \brief 2^e as float32 for e in [-149, 127] (exact; subnormal below -126). */
TL_HD float exp2_int(int e) {
  if (e >= -126) return float_of(static_cast<uint32_t>(e + 127) << 23);
  return float_of(1u << (e + 149));
}

/*! \brief float32 value of E8M0 bits: 2^(bits - 127); 0xff is NaN. */
TL_HD float float_from_e8m0_bits(uint8_t b) {
  return b == 0xff ? float_of(0x7fc00000u) : exp2_int(static_cast<int>(b) - kE8M0Bias);
}

}  // namespace fp8
}  // namespace tl
