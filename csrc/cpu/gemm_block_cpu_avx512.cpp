// AVX-512 promotion step of the block-scaled CPU GEMM (see gemm_block_cpu.h).
#include <immintrin.h>

#include "gemm_block_cpu.h"

namespace tl {
namespace cpu {
namespace gemm_block {
namespace {

void promote(const float* part, const float* sa, const float* sb, int rows, int cols, int ld,
             float* acc) {
  for (int i = 0; i < rows; ++i) {
    const __m512 a = _mm512_set1_ps(sa[i]);
    int j = 0;
    for (; j + 16 <= cols; j += 16) {
      const __m512 s = _mm512_mul_ps(a, _mm512_loadu_ps(sb + j));
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(part + i * ld + j), s);
      _mm512_storeu_ps(acc + i * ld + j, _mm512_add_ps(_mm512_loadu_ps(acc + i * ld + j), v));
    }
    if (j < cols) {
      const __mmask16 m = static_cast<__mmask16>((1u << (cols - j)) - 1);
      const __m512 s = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, sb + j));
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, part + i * ld + j), s);
      _mm512_mask_storeu_ps(acc + i * ld + j, m,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + i * ld + j), v));
    }
  }
}

}  // namespace

PromoteFn promote_avx512() { return promote; }

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
