/*!
 * \file element_types.h
 * \brief Element-type tags: storage type plus load/store to float32.
 *
 * Kernels are templates over these tags; dispatch.h maps a runtime DType to
 * one. Host and device code share them, like fp8_math.h.
 */
#pragma once

#include <cstdint>

#include "transformer_linear/fp8_math.h"
#include "transformer_linear/tensor.h"

namespace tl {

struct Float32 {
  using storage = float;
  static constexpr DType dtype = DType::kFloat32;
  static TL_HD float load(float v) { return v; }
  static TL_HD float store(float v) { return v; }
};

struct BFloat16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::kBFloat16;
  static TL_HD float load(uint16_t v) { return fp8::float_from_bf16_bits(v); }
  static TL_HD uint16_t store(float v) { return fp8::bf16_bits_from_float(v); }
};

struct Float16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::kFloat16;
  static TL_HD float load(uint16_t v) { return fp8::float_from_fp16_bits(v); }
  static TL_HD uint16_t store(float v) { return fp8::fp16_bits_from_float(v); }
};

struct Float8E4M3 {
  using storage = uint8_t;
  static constexpr DType dtype = DType::kFloat8E4M3;
  static constexpr float kMax = fp8::kE4M3Max;
  static TL_HD float load(uint8_t v) { return fp8::float_from_e4m3_bits(v); }
  /*! \brief Saturating RNE cast of x * scale. */
  static TL_HD uint8_t quantize(float x, float scale) { return fp8::quantize_e4m3(x, scale); }
};

struct Float8E5M2 {
  using storage = uint8_t;
  static constexpr DType dtype = DType::kFloat8E5M2;
  static constexpr float kMax = fp8::kE5M2Max;
  static TL_HD float load(uint8_t v) { return fp8::float_from_e5m2_bits(v); }
  static TL_HD uint8_t quantize(float x, float scale) { return fp8::quantize_e5m2(x, scale); }
};

/*! \brief Largest finite value of an FP8 dtype (0 for any other dtype). */
inline float fp8_max(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? fp8::kE4M3Max : (dtype == DType::kFloat8E5M2 ? fp8::kE5M2Max : 0.0f);
}

}  // namespace tl
