// AVX2 micro-kernel of the NVFP4 CPU GEMM (see gemm_nvfp4_cpu.h): a 6 x 16 register tile
// (the tile of gemm_cpu_avx2.cpp), fused multiply-adds from zero over each 16-k block
// (exact there), then one addition of the block's sums into the fp32 total in memory.
#include <immintrin.h>

#include "gemm_nvfp4_cpu.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

template <int MR, int NV>
void micro_fp32(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK) {
    __m256 acc[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
    }
#pragma GCC unroll 2
    for (int k = 0; k < kBlockK; ++k, a += MR, b += 8 * NV) {
      __m256 bv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m256 av = _mm256_broadcast_ss(a + i);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* t = total + i * ld_total + 8 * v;
        _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), acc[i][v]));
      }
    }
  }
}

constexpr int kMr = 6;
constexpr int kNv = 2;

}  // namespace

KernelSet avx2_kernels() { return KernelSet{kMr, 8 * kNv, 1, 256, 144, 2048, micro_fp32<kMr, kNv>}; }

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
