// The integer constants of fp8_math.h's two float -> FP8 conversions
// (e4m3_bits_from_float, e5m2_bits_from_float), for the vector casts that
// apply them lane by lane (quantize_lanes_avx2.h, quantize_lanes_avx512.h).
// Lanes hold |x| as float32 bits after saturation.
#pragma once

#include <cstdint>

#include "transformer_linear/dispatch.h"

// Forces a lane kernel inline into its range loop. GCC otherwise outlines
// a cast that an unrolled loop calls four times, and each call then rebuilds
// its dozen vector constants from general registers: the AVX2 quantize ran
// 2-3x slower that way.
#define TL_LANE_INLINE inline __attribute__((always_inline))

namespace tl {
namespace cpu {

template <typename Out>
struct Fp8CastBits;

template <>
struct Fp8CastBits<Float8E4M3> {
  static constexpr uint32_t kMantShift = 20;
  static constexpr uint32_t kRebias = (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu;
  static constexpr uint32_t kSubnormalBelow = 121u << 23;  // 2^-6
  static constexpr uint32_t kDenormMask = 141u << 23;
  static constexpr uint32_t kSpecialFrom = 1087u << 20;  // 480: NaN after saturation
  static constexpr bool kHasInf = false;                  // every special lane is NaN
  static constexpr uint32_t kNanBits = 0x7f;
};

template <>
struct Fp8CastBits<Float8E5M2> {
  static constexpr uint32_t kMantShift = 21;
  static constexpr uint32_t kRebias = (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu;
  static constexpr uint32_t kSubnormalBelow = 113u << 23;  // 2^-14
  static constexpr uint32_t kDenormMask = 134u << 23;
  static constexpr uint32_t kSpecialFrom = 143u << 23;  // 65536
  static constexpr bool kHasInf = true;                  // special lanes above kNanAbove are NaN
  static constexpr uint32_t kInfBits = 0x7c;
  static constexpr uint32_t kNanAbove = 255u << 23;
  static constexpr uint32_t kNanBits = 0x7f;
};

// The constants of the 32- and 64-lane casts (quantize_lanes_avx2.h explains
// them): the FP8 grid reached by a magic-number addition, the code read from
// float16 bits. Lanes hold |x| * scale * kCodeScale (the "code domain").
template <typename Out>
struct Fp8ViaHalf;

template <>
struct Fp8ViaHalf<Float8E4M3> {
  static constexpr float kCodeScale = 0x1p-8f;
  static constexpr float kMax = 448.0f * kCodeScale;
  static constexpr int32_t kMinNormalBits = 113 << 23;  // 2^-14 = 2^-6 * kCodeScale
  static constexpr float kMagicFactor = 0x1p20f;        // M = 2^max(E, Emin) * 2^(23 - 3)
  static constexpr int kHalfShift = 7;                  // float16 bits >> 7: the code
};

template <>
struct Fp8ViaHalf<Float8E5M2> {
  static constexpr float kCodeScale = 1.0f;
  static constexpr float kMax = 57344.0f;
  static constexpr int32_t kMinNormalBits = 113 << 23;  // 2^-14
  static constexpr float kMagicFactor = 0x1p21f;        // M = 2^max(E, Emin) * 2^(23 - 2)
  static constexpr int kHalfShift = 8;                  // float16 bits >> 8: the code
};

// scale * kCodeScale in *code_sc; false where the 32-lane cast must not take the
// scale: not positive and finite, or scale * kCodeScale inexact (e4m3 scales
// below 2^-118 with bits beyond a subnormal's).
template <typename Out>
inline bool code_scale(float scale, float* code_sc) {
  constexpr float k = Fp8ViaHalf<Out>::kCodeScale;
  *code_sc = scale * k;
  return scale > 0.0f && scale <= 0x1.fffffep127f && *code_sc / k == scale;
}

}  // namespace cpu
}  // namespace tl
