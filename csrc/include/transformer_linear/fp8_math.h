/*!
 * \file fp8_math.h
 * \brief Per-element math shared by the CPU and CUDA kernels.
 *
 * Everything here compiles as host and device code, so both backends round
 * and saturate identically and the CPU tests cover the CUDA numerics.
 * transformer_linear/reference/__init__.py defines the same functions in torch; the
 * tests hold the kernels bitwise to it.
 */
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TL_HD __host__ __device__ __forceinline__
#else
#define TL_HD inline
#endif

namespace tl {
namespace fp8 {

/*! \brief Largest finite float8_e4m3fn value. */
constexpr float kE4M3Max = 448.0f;
/*! \brief Largest finite float8_e5m2 value. */
constexpr float kE5M2Max = 57344.0f;
/*! \brief Largest finite float32 (FLT_MAX). */
constexpr float kFloatMax = 3.40282346638528859812e+38f;
/*! \brief Smallest normal float32 (FLT_MIN). */
constexpr float kFloatMinNormal = 1.17549435082228750797e-38f;

TL_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

TL_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

TL_HD bool is_nan(float f) { return (bits_of(f) & 0x7fffffffu) > 0x7f800000u; }
TL_HD bool is_finite(float f) { return (bits_of(f) & 0x7f800000u) != 0x7f800000u; }

/*!
 * \brief Clamp to [-max, max]; NaN passes through unchanged (sign included).
 *
 * Saturating before the cast is what makes overflow and +-inf land on +-max
 * in both formats (a plain e5m2 cast would round them to +-inf).
 */
TL_HD float saturate(float x, float max) {
  if (is_nan(x)) return x;
  return x > max ? max : (x < -max ? -max : x);
}

/*!
 * \brief float32 -> float8_e4m3fn bits, round to nearest even, no saturation.
 *
 * Values at or above 480 become NaN (0x7f), as in c10's conversion that
 * torch's `.to(torch.float8_e4m3fn)` uses; call saturate() first.
 * Subnormals are rounded by letting a float addition do the rounding: adding
 * 2^(-6) * 2^(23-3+...) aligns the fp8 subnormal grid with float32's last bit.
 */
TL_HD uint8_t e4m3_bits_from_float(float f) {
  constexpr uint32_t kNanThreshold = 1087u << 20;  // 480.0f
  constexpr uint32_t kDenormMask = 141u << 23;     // 2^14
  uint32_t f_bits = bits_of(f);
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kNanThreshold) {
    result = 0x7f;
  } else if (f_bits < (121u << 23)) {  // below 2^-6: the e4m3 subnormal range
    f_bits = bits_of(float_of(f_bits) + float_of(kDenormMask));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1u;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

/*!
 * \brief float32 -> float8_e5m2 bits, round to nearest even, no saturation.
 *
 * Values that round above 57344 become inf, NaN stays NaN (0x7f); call
 * saturate() first for the saturating cast.
 */
TL_HD uint8_t e5m2_bits_from_float(float f) {
  constexpr uint32_t kFloatInf = 255u << 23;
  constexpr uint32_t kInfThreshold = 143u << 23;  // 65536.0f
  constexpr uint32_t kDenormMask = 134u << 23;    // 2^7
  uint32_t f_bits = bits_of(f);
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kInfThreshold) {
    result = f_bits > kFloatInf ? 0x7f : 0x7c;
  } else if (f_bits < (113u << 23)) {  // below 2^-14: the e5m2 subnormal range
    f_bits = bits_of(float_of(f_bits) + float_of(kDenormMask));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 21) & 1u;
    f_bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 21);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

/*! \brief float8_e4m3fn bits -> float32 (exact). */
TL_HD float float_from_e4m3_bits(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return float_of(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {
    // Subnormal: man * 2^-9, exactly representable as a normal float32.
    const float v = static_cast<float>(man) * 0.001953125f;
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 120u) << 23) | (man << 20));
}

/*! \brief float8_e5m2 bits -> float32 (exact); e5m2 is the top byte of an IEEE half. */
TL_HD float float_from_e5m2_bits(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 2) & 0x1fu;
  const uint32_t man = b & 0x3u;
  if (exp == 0x1fu) return float_of(sign | 0x7f800000u | (man << 21));  // inf / NaN
  if (exp == 0) {
    // Subnormal: man * 2^-16.
    const float v = static_cast<float>(man) * 1.52587890625e-05f;
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112u) << 23) | (man << 21));
}

/*! \brief Saturating, round-to-nearest-even cast of `x * scale` to float8_e4m3fn. */
TL_HD uint8_t quantize_e4m3(float x, float scale) { return e4m3_bits_from_float(saturate(x * scale, kE4M3Max)); }

/*! \brief Saturating, round-to-nearest-even cast of `x * scale` to float8_e5m2. */
TL_HD uint8_t quantize_e5m2(float x, float scale) { return e5m2_bits_from_float(saturate(x * scale, kE5M2Max)); }

/*!
 * \brief The scaling factor that maps `amax` onto the format's range.
 *
 * scale = fp8_max / amax / 2^margin, computed as (fp8_max / amax) * 2^-margin
 * in float32 (reference.compute_scale is the same formula). Rules that keep
 * the scale finite and non-zero:
 *   - amax == 0, amax negative, inf or NaN: return `fallback` (the previous
 *     scale for delayed scaling, 1 for current scaling);
 *   - a quotient that overflows to inf (tiny amax): FLT_MAX;
 *   - a result that underflows below FLT_MIN (huge margin): FLT_MIN.
 *
 * \param amax          max |x| of the tensor to be cast.
 * \param fp8_max       448 (e4m3) or 57344 (e5m2).
 * \param margin_factor 2^-margin, exact in float32 for margin < 127.
 * \param fallback      the scale to keep when amax gives none.
 */
TL_HD float compute_scale(float amax, float fp8_max, float margin_factor, float fallback) {
  if (!(amax > 0.0f) || !is_finite(amax)) return fallback;
  float scale = fp8_max / amax;
  if (!is_finite(scale)) scale = kFloatMax;
  scale = scale * margin_factor;
  if (scale < kFloatMinNormal) scale = kFloatMinNormal;
  return scale;
}

/*! \brief NaN-propagating max of |x| into a running amax. */
TL_HD float amax_update(float running, float x) {
  const float a = float_of(bits_of(x) & 0x7fffffffu);
  if (is_nan(running)) return running;
  if (is_nan(a)) return a;
  return a > running ? a : running;
}

/*! \brief bfloat16 bits -> float32 (exact). */
TL_HD float float_from_bf16_bits(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

/*! \brief float32 -> bfloat16 bits, round to nearest even (torch's rule: NaN becomes 0x7fc0). */
TL_HD uint16_t bf16_bits_from_float(float f) {
  if (is_nan(f)) return 0x7fc0;
  const uint32_t u = bits_of(f);
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

/*! \brief IEEE half bits -> float32 (exact). */
TL_HD float float_from_fp16_bits(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  constexpr uint32_t kExpOffset = 0xE0u << 23;
  const float exp_scale = float_of(0x7800000u);  // 2^-112
  const float normalized = float_of((two_w >> 4) + kExpOffset) * exp_scale;
  constexpr uint32_t kMagicMask = 126u << 23;
  const float denormalized = float_of((two_w >> 17) | kMagicMask) - 0.5f;
  constexpr uint32_t kDenormCutoff = 1u << 27;
  const uint32_t result = sign | (two_w < kDenormCutoff ? bits_of(denormalized) : bits_of(normalized));
  return float_of(result);
}

/*! \brief float32 -> IEEE half bits, round to nearest even, overflow to inf, NaN kept. */
TL_HD uint16_t fp16_bits_from_float(float f) {
  const float scale_to_inf = float_of(0x77800000u);   // 2^112
  const float scale_to_zero = float_of(0x08800000u);  // 2^-110
  float base = (f < 0 ? -f : f) * scale_to_inf;
  base = base * scale_to_zero;
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

}  // namespace fp8
}  // namespace tl
