// Vector NVFP4 quantize kernels, written once with GCC vector extensions for W float
// lanes and compiled per instruction set (quantize_nvfp4_cpu_avx2.cpp: W = 8,
// quantize_nvfp4_cpu_avx512.cpp: W = 16). They run on the float32 band tile of the driver
// (quantize_nvfp4_cpu.cpp) and compute what its portable code computes, element for
// element (same float32 operations, no contraction; per-block scales by the same scalar
// functions of quantize_nvfp4_cpu.h), so results are bitwise equal to it:
//   - 1x16 blocks in lanes: lane l of vector i holds value i of block l, so a block's
//     amax, scale, encode factor and codes are all lane-wise (the scales in vector form
//     of block_scale_bits / block_encode_factor). Columnwise blocks (W columns of the
//     band, after the Hadamard transform, itself lane-wise) load this way directly;
//     rowwise blocks are loaded W at a time and transposed in registers.
//   - 16x16 tiles: lanes are the tile's columns; the tile's amax is reduced across lanes and
//     its one scale computed by the same vector scale functions.
// The band tile itself is loaded here too (float32 copied, bfloat16 widened in vectors), with
// the next chunk of the input prefetched.
// Amax: |x| as integer bits, whose unsigned order is the float order with every NaN above
// +inf, so a NaN anywhere gives a NaN amax (and the 0x7f scale), as fp8::amax_update does.
// Stochastic rounding takes Philox4x32-10 computed in lanes, on the same counters, and
// decides rounding up by a uint32 comparison equivalent to the portable float64 one.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../common/backend_nvfp4.h"
#include "quantize_nvfp4_cpu.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

/*!
 * \brief Where the columnwise blocks of one band tile (columns [c0, c1)) go: column c0 + j's 8 bytes of
 *        codes at data + j * data_ld, its scale at scale + j * scale_ld (the driver's staging buffer,
 *        quantize_nvfp4_cpu.cpp).
 */
struct ColumnsOut {
  uint8_t* data;
  int64_t data_ld;
  uint8_t* scale;
  int64_t scale_ld;
};

/*! \brief The vector kernels of one instruction set (arguments as the portable driver's). */
struct VecKernels {
  // Rows [r0, r1) x columns [c0, c1) of a float32 or bfloat16 input as float32 into `tile`
  // (ld = c1 - c0); false for other dtypes (the driver's scalar load).
  bool (*load_tile)(const QuantizeNvfp4Params& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* tile);
  void (*rows_1d)(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
  void (*columns_1d)(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t c0, int64_t c1,
                     const ColumnsOut& out_t);
  // out_t: the transposed copy's blocks (with output_t; 16 rows then).
  void (*tiles_2d)(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                   const ColumnsOut& out_t);
};

VecKernels avx2_vec_kernels();
VecKernels avx512_vec_kernels();

// The vector types of W lanes (GCC takes vector_size only as a non-dependent constant),
// and of W / 2 lanes (the halves of the float64 comparison, the u64 view of code pairs).
template <int W>
struct VecTypes;

#define TL_NVFP4_VEC_TYPES(W)                                      \
  template <>                                                      \
  struct VecTypes<W> {                                             \
    typedef float F __attribute__((vector_size(4 * W)));           \
    typedef int32_t I __attribute__((vector_size(4 * W)));         \
    typedef uint32_t U __attribute__((vector_size(4 * W)));        \
    typedef uint64_t U64 __attribute__((vector_size(8 * W)));      \
    typedef uint64_t Q __attribute__((vector_size(4 * W)));        \
    typedef uint8_t B __attribute__((vector_size(W / 2)));         \
    typedef uint16_t S __attribute__((vector_size(2 * W)));        \
    typedef float FH __attribute__((vector_size(2 * W)));          \
    typedef uint32_t UH __attribute__((vector_size(2 * W)));       \
    typedef int32_t IH __attribute__((vector_size(2 * W)));        \
    typedef double DH __attribute__((vector_size(4 * W)));         \
    typedef int64_t LH __attribute__((vector_size(4 * W)));        \
  };
TL_NVFP4_VEC_TYPES(8)
TL_NVFP4_VEC_TYPES(16)
#undef TL_NVFP4_VEC_TYPES

template <int W>
struct Vec {
  using F = typename VecTypes<W>::F;
  using I = typename VecTypes<W>::I;
  using U = typename VecTypes<W>::U;
  using U64 = typename VecTypes<W>::U64;
  using Q = typename VecTypes<W>::Q;  // W / 2 lanes of 64 bits
  static constexpr int kNB = kBlock / W;  // vectors per 16-value block

  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static F splat(float x) { return F{} + x; }
  static U usplat(uint32_t x) { return U{} + x; }
  static U bits(F v) {
    U u;
    std::memcpy(&u, &v, sizeof(u));
    return u;
  }
  static F from_bits(U u) {
    F v;
    std::memcpy(&v, &u, sizeof(v));
    return v;
  }
  static U abs_bits(F v) { return bits(v) & 0x7fffffffu; }
  static U umax(U a, U b) { return a > b ? a : b; }

  // e2m1_rne of each lane, as int codes. Below 1 (E2M1's subnormals, steps of 0.5) a float
  // addition of 2^22 (whose ulp is 0.5) rounds to nearest even; from 1 to 6 the float's
  // mantissa is rounded to one bit like fp8_math.h's e4m3 conversion; above 6 saturates.
  // Same codes as the threshold comparisons of e2m1_rne.
  static I codes_rne(F x) {
    const U ub = bits(x);
    const F a = from_bits(ub & 0x7fffffffu);
    const F a6 = a < kE2M1Max ? a : splat(kE2M1Max);  // NaN lanes are replaced below
    constexpr uint32_t kMagic = 149u << 23;           // 2^22
    const U sub = bits(a6 + from_bits(usplat(kMagic))) - kMagic;
    const U fb = bits(a6);
    const U norm = ((fb + 0x1fffffu + ((fb >> 22) & 1u)) >> 22) - 252u;
    const I code = (I)(a6 < 1.0f ? sub : norm);
    const I sign = (I)((ub >> 31) << 3);
    return (ub & 0x7fffffffu) > 0x7f800000u ? I{} + 7 : code | sign;
  }

  // e2m1_stochastic of each lane with its random bits. The lower E2M1 neighbour of
  // a = min(|x|, 6) is a with its mantissa cut to one bit (a >= 1), or 0.5 or 0 (a < 1);
  // the gap to the next is a power of two (2^(e - 1) for a >= 1, else 0.5), so
  // frac = (a - lo) / gap is exact (Sterbenz subtraction, power-of-two division) and
  // equals the portable code's. "frac * 2^32 > rbits" (float64 there, both sides exact) is
  // ceil(frac * 2^32) > rbits in uint32: frac * 2^32 is an exact float below 2^32 - 255,
  // and for an integer r, x > r exactly when ceil(x) > r.
  static I codes_sr(F x, U rbits) {
    const U ub = bits(x);
    const F fa = from_bits(ub & 0x7fffffffu);
    const F a = fa < kE2M1Max ? fa : splat(kE2M1Max);  // fmin(|x|, 6); NaN lanes are replaced below
    const U fb = bits(a);
    const I big = a >= 1.0f, half = a >= 0.5f;
    const F lo_v = big ? from_bits(fb & 0xffc00000u) : from_bits((U)half & 0x3f000000u);
    const F inv_gap = big ? from_bits((255u << 23) - (fb & 0x7f800000u)) : splat(2.0f);
    const F frac = (a - lo_v) * inv_gap;
    const I lo = big ? (I)((fb >> 22) - 252u) : -half;
    const U up = ceil_to_u32(frac * 4294967296.0f) > rbits;
    const I code = lo - ((lo < 7) & (I)up);
    const I sign = (I)((ub >> 31) << 3);
    return (ub & 0x7fffffffu) > 0x7f800000u ? I{} + 7 : code | sign;
  }

  // ceil of each lane (>= 0, below 2^32, as a float) as uint32.
  static U ceil_to_u32(F x) {
#if defined(__AVX512F__)
    if constexpr (W == 16) return (U)_mm512_cvt_roundps_epu32((__m512)x, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) {
      const F c = (F)_mm256_ceil_ps((__m256)x);  // an integer: the conversions below are exact
      const I small = c < 2147483648.0f;          // else c - 2^31 is exact (c a multiple of 256)
      const U r = (U)__builtin_convertvector(small ? c : c - 2147483648.0f, I);
      return small ? r : r ^ 0x80000000u;
    }
#endif
    U r;
    for (int l = 0; l < W; ++l) r[l] = static_cast<uint32_t>(std::ceil(x[l]));
    return r;
  }

  // out lane l = first + l * step, in vector operations: lanes stored one by one and then loaded as a
  // vector stall the load (no store forwarding), which took a sixth of a stochastically rounded quantize's
  // time. (An out parameter: a 64-byte vector return value would change the ABI on the AVX2 path.)
  static void lane_indices(uint64_t first, uint64_t step, U64& out) {
    U64 iota;
    for (int l = 0; l < W; ++l) iota[l] = static_cast<uint64_t>(l);  // a constant
    out = (U64{} + first) + iota * step;
  }

  // Each lane's low 32 bits times m, as the whole 64-bit product (vpmuludq where compiled in).
  static Q mul_low32(Q a, uint32_t m) {
#if defined(__AVX512F__)
    if constexpr (W == 16) return (Q)_mm512_mul_epu32((__m512i)a, _mm512_set1_epi64(m));
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) return (Q)_mm256_mul_epu32((__m256i)a, _mm256_set1_epi64x(m));
#endif
    return (a & 0xffffffffu) * static_cast<uint64_t>(m);
  }

  // Each lane's high 32 bits in its low half (the upper half keeps them too): a dword shuffle, which runs
  // beside the multiplies where a 64-bit shift would compete with them for one port (AVX-512).
  static Q high_words(Q p) {
    U u;
    std::memcpy(&u, &p, sizeof(u));
    I odd;
    for (int l = 0; l < W; ++l) odd[l] = l | 1;
    u = __builtin_shuffle(u, odd);
    std::memcpy(&p, &u, sizeof(p));
    return p;
  }

  // Philox4x32-10 under key `seed` of each lane's counter (low and high 32 bits of g, c2, c3): words[t]
  // lane l is word t of lane l's output.
  //
  // Run on two halves of W / 2 64-bit lanes, each 32-bit word in the low half of a lane: the 32 x 32 ->
  // 64-bit multiply then leaves a product's low word in place and its high word one shuffle away, where W
  // 32-bit lanes needed their even and odd lanes multiplied apart and blended back, twice a round (the
  // blends and shifts were most of a stochastically rounded quantize). A lane's upper half is never
  // cleared: it feeds only XORs into other upper halves and multiplies, which read the low half.
  static void philox_words(const U64& g, uint32_t c2, uint32_t c3, uint64_t seed, U (&words)[4]) {
    Q c[2][4];
    for (int h = 0; h < 2; ++h) {
      Q gh;
      std::memcpy(&gh, reinterpret_cast<const char*>(&g) + h * sizeof(Q), sizeof(Q));
      c[h][0] = gh;
      c[h][1] = gh >> 32;
      c[h][2] = Q{} + c2;
      c[h][3] = Q{} + c3;
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    // Unrolled: the rounds' rotation of the four words is then renaming, not register moves.
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
      if (r) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      for (int h = 0; h < 2; ++h) {  // the halves are independent chains: interleaved, they overlap
        const Q p0 = mul_low32(c[h][0], 0xD2511F53u), p1 = mul_low32(c[h][2], 0xCD9E8D57u);
        c[h][0] = high_words(p1) ^ c[h][1] ^ k0;
        c[h][1] = p1;
        c[h][2] = high_words(p0) ^ c[h][3] ^ k1;
        c[h][3] = p0;
      }
    }
    // The low words of both halves into one vector with one two-source shuffle (two half-width stores read
    // back as one vector would wait for no store forwarding).
    I low_words;
    for (int l = 0; l < W; ++l) low_words[l] = 2 * l;
    for (int t = 0; t < 4; ++t) {
      U lo, hi;
      std::memcpy(&lo, &c[0][t], sizeof(U));
      std::memcpy(&hi, &c[1][t], sizeof(U));
      words[t] = __builtin_shuffle(lo, hi, low_words);
    }
  }

  // Random bits of W consecutive indices first.. (first a multiple of 4) of one usage.
  static U row_bits(const QuantizeNvfp4Params& p, uint32_t usage, uint64_t first) {
    U64 idx;
    lane_indices(first, 1, idx);
    U c[4];
    philox_words(idx >> 2, static_cast<uint32_t>(p.offset), static_cast<uint32_t>(p.offset >> 32) | (usage << 31),
                 p.seed, c);
    const U word = __builtin_convertvector(idx & 3u, U);
    return word == 0 ? c[0] : word == 1 ? c[1] : word == 2 ? c[2] : c[3];
  }

  // 16 codes (lane order, kNB vectors) -> 8 bytes, the first of each pair in the low nibble.
  static void pack_lanes(const I (&codes)[kNB], uint8_t* out) {
    using B = typename VecTypes<W>::B;
    for (int v = 0; v < kNB; ++v) {
      Q q;
      std::memcpy(&q, &codes[v], sizeof(q));
      const B b = __builtin_convertvector((q | (q >> 28)) & 0xffu, B);
      std::memcpy(out + v * (W / 2), &b, sizeof(b));
    }
  }

  // Codes of 16 row vectors (lane = column), packed per lane: out[l] holds the 16 codes of
  // lane l, pairs of rows per byte. (Written to memory: a 64-byte vector return value
  // would change the ABI on the AVX2 path.)
  static void pack_rows(const I (&codes)[kBlock], uint64_t* out) {
    U64 packed = U64{};
    for (int pr = 0; pr < kBlock / 2; ++pr) {
      const I byte = codes[2 * pr] | (codes[2 * pr + 1] << 4);
      packed |= __builtin_convertvector(byte, U64) << (8 * pr);
    }
    std::memcpy(out, &packed, sizeof(packed));
  }

  // Full-width interleaves of two vectors: lanes 0.. (lo) or W / 2.. (hi) of a and b, alternating.
  static I interleave_mask(int first) {
    I m;
    for (int j = 0; j < W / 2; ++j) {
      m[2 * j] = first + j;
      m[2 * j + 1] = first + j + W;
    }
    return m;
  }

  // In place: W x W transpose (log2(W) rounds of interleaving row i with row i + W / 2).
  static void transpose(F (&r)[W]) {
    const I lo = interleave_mask(0), hi = interleave_mask(W / 2);
    for (int round = 1; round < W; round *= 2) {
      F out[W];
      for (int i = 0; i < W / 2; ++i) {
        out[2 * i] = __builtin_shuffle(r[i], r[i + W / 2], lo);
        out[2 * i + 1] = __builtin_shuffle(r[i], r[i + W / 2], hi);
      }
      for (int i = 0; i < W; ++i) r[i] = out[i];
    }
  }

  // block_scale_bits of each lane's amax (amax >= 0 or NaN), as fp8_math.h computes it.
  static U scale_bits(F amax, float s_enc) {
    const F s = amax * (s_enc * (1.0f / kE2M1Max));
    const I nan = (bits(s) & 0x7fffffffu) > 0x7f800000u;
    const F sat = s > fp8::kE4M3Max ? splat(fp8::kE4M3Max) : s;
    const U fb = bits(sat);
    constexpr uint32_t kDenormMask = 141u << 23;
    const U sub = bits(sat + from_bits(usplat(kDenormMask))) - kDenormMask;
    const U norm = (fb + ((static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu) + ((fb >> 20) & 1u)) >> 20;
    const U result = (fb < (121u << 23) ? sub : norm) & 0xffu;
    return nan ? usplat(0x7f) : result;
  }

  // block_encode_factor of each lane's scale bits.
  static F encode_factor(U sb, float s_enc) {
    const float s_dec = 1.0f / s_enc;
    const U exp = (sb >> 3) & 0xfu, man = sb & 7u;
    const F sub = __builtin_convertvector(man, F) * 0.001953125f;
    const F norm = from_bits(((exp + 120u) << 23) | (man << 20));
    F dec = exp == 0 ? sub : norm;
    dec = sb == 0x7fu ? from_bits(usplat(0x7fc00000u)) : dec;
    const F q = 1.0f / (dec * s_dec);
    return q < fp8::kFloatMax ? q : splat(fp8::kFloatMax);  // fmin: NaN and inf give FLT_MAX
  }

  // Quantize W blocks held in lanes (v[i] lane l: value i of block l): scale bits to sb[l],
  // the 16 packed codes to packed[l]. g[l]: the Philox counter of the block's first value
  // (its index / 4) in copy `usage`.
  static void quantize_blocks(const F (&v)[kBlock], float s_enc, const QuantizeNvfp4Params& p, uint32_t usage,
                              const U64& g, uint8_t* sb, uint64_t* packed) {
    U m = U{};
    for (int i = 0; i < kBlock; ++i) m = umax(m, abs_bits(v[i]));
    const U sbits = scale_bits(from_bits(m), s_enc);
    const F factor = encode_factor(sbits, s_enc);
    I codes[kBlock];
    if (p.stochastic_rounding) {
      for (int q = 0; q < 4; ++q) {
        U ctr[4];
        philox_words(g + static_cast<uint64_t>(q), static_cast<uint32_t>(p.offset),
                     static_cast<uint32_t>(p.offset >> 32) | (usage << 31), p.seed, ctr);
        for (int t = 0; t < 4; ++t) codes[4 * q + t] = codes_sr(v[4 * q + t] * factor, ctr[t]);
      }
    } else {
      for (int i = 0; i < kBlock; ++i) codes[i] = codes_rne(v[i] * factor);
    }
    pack_rows(codes, packed);
    for (int l = 0; l < W; ++l) sb[l] = static_cast<uint8_t>(sbits[l]);
  }

  static bool load_tile(const QuantizeNvfp4Params& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        float* tile) {
    const int64_t w = c1 - c0;  // a multiple of 16 (K % 16 == 0)
    if (p.input.dtype == DType::kFloat32) {
      const float* x = p.input.ptr<const float>();
      for (int64_t r = r0; r < r1; ++r) std::memcpy(tile + (r - r0) * w, x + r * p.k + c0, w * sizeof(float));
      return true;
    }
    if (p.input.dtype == DType::kBFloat16) {
      using S = typename VecTypes<W>::S;
      const uint16_t* x = p.input.ptr<const uint16_t>();
      for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* src = x + r * p.k + c0;
        float* dst = tile + (r - r0) * w;
        for (int64_t c = 0; c < w; c += W) {
          S h;
          std::memcpy(&h, src + c, sizeof(h));
          const U u = __builtin_convertvector(h, U) << 16;  // float_from_bf16_bits
          std::memcpy(dst + c, &u, sizeof(u));
        }
      }
      return true;
    }
    return false;
  }

  static void rows_1d(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t r1, int64_t c0,
                      int64_t c1) {
    const int64_t w = c1 - c0;
    uint8_t* out = p.output.ptr<uint8_t>();
    uint8_t* scale = static_cast<uint8_t*>(p.scale.data);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; c += kBlock * W) {
        const int blocks = static_cast<int>((c1 - c) / kBlock < W ? (c1 - c) / kBlock : W);
        const float* src = tile + (r - r0) * w + (c - c0);
        F v[kBlock];
        for (int h = 0; h < kNB; ++h) {  // values h * W .. of each block
          F t[W];
          for (int b = 0; b < W; ++b) t[b] = b < blocks ? load(src + b * kBlock + h * W) : F{};
          transpose(t);
          for (int i = 0; i < W; ++i) v[h * W + i] = t[i];
        }
        U64 g;
        lane_indices(static_cast<uint64_t>(r * p.k + c) >> 2, kBlock / 4, g);
        uint8_t sb[W];
        uint64_t packed[W];
        quantize_blocks(v, p.s_enc, p, 0, g, sb, packed);
        if (blocks == W) {  // fixed-size copies (no library calls)
          std::memcpy(scale + r * (p.k / kBlock) + c / kBlock, sb, W);
          std::memcpy(out + (r * p.k + c) / 2, packed, W * sizeof(uint64_t));
        } else {
          std::memcpy(scale + r * (p.k / kBlock) + c / kBlock, sb, blocks);
          std::memcpy(out + (r * p.k + c) / 2, packed, blocks * sizeof(uint64_t));
        }
      }
    }
  }

  static void hadamard(F (&v)[kBlock]) {
    for (int i = 0; i < kBlock; ++i) v[i] = v[i] * kRhtSigns[i];
    // Unrolled whole, so the 16 vectors stay in registers (a rolled butterfly kept them on the stack).
#pragma GCC unroll 4
    for (int half = 1; half < kBlock; half *= 2) {
#pragma GCC unroll 8
      for (int base = 0; base < kBlock; base += 2 * half) {
#pragma GCC unroll 8
        for (int j = base; j < base + half; ++j) {
          const F a = v[j], b = v[j + half];
          v[j] = a + b;
          v[j + half] = a - b;
        }
      }
    }
    for (int i = 0; i < kBlock; ++i) v[i] = v[i] * 0.25f;
  }

  static void columns_1d(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t c0, int64_t c1,
                         const ColumnsOut& out_t) {
    const int64_t w = c1 - c0;
    // Locals: byte stores may alias out_t and p, whose fields would be reloaded after each one.
    uint8_t* const data = out_t.data;
    uint8_t* const scale = out_t.scale;
    const int64_t data_ld = out_t.data_ld, scale_ld = out_t.scale_ld;
    for (int64_t c = c0; c < c1; c += W) {
      const int lanes = static_cast<int>(c1 - c < W ? c1 - c : W);
      F v[kBlock];
      for (int i = 0; i < kBlock; ++i) {
        const float* src = tile + i * w + (c - c0);
        if (lanes == W) {
          v[i] = load(src);
        } else {
          v[i] = F{};
          for (int l = 0; l < lanes; ++l) v[i][l] = src[l];
        }
      }
      if (p.rht) hadamard(v);
      U64 g;
      lane_indices(static_cast<uint64_t>(c * p.m + r0), static_cast<uint64_t>(p.m), g);
      g >>= 2;
      uint8_t sb[W];
      uint64_t packed[W];
      quantize_blocks(v, p.s_enc_t, p, 1, g, sb, packed);
      for (int l = 0; l < lanes; ++l) {
        scale[(c - c0 + l) * scale_ld] = sb[l];
        std::memcpy(data + (c - c0 + l) * data_ld, &packed[l], sizeof(uint64_t));
      }
    }
  }

  static void tiles_2d(const QuantizeNvfp4Params& p, const float* tile, int64_t r0, int64_t r1, int64_t c0,
                       int64_t c1, const ColumnsOut& out_t) {
    const int64_t w = c1 - c0, h = r1 - r0;
    for (int64_t c = c0; c < c1; c += kBlock) {
      F v[kBlock][kNB];
      U m = U{};
      for (int i = 0; i < kBlock; ++i) {
        for (int j = 0; j < kNB; ++j) {
          v[i][j] = i < h ? load(tile + i * w + (c - c0) + j * W) : F{};
          m = umax(m, abs_bits(v[i][j]));
        }
      }
      for (int step = W / 2; step > 0; step /= 2) {  // every lane: the tile's amax bits
        U sh;
        for (int l = 0; l < W; ++l) sh[l] = l ^ step;
        m = umax(m, __builtin_shuffle(m, sh));
      }
      const U sbits = scale_bits(from_bits(m), p.s_enc);
      const F factor = encode_factor(sbits, p.s_enc);
      const uint8_t sb = static_cast<uint8_t>(sbits[0]);
      I codes[kBlock][kNB];
      for (int i = 0; i < h; ++i) {
        const uint64_t first = static_cast<uint64_t>((r0 + i) * p.k + c);
        for (int j = 0; j < kNB; ++j) {
          codes[i][j] = p.stochastic_rounding ? codes_sr(v[i][j] * factor, row_bits(p, 0, first + j * W))
                                              : codes_rne(v[i][j] * factor);
        }
      }
      if (p.output.defined()) {
        uint8_t* scale = static_cast<uint8_t*>(p.scale.data);
        for (int64_t i = 0; i < h; ++i) {
          scale[(r0 + i) * (p.k / kBlock) + c / kBlock] = sb;
          pack_lanes(codes[i], p.output.ptr<uint8_t>() + ((r0 + i) * p.k + c) / 2);
        }
      }
      if (p.output_t.defined()) {  // h == 16 here: M % 16 == 0 was checked
        uint8_t* const data = out_t.data;
        uint8_t* const scale = out_t.scale;
        const int64_t data_ld = out_t.data_ld, scale_ld = out_t.scale_ld;
        for (int j = 0; j < kNB; ++j) {
          I col[kBlock];
          for (int i = 0; i < kBlock; ++i) col[i] = codes[i][j];
          uint64_t packed[W];
          pack_rows(col, packed);
          for (int l = 0; l < W; ++l) {
            const int64_t cj = c - c0 + j * W + l;
            scale[cj * scale_ld] = sb;
            std::memcpy(data + cj * data_ld, &packed[l], sizeof(uint64_t));
          }
        }
      }
    }
  }

  static VecKernels kernels() { return VecKernels{load_tile, rows_1d, columns_1d, tiles_2d}; }
};

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
