// AVX-512 micro-kernels of the NVFP4 CPU GEMM (see gemm_nvfp4_cpu.h): the 14 x 32
// register tile of gemm_cpu_avx512.cpp, sums from zero over each 16-k block (exact
// there), then one addition of the block's sums into the fp32 total in memory.
//
// The vdpbf16ps kernel computes the same bits as the fp32 one: every packed value is an
// E2M1 value times an E4M3 scale, at most 5 significant bits and magnitude >= 2^-10
// (exact and normal in bf16), every product a multiple of 2^-20 with at most 10
// significant bits, and every partial sum of a block a multiple of the block's smallest
// product below 2^24 times it: exact, and never denormal, so the instruction's DAZ/FTZ
// and its internal rounding change nothing.
#include <immintrin.h>

#include "gemm_nvfp4_cpu.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

template <int MR, int NV>
inline void add_to_total(__m512 (&acc)[MR][NV], float* total, int64_t ld_total) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* t = total + i * ld_total + 16 * v;
      _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), acc[i][v]));
    }
  }
}

template <int MR, int NV>
inline void zero_tile(__m512 (&acc)[MR][NV]) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
}

template <int MR, int NV>
void micro_fp32(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK) {
    __m512 acc[MR][NV];
    zero_tile<MR, NV>(acc);
#pragma GCC unroll 2
    for (int k = 0; k < kBlockK; ++k, a += MR, b += 16 * NV) {
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
    add_to_total<MR, NV>(acc, total, ld_total);
  }
}

template <int MR, int NV>
void micro_bf16(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const int32_t* a = static_cast<const int32_t*>(a_packed);
  const int32_t* b = static_cast<const int32_t*>(b_packed);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK) {
    __m512 acc[MR][NV];
    zero_tile<MR, NV>(acc);
#pragma GCC unroll 2
    for (int g = 0; g < kBlockK / 2; ++g, a += MR, b += 16 * NV) {
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
    add_to_total<MR, NV>(acc, total, ld_total);
  }
}

constexpr int kMr = 14;
constexpr int kNv = 2;

}  // namespace

KernelSet avx512_kernels() { return KernelSet{kMr, 16 * kNv, 1, 256, 336, 2048, micro_fp32<kMr, kNv>}; }

KernelSet avx512_bf16_kernels() { return KernelSet{kMr, 16 * kNv, 2, 512, 336, 2048, micro_bf16<kMr, kNv>}; }

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
