// AVX2 micro-kernel of the NVFP4 CPU GEMM (see gemm_nvfp4_cpu.h): one 8-lane row of
// partial sums per output row, fused multiply-adds (exact inside a K block).
#include <immintrin.h>

#include "gemm_nvfp4_cpu.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

constexpr int kBlock = 16;
static_assert(kNR == 8 && kMR == 4, "one __m256 per output row");

void micro_kernel(const float* a, const float* b, int64_t kc, int64_t i0, int64_t j0, float* acc,
                  int64_t ld_acc) {
  __m256 total[kMR];
  for (int i = 0; i < kMR; ++i) total[i] = _mm256_loadu_ps(acc + (i0 + i) * ld_acc + j0);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlock) {
    __m256 part[kMR];
    for (int i = 0; i < kMR; ++i) part[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + kBlock; ++k) {
      const __m256 bv = _mm256_loadu_ps(b + k * kNC + j0);
      const float* av = a + k * kMC + i0;
      for (int i = 0; i < kMR; ++i) part[i] = _mm256_fmadd_ps(_mm256_set1_ps(av[i]), bv, part[i]);
    }
    for (int i = 0; i < kMR; ++i) total[i] = _mm256_add_ps(total[i], part[i]);
  }
  for (int i = 0; i < kMR; ++i) _mm256_storeu_ps(acc + (i0 + i) * ld_acc + j0, total[i]);
}

}  // namespace

MicroKernelFn micro_kernel_avx2() { return micro_kernel; }

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
