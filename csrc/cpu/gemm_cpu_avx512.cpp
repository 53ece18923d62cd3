// AVX-512 packing and micro-kernels of the CPU FP8 GEMM (layout: gemm_cpu.h).
// Compiled with -mavx512f/bw/vl/dq/bf16; entered only after the runtime ISA check.
//
// Decoding: FP8 -> bf16 bits by table lookup, 32 values per step. The 128
// magnitudes live in four registers of 32 words; two vpermi2w pick among
// them by the low 6 bits and bit 6 chooses the pair. bf16 holds every FP8
// value exactly, and fp32 is bf16 with 16 more zero bits.
//
// vdpbf16ps treats denormal inputs and results as zero (DAZ/FTZ). Inputs are
// FP8 values, all normal in bf16 (smallest: e5m2 2^-16). Every product is a
// multiple of 2^-32 (exact in fp32), so any partial sum is 0 or >= 2^-32 in
// magnitude, far above fp32's denormal range: the flush never changes a
// result, and this path computes the same function as the fp32-FMA one.
//
// Speed note: vdpbf16ps rates differ by CPU. On Sapphire Rapids it delivered
// about half the FLOP rate of fp32 FMA (~60 vs ~125 GFLOP/s on one core,
// register-only loops), so CPUs with AMX tiles run the avx512_bf16 path on
// AMX instead (gemm_cpu_amx_avx512.cpp); on AMD Zen 4 it runs at twice the
// fp32-FMA rate (~195 vs ~95 GFLOP/s per core for a 2048^3 GEMM). Which of
// the two kernels runs is measured at first use (isa_select.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm_cpu.h"

namespace tl {
namespace cpu {
namespace gemm {
namespace {

__mmask32 prefix_mask32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : (n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1));
}
__mmask16 prefix_mask16(int64_t n) {
  return static_cast<__mmask16>(prefix_mask32(std::min<int64_t>(n, 16)));
}

class Decoder {
 public:
  explicit Decoder(DType dtype) {
    const uint16_t* t = fp8_magnitude_bf16_table(dtype);
    t0_ = _mm512_loadu_si512(t);
    t1_ = _mm512_loadu_si512(t + 32);
    t2_ = _mm512_loadu_si512(t + 64);
    t3_ = _mm512_loadu_si512(t + 96);
  }

  // bf16 bits of the FP8 bytes p[0, 32) selected by `mask`; the others give +0.
  __m512i bf16x32(const uint8_t* p, __mmask32 mask) const {
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, p));
    const __m512i low = _mm512_permutex2var_epi16(t0_, idx, t1_);
    const __m512i high = _mm512_permutex2var_epi16(t2_, idx, t3_);
    const __mmask32 use_high = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40));
    const __m512i magnitude = _mm512_mask_blend_epi16(use_high, low, high);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(idx, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(magnitude, sign);
  }

 private:
  __m512i t0_, t1_, t2_, t3_;
};

// Words 0..15 (half 0) or 16..31 (half 1) of w, zero-extended to dwords.
__m512i widen_half(__m512i w, int half) {
  return _mm512_cvtepu16_epi32(half ? _mm512_extracti64x4_epi64(w, 1) : _mm512_castsi512_si256(w));
}

// In-place transpose of a 16 x 16 block of dwords held as 16 row registers:
// 32-bit and 64-bit interleaves build 4 x 4 blocks inside each 128-bit lane,
// two rounds of 128-bit lane shuffles put the blocks in place.
void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int b = 0; b < 16; b += 4) {
    u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
    u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
    u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
    u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// bf16 words of src[i0 + t, k0 : k0 + 32] for t < 16 (row-major src); rows
// past `valid_rows` and k past kc are zero.
void decode_row_block(const Decoder& dec, const Operand& src, int64_t i0, int64_t valid_rows,
                      int64_t k0, int64_t kc, __m512i (&w)[16]) {
  const __mmask32 k_mask = prefix_mask32(kc - k0);
  for (int t = 0; t < 16; ++t) {
    w[t] = dec.bf16x32(src.data + (i0 + t) * src.row_stride + k0, t < valid_rows ? k_mask : 0);
  }
}

}  // namespace

// kpack = 2 (bf16 pairs):
//   panel dword [g * r + i] = (bf16(src[i, 2g + 1]) << 16) | bf16(src[i, 2g]).
void pack_bf16_pairs_padded(const Operand& src, int64_t rows, int64_t kc, int r, int64_t groups,
                            void* dst) {
  const Decoder dec(src.dtype);
  const int64_t used = (kc + 1) / 2;
  uint32_t* out = static_cast<uint32_t*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += groups * r) {
    std::memset(out + used * r, 0, (groups - used) * r * sizeof(uint32_t));
    if (src.col_stride == 1) {
      // Row-major: decode 16 rows x 32 k, whose dwords are already k-pairs,
      // and transpose them into 16 groups x 16 rows.
      for (int64_t i0 = 0; i0 < r; i0 += 16) {
        const __mmask16 store_rows = prefix_mask16(r - i0);
        for (int64_t g0 = 0; g0 < used; g0 += 16) {
          __m512i w[16];
          decode_row_block(dec, src, p0 + i0, rows - p0 - i0, 2 * g0, kc, w);
          transpose16x16(w);
          for (int64_t g = 0; g < std::min<int64_t>(16, used - g0); ++g) {
            _mm512_mask_storeu_epi32(out + (g0 + g) * r + i0, store_rows, w[g]);
          }
        }
      }
      continue;
    }
    // Column-major (row_stride == 1): the rows of one k are contiguous bytes.
    for (int64_t g = 0; g < used; ++g) {
      const uint8_t* k_even = src.data + p0 + 2 * g * src.col_stride;
      const bool has_odd = 2 * g + 1 < kc;
      for (int64_t i0 = 0; i0 < r; i0 += 32) {
        const __mmask32 valid = prefix_mask32(std::min<int64_t>(r, rows - p0) - i0);
        const __m512i even = dec.bf16x32(k_even + i0, valid);
        const __m512i odd = dec.bf16x32(k_even + src.col_stride + i0, has_odd ? valid : 0);
        for (int half = 0; half < 2; ++half) {
          const __m512i pairs =
              _mm512_or_si512(widen_half(even, half), _mm512_slli_epi32(widen_half(odd, half), 16));
          _mm512_mask_storeu_epi32(out + g * r + i0 + 16 * half, prefix_mask16(r - i0 - 16 * half),
                                   pairs);
        }
      }
    }
  }
}

// kpack = 32 (AMX A tiles): panel words [(b * r + i) * 32 + t] = bf16(src[i, 32 b + t]).
void pack_bf16_k32(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  const Decoder dec(src.dtype);
  const int64_t blocks = (kc + 31) / 32;
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += blocks * r * 32) {
    for (int64_t i0 = 0; i0 < r; i0 += 16) {
      const int64_t valid = rows - p0 - i0, stored = std::min<int64_t>(16, r - i0);
      for (int64_t b = 0; b < blocks; ++b) {
        __m512i w[16];
        if (src.col_stride == 1) {  // row-major: a decoded row block is already the tile layout
          decode_row_block(dec, src, p0 + i0, valid, 32 * b, kc, w);
        } else {  // column-major: build k-pairs for 16 rows, then transpose to rows
          const __mmask32 row_mask = prefix_mask32(std::min<int64_t>(valid, 16));
          for (int g = 0; g < 16; ++g) {
            const int64_t k = 32 * b + 2 * g;
            const uint8_t* col = src.data + (p0 + i0) + k * src.col_stride;
            const __m512i even = dec.bf16x32(col, k < kc ? row_mask : 0);
            const __m512i odd = dec.bf16x32(col + src.col_stride, k + 1 < kc ? row_mask : 0);
            w[g] = _mm512_or_si512(widen_half(even, 0), _mm512_slli_epi32(widen_half(odd, 0), 16));
          }
          transpose16x16(w);
        }
        for (int64_t t = 0; t < stored; ++t) _mm512_storeu_si512(out + (b * r + i0 + t) * 32, w[t]);
      }
    }
  }
}

namespace {

void pack_bf16_pairs(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  pack_bf16_pairs_padded(src, rows, kc, r, (kc + 1) / 2, dst);
}

// kpack = 1 (fp32): panel float [k * r + i] = src[i, k].
void pack_fp32(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  const Decoder dec(src.dtype);
  uint32_t* out = static_cast<uint32_t*>(dst);
  if (src.col_stride == 1) {
    // Row-major: decode 16 rows x 32 k, widen each half to fp32 and transpose.
    for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
      for (int64_t i0 = 0; i0 < r; i0 += 16) {
        const __mmask16 store_rows = prefix_mask16(r - i0);
        for (int64_t k0 = 0; k0 < kc; k0 += 32) {
          __m512i w[16];
          decode_row_block(dec, src, p0 + i0, rows - p0 - i0, k0, kc, w);
          for (int half = 0; half < 2; ++half) {
            __m512i f[16];
            for (int t = 0; t < 16; ++t) f[t] = _mm512_slli_epi32(widen_half(w[t], half), 16);
            transpose16x16(f);
            const int64_t kh = k0 + 16 * half;
            for (int64_t k = 0; k < std::min<int64_t>(16, kc - kh); ++k) {
              _mm512_mask_storeu_epi32(out + (kh + k) * r + i0, store_rows, f[k]);
            }
          }
        }
      }
    }
    return;
  }
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t i0 = 0; i0 < r; i0 += 32) {
        const __mmask32 valid = prefix_mask32(std::min<int64_t>(r, rows - p0) - i0);
        const __m512i w = dec.bf16x32(src.data + p0 + k * src.col_stride + i0, valid);
        for (int half = 0; half < 2; ++half) {
          _mm512_mask_storeu_epi32(out + k * r + i0 + 16 * half, prefix_mask16(r - i0 - 16 * half),
                                   _mm512_slli_epi32(widen_half(w, half), 16));
        }
      }
    }
  }
}

// Shared head of the micro-kernels: the accumulators start at zero.
template <int MR, int NV>
inline void zero_tile(__m512 (&acc)[MR][NV]) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
}

// Shared tail of the micro-kernels: c_out = acc (+ c_in).
template <int MR, int NV>
inline void finish_tile(__m512 (&acc)[MR][NV], const float* c_in, int64_t ldc_in, float* c_out,
                        int64_t ldc_out) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __m512 x = acc[i][v];
      if (c_in) x = _mm512_add_ps(x, _mm512_loadu_ps(c_in + i * ldc_in + 16 * v));
      _mm512_storeu_ps(c_out + i * ldc_out + 16 * v, x);
    }
  }
}

// MR x (16 * NV) tile; A broadcast one packed value per row, B loaded as NV vectors.
template <int MR, int NV>
void micro_bf16(int64_t kc, const void* a_packed, const void* b_packed, const float* c_in,
                int64_t ldc_in, float* c_out, int64_t ldc_out) {
  const int32_t* a = static_cast<const int32_t*>(a_packed);
  const int32_t* b = static_cast<const int32_t*>(b_packed);
  __m512 acc[MR][NV];
  zero_tile<MR, NV>(acc);
  const int64_t groups = (kc + 1) / 2;
  for (int64_t g = 0; g < groups; ++g, a += MR, b += 16 * NV) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a[i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
  finish_tile<MR, NV>(acc, c_in, ldc_in, c_out, ldc_out);
}

template <int MR, int NV>
void micro_fp32(int64_t kc, const void* a_packed, const void* b_packed, const float* c_in,
                int64_t ldc_in, float* c_out, int64_t ldc_out) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  __m512 acc[MR][NV];
  zero_tile<MR, NV>(acc);
  for (int64_t k = 0; k < kc; ++k, a += MR, b += 16 * NV) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
  finish_tile<MR, NV>(acc, c_in, ldc_in, c_out, ldc_out);
}

constexpr int kMr = 14;
constexpr int kNv = 2;

struct Avx512Tag {};  // this file's instantiation of store_tile (StoreTiles)

}  // namespace

StoreTiles avx512_store_tiles(bool streaming) { return StoreTiles::instantiate<Avx512Tag>(streaming); }

KernelSet avx512_kernels() {
  return KernelSet{kMr, 16 * kNv, 1, 4, 256, 336, 2048, pack_fp32, pack_fp32, micro_fp32<kMr, kNv>,
                   nullptr, true, avx512_store_tiles()};
}

// KC 2048 / MC 112: a 14 x 2048 A panel (56 KiB) and the 32 x 2048 B panel (128 KiB) both stream from L2
// (the 448 KiB A block fits a 1 MiB L2 beside the B panel) about as fast as a 32 KiB panel from L1 does,
// and K up to 2048 takes one pass with no partial sums to store and reload. The micro-kernel still sums
// 512 k at a time (sum_kc), so results keep the bits of KC 512. On AMD Zen 4, fp8_gemm (bf16 out) against
// KC 512 / MC 336 / NC 2048 in one process, GFLOP/s: one core 2048^3 186 -> 194, 4096 x 4096 x 1024
// 171 -> 195 (bf16 torch.mm 190, 174); two threads 376 -> 389, 334 -> 396 (torch.mm 395, 363). NC 1024
// keeps each packed B chunk at 4 MiB.
KernelSet avx512_bf16_kernels() {
  KernelSet ks{kMr, 16 * kNv, 2, 2, 2048, 112, 1024, pack_bf16_pairs, pack_bf16_pairs, micro_bf16<kMr, kNv>,
               nullptr, true, avx512_store_tiles()};
  ks.sum_kc = 512;
  return ks;
}

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
