// AVX2 lane kernels shared by the quantize families (quantize_cpu_avx2.cpp,
// quantize_block_cpu_avx2.cpp): loads of 8 high-precision elements as fp32
// lanes, the bitwise cast to FP8, range amax / cast, and byte transposes.
// Include only from *_avx2.cpp files (compiled with -mavx2 -mfma -mf16c).
//
// The same function as quantize_lanes_avx512.h, 8 lanes wide. The 8-lane cast
// (to_fp8) is fp8_math.h's e4m3_bits_from_float / e5m2_bits_from_float lane by
// lane, with the same integer rounding for normals and the same float addition
// that rounds subnormals (no contracted FMA, -ffp-contract=off); the 32-lane
// cast rounds by a magic-number addition written as two explicit FMAs (see
// fp8_codes), the same rounding: results are bitwise those of the scalar path.
// AVX2 has no mask registers: comparisons give all-ones lanes for vpblendvb,
// and the partial vectors at the end of a range are read through a zeroed
// stack buffer, so no byte past the range is touched.
//
// Every lane value the comparisons see has its sign bit clear, so signed
// 32-bit comparisons order them as unsigned ones would.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fp8_cast_bits.h"
#include "transformer_linear/dispatch.h"
#include "transpose_bytes_sse2.h"

namespace tl {
namespace cpu {
namespace avx2 {

// --- loads: 8 elements -> fp32 lanes ---------------------------------------

template <typename In>
TL_LANE_INLINE __m256 widen(__m128i h) {
  if constexpr (std::is_same_v<In, Float16>) {
    return _mm256_cvtph_ps(h);
  } else {  // bfloat16 is the top half of a float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <typename In>
TL_LANE_INLINE __m256 load_hp(const typename In::storage* p) {
  if constexpr (std::is_same_v<In, Float32>) {
    return _mm256_loadu_ps(p);
  } else {
    return widen<In>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// The first n (< 8) elements at p; the other lanes read as +0.
template <typename In>
TL_LANE_INLINE __m256 load_hp(const typename In::storage* p, int64_t n) {
  typename In::storage buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(buf[0]));
  return load_hp<In>(buf);
}

TL_LANE_INLINE __m256i abs_bits(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

TL_LANE_INLINE uint32_t reduce_max_epu32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

TL_LANE_INLINE __m256i lanes_gt(__m256i a, uint32_t b) {
  return _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(b)));
}
TL_LANE_INLINE __m256i lanes_lt(__m256i a, uint32_t b) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(b)), a);
}

// --- the cast ------------------------------------------------------------

// FP8 bits of the lanes at or above kSpecialFrom: NaN, or e5m2's infinity.
template <typename B>
TL_LANE_INLINE __m256i special_bits(__m256i u) {
  if constexpr (B::kHasInf) {
    return _mm256_blendv_epi8(_mm256_set1_epi32(B::kInfBits), _mm256_set1_epi32(B::kNanBits), lanes_gt(u, B::kNanAbove));
  } else {
    return _mm256_set1_epi32(B::kNanBits);
  }
}

// Saturating RNE cast of x * scale: 8 lanes, each holding its FP8 byte (Out::quantize).
template <typename Out>
TL_LANE_INLINE __m256i to_fp8(__m256 x, __m256 scale) {
  using B = Fp8CastBits<Out>;
  __m256 v = _mm256_mul_ps(x, scale);
  // vminps/vmaxps return the second operand when either is NaN, so NaN
  // passes through as in fp8::saturate.
  v = _mm256_min_ps(_mm256_set1_ps(Out::kMax), v);
  v = _mm256_max_ps(_mm256_set1_ps(-Out::kMax), v);
  __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  u = _mm256_xor_si256(u, sign);

  const __m256i mant_odd = _mm256_and_si256(_mm256_srli_epi32(u, B::kMantShift), _mm256_set1_epi32(1));
  __m256i normal = _mm256_add_epi32(u, _mm256_set1_epi32(static_cast<int>(B::kRebias)));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, mant_odd), B::kMantShift);

  const __m256i denorm = _mm256_set1_epi32(static_cast<int>(B::kDenormMask));
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(denorm));
  const __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(sum), denorm);

  __m256i r = _mm256_blendv_epi8(normal, subnormal, lanes_lt(u, B::kSubnormalBelow));
  r = _mm256_blendv_epi8(r, special_bits<B>(u), lanes_gt(u, B::kSpecialFrom - 1));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// The low bytes of 16 lanes (values 0..255), in order, as 16 bytes.
TL_LANE_INLINE __m128i pack_bytes(__m256i lo, __m256i hi) {
  const __m128i w0 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i w1 = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  return _mm_packus_epi16(w0, w1);
}

// The cast of 32 lanes at a time, as to_fp8 but with fewer instructions. The
// saturated magnitude a = min(kMax, |x| * scale) is rounded to the FP8 grid by
// one float addition: with M = 2^(max(E, Emin) + 23 - mantissa bits) for a's
// exponent E and the format's smallest normal exponent Emin, the sum a + M has
// the FP8 grid's spacing as its unit in the last place, so it rounds a
// ties-to-even (normals and subnormals alike, the same rounding as
// fp8_math.h's), and r = (a + M) - M is exact. Both are FMAs on the power of
// two 2^max(E, Emin) (a's exponent field, at least Emin's), so M is never
// formed. r is then an FP8 value, exactly a float16, and vcvtps2ph narrows it
// to the float16 bits whose top byte is the FP8 code: for e4m3 after the
// prescale of 2^-8 (float16's exponent bias is e4m3's plus 8, so normals and
// subnormals of both line up), for e5m2 as it is (the same exponent field).
// Per 8 lanes: and (|x|, shared with a fused amax), mul, min, and, max, two
// FMAs, vcvtps2ph, and a quarter of the 32-lane packing (12 instructions per
// 32); the integer rounding (fp8_magnitude before this) was 12 after the mul,
// and its packing 8 per 32.
//
// The products are taken in the "code domain": |x| * scale * kCodeScale (2^-8
// for e4m3), where saturation and the magic numbers are scaled alike.
// Multiplying by the uniform scale * 2^-8 rounds as (x * scale) * 2^-8
// whenever that factor is exact; products that land among float32 subnormals
// there are below 2^-118 and cast to ±0 either way. The signs are the inputs'
// (packed to bytes apart and OR'd in once per 32 lanes): for a positive finite
// scale, x * scale has x's sign and |x| * scale = |x * scale|, NaN included.
// code_scale says which scales qualify; the 16-lane to_fp8 takes the others.
//
// NaN: its exponent field gives 2^max(E, Emin) = inf, r stays NaN (an FMA with
// one NaN operand returns it), and vcvtps2ph gives a float16 NaN (0x7e00 and
// up, sign clear), whose shifted bits sort above every finite code.

// float16 bits of a (>= 0 or NaN, in the code domain) saturated and rounded to the FP8 grid.
template <typename Out>
TL_LANE_INLINE __m128i fp8_grid_halves(__m256 a) {
  using H = Fp8ViaHalf<Out>;
  // vminps returns the second operand when either is NaN: NaN passes.
  a = _mm256_min_ps(_mm256_set1_ps(H::kMax), a);
  // 2^max(E, Emin): a's exponent field, at least Emin's (a NaN's gives inf).
  const __m256 p = _mm256_castsi256_ps(_mm256_max_epi32(
      _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7f800000)), _mm256_set1_epi32(H::kMinNormalBits)));
  const __m256 k = _mm256_set1_ps(H::kMagicFactor);
  const __m256 r = _mm256_fnmadd_ps(p, k, _mm256_fmadd_ps(p, k, a));  // (a + M) - M, M = p * k exactly
  return _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The FP8 codes (no sign) of 32 lanes of magnitudes in the code domain, in the
// order of the lanes (a[0]'s 8, then a[1]'s, ...). The float16 bits >> 7 are
// e4m3's code (NaN: 0xfc and up), >> 8 e5m2's (NaN: 0x7e or 0x7f, finite codes
// up to 0x7b).
template <typename Out>
TL_LANE_INLINE __m256i fp8_codes(const __m256 (&a)[4]) {
  const __m128i h0 = fp8_grid_halves<Out>(a[0]), h1 = fp8_grid_halves<Out>(a[1]);
  const __m128i h2 = fp8_grid_halves<Out>(a[2]), h3 = fp8_grid_halves<Out>(a[3]);
  // [h0 | h2], [h1 | h3]: the in-lane pack leaves h0 h1 | h2 h3.
  const __m256i w02 = _mm256_inserti128_si256(_mm256_castsi128_si256(h0), h2, 1);
  const __m256i w13 = _mm256_inserti128_si256(_mm256_castsi128_si256(h1), h3, 1);
  constexpr int kShift = Fp8ViaHalf<Out>::kHalfShift;
  const __m256i mag = _mm256_packus_epi16(_mm256_srli_epi16(w02, kShift), _mm256_srli_epi16(w13, kShift));
  if constexpr (std::is_same_v<Out, Float8E4M3>) {
    return _mm256_min_epu8(mag, _mm256_set1_epi8(0x7f));  // NaN's 0xfc and up -> 0x7f
  } else {
    // NaN's 0x7e and 0x7f -> 0x7f: code + 4 has its top bit set for NaN alone.
    return _mm256_blendv_epi8(mag, _mm256_set1_epi8(0x7f), _mm256_add_epi8(mag, _mm256_set1_epi8(4)));
  }
}

// codes with each byte's sign taken from the top bit of the same byte of sign.
TL_LANE_INLINE __m256i with_signs(__m256i codes, __m256i sign) {
  return _mm256_or_si256(codes, _mm256_and_si256(sign, _mm256_set1_epi8(static_cast<char>(0x80))));
}

// Bytes whose top bits are the signs of 32 float32 lanes, in the order of the lanes:
// signed saturating packs keep each lane's sign, one permutation undoes their order.
TL_LANE_INLINE __m256i sign_bytes(const __m256 (&x)[4]) {
  const __m256i packed =
      _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(x[0]), _mm256_castps_si256(x[1])),
                         _mm256_packs_epi32(_mm256_castps_si256(x[2]), _mm256_castps_si256(x[3])));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The FP8 bytes of x[j] * scale, in the order of the lanes; code_sc from code_scale
// (which returned true).
template <typename Out>
TL_LANE_INLINE __m256i fp8_bytes(const __m256 (&x)[4], __m256 code_sc) {
  __m256 a[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a[j] = _mm256_mul_ps(_mm256_castsi256_ps(abs_bits(x[j])), code_sc);
  return with_signs(fp8_codes<Out>(a), sign_bytes(x));
}

// As above with one positive finite scale per lane: |x[j]| * scale[j], then times
// kCodeScale (exact unless the product is below 2^-118, which casts to ±0 either way).
template <typename Out>
TL_LANE_INLINE __m256i fp8_bytes(const __m256 (&x)[4], const __m256 (&scale)[4]) {
  __m256 a[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    a[j] = _mm256_mul_ps(_mm256_castsi256_ps(abs_bits(x[j])), scale[j]);
    if constexpr (Fp8ViaHalf<Out>::kCodeScale != 1.0f) {
      a[j] = _mm256_mul_ps(a[j], _mm256_set1_ps(Fp8ViaHalf<Out>::kCodeScale));
    }
  }
  return with_signs(fp8_codes<Out>(a), sign_bytes(x));
}

// The FP8 bytes of 32 bfloat16 elements (16 in h0, 16 in h1) times the scale, in
// element order; code_sc from code_scale. habs0 and habs1 hold h0 and h1 & 0x7fff.
// Interleaving with zero words widens bfloat16 to float32 in one instruction
// per 8 lanes, in the order {0-3, 8-11}, {4-7, 12-15}, ...: one in-lane dword
// shuffle puts the codes in element order. The signs pack straight from the
// 16-bit words.
template <typename Out>
TL_LANE_INLINE __m256i fp8_bytes_bf16(__m256i h0, __m256i h1, __m256i habs0, __m256i habs1, __m256 code_sc) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 a[4];
  a[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, habs0)), code_sc);
  a[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, habs0)), code_sc);
  a[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, habs1)), code_sc);
  a[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, habs1)), code_sc);
  const __m256i codes = _mm256_shuffle_epi32(fp8_codes<Out>(a), 0xd8);
  return with_signs(codes, _mm256_permute4x64_epi64(_mm256_packs_epi16(h0, h1), 0xd8));
}

// 8 scales for the per-lane cast: the first n (< 8) of them, the rest 0.
TL_LANE_INLINE __m256 load_scales(const float* p, int64_t n) {
  float buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(float));
  return _mm256_loadu_ps(buf);
}

template <typename In, typename Out, bool kAmax, bool kStream>
float cast_range(const typename In::storage* x, uint8_t* q, float scale, int64_t begin,
                 int64_t end) {
  const __m256 sc = _mm256_set1_ps(scale);
  float code_sc_scalar;
  // The 32-lane cast needs scale * kCodeScale exact; the 16-lane one below takes any scale.
  const int64_t end32 = code_scale<Out>(scale, &code_sc_scalar) ? end : begin;
  const __m256 code_sc = _mm256_set1_ps(code_sc_scalar);
  __m256i acc = _mm256_setzero_si256();
  // Fewer than 16 elements: through stack buffers, lanes past n read as +0.
  auto partial = [&](int64_t i, int64_t n) {
    const __m256 v0 = load_hp<In>(x + i, std::min<int64_t>(n, 8));
    const __m256 v1 = n > 8 ? load_hp<In>(x + i + 8, n - 8) : _mm256_setzero_ps();
    if (kAmax) acc = _mm256_max_epu32(acc, _mm256_max_epu32(abs_bits(v0), abs_bits(v1)));
    alignas(16) uint8_t bytes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), pack_bytes(to_fp8<Out>(v0, sc), to_fp8<Out>(v1, sc)));
    std::memcpy(q + i, bytes, static_cast<size_t>(n));
  };
  int64_t i = begin;
  if (kStream) {  // align q for the 16-byte non-temporal stores
    const int64_t head = std::min<int64_t>(end - i, (16 - (reinterpret_cast<uintptr_t>(q + i) & 15)) & 15);
    if (head > 0) partial(i, head);
    i += head;
  }
  // bfloat16 amax on the 16-bit words, 16 lanes per max.
  __m256i acc16 = _mm256_setzero_si256();
  for (; i + 32 <= end32; i += 32) {
    __m256i b;
    if constexpr (std::is_same_v<In, BFloat16>) {
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16));
      const __m256i mag = _mm256_set1_epi16(0x7fff);
      const __m256i habs0 = _mm256_and_si256(h0, mag), habs1 = _mm256_and_si256(h1, mag);
      if (kAmax) acc16 = _mm256_max_epu16(acc16, _mm256_max_epu16(habs0, habs1));
      b = fp8_bytes_bf16<Out>(h0, h1, habs0, habs1, code_sc);
    } else {
      __m256 v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) v[j] = load_hp<In>(x + i + 8 * j);
      if (kAmax) {
        acc = _mm256_max_epu32(acc, _mm256_max_epu32(_mm256_max_epu32(abs_bits(v[0]), abs_bits(v[1])),
                                                      _mm256_max_epu32(abs_bits(v[2]), abs_bits(v[3]))));
      }
      b = fp8_bytes<Out>(v, code_sc);
    }
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(b));
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i + 16), _mm256_extracti128_si256(b, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), b);
    }
  }
  if constexpr (std::is_same_v<In, BFloat16> && kAmax) {  // the words' maximum, as float32 bits
    acc = _mm256_max_epu32(acc, _mm256_max_epu32(_mm256_slli_epi32(_mm256_unpacklo_epi16(acc16, _mm256_setzero_si256()), 16),
                                                  _mm256_slli_epi32(_mm256_unpackhi_epi16(acc16, _mm256_setzero_si256()), 16)));
  }
  for (; i + 16 <= end; i += 16) {
    const __m256 v0 = load_hp<In>(x + i), v1 = load_hp<In>(x + i + 8);
    if (kAmax) acc = _mm256_max_epu32(acc, _mm256_max_epu32(abs_bits(v0), abs_bits(v1)));
    const __m128i b = pack_bytes(to_fp8<Out>(v0, sc), to_fp8<Out>(v1, sc));
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), b);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
    }
  }
  if (i < end) partial(i, end - i);
  if (kStream) _mm_sfence();
  return fp8::float_of(reduce_max_epu32(acc));
}

// amax of 16-bit formats straight on the bits, 32 lanes at a time.
template <typename In>
float amax_range(const typename In::storage* x, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<In, Float32>) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
      acc0 = _mm256_max_epu32(acc0, abs_bits(_mm256_loadu_ps(x + i)));
      acc1 = _mm256_max_epu32(acc1, abs_bits(_mm256_loadu_ps(x + i + 8)));
    }
    for (; i < end; i += 8) acc0 = _mm256_max_epu32(acc0, abs_bits(load_hp<In>(x + i, std::min<int64_t>(8, end - i))));
    return fp8::float_of(reduce_max_epu32(_mm256_max_epu32(acc0, acc1)));
  } else {
    const __m256i mag = _mm256_set1_epi16(0x7fff);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = begin;
    for (; i + 32 <= end; i += 32) {
      acc0 = _mm256_max_epu16(acc0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mag));
      acc1 = _mm256_max_epu16(acc1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16)), mag));
    }
    acc0 = _mm256_max_epu16(acc0, acc1);
    const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(acc0));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(acc0, 1));
    uint32_t bits = reduce_max_epu32(_mm256_max_epu32(lo, hi));
    for (; i < end; ++i) bits = std::max<uint32_t>(bits, x[i] & 0x7fffu);
    return In::load(static_cast<uint16_t>(bits));
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 16 x 16
// byte blocks transposed in registers into a buffer of 16 output rows x 128
// bytes, which then goes out row by row (see quantize_lanes_avx512.h for why).
inline void transpose_bytes(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                            uint8_t* dst, int64_t ld_dst) {
  constexpr int64_t kChunk = 128;  // output bytes per row and buffer pass
  alignas(64) uint8_t buffer[16 * kChunk];
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t nc = std::min<int64_t>(16, cols - c);
    for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
      const int64_t nr0 = std::min(kChunk, rows - r0);
      for (int64_t r = 0; r < nr0; r += 16) {
        const int64_t nrows = std::min<int64_t>(16, nr0 - r);
        __m128i block[16];
        if (nc == 16 && nrows == 16) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            block[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (r0 + r + i) * ld_src + c));
          }
        } else {
          for (int64_t i = 0; i < 16; ++i) {
            alignas(16) uint8_t row[16] = {};
            if (i < nrows) std::memcpy(row, src + (r0 + r + i) * ld_src + c, static_cast<size_t>(nc));
            block[i] = _mm_load_si128(reinterpret_cast<const __m128i*>(row));
          }
        }
        sse2::transpose16x16(block);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm_store_si128(reinterpret_cast<__m128i*>(buffer + j * kChunk + r), block[j]);
      }
      for (int64_t j = 0; j < nc; ++j) {
        std::memcpy(dst + (c + j) * ld_dst + r0, buffer + j * kChunk, static_cast<size_t>(nr0));
      }
    }
  }
}

}  // namespace avx2
}  // namespace cpu
}  // namespace tl
