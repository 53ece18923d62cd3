// AVX-512 kernels of the CPU quantize family, 16 lanes at a time; the lane
// kernels (loads, the bitwise FP8 cast, amax) are quantize_lanes_avx512.h's,
// the range kernels built on them quantize_cpu_vec.h's.

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "quantize_cpu_isa.h"
#include "quantize_lanes_avx512.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx512 {
namespace {

// --- dequantize -------------------------------------------------------------

// FP8 bytes -> exact fp32: place exponent and mantissa in a float32 and let a
// multiply by 2^(127 - bias) rebias them (subnormals included: the product is
// exact); NaN / inf patterns are written directly.
template <typename In>
TL_LANE_INLINE __m512 fp8_to_float(__m128i bytes) {
  const __m512i w = _mm512_cvtepu8_epi32(bytes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi32(0x7f));
  constexpr bool kE4M3 = std::is_same_v<In, Float8E4M3>;
  constexpr int kShift = kE4M3 ? 20 : 21;
  const __m512 rebias = _mm512_set1_ps(kE4M3 ? 0x1p120f : 0x1p112f);
  const __m512 finite =
      _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_slli_epi32(mag, kShift))), rebias);
  __mmask16 special;
  __m512i special_bits;
  if constexpr (kE4M3) {
    special = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    special_bits = _mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000));
  } else {
    special = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x7c));
    const __m512i man = _mm512_slli_epi32(_mm512_and_si512(mag, _mm512_set1_epi32(3)), 21);
    special_bits = _mm512_or_si512(_mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)), man);
  }
  return _mm512_mask_blend_ps(special, finite, _mm512_castsi512_ps(special_bits));
}

// fp32 lanes -> 16 stored elements of Out, as Out::store.
template <typename Out>
TL_LANE_INLINE void store_hp(typename Out::storage* y, __m512 v, __mmask16 m) {
  if constexpr (std::is_same_v<Out, Float32>) {
    _mm512_mask_storeu_ps(y, m, v);
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m256i h;
    if constexpr (std::is_same_v<Out, BFloat16>) {
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
      r = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(r, 16), _mm512_set1_epi32(0x7fc0));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // fp16_bits_from_float turns every NaN into sign | 0x7e00.
      const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))), 16);
      const __m256i nan_bits = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
      h = _mm256_mask_blend_epi16(nan, h, nan_bits);
    }
    _mm256_mask_storeu_epi16(y, m, h);
  }
}

template <typename In, typename Out>
void dequantize_range(const uint8_t* q, float scale_inv, typename Out::storage* y, int64_t begin,
                      int64_t end) {
  const __m512 s = _mm512_set1_ps(scale_inv);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = tail_mask(std::min<int64_t>(16, end - i));
    const __m128i b = _mm_maskz_loadu_epi8(m, q + i);
    store_hp<Out>(y + i, _mm512_mul_ps(fp8_to_float<In>(b), s), m);
  }
}

// One 64-byte line to 64-byte-aligned dst, bypassing the cache.
TL_LANE_INLINE void stream_line(uint8_t* dst, const uint8_t* src) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
}

#include "quantize_cpu_vec.h"  // the range kernels, on the ones above

}  // namespace
}  // namespace avx512

QuantizeKernels avx512_quantize_kernels() { return avx512::quantize_kernels(); }

}  // namespace cpu
}  // namespace tl
