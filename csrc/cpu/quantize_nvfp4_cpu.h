// NVFP4 element math of the CPU kernels: Philox bits, E2M1 rounding and decoding, the
// global and block scales, the Hadamard transform. Each function follows its namesake in
// transformer_linear/reference/nvfp4.py (and formats/nvfp4.py) operation for operation,
// in float32 without contraction (CMakeLists: -ffp-contract=off), so results are bitwise equal.
#pragma once

#include <cmath>
#include <cstdint>

#include "transformer_linear/fp8_math.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

constexpr int kBlock = 16;
constexpr float kE2M1Max = 6.0f;

/*! \brief Value of each E2M1 code (bit 3: sign). */
constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/*! \brief Transformer Engine's fixed sign vector of the wgrad Hadamard transform. */
constexpr float kRhtSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};

/*! \brief Philox4x32-10 (Random123) of one counter under one key. */
inline void philox4x32_10(uint32_t ctr[4], uint32_t k0, uint32_t k1) {
  constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = kM0 * ctr[0], p1 = kM1 * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t c1 = ctr[1], c3 = ctr[3];
    ctr[0] = hi1 ^ c1 ^ k0;
    ctr[1] = lo1;
    ctr[2] = hi0 ^ c3 ^ k1;
    ctr[3] = lo0;
  }
}

/*!
 * \brief The random bits of elements [first, first + n) (first a multiple of 4, n a multiple
 *        of 4) of one usage: Philox counter (index / 4, offset, usage), key = seed.
 */
inline void random_bits(uint64_t seed, uint64_t offset, uint32_t usage, uint64_t first, int n,
                        uint32_t* bits) {
  for (int i = 0; i < n; i += 4) {
    const uint64_t g = (first + static_cast<uint64_t>(i)) >> 2;
    uint32_t ctr[4] = {static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32),
                       static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(offset >> 32) | (usage << 31)};
    philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    for (int j = 0; j < 4; ++j) bits[i + j] = ctr[j];
  }
}

/*! \brief float32 -> E2M1 code, nearest-even (ties to the even code), saturating; NaN -> 7. */
inline uint8_t e2m1_rne(float v) {
  if (fp8::is_nan(v)) return 7;
  const float a = std::fabs(v);
  const uint8_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(code | (std::signbit(v) ? 8 : 0));
}

/*! \brief float32 -> E2M1 code, rounding up with probability of the distance to the lower neighbour. */
inline uint8_t e2m1_stochastic(float v, uint32_t rbits) {
  if (fp8::is_nan(v)) return 7;
  const float a = std::fmin(std::fabs(v), kE2M1Max);
  int lo = 0;
  while (lo < 7 && kE2M1Values[lo + 1] <= a) ++lo;
  uint8_t code = static_cast<uint8_t>(lo);
  if (lo < 7) {
    const float frac = (a - kE2M1Values[lo]) / (kE2M1Values[lo + 1] - kE2M1Values[lo]);
    if (static_cast<double>(frac) * 4294967296.0 > static_cast<double>(rbits)) ++code;
  }
  return static_cast<uint8_t>(code | (std::signbit(v) ? 8 : 0));
}

/*! \brief Transformer Engine's global encode scale: 448 * 6 / amax, 1 for amax 0 or inf. */
inline float global_encode_scale(float amax) {
  const float scale = std::fmin(fp8::kE4M3Max * kE2M1Max / amax, fp8::kFloatMax);
  return (amax == 0.0f || scale == 0.0f) ? 1.0f : scale;
}

/*! \brief E4M3 bits of the decode scale of a block: e4m3(block_amax * (S_enc * fl(1/6))), NaN 0x7f. */
inline uint8_t block_scale_bits(float block_amax, float s_enc) {
  const float s = block_amax * (s_enc * (1.0f / kE2M1Max));
  if (fp8::is_nan(s)) return 0x7f;
  return fp8::e4m3_bits_from_float(fp8::saturate(s, fp8::kE4M3Max));
}

/*! \brief The factor that maps a block onto the E2M1 range: min(1 / (scale * (1 / S_enc)), FLT_MAX). */
inline float block_encode_factor(uint8_t scale_bits, float s_enc) {
  const float s_dec = 1.0f / s_enc;
  return std::fmin(1.0f / (fp8::float_from_e4m3_bits(scale_bits) * s_dec), fp8::kFloatMax);
}

/*! \brief In place: the random Hadamard transform of 16 values (signs, butterfly, * 0.25). */
inline void hadamard16(float* v) {
  for (int i = 0; i < kBlock; ++i) v[i] = v[i] * kRhtSigns[i];
  for (int half = 1; half < kBlock; half *= 2) {
    for (int base = 0; base < kBlock; base += 2 * half) {
      for (int j = base; j < base + half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
    }
  }
  for (int i = 0; i < kBlock; ++i) v[i] = v[i] * 0.25f;
}

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
