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
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemm_cpu.h"
#include "transformer_linear/check.h"

namespace tl {
namespace cpu {
namespace gemm {
namespace {

constexpr int64_t kMaxKc = 1024;  // largest KC of the kernel sets below (row buffer size)

__mmask32 prefix_mask32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : (n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1));
}
__mmask16 prefix_mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : (n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1));
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

// Decode row i of `src` (k contiguous) into words tmp[0, kc), zero-padded to a multiple of 32.
void decode_row(const Decoder& dec, const Operand& src, int64_t i, int64_t kc, uint16_t* tmp) {
  const uint8_t* row = src.data + i * src.row_stride;
  for (int64_t k0 = 0; k0 < kc; k0 += 32) {
    _mm512_storeu_si512(tmp + k0, dec.bf16x32(row + k0, prefix_mask32(kc - k0)));
  }
}

}  // namespace

// kpack = 2 (bf16 pairs): panel dword [g * r + i] = (bf16(src[i, 2g + 1]) << 16) | bf16(src[i, 2g]).
void pack_bf16_pairs_padded(const Operand& src, int64_t rows, int64_t kc, int r, int64_t groups,
                            void* dst) {
  const Decoder dec(src.dtype);
  const int64_t used = (kc + 1) / 2;
  uint32_t* out = static_cast<uint32_t*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += groups * r) {
    std::memset(out + used * r, 0, (groups - used) * r * sizeof(uint32_t));
    if (src.col_stride == 1) {
      TL_CHECK(kc <= kMaxKc, "fp8_gemm: internal error: KC ", kc, " exceeds ", kMaxKc);
      alignas(64) uint16_t tmp[kMaxKc + 32];
      for (int64_t i = 0; i < r; ++i) {
        if (p0 + i < rows) {
          decode_row(dec, src, p0 + i, kc, tmp);  // an odd kc leaves tmp[kc] = 0
          uint32_t pair;
          for (int64_t g = 0; g < used; ++g) {
            std::memcpy(&pair, tmp + 2 * g, sizeof(pair));
            out[g * r + i] = pair;
          }
        } else {
          for (int64_t g = 0; g < used; ++g) out[g * r + i] = 0;
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
          _mm512_mask_storeu_epi32(out + g * r + i0 + 16 * half, prefix_mask16(r - i0 - 16 * half), pairs);
        }
      }
    }
  }
}

void decode_row_bf16(const Operand& src, int64_t i, int64_t kc, uint16_t* out) {
  decode_row(Decoder(src.dtype), src, i, kc, out);
}

void decode_column_bf16(const Operand& src, int64_t rows, int64_t k, uint16_t* out) {
  const Decoder dec(src.dtype);
  _mm512_storeu_si512(out, dec.bf16x32(src.data + k * src.col_stride, prefix_mask32(rows)));
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
    TL_CHECK(kc <= kMaxKc, "fp8_gemm: internal error: KC ", kc, " exceeds ", kMaxKc);
    alignas(64) uint16_t tmp[kMaxKc + 32];
    for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
      for (int64_t i = 0; i < r; ++i) {
        if (p0 + i < rows) {
          decode_row(dec, src, p0 + i, kc, tmp);
          for (int64_t k = 0; k < kc; ++k) out[k * r + i] = static_cast<uint32_t>(tmp[k]) << 16;
        } else {
          for (int64_t k = 0; k < kc; ++k) out[k * r + i] = 0;
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
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
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
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
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

}  // namespace

KernelSet avx512_kernels() {
  return KernelSet{kMr, 16 * kNv, 1, 4, 256, 336, 2048, pack_fp32, pack_fp32, micro_fp32<kMr, kNv>};
}

KernelSet avx512_bf16_kernels() {
  return KernelSet{kMr, 16 * kNv, 2, 2, 512, 336, 2048, pack_bf16_pairs, pack_bf16_pairs,
                   micro_bf16<kMr, kNv>};
}

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
