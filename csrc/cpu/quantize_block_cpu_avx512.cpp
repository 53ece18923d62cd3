// AVX-512 row kernels of the CPU blockwise quantize (quantize_block_cpu.h),
// 16 lanes at a time on quantize_lanes_avx512.h's loads and cast.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "quantize_block_cpu.h"
#include "quantize_lanes_avx512.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx512 {
namespace {

// Running amaxes are non-negative floats or NaN, so their bits compare like the lanes'.
template <typename In>
void column_amax(const void* xv, int64_t n, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i a = _mm512_loadu_si512(amax + i);
    _mm512_storeu_si512(amax + i, _mm512_max_epu32(a, abs_bits(load_hp<In>(x + i))));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512i a = _mm512_maskz_loadu_epi32(m, amax + i);
    _mm512_mask_storeu_epi32(amax + i, m, _mm512_max_epu32(a, abs_bits(load_hp<In>(x + i, m))));
  }
}

// 64 lanes at a time on quantize_lanes_avx512.h's fp8_bytes_scaled (block scales are positive and
// finite), the rest 16 at a time (to_fp8).
template <typename In, typename Out>
void column_cast(const void* xv, uint8_t* q, int64_t n, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 v[4], sc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      v[j] = load_hp<In>(x + i + 16 * j);
      sc[j] = _mm512_loadu_ps(scale + i + 16 * j);
    }
    _mm512_storeu_si512(q + i, fp8_bytes_scaled<Out>(v, sc));
  }
  for (; i + 16 <= n; i += 16) {
    const __m128i b = to_fp8<Out>(load_hp<In>(x + i), _mm512_loadu_ps(scale + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm_mask_storeu_epi8(q + i, m, to_fp8<Out>(load_hp<In>(x + i, m), _mm512_maskz_loadu_ps(m, scale + i)));
  }
}

// amax of x[b, e), folding |x[i]| into col_amax[i] on the way.
template <typename In>
TL_LANE_INLINE float amax_fold(const typename In::storage* x, int64_t b, int64_t e, float* col_amax) {
  __m512i acc = _mm512_setzero_si512();
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512i a = abs_bits(load_hp<In>(x + i));
    acc = _mm512_max_epu32(acc, a);
    _mm512_storeu_si512(col_amax + i, _mm512_max_epu32(_mm512_loadu_si512(col_amax + i), a));
  }
  if (i < e) {
    const __mmask16 m = tail_mask(e - i);
    const __m512i a = abs_bits(load_hp<In>(x + i, m));
    acc = _mm512_max_epu32(acc, a);
    _mm512_mask_storeu_epi32(col_amax + i, m, _mm512_max_epu32(_mm512_maskz_loadu_epi32(m, col_amax + i), a));
  }
  return fp8::float_of(_mm512_reduce_max_epu32(acc));
}

// q[i] = quantize(x[i], sc) for i in [b, e); with kStream, q + b is 16-byte aligned.
// With `ahead` > 0, prefetches the input `ahead` elements past each 32 it casts.
template <typename In, typename Out, bool kStream>
TL_LANE_INLINE void cast_block(const typename In::storage* x, uint8_t* q, __m512 sc, int64_t b, int64_t e,
                               int64_t ahead) {
  int64_t i = b;
  for (; i + 32 <= e; i += 32) {
    if (ahead > 0) quantize_block::prefetch_lines<32 * sizeof(typename In::storage)>(x + i + ahead);
    const __m128i v0 = to_fp8<Out>(load_hp<In>(x + i), sc);
    const __m128i v1 = to_fp8<Out>(load_hp<In>(x + i + 16), sc);
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), v0);
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i + 16), v1);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), v0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i + 16), v1);
    }
  }
  for (; i + 16 <= e; i += 16) {
    const __m128i v = to_fp8<Out>(load_hp<In>(x + i), sc);
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), v);
    }
  }
  if (i < e) {
    const __mmask16 m = tail_mask(e - i);
    _mm_mask_storeu_epi8(q + i, m, to_fp8<Out>(load_hp<In>(x + i, m), sc));
  }
}

// q[i] = quantize(x[i], scale[(i - b) / seg]) for i in [b, e): blocks of seg elements from b, each with
// its (positive, finite) scale. Where seg is a multiple of 32, 64 lanes at a time (each half of a chunk
// in one block) on the 64-lane cast; the rest block by block, 16 lanes at a time (cast_block). With
// kStream, q + b is 16-byte aligned; with `ahead` > 0, prefetches the input `ahead` elements on.
template <typename In, typename Out, bool kStream>
TL_LANE_INLINE void cast_blocks(const typename In::storage* x, uint8_t* q, const float* scale, int64_t seg,
                                int64_t b, int64_t e, int64_t ahead) {
  int64_t i = b;
  if (seg % 32 == 0) {
    for (; i + 64 <= e; i += 64) {
      if (ahead > 0) quantize_block::prefetch_lines<64 * sizeof(typename In::storage)>(x + i + ahead);
      const __m512 s0 = _mm512_set1_ps(scale[(i - b) / seg]), s1 = _mm512_set1_ps(scale[(i + 32 - b) / seg]);
      __m512i bytes;
      if constexpr (std::is_same_v<In, BFloat16>) {
        const __m512i h0 = _mm512_loadu_si512(x + i), h1 = _mm512_loadu_si512(x + i + 32);
        const __m512i mag = _mm512_set1_epi16(0x7fff);
        bytes = fp8_bytes_bf16_scaled<Out>(h0, h1, _mm512_and_si512(h0, mag), _mm512_and_si512(h1, mag), s0, s1);
      } else {
        __m512 v[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) v[j] = load_hp<In>(x + i + 16 * j);
        const __m512 sc[4] = {s0, s0, s1, s1};
        bytes = fp8_bytes_scaled<Out>(v, sc);
      }
      store_bytes64<kStream>(q + i, bytes);
    }
  }
  while (i < e) {
    const int64_t j = (i - b) / seg, block_end = std::min(e, b + (j + 1) * seg);
    cast_block<In, Out, kStream>(x, q, _mm512_set1_ps(scale[j]), i, block_end, ahead);
    i = block_end;
  }
}

// block_scale_of for 16 blocks: amax[0, 16) -> scale[0, 16), scale_inv[index, index + 16), bitwise the
// scalar function (the same IEEE divisions; E8M0 with the ceil rule only).
TL_LANE_INLINE void block_scales16(const float* amax, const quantize_block::ScaleRule& rule, void* scale_inv,
                                   int64_t index, float* scale) {
  const __m512 a = _mm512_loadu_ps(amax);
  const __m512 inf = _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000));
  const __m512 abs_a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  // amax > 0 and finite; other lanes take the fallback (scale 1, E8M0 exponent 0).
  const __mmask16 valid = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ) &
                          _mm512_cmp_ps_mask(abs_a, inf, _CMP_LT_OQ);
  const __m512 fp8_max = _mm512_set1_ps(rule.fp8_max);
  if (rule.e8m0) {
    const __m512i v = _mm512_castps_si512(_mm512_div_ps(a, fp8_max));
    const __m512i biased = _mm512_srli_epi32(v, 23);
    const __m512i mantissa = _mm512_and_si512(v, _mm512_set1_epi32(0x7fffff));
    const __mmask16 up = (_mm512_cmpgt_epi32_mask(biased, _mm512_setzero_si512()) &
                          _mm512_test_epi32_mask(mantissa, mantissa)) |
                         (_mm512_cmpeq_epi32_mask(biased, _mm512_setzero_si512()) &
                          _mm512_cmpgt_epi32_mask(mantissa, _mm512_set1_epi32(0x400000)));
    __m512i e = _mm512_sub_epi32(biased, _mm512_set1_epi32(fp8::kE8M0Bias));
    e = _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-fp8::kE8M0Bias)), _mm512_set1_epi32(fp8::kE8M0Bias));
    e = _mm512_maskz_mov_epi32(valid, e);
    const __m512i bits = _mm512_add_epi32(e, _mm512_set1_epi32(fp8::kE8M0Bias));  // 0..254
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(scale_inv) + index), _mm512_cvtepi32_epi8(bits));
    // exp2_int(-e): 2^-127 is the subnormal 0x00400000, the rest normal.
    const __m512i ne_biased = _mm512_sub_epi32(_mm512_set1_epi32(127), e);  // -e + 127 in [0, 254]
    const __m512i sc = _mm512_mask_mov_epi32(_mm512_slli_epi32(ne_biased, 23),
                                             _mm512_cmpeq_epi32_mask(ne_biased, _mm512_setzero_si512()),
                                             _mm512_set1_epi32(0x00400000));
    _mm512_storeu_si512(scale, sc);
    return;
  }
  __m512 sc = _mm512_div_ps(fp8_max, a);
  sc = _mm512_mask_mov_ps(_mm512_set1_ps(fp8::kFloatMax), _mm512_cmp_ps_mask(sc, inf, _CMP_LT_OQ), sc);
  sc = _mm512_max_ps(sc, _mm512_set1_ps(fp8::kFloatMinNormal));
  sc = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), valid, sc);
  if (rule.power_2) {
    sc = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(sc), _mm512_set1_epi32(static_cast<int>(0xff800000u))));
  }
  _mm512_storeu_ps(scale, sc);
  _mm512_storeu_ps(static_cast<float*>(scale_inv) + index, _mm512_div_ps(_mm512_set1_ps(1.0f), sc));
}

// block_scale_of for blocks [0, n): 16 at a time where the rule allows.
TL_LANE_INLINE void block_scales(const float* amax, int64_t n, const quantize_block::ScaleRule& rule, void* scale_inv,
                                 int64_t index, float* scale) {
  int64_t j = 0;
  if (!(rule.e8m0 && rule.e8m0_floor)) {
    for (; j + 16 <= n; j += 16) block_scales16(amax + j, rule, scale_inv, index + j, scale + j);
    if (j < n) {
      // The last n - j through a padded vector (an amax of 0 gives scale 1 in the unused lanes):
      // runs of a few blocks would otherwise take the scalar path.
      const int64_t rest = n - j;
      alignas(64) float a[16] = {}, sc[16], inv[16];
      std::memcpy(a, amax + j, static_cast<size_t>(rest) * sizeof(float));
      block_scales16(a, rule, inv, 0, sc);
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
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
      acc0 = _mm512_max_epu32(acc0, abs_bits(load_hp<In>(x + i)));
      acc1 = _mm512_max_epu32(acc1, abs_bits(load_hp<In>(x + i + 16)));
    }
    for (; i < e; i += 16) acc0 = _mm512_max_epu32(acc0, abs_bits(load_hp<In>(x + i, tail_mask(std::min<int64_t>(16, e - i)))));
    return fp8::float_of(_mm512_reduce_max_epu32(_mm512_max_epu32(acc0, acc1)));
  } else {  // 16-bit formats straight on the bits
    const __m512i mag = _mm512_set1_epi16(0x7fff);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = b; i < e; i += 32) {
      const __mmask32 m = e - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (e - i)) - 1u);
      acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, x + i), mag));
    }
    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(acc));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(acc, 1));
    return In::load(static_cast<uint16_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi))));
  }
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
    for (int64_t j = 0; j < nj; ++j) {
      const int64_t b = b0 + j * seg, e = std::min(n, b + seg);
      amax[j] = col_amax ? amax_fold<In>(x, b, e, col_amax) : block_amax<In>(x, b, e);
    }
    block_scales(amax, nj, rule, scale_inv, first + j0, scale);
    cast_blocks<In, Out, kStream>(x, q, scale, seg, b0, std::min(n, b0 + nj * seg), ahead);
  }
}

template <typename In, typename Out>
void row_blocks(const void* xv, uint8_t* q, int64_t n, int64_t seg, const quantize_block::ScaleRule& rule,
                void* scale_inv, int64_t first, float* col_amax, bool stream) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  if (stream && ((reinterpret_cast<uintptr_t>(q) | static_cast<uintptr_t>(seg)) & 15) == 0) {
    row_blocks_impl<In, Out, true>(x, q, n, seg, rule, scale_inv, first, col_amax);
  } else {
    row_blocks_impl<In, Out, false>(x, q, n, seg, rule, scale_inv, first, col_amax);
  }
}

// Rows of up to 128 bytes from a 16-row buffer (row j at buffer + j * 128) to
// dst + j * ld_dst: whole 64-byte stores, non-temporal when kStream and aligned.
template <bool kStream>
TL_LANE_INLINE void flush_rows(const uint8_t* buffer, int64_t nrows, int64_t nbytes, uint8_t* dst, int64_t ld_dst) {
  for (int64_t j = 0; j < nrows; ++j) {
    const uint8_t* row = buffer + j * 128;
    uint8_t* out = dst + j * ld_dst;
    for (int64_t b = 0; b < nbytes; b += 64) {
      const int64_t n = std::min<int64_t>(64, nbytes - b);
      if (kStream && n == 64 && (reinterpret_cast<uintptr_t>(out + b) & 63) == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + b), _mm512_load_si512(row + b));
      } else {
        const __mmask64 m = n == 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
        _mm512_mask_storeu_epi8(out + b, m, _mm512_load_si512(row + b));
      }
    }
  }
}

template <bool kStream>
void transpose_out_impl(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                        int64_t ld_dst) {
  constexpr int64_t kChunk = 128;
  alignas(64) uint8_t buffer[16 * kChunk];
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t nc = std::min<int64_t>(16, cols - c);
    const __mmask16 col_mask = tail_mask(nc);
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
            block[i] = i < nrows ? _mm_maskz_loadu_epi8(col_mask, sr + i * ld_src) : _mm_setzero_si128();
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

template <typename In>
void segment_amax(const void* xv, int64_t n, int64_t seg, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    amax[j] = fp8::amax_update(amax[j], amax_range<In>(x, b, std::min(n, b + seg)));
  }
}

template <typename In, typename Out>
void segment_cast(const void* xv, uint8_t* q, int64_t n, int64_t seg, const float* scale, bool /*stream*/) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    cast_range<In, Out, false, false>(x, q, scale[j], b, std::min(n, b + seg));
  }
}

// No copy_out: 128 x 128 blocks are cast straight into output and transposed from it.
constexpr decltype(quantize_block::RowKernels::copy_out) copy_out_kernel() { return nullptr; }

#include "quantize_block_cpu_vec.h"  // the RowKernels table

}  // namespace
}  // namespace avx512

namespace quantize_block {

RowKernels avx512_kernels(DType in, DType out) { return avx512::block_row_kernels(in, out); }

}  // namespace quantize_block
}  // namespace cpu
}  // namespace tl
