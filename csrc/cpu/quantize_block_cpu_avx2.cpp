// AVX2 row kernels of the CPU blockwise quantize (quantize_block_cpu.h),
// 8 lanes at a time on quantize_lanes_avx2.h's loads and cast.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "quantize_block_cpu.h"
#include "quantize_lanes_avx2.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx2 {
namespace {

// Running amaxes are non-negative floats or NaN, so their bits compare like the lanes'.
template <typename In>
void column_amax(const void* xv, int64_t n, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(amax + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax + i),
                        _mm256_max_epu32(a, abs_bits(load_hp<In>(x + i))));
  }
  for (; i < n; ++i) amax[i] = fp8::amax_update(amax[i], In::load(x[i]));
}

// The FP8 bytes of x[0, 32) * scale in element order, code_sc = scale * kCodeScale (code_scale): the
// cast of quantize_lanes_avx2.h's cast_range (fewer instructions than to_fp8 + pack_bytes).
template <typename In, typename Out>
TL_LANE_INLINE __m256i cast32(const typename In::storage* x, __m256 code_sc) {
  if constexpr (std::is_same_v<In, BFloat16>) {
    const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    const __m256i mag = _mm256_set1_epi16(0x7fff);
    return fp8_bytes_bf16<Out>(h0, h1, _mm256_and_si256(h0, mag), _mm256_and_si256(h1, mag), code_sc);
  } else {
    __m256 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) v[j] = load_hp<In>(x + 8 * j);
    return fp8_bytes<Out>(v, code_sc);
  }
}

// cast32 with one scale per element: x[i] * scale[i].
template <typename In, typename Out>
TL_LANE_INLINE __m256i cast32_lanes(const typename In::storage* x, const float* scale) {
  __m256 v[4], sc[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    v[j] = load_hp<In>(x + 8 * j);
    sc[j] = _mm256_loadu_ps(scale + 8 * j);
  }
  return fp8_bytes<Out>(v, sc);
}

template <typename In, typename Out>
void column_cast(const void* xv, uint8_t* q, int64_t n, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  // Rows of a page or more: prefetch about 2 KiB ahead (the rows come from L3 or memory).
  constexpr int64_t kAhead = 2048 / sizeof(typename In::storage);
  if (quantize_block::kernel_prefetches(n * sizeof(*x))) {
    for (; i + 32 <= n; i += 32) {
      quantize_block::prefetch_lines<32 * sizeof(typename In::storage)>(x + i + kAhead);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), cast32_lanes<In, Out>(x + i, scale + i));
    }
  }
  for (; i + 32 <= n; i += 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), cast32_lanes<In, Out>(x + i, scale + i));
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = to_fp8<Out>(load_hp<In>(x + i), _mm256_loadu_ps(scale + i));
    const __m256i hi = to_fp8<Out>(load_hp<In>(x + i + 8), _mm256_loadu_ps(scale + i + 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), pack_bytes(lo, hi));
  }
  if (i < n) {
    const int64_t rest = n - i, n0 = std::min<int64_t>(rest, 8);
    const __m256i lo = to_fp8<Out>(load_hp<In>(x + i, n0), load_scales(scale + i, n0));
    const __m256i hi = rest > 8 ? to_fp8<Out>(load_hp<In>(x + i + 8, rest - 8), load_scales(scale + i + 8, rest - 8))
                                : _mm256_setzero_si256();
    alignas(16) uint8_t bytes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), pack_bytes(lo, hi));
    std::memcpy(q + i, bytes, static_cast<size_t>(rest));
  }
}

// amax of x[b, e), folding |x[i]| into col_amax[i] on the way.
template <typename In>
TL_LANE_INLINE float amax_fold(const typename In::storage* x, int64_t b, int64_t e, float* col_amax) {
  __m256i acc = _mm256_setzero_si256();
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256i a = abs_bits(load_hp<In>(x + i));
    acc = _mm256_max_epu32(acc, a);
    __m256i* c = reinterpret_cast<__m256i*>(col_amax + i);
    _mm256_storeu_si256(c, _mm256_max_epu32(_mm256_loadu_si256(c), a));
  }
  uint32_t bits = reduce_max_epu32(acc);
  for (; i < e; ++i) {
    const float v = In::load(x[i]);
    col_amax[i] = fp8::amax_update(col_amax[i], v);
    bits = std::max(bits, fp8::bits_of(v) & 0x7fffffffu);
  }
  return fp8::float_of(bits);
}

// q[i] = quantize(x[i], scale) for i in [b, e); with kStream, q + b is 16-byte aligned.
// With `ahead` > 0, prefetches the input `ahead` elements past each 32 it casts.
template <typename In, typename Out, bool kStream>
TL_LANE_INLINE void cast_block(const typename In::storage* x, uint8_t* q, float scale, int64_t b, int64_t e,
                               int64_t ahead) {
  const __m256 sc = _mm256_set1_ps(scale);
  float code_sc;
  // The 32-lane cast needs scale * kCodeScale exact; the 16-lane one below takes any scale.
  const int64_t e32 = code_scale<Out>(scale, &code_sc) ? e : b;
  int64_t i = b;
  for (; i + 32 <= e32; i += 32) {
    if (ahead > 0) quantize_block::prefetch_lines<32 * sizeof(typename In::storage)>(x + i + ahead);
    const __m256i bytes = cast32<In, Out>(x + i, _mm256_set1_ps(code_sc));
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(bytes));
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i + 16), _mm256_extracti128_si256(bytes, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
    }
  }
  for (; i + 16 <= e; i += 16) {
    const __m128i v = pack_bytes(to_fp8<Out>(load_hp<In>(x + i), sc), to_fp8<Out>(load_hp<In>(x + i + 8), sc));
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), v);
    }
  }
  if (i < e) {
    const int64_t rest = e - i, n0 = std::min<int64_t>(rest, 8);
    const __m256i lo = to_fp8<Out>(load_hp<In>(x + i, n0), sc);
    const __m256i hi = rest > 8 ? to_fp8<Out>(load_hp<In>(x + i + 8, rest - 8), sc) : _mm256_setzero_si256();
    alignas(16) uint8_t bytes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), pack_bytes(lo, hi));
    std::memcpy(q + i, bytes, static_cast<size_t>(rest));
  }
}

// block_scale_of for 8 blocks: amax[0, 8) -> scale[0, 8), scale_inv[index, index + 8), bitwise the
// scalar function (the same IEEE divisions; E8M0 with the ceil rule only).
TL_LANE_INLINE void block_scales8(const float* amax, const quantize_block::ScaleRule& rule, void* scale_inv,
                                  int64_t index, float* scale) {
  const __m256 a = _mm256_loadu_ps(amax);
  const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  const __m256 abs_a = _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  // amax > 0 and finite; other lanes take the fallback (scale 1, E8M0 exponent 0).
  const __m256 valid = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ),
                                     _mm256_cmp_ps(abs_a, inf, _CMP_LT_OQ));
  const __m256 fp8_max = _mm256_set1_ps(rule.fp8_max);
  if (rule.e8m0) {
    const __m256i v = _mm256_castps_si256(_mm256_div_ps(a, fp8_max));
    const __m256i biased = _mm256_srli_epi32(v, 23);
    const __m256i mantissa = _mm256_and_si256(v, _mm256_set1_epi32(0x7fffff));
    const __m256i inexact = _mm256_xor_si256(_mm256_cmpeq_epi32(mantissa, _mm256_setzero_si256()),
                                             _mm256_set1_epi32(-1));
    const __m256i above_half = _mm256_cmpgt_epi32(mantissa, _mm256_set1_epi32(0x400000));
    const __m256i up = _mm256_blendv_epi8(above_half, inexact, _mm256_cmpgt_epi32(biased, _mm256_setzero_si256()));
    __m256i e = _mm256_sub_epi32(_mm256_sub_epi32(biased, _mm256_set1_epi32(fp8::kE8M0Bias)), up);
    e = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(-fp8::kE8M0Bias)), _mm256_set1_epi32(fp8::kE8M0Bias));
    e = _mm256_and_si256(e, _mm256_castps_si256(valid));
    const __m256i bits = _mm256_add_epi32(e, _mm256_set1_epi32(fp8::kE8M0Bias));  // 0..254
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(scale_inv) + index), _mm_packus_epi16(w, w));
    // exp2_int(-e): 2^-127 is the subnormal 0x00400000, the rest normal.
    const __m256i ne_biased = _mm256_sub_epi32(_mm256_set1_epi32(127), e);  // -e + 127 in [0, 254]
    const __m256i sc = _mm256_blendv_epi8(_mm256_slli_epi32(ne_biased, 23), _mm256_set1_epi32(0x00400000),
                                          _mm256_cmpeq_epi32(ne_biased, _mm256_setzero_si256()));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale), sc);
    return;
  }
  __m256 sc = _mm256_div_ps(fp8_max, a);
  sc = _mm256_blendv_ps(_mm256_set1_ps(fp8::kFloatMax), sc, _mm256_cmp_ps(sc, inf, _CMP_LT_OQ));
  sc = _mm256_max_ps(sc, _mm256_set1_ps(fp8::kFloatMinNormal));
  sc = _mm256_blendv_ps(_mm256_set1_ps(1.0f), sc, valid);
  if (rule.power_2) sc = _mm256_and_ps(sc, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xff800000u))));
  _mm256_storeu_ps(scale, sc);
  _mm256_storeu_ps(static_cast<float*>(scale_inv) + index, _mm256_div_ps(_mm256_set1_ps(1.0f), sc));
}

// block_scale_of for blocks [0, n): 8 at a time where the rule allows.
TL_LANE_INLINE void block_scales(const float* amax, int64_t n, const quantize_block::ScaleRule& rule, void* scale_inv,
                                 int64_t index, float* scale) {
  int64_t j = 0;
  if (!(rule.e8m0 && rule.e8m0_floor)) {
    for (; j + 8 <= n; j += 8) block_scales8(amax + j, rule, scale_inv, index + j, scale + j);
    if (j < n) {
      // The last n - j through a padded vector (an amax of 0 gives scale 1 in the unused lanes):
      // runs of a few blocks would otherwise take the scalar path.
      const int64_t rest = n - j;
      alignas(64) float a[8] = {}, sc[8], inv[8];
      std::memcpy(a, amax + j, static_cast<size_t>(rest) * sizeof(float));
      block_scales8(a, rule, inv, 0, sc);
      std::memcpy(scale + j, sc, static_cast<size_t>(rest) * sizeof(float));
      if (rule.e8m0) {
        std::memcpy(static_cast<uint8_t*>(scale_inv) + index + j, inv, static_cast<size_t>(rest));
      } else {
        std::memcpy(static_cast<float*>(scale_inv) + index + j, inv, static_cast<size_t>(rest) * sizeof(float));
      }
      return;
    }
  }
  for (; j < n; ++j) scale[j] = quantize_block::block_scale_of(amax[j], rule, scale_inv, index + j);
}

// amax_range, inlined into the row kernel (one call per block of 32 cost as much as its loads).
template <typename In>
TL_LANE_INLINE float block_amax(const typename In::storage* x, int64_t b, int64_t e) {
  if constexpr (std::is_same_v<In, Float32>) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
      acc0 = _mm256_max_epu32(acc0, abs_bits(_mm256_loadu_ps(x + i)));
      acc1 = _mm256_max_epu32(acc1, abs_bits(_mm256_loadu_ps(x + i + 8)));
    }
    for (; i < e; i += 8) acc0 = _mm256_max_epu32(acc0, abs_bits(load_hp<In>(x + i, std::min<int64_t>(8, e - i))));
    return fp8::float_of(reduce_max_epu32(_mm256_max_epu32(acc0, acc1)));
  } else {  // 16-bit formats straight on the bits
    const __m256i mag = _mm256_set1_epi16(0x7fff);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
      acc0 = _mm256_max_epu16(acc0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mag));
      acc1 = _mm256_max_epu16(acc1,
                              _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16)), mag));
    }
    acc0 = _mm256_max_epu16(acc0, acc1);
    __m128i m = _mm_max_epu16(_mm256_castsi256_si128(acc0), _mm256_extracti128_si256(acc0, 1));
    m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0xb1));
    m = _mm_max_epu16(m, _mm_srli_epi32(m, 16));
    uint32_t bits = static_cast<uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffu;
    for (; i < e; ++i) bits = std::max<uint32_t>(bits, x[i] & 0x7fffu);
    return In::load(static_cast<uint16_t>(bits));
  }
}

// Lane j of the result: the largest of v[j]'s lanes (unsigned 32-bit), 8 vectors in 21 instructions
// where 8 reduce_max_epu32 take 56.
TL_LANE_INLINE __m256i reduce8_max_epu32(const __m256i (&v)[8]) {
  __m256i t[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    // per 128-bit lane: max(v[2k][0], v[2k][2]), max(v[2k+1][0], v[2k+1][2]), then the same of [1], [3]
    const __m256i a = v[2 * k], b = v[2 * k + 1];
    t[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  }
  // per 128-bit lane: the maxima of that lane of v[0..3] (u0) and v[4..7] (u1)
  const __m256i u0 = _mm256_max_epu32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
  const __m256i u1 = _mm256_max_epu32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The amaxes of the 8 whole blocks of seg (a multiple of 32) elements from x + b into amax[0, 8), as
// block_amax / amax_fold (folding |x[i]| into col_amax[i] when given) would give them one by one.
template <typename In>
TL_LANE_INLINE void amax8(const typename In::storage* x, int64_t b, int64_t seg, float* amax, float* col_amax) {
  __m256i acc[8];
  if (!col_amax && !std::is_same_v<In, Float32>) {
    // 16-bit formats on the bits, as block_amax; the words' maxima widened to 32 bits.
    const __m256i mag = _mm256_set1_epi16(0x7fff);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const typename In::storage* xb = x + b + k * seg;
      __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
      for (int64_t i = 0; i < seg; i += 32) {
        a0 = _mm256_max_epu16(a0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + i)), mag));
        a1 = _mm256_max_epu16(a1,
                              _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + i + 16)), mag));
      }
      a0 = _mm256_max_epu16(a0, a1);
      acc[k] = _mm256_max_epu32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a0)),
                                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a0, 1)));
    }
    alignas(32) uint32_t bits[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bits), reduce8_max_epu32(acc));
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) amax[k] = In::load(static_cast<uint16_t>(bits[k]));
    return;
  }
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const int64_t bk = b + k * seg;
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int64_t i = bk; i < bk + seg; i += 16) {
      const __m256i v0 = abs_bits(load_hp<In>(x + i)), v1 = abs_bits(load_hp<In>(x + i + 8));
      a0 = _mm256_max_epu32(a0, v0);
      a1 = _mm256_max_epu32(a1, v1);
      if (col_amax) {
        __m256i* c = reinterpret_cast<__m256i*>(col_amax + i);
        _mm256_storeu_si256(c, _mm256_max_epu32(_mm256_loadu_si256(c), v0));
        _mm256_storeu_si256(c + 1, _mm256_max_epu32(_mm256_loadu_si256(c + 1), v1));
      }
    }
    acc[k] = _mm256_max_epu32(a0, a1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax), reduce8_max_epu32(acc));
}

template <typename In, typename Out, bool kStream>
void row_blocks_impl(const typename In::storage* x, uint8_t* q, int64_t n, int64_t seg,
                     const quantize_block::ScaleRule& rule, void* scale_inv, int64_t first, float* col_amax) {
  // Up to kGroup blocks at a time: their amaxes, then their scales, then their
  // casts, so that the scale math of one block (two divisions) does not sit
  // between its amax and its cast.
  constexpr int64_t kGroup = 32;
  float amax[kGroup], scale[kGroup];
  // Rows as long as a page: the casts of a group prefetch the next group's
  // input (the next row's start past the last), so that its amax pass reads
  // from cache while the casts keep the core busy. Shorter rows are
  // prefetched by the driver.
  const int64_t ahead = quantize_block::kernel_prefetches(n * sizeof(*x)) ? std::min(n, kGroup * seg) : 0;
  for (int64_t j0 = 0, b0 = 0; b0 < n; j0 += kGroup, b0 += kGroup * seg) {
    const int64_t nj = std::min<int64_t>(kGroup, (n - b0 + seg - 1) / seg);
    int64_t j = 0;
    if (seg % 32 == 0) {  // whole blocks 8 at a time, their lane maxima reduced together
      for (; j + 8 <= nj && b0 + (j + 8) * seg <= n; j += 8) amax8<In>(x, b0 + j * seg, seg, amax + j, col_amax);
    }
    for (; j < nj; ++j) {
      const int64_t b = b0 + j * seg, e = std::min(n, b + seg);
      amax[j] = col_amax ? amax_fold<In>(x, b, e, col_amax) : block_amax<In>(x, b, e);
    }
    block_scales(amax, nj, rule, scale_inv, first + j0, scale);
    for (int64_t j = 0; j < nj; ++j) {
      const int64_t b = b0 + j * seg;
      cast_block<In, Out, kStream>(x, q, scale[j], b, std::min(n, b + seg), ahead);
    }
  }
}

// The row-major output goes out with ordinary stores: on Zen 3 / Zen 4 the
// 16-byte non-temporal stores AVX2 has for it measured no faster (slower for
// bf16 input) than letting the lines through the cache. `stream` is ignored.
template <typename In, typename Out>
void row_blocks(const void* xv, uint8_t* q, int64_t n, int64_t seg, const quantize_block::ScaleRule& rule,
                void* scale_inv, int64_t first, float* col_amax, bool /*stream*/) {
  row_blocks_impl<In, Out, false>(static_cast<const typename In::storage*>(xv), q, n, seg, rule, scale_inv, first,
                                  col_amax);
}

// Rows of up to 128 bytes from a buffer of up to 32 rows (row j at buffer + j * 128) to
// dst + j * ld_dst: whole 32-byte stores, non-temporal when kStream and aligned.
template <bool kStream>
TL_LANE_INLINE void flush_rows(const uint8_t* buffer, int64_t nrows, int64_t nbytes, uint8_t* dst, int64_t ld_dst) {
  for (int64_t j = 0; j < nrows; ++j) {
    const uint8_t* row = buffer + j * 128;
    uint8_t* out = dst + j * ld_dst;
    if (nbytes == 128) {
      const bool stream = kStream && (reinterpret_cast<uintptr_t>(out) & 31) == 0;
#pragma GCC unroll 4
      for (int b = 0; b < 128; b += 32) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + b));
        if (stream) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(out + b), v);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), v);
        }
      }
    } else {
      std::memcpy(out, row, static_cast<size_t>(nbytes));
    }
  }
}

// One round of the 16 x 16 byte transpose on both 128-bit lanes at once: interleave row i with row i + 8.
TL_LANE_INLINE void interleave_round(const __m256i (&in)[16], __m256i (&out)[16]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    out[2 * i] = _mm256_unpacklo_epi8(in[i], in[i + 8]);
    out[2 * i + 1] = _mm256_unpackhi_epi8(in[i], in[i + 8]);
  }
}

// Two 16 x 16 byte transposes, one per 128-bit lane: rows[i] holds row i of columns [0, 16) (low lane)
// and of [16, 32) (high lane); afterwards rows[j] holds column j (low) and column 16 + j (high).
TL_LANE_INLINE void transpose16x32(__m256i (&rows)[16]) {
  __m256i tmp[16];
  interleave_round(rows, tmp);
  interleave_round(tmp, rows);
  interleave_round(rows, tmp);
  interleave_round(tmp, rows);
}

// dst[c * ld_dst + r] = src[r * ld_src + c]: blocks of 16 rows x 32 columns (16 x 16 with the
// columns left over) transposed in registers into a buffer of 32 output rows x 128 bytes, which
// then goes out row by row in whole 32-byte stores (flush_rows).
template <bool kStream>
void transpose_out_impl(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                        int64_t ld_dst) {
  constexpr int64_t kChunk = 128;
  alignas(64) uint8_t buffer[32 * kChunk];
  int64_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
      const int64_t nr0 = std::min(kChunk, rows - r0);
      for (int64_t r = 0; r < nr0; r += 16) {
        const int64_t nrows = std::min<int64_t>(16, nr0 - r);
        const uint8_t* sr = src + (r0 + r) * ld_src + c;
        __m256i block[16];
        if (nrows == 16) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) block[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + i * ld_src));
        } else {
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            block[i] = i < nrows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + i * ld_src))
                                 : _mm256_setzero_si256();
          }
        }
        transpose16x32(block);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          _mm_store_si128(reinterpret_cast<__m128i*>(buffer + j * kChunk + r), _mm256_castsi256_si128(block[j]));
          _mm_store_si128(reinterpret_cast<__m128i*>(buffer + (16 + j) * kChunk + r),
                          _mm256_extracti128_si256(block[j], 1));
        }
      }
      flush_rows<kStream>(buffer, 32, nr0, dst + c * ld_dst + r0, ld_dst);
    }
  }
  for (; c < cols; c += 16) {
    const int64_t nc = std::min<int64_t>(16, cols - c);
    for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
      const int64_t nr0 = std::min(kChunk, rows - r0);
      for (int64_t r = 0; r < nr0; r += 16) {
        const int64_t nrows = std::min<int64_t>(16, nr0 - r);
        const uint8_t* sr = src + (r0 + r) * ld_src + c;
        __m128i block[16];
        if (nc == 16 && nrows == 16) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) block[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + i * ld_src));
        } else {
          for (int64_t i = 0; i < 16; ++i) {
            alignas(16) uint8_t row[16] = {};
            if (i < nrows) std::memcpy(row, sr + i * ld_src, static_cast<size_t>(nc));
            block[i] = _mm_load_si128(reinterpret_cast<const __m128i*>(row));
          }
        }
        sse2::transpose16x16(block);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm_store_si128(reinterpret_cast<__m128i*>(buffer + j * kChunk + r), block[j]);
      }
      flush_rows<kStream>(buffer, nc, nr0, dst + c * ld_dst + r0, ld_dst);
    }
  }
}

void transpose_out(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld_dst,
                   bool stream) {
  if (stream) {
    transpose_out_impl<true>(src, ld_src, rows, cols, dst, ld_dst);
  } else {
    transpose_out_impl<false>(src, ld_src, rows, cols, dst, ld_dst);
  }
}

void scales(const float* amax, int64_t n, const quantize_block::ScaleRule& rule, void* scale_inv, float* scale) {
  block_scales(amax, n, rule, scale_inv, 0, scale);
}

void fence() { _mm_sfence(); }

// The segment kernels (128 x 128 blocks: a row's blocks' amaxes, then their casts) on the
// inlined block kernels of row_blocks, not a call of amax_range / cast_range per block.
template <typename In>
void segment_amax(const void* xv, int64_t n, int64_t seg, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    amax[j] = fp8::amax_update(amax[j], block_amax<In>(x, b, std::min(n, b + seg)));
  }
}

// With `stream` (row-major-only 128 x 128 blocks: each row of a tile is a few whole lines, whose
// read for ownership the ordinary stores waited on) the blocks whose output is 16-byte aligned go
// out with non-temporal stores.
template <typename In, typename Out>
void segment_cast(const void* xv, uint8_t* q, int64_t n, int64_t seg, const float* scale, bool stream) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    const int64_t e = std::min(n, b + seg);
    if (stream && (reinterpret_cast<uintptr_t>(q + b) & 15) == 0) {
      cast_block<In, Out, true>(x, q, scale[j], b, e, 0);
    } else {
      cast_block<In, Out, false>(x, q, scale[j], b, e, 0);
    }
  }
}

// RowKernels::copy_out: 32-byte stores, non-temporal when `stream` and the row is aligned.
void copy_out(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld_dst,
              bool stream) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * ld_src;
    uint8_t* d = dst + r * ld_dst;
    int64_t c = 0;
    if (stream && (reinterpret_cast<uintptr_t>(d) & 31) == 0) {
      for (; c + 32 <= cols; c += 32) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + c),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c)));
      }
    }
    std::memcpy(d + c, s + c, static_cast<size_t>(cols - c));
  }
}

constexpr decltype(quantize_block::RowKernels::copy_out) copy_out_kernel() { return &copy_out; }

#include "quantize_block_cpu_vec.h"  // the RowKernels table

}  // namespace
}  // namespace avx2

namespace quantize_block {

RowKernels avx2_kernels(DType in, DType out) { return avx2::block_row_kernels(in, out); }

}  // namespace quantize_block
}  // namespace cpu
}  // namespace tl
