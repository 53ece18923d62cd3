// AVX2 packing and micro-kernel of the CPU FP8 GEMM (layout: gemm_cpu.h).
// Compiled with -mavx2 -mfma -mf16c; entered only after the runtime ISA check.
//
// Panels hold fp32 (kpack = 1): AVX2 has no bf16 dot product, and fp32 FMA
// is the ceiling of these CPUs (two 256-bit FMA pipes per core on Haswell to
// Alder Lake and AMD Zen 2 / 3).
//
// Decoding FP8 -> fp32, 8 values per step, without a table: the byte goes
// into the exponent and mantissa fields of a binary16 (e5m2 is binary16's top
// byte; e4m3's fields are shifted one bit down, its bias of 7 against 15
// undone by an exact multiply by 2^8) and vcvtph2ps widens it exactly,
// subnormals included, whatever the MXCSR denormal flags say. Only e4m3's
// NaN (S.1111.111, a normal binary16 there) needs a fix-up. This measured
// faster than a vgatherdps from the 256-entry fp32 table on AMD Zen 3 (see
// the README's CPU benchmark section).
//
// Micro-kernel: 6 rows of A x 16 columns (two YMM vectors of B): 12
// accumulators, 2 B vectors and 1 broadcast A value fill 15 of the 16 YMM
// registers, and each k step issues 12 FMAs against 8 loads.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "gemm_cpu.h"
#include "pack_avx2.h"

namespace tl {
namespace cpu {
namespace gemm {
namespace {

using avx2::store_floats;
using avx2::transpose8x8;

// 8 FP8 bytes (the low 8 of `bytes`) -> 8 exact fp32 lanes.
template <bool kE4M3>
__m256 decode8(__m128i bytes) {
  const __m128i w = _mm_cvtepu8_epi16(bytes);
  if constexpr (!kE4M3) {
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  } else {
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(mag, 7))),
                                   _mm256_set1_ps(256.0f));
    const __m128i nan16 = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), nan);
  }
}

// Loads n (<= 8) bytes at p into the low bytes of a vector, the rest zero.
inline __m128i load_bytes(const uint8_t* p, int64_t n) {
  uint64_t v = 0;
  std::memcpy(&v, p, static_cast<size_t>(std::clamp<int64_t>(n, 0, 8)));
  return _mm_cvtsi64_si128(static_cast<int64_t>(v));
}

// kpack = 1 (fp32): panel float [k * r + i] = src[i, k].
template <bool kE4M3>
void pack_fp32(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  float* out = static_cast<float*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
    const int64_t valid = std::min<int64_t>(r, rows - p0);
    if (src.col_stride == 1) {
      // Row-major: decode 8 rows x 8 k, transpose, store 8 k rows of 8 floats.
      for (int64_t i0 = 0; i0 < r; i0 += 8) {
        const int64_t stored = std::min<int64_t>(8, r - i0);
        for (int64_t k0 = 0; k0 < kc; k0 += 8) {
          const int64_t nk = std::min<int64_t>(8, kc - k0);
          __m256 f[8];
          for (int t = 0; t < 8; ++t) {
            const uint8_t* row = src.data + (p0 + i0 + t) * src.row_stride + k0;
            f[t] = i0 + t < valid ? decode8<kE4M3>(nk == 8 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))
                                                           : load_bytes(row, nk))
                                  : _mm256_setzero_ps();
          }
          transpose8x8(f);
          for (int64_t k = 0; k < nk; ++k) store_floats(out + (k0 + k) * r + i0, f[k], stored);
        }
      }
      continue;
    }
    // Column-major (row_stride == 1): the rows of one k are contiguous bytes.
    for (int64_t k = 0; k < kc; ++k) {
      const uint8_t* col = src.data + p0 + k * src.col_stride;
      for (int64_t i0 = 0; i0 < r; i0 += 8) {
        const int64_t n = std::min<int64_t>(8, valid - i0);
        const __m128i b = n == 8 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(col + i0))
                                 : load_bytes(col + i0, n);
        store_floats(out + k * r + i0, decode8<kE4M3>(b), std::min<int64_t>(8, r - i0));
      }
    }
  }
}

void pack(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  if (src.dtype == DType::kFloat8E4M3) {
    pack_fp32<true>(src, rows, kc, r, dst);
  } else {
    pack_fp32<false>(src, rows, kc, r, dst);
  }
}

template <int MR, int NV>
void micro_fp32(int64_t kc, const void* a_packed, const void* b_packed, const float* c_in,
                int64_t ldc_in, float* c_out, int64_t ldc_out) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  // The C tile is read and written only after the k loop; when it lives in the fp32 totals of a
  // multi-pass K (megabytes, in L3 or memory), asking for its lines now lets them arrive while the
  // FMAs run instead of stalling the tile's end (measured ~4% on the grouped weight gradient).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (c_in) {
      _mm_prefetch(reinterpret_cast<const char*>(c_in + i * ldc_in), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c_in + i * ldc_in + 8 * NV - 1), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(c_out + i * ldc_out), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c_out + i * ldc_out + 8 * NV - 1), _MM_HINT_T0);
  }
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k, a += MR, b += 8 * NV) {
    __m256 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __m256 x = acc[i][v];
      if (c_in) x = _mm256_add_ps(x, _mm256_loadu_ps(c_in + i * ldc_in + 8 * v));
      _mm256_storeu_ps(c_out + i * ldc_out + 8 * v, x);
    }
  }
}

constexpr int kMr = 6;
constexpr int kNv = 2;

struct Avx2Tag {};  // this file's instantiation of store_tile (StoreTiles)

}  // namespace

KernelSet avx2_kernels() {
  return KernelSet{kMr, 8 * kNv, 1, 4, 256, 144, 2048, pack, pack, micro_fp32<kMr, kNv>, nullptr, true,
                   StoreTiles::instantiate<Avx2Tag>()};
}

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
