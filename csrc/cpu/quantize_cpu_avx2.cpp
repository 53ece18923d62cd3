// AVX2 kernels of the CPU quantize family, 8 lanes at a time; the lane
// kernels (loads, the bitwise FP8 cast, amax) are quantize_lanes_avx2.h's,
// the range kernels built on them quantize_cpu_vec.h's.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "quantize_cpu_isa.h"
#include "quantize_lanes_avx2.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx2 {
namespace {

// --- dequantize -------------------------------------------------------------

// FP8 bytes (the low 8 of `bytes`) -> exact fp32, as quantize_cpu_avx512.cpp:
// exponent and mantissa placed in a float32 and rebiased by a multiply by
// 2^(127 - bias) (exact, subnormals included); NaN / inf patterns written directly.
template <typename In>
TL_LANE_INLINE __m256 fp8_to_float(__m128i bytes) {
  const __m256i w = _mm256_cvtepu8_epi32(bytes);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi32(0x7f));
  constexpr bool kE4M3 = std::is_same_v<In, Float8E4M3>;
  constexpr int kShift = kE4M3 ? 20 : 21;
  const __m256 rebias = _mm256_set1_ps(kE4M3 ? 0x1p120f : 0x1p112f);
  const __m256 finite =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_slli_epi32(mag, kShift))), rebias);
  __m256i special, special_bits;
  if constexpr (kE4M3) {
    special = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
    special_bits = _mm256_or_si256(sign, _mm256_set1_epi32(0x7fc00000));
  } else {
    special = lanes_gt(mag, 0x7b);
    const __m256i man = _mm256_slli_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(3)), 21);
    special_bits = _mm256_or_si256(_mm256_or_si256(sign, _mm256_set1_epi32(0x7f800000)), man);
  }
  return _mm256_blendv_ps(finite, _mm256_castsi256_ps(special_bits), _mm256_castsi256_ps(special));
}

// fp32 lanes -> 8 elements of Out, as Out::store, at y.
template <typename Out>
TL_LANE_INLINE void store_hp(typename Out::storage* y, __m256 v) {
  if constexpr (std::is_same_v<Out, Float32>) {
    _mm256_storeu_ps(y, v);
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m128i h;
    if constexpr (std::is_same_v<Out, BFloat16>) {
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
      r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
      h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // fp16_bits_from_float turns every NaN into sign | 0x7e00.
      const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))), 16);
      const __m256i nan_bits = _mm256_or_si256(sign, _mm256_set1_epi32(0x7e00));
      const __m128i nan_words = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
      h = _mm_blendv_epi8(h, _mm_packus_epi32(_mm256_castsi256_si128(nan_bits), _mm256_extracti128_si256(nan_bits, 1)),
                          nan_words);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), h);
  }
}

template <typename In, typename Out>
void dequantize_range(const uint8_t* q, float scale_inv, typename Out::storage* y, int64_t begin,
                      int64_t end) {
  const __m256 s = _mm256_set1_ps(scale_inv);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
    store_hp<Out>(y + i, _mm256_mul_ps(fp8_to_float<In>(bytes), s));
  }
  if (i < end) {  // the last n < 8 elements, through stack buffers
    const int64_t n = end - i;
    uint64_t bytes = 0;
    std::memcpy(&bytes, q + i, static_cast<size_t>(n));
    typename Out::storage out[8];
    store_hp<Out>(out, _mm256_mul_ps(fp8_to_float<In>(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))), s));
    std::memcpy(y + i, out, static_cast<size_t>(n) * sizeof(out[0]));
  }
}

// One 64-byte line to 64-byte-aligned dst, bypassing the cache.
TL_LANE_INLINE void stream_line(uint8_t* dst, const uint8_t* src) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
}

#include "quantize_cpu_vec.h"  // the range kernels, on the ones above

}  // namespace
}  // namespace avx2

QuantizeKernels avx2_quantize_kernels() { return avx2::quantize_kernels(); }

}  // namespace cpu
}  // namespace tl
