// AVX-512 lane kernels shared by the quantize families (quantize_cpu_avx512.cpp,
// quantize_block_cpu_avx512.cpp): loads of 16 high-precision elements as fp32
// lanes, the bitwise cast to FP8, range amax / cast, and byte transposes.
// Include only from *_avx512.cpp files (compiled with the AVX-512 flags).
//
// The 16-lane cast (to_fp8) follows fp8_math.h's e4m3_bits_from_float /
// e5m2_bits_from_float lane by lane: the same integer rounding for normals and
// the same float addition that rounds subnormals (no contracted FMA,
// -ffp-contract=off). The 64-lane cast (cast_range's, and the block quantize's
// with a scale per block or per column: fp8_bytes_scaled, fp8_bytes_bf16_scaled)
// rounds by a magic-number addition written as two explicit FMAs (see
// quantize_lanes_avx2.h), the same rounding. Both are bitwise the scalar path; tests/test_quantize.py,
// tests/test_quantize_cast_exhaustive.py and tests/test_blockwise_quantize.py
// check every bf16 and fp16 bit pattern and fp32 values at every boundary.
//
// amax works on the integer bits of |x|: for non-negative IEEE values the
// unsigned bit order is the value order and every NaN sorts above inf, so an
// unsigned max propagates NaN for free (which NaN comes back is unspecified).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fp8_cast_bits.h"
#include "transformer_linear/dispatch.h"
#include "transpose_bytes_sse2.h"

namespace tl {
namespace cpu {
namespace avx512 {

TL_LANE_INLINE __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// --- loads: 16 elements -> fp32 lanes (masked lanes read as +0) -----------

TL_LANE_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TL_LANE_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <typename In>
TL_LANE_INLINE __m512 widen(__m256i h) {
  if constexpr (std::is_same_v<In, Float16>) {
    return _mm512_cvtph_ps(h);
  } else {  // bfloat16 is the top half of a float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename In>
TL_LANE_INLINE __m512 load_hp(const typename In::storage* p, __mmask16 m) {
  if constexpr (std::is_same_v<In, Float32>) {
    return load16(p, m);
  } else {
    return widen<In>(_mm256_maskz_loadu_epi16(m, p));
  }
}

template <typename In>
TL_LANE_INLINE __m512 load_hp(const typename In::storage* p) {
  if constexpr (std::is_same_v<In, Float32>) {
    return load16(p);
  } else {
    return widen<In>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

TL_LANE_INLINE __m512i abs_bits(__m512 v) {
  return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
}

// --- the cast ------------------------------------------------------------

// FP8 bits of the lanes at or above kSpecialFrom: NaN, or e5m2's infinity.
template <typename B>
TL_LANE_INLINE __m512i special_bits(__m512i u) {
  if constexpr (B::kHasInf) {
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(B::kNanAbove));
    return _mm512_mask_blend_epi32(nan, _mm512_set1_epi32(B::kInfBits), _mm512_set1_epi32(B::kNanBits));
  } else {
    return _mm512_set1_epi32(B::kNanBits);
  }
}

// Saturating RNE cast of x * scale, 16 lanes -> 16 bytes (Out::quantize).
template <typename Out>
TL_LANE_INLINE __m128i to_fp8(__m512 x, __m512 scale) {
  using B = Fp8CastBits<Out>;
  __m512 v = _mm512_mul_ps(x, scale);
  // vminps/vmaxps return the second operand when either is NaN, so NaN
  // passes through as in fp8::saturate.
  v = _mm512_min_ps(_mm512_set1_ps(Out::kMax), v);
  v = _mm512_max_ps(_mm512_set1_ps(-Out::kMax), v);
  __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  u = _mm512_xor_si512(u, sign);

  const __m512i mant_odd = _mm512_and_si512(_mm512_srli_epi32(u, B::kMantShift), _mm512_set1_epi32(1));
  __m512i normal = _mm512_add_epi32(u, _mm512_set1_epi32(static_cast<int>(B::kRebias)));
  normal = _mm512_srli_epi32(_mm512_add_epi32(normal, mant_odd), B::kMantShift);

  const __m512i denorm = _mm512_set1_epi32(static_cast<int>(B::kDenormMask));
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(denorm));
  const __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(sum), denorm);

  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(B::kSubnormalBelow));
  const __mmask16 is_special = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(B::kSpecialFrom));
  __m512i r = _mm512_mask_blend_epi32(is_sub, normal, subnormal);
  r = _mm512_mask_blend_epi32(is_special, r, special_bits<B>(u));
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);  // keeps the low byte, like static_cast<uint8_t>
}

// The cast of 64 lanes at a time, as to_fp8 with fewer instructions: the
// rounding of quantize_lanes_avx2.h's 32-lane cast (a magic-number addition as
// two FMAs, then vcvtps2ph, whose float16 bits hold the FP8 code; constants in
// Fp8ViaHalf), 16 lanes wide, on |x| * scale * kCodeScale with the inputs'
// signs set once per 64 lanes (code_scale: a positive finite scale, exact in
// the code domain; the 16-lane to_fp8 takes other scales). Per 16 lanes: and
// (|x|, shared with a fused amax), mul, min, and, max, two FMAs, vcvtps2ph,
// and a quarter of the 64-lane packing (12 instructions per 64).

// float16 bits of a (>= 0 or NaN, in the code domain) saturated and rounded to the FP8 grid.
template <typename Out>
TL_LANE_INLINE __m256i fp8_grid_halves(__m512 a) {
  using H = Fp8ViaHalf<Out>;
  // vminps returns the second operand when either is NaN: NaN passes.
  a = _mm512_min_ps(_mm512_set1_ps(H::kMax), a);
  // 2^max(E, Emin): a's exponent field, at least Emin's (a NaN's gives inf).
  const __m512 p = _mm512_castsi512_ps(_mm512_max_epi32(
      _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(H::kMinNormalBits)));
  const __m512 k = _mm512_set1_ps(H::kMagicFactor);
  const __m512 r = _mm512_fnmadd_ps(p, k, _mm512_fmadd_ps(p, k, a));  // (a + M) - M, M = p * k exactly
  return _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The FP8 codes (no sign) of 64 lanes of magnitudes in the code domain, in the
// byte order the in-lane pack of [a0 | a1] and [a2 | a3]'s float16 words leaves
// them: 8-byte groups a0[0-7] a2[0-7] a0[8-15] a2[8-15] a1[0-7] a3[0-7] ...
// (fp8_bytes and fp8_bytes_bf16 permute them into element order). NaN becomes 0x7f.
template <typename Out>
TL_LANE_INLINE __m512i fp8_codes_in_pack_order(const __m512 (&a)[4]) {
  const __m512i w01 = _mm512_inserti64x4(_mm512_castsi256_si512(fp8_grid_halves<Out>(a[0])), fp8_grid_halves<Out>(a[1]), 1);
  const __m512i w23 = _mm512_inserti64x4(_mm512_castsi256_si512(fp8_grid_halves<Out>(a[2])), fp8_grid_halves<Out>(a[3]), 1);
  constexpr int kShift = Fp8ViaHalf<Out>::kHalfShift;
  const __m512i mag = _mm512_packus_epi16(_mm512_srli_epi16(w01, kShift), _mm512_srli_epi16(w23, kShift));
  if constexpr (std::is_same_v<Out, Float8E4M3>) {
    return _mm512_min_epu8(mag, _mm512_set1_epi8(0x7f));  // NaN's 0xfc and up -> 0x7f
  } else {  // NaN's 0x7e and 0x7f -> 0x7f (finite codes are at most 0x7b)
    return _mm512_mask_mov_epi8(mag, _mm512_cmpgt_epu8_mask(mag, _mm512_set1_epi8(0x7c)), _mm512_set1_epi8(0x7f));
  }
}

// codes | (sign & 0x80), byte by byte.
TL_LANE_INLINE __m512i with_signs(__m512i codes, __m512i sign) {
  return _mm512_ternarylogic_epi32(codes, sign, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // a | (b & c)
}

// The FP8 bytes of 64 float32 lanes x[j] in element order (x[0]'s 16, then x[1]'s, ...), from their
// scaled magnitudes in the code domain a[j].
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes_of(const __m512 (&x)[4], const __m512 (&a)[4]) {
  const __m512i codes = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), fp8_codes_in_pack_order<Out>(a));
  // Signed saturating packs keep each lane's sign in its byte's top bit; 4-byte
  // group l of 128-bit lane k then holds elements 16 * l + 4 * k ...: a 4x4
  // transpose of dwords puts them in order.
  const __m512i packed =
      _mm512_packs_epi16(_mm512_packs_epi32(_mm512_castps_si512(x[0]), _mm512_castps_si512(x[1])),
                         _mm512_packs_epi32(_mm512_castps_si512(x[2]), _mm512_castps_si512(x[3])));
  const __m512i sign =
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
  return with_signs(codes, sign);
}

// The FP8 bytes of 64 float32 lanes x[j] * scale in element order, code_sc = scale * kCodeScale (code_scale).
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes(const __m512 (&x)[4], __m512 code_sc) {
  __m512 a[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a[j] = _mm512_mul_ps(_mm512_castsi512_ps(abs_bits(x[j])), code_sc);
  return fp8_bytes_of<Out>(x, a);
}

// |x| * scale in the code domain for one positive finite scale per lane: the product, then times
// kCodeScale (exact unless the product is below 2^-118, which casts to ±0 either way), so any such
// scale qualifies, as in quantize_lanes_avx2.h's per-lane fp8_bytes.
template <typename Out>
TL_LANE_INLINE __m512 code_magnitude(__m512 abs_x, __m512 scale) {
  const __m512 a = _mm512_mul_ps(abs_x, scale);
  if constexpr (Fp8ViaHalf<Out>::kCodeScale != 1.0f) return _mm512_mul_ps(a, _mm512_set1_ps(Fp8ViaHalf<Out>::kCodeScale));
  return a;
}

// The FP8 bytes of 64 float32 lanes x[j] * scale[j] in element order, one positive finite scale per lane.
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes_scaled(const __m512 (&x)[4], const __m512 (&scale)[4]) {
  __m512 a[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a[j] = code_magnitude<Out>(_mm512_castsi512_ps(abs_bits(x[j])), scale[j]);
  return fp8_bytes_of<Out>(x, a);
}

// The casts of 64 bfloat16 elements (32 in h0, 32 in h1): habs0 and habs1 hold
// h0 and h1 & 0x7fff. Interleaving with zero words widens bfloat16 to float32 in
// one instruction per 16 lanes: per 128-bit lane, a0 takes elements 0-3 of each
// 8, a1 4-7 (a2, a3 the same of h1), so the codes' 4-byte groups come out of the
// pack in the order 0 2 4 6 8 ... of a0 and a2, then 1 3 5 7 ...: one dword
// permutation. The signs pack straight from the 16-bit words.

// The magnitudes of h0 (a[0], a[1]) and h1 (a[2], a[3]) as float32, in the lane order above.
TL_LANE_INLINE void bf16_magnitudes(__m512i habs0, __m512i habs1, __m512 (&a)[4]) {
  const __m512i zero = _mm512_setzero_si512();
  a[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, habs0));
  a[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, habs0));
  a[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, habs1));
  a[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, habs1));
}

// The FP8 bytes of the 64 bfloat16 elements in h0, h1 from their scaled magnitudes a[j] (bf16_magnitudes'
// vectors in the code domain).
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes_bf16_of(__m512i h0, __m512i h1, const __m512 (&a)[4]) {
  // Pack order, 4-byte groups: a0[0-3] a0[4-7] a2[0-3] a2[4-7] a0[8-11] ... then a1's and a3's; a0's
  // group g is elements 8 * g + 0-3 and a1's 8 * g + 4-7 (a2, a3: 32 on).
  const __m512i codes = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15), fp8_codes_in_pack_order<Out>(a));
  const __m512i sign = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), _mm512_packs_epi16(h0, h1));
  return with_signs(codes, sign);
}

// The FP8 bytes of 64 bfloat16 elements (32 in h0, 32 in h1) times the scale, in element order, code_sc
// = scale * kCodeScale (code_scale); habs0 and habs1 hold h0 and h1 & 0x7fff.
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes_bf16(__m512i h0, __m512i h1, __m512i habs0, __m512i habs1, __m512 code_sc) {
  __m512 a[4];
  bf16_magnitudes(habs0, habs1, a);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a[j] = _mm512_mul_ps(a[j], code_sc);
  return fp8_bytes_bf16_of<Out>(h0, h1, a);
}

// fp8_bytes_bf16 with h0's 32 elements times scale0 and h1's times scale1 (positive and finite).
template <typename Out>
TL_LANE_INLINE __m512i fp8_bytes_bf16_scaled(__m512i h0, __m512i h1, __m512i habs0, __m512i habs1, __m512 scale0,
                                             __m512 scale1) {
  __m512 a[4];
  bf16_magnitudes(habs0, habs1, a);
  a[0] = code_magnitude<Out>(a[0], scale0);
  a[1] = code_magnitude<Out>(a[1], scale0);
  a[2] = code_magnitude<Out>(a[2], scale1);
  a[3] = code_magnitude<Out>(a[3], scale1);
  return fp8_bytes_bf16_of<Out>(h0, h1, a);
}

// q[0, 64) = b, with non-temporal stores under kStream (q then 16-byte aligned, not always 64).
template <bool kStream>
TL_LANE_INLINE void store_bytes64(uint8_t* q, __m512i b) {
  if (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(q), _mm512_castsi512_si128(b));
    _mm_stream_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_extracti32x4_epi32(b, 1));
    _mm_stream_si128(reinterpret_cast<__m128i*>(q + 32), _mm512_extracti32x4_epi32(b, 2));
    _mm_stream_si128(reinterpret_cast<__m128i*>(q + 48), _mm512_extracti32x4_epi32(b, 3));
  } else {
    _mm512_storeu_si512(q, b);
  }
}

template <typename In, typename Out, bool kAmax, bool kStream>
float cast_range(const typename In::storage* x, uint8_t* q, float scale, int64_t begin,
                 int64_t end) {
  const __m512 sc = _mm512_set1_ps(scale);
  float code_sc_scalar;
  // The 64-lane cast needs a positive finite scale, exact times kCodeScale; the 16-lane one takes any.
  const int64_t end64 = code_scale<Out>(scale, &code_sc_scalar) ? end : begin;
  const __m512 code_sc = _mm512_set1_ps(code_sc_scalar);
  __m512i acc = _mm512_setzero_si512();
  auto masked = [&](int64_t i, int64_t n) {
    const __mmask16 m = tail_mask(n);
    const __m512 v = load_hp<In>(x + i, m);
    if (kAmax) acc = _mm512_max_epu32(acc, abs_bits(v));
    _mm_mask_storeu_epi8(q + i, m, to_fp8<Out>(v, sc));
  };
  int64_t i = begin;
  if (kStream) {  // align q for the 16-byte non-temporal stores
    const int64_t head = std::min<int64_t>(end - i, (16 - (reinterpret_cast<uintptr_t>(q + i) & 15)) & 15);
    if (head > 0) masked(i, head);
    i += head;
  }
  __m512i acc16 = _mm512_setzero_si512();  // bfloat16 amax on the 16-bit words
  for (; i + 64 <= end64; i += 64) {
    __m512i b;
    if constexpr (std::is_same_v<In, BFloat16>) {
      const __m512i h0 = _mm512_loadu_si512(x + i);
      const __m512i h1 = _mm512_loadu_si512(x + i + 32);
      const __m512i mag = _mm512_set1_epi16(0x7fff);
      const __m512i habs0 = _mm512_and_si512(h0, mag), habs1 = _mm512_and_si512(h1, mag);
      if (kAmax) acc16 = _mm512_max_epu16(acc16, _mm512_max_epu16(habs0, habs1));
      b = fp8_bytes_bf16<Out>(h0, h1, habs0, habs1, code_sc);
    } else {
      __m512 v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) v[j] = load_hp<In>(x + i + 16 * j);
      if (kAmax) {
        acc = _mm512_max_epu32(acc, _mm512_max_epu32(_mm512_max_epu32(abs_bits(v[0]), abs_bits(v[1])),
                                                      _mm512_max_epu32(abs_bits(v[2]), abs_bits(v[3]))));
      }
      b = fp8_bytes<Out>(v, code_sc);
    }
    store_bytes64<kStream>(q + i, b);
  }
  if constexpr (std::is_same_v<In, BFloat16> && kAmax) {  // the words' maximum, as float32 bits
    const __m512i zero = _mm512_setzero_si512();
    acc = _mm512_max_epu32(acc, _mm512_max_epu32(_mm512_slli_epi32(_mm512_unpacklo_epi16(acc16, zero), 16),
                                                  _mm512_slli_epi32(_mm512_unpackhi_epi16(acc16, zero), 16)));
  }
  for (; i + 16 <= end; i += 16) {
    const __m512 v = load_hp<In>(x + i);
    if (kAmax) acc = _mm512_max_epu32(acc, abs_bits(v));
    const __m128i b = to_fp8<Out>(v, sc);
    if (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q + i), b);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
    }
  }
  if (i < end) masked(i, end - i);
  if (kStream) _mm_sfence();
  return fp8::float_of(_mm512_reduce_max_epu32(acc));
}

// amax of 16-bit formats straight on the bits, 32 lanes at a time.
template <typename In>
float amax_range(const typename In::storage* x, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<In, Float32>) {
    __m512i acc = _mm512_setzero_si512();
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) acc = _mm512_max_epu32(acc, abs_bits(load16(x + i)));
    if (i < end) acc = _mm512_max_epu32(acc, abs_bits(load16(x + i, tail_mask(end - i))));
    return fp8::float_of(_mm512_reduce_max_epu32(acc));
  } else {
    const __m512i mag = _mm512_set1_epi16(0x7fff);
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) {
      acc0 = _mm512_max_epu16(acc0, _mm512_and_si512(_mm512_loadu_si512(x + i), mag));
      acc1 = _mm512_max_epu16(acc1, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), mag));
    }
    for (; i < end; i += 32) {
      const __mmask32 m = end - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (end - i)) - 1u);
      acc0 = _mm512_max_epu16(acc0, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, x + i), mag));
    }
    acc0 = _mm512_max_epu16(acc0, acc1);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(acc0));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(acc0, 1));
    return In::load(static_cast<uint16_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi))));
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 16 x 16
// byte blocks transposed in registers into a buffer of 16 output rows x 128
// bytes, which then goes out row by row in whole 64-byte stores. Storing each
// block's 16 rows straight to `dst` would touch 16 lines one row stride apart
// per block, and with a power-of-two stride (4096-row inputs) they all fall
// into one L1 set: more lines than its ways, evicted before they fill.
inline void transpose_bytes(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                            uint8_t* dst, int64_t ld_dst) {
  constexpr int64_t kChunk = 128;  // output bytes per row and buffer pass
  alignas(64) uint8_t buffer[16 * kChunk];
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t nc = std::min<int64_t>(16, cols - c);
    const __mmask16 col_mask = tail_mask(nc);
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
            block[i] = i < nrows ? _mm_maskz_loadu_epi8(col_mask, src + (r0 + r + i) * ld_src + c) : _mm_setzero_si128();
          }
        }
        sse2::transpose16x16(block);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm_store_si128(reinterpret_cast<__m128i*>(buffer + j * kChunk + r), block[j]);
      }
      for (int64_t j = 0; j < nc; ++j) {
        const uint8_t* row = buffer + j * kChunk;
        uint8_t* out = dst + (c + j) * ld_dst + r0;
        for (int64_t b = 0; b < nr0; b += 64) {
          const int64_t n = std::min<int64_t>(64, nr0 - b);
          const __mmask64 m = n == 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
          _mm512_mask_storeu_epi8(out + b, m, _mm512_load_si512(row + b));
        }
      }
    }
  }
}

}  // namespace avx512
}  // namespace cpu
}  // namespace tl
