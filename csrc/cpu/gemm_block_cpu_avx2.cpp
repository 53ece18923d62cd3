// AVX2 promotion and folding steps of the block-scaled CPU GEMM (see gemm_block_cpu.h).
#include <immintrin.h>

#include <algorithm>

#include "gemm_block_cpu.h"

namespace tl {
namespace cpu {
namespace gemm_block {
namespace {

void promote(const float* part, int ld_part, const float* sa, const float* sb, int rows, int cols,
             bool first, float* acc, int64_t ld_acc) {
  for (int i = 0; i < rows; ++i) {
    const __m256 a = _mm256_set1_ps(sa[i]);
    const float* p = part + i * ld_part;
    float* c = acc + i * ld_acc;
    int j = 0;
    for (; j + 8 <= cols; j += 8) {
      const __m256 s = _mm256_mul_ps(a, _mm256_loadu_ps(sb + j));
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + j), s);
      if (!first) v = _mm256_add_ps(_mm256_loadu_ps(c + j), v);
      _mm256_storeu_ps(c + j, v);
    }
    for (; j < cols; ++j) {  // the same two roundings as the vector lanes
      const float v = p[j] * (sa[i] * sb[j]);
      c[j] = first ? v : c[j] + v;
    }
  }
}

// fp32 panels (kpack = 1): element (row, k) at [k * r + row]; its exponent is
// added to the float's exponent field where the value is nonzero and finite.
void fold(void* panel, int elem_bytes, int64_t kc, int r, int kpack, const int32_t* row_exp,
          int64_t block_k) {
  if (elem_bytes != 4 || kpack != 1) {
    return fold_generic(panel, elem_bytes, kc, r, kpack, row_exp, block_k);
  }
  uint32_t* data = static_cast<uint32_t*>(panel);
  const __m256i mag_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  for (int64_t k0 = 0; k0 < kc; k0 += block_k) {
    const int32_t* e = row_exp + (k0 / block_k) * r;
    for (int i = 0; i < r; i += 8) {
      // Lanes past the panel's r rows are neither read nor written.
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(r - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256i add = _mm256_slli_epi32(_mm256_maskload_epi32(e + i, lanes), 23);
      for (int64_t k = k0; k < std::min(kc, k0 + block_k); ++k) {
        int* p = reinterpret_cast<int*>(data + k * r + i);
        const __m256i v = _mm256_maskload_epi32(p, lanes);
        const __m256i mag = _mm256_and_si256(v, mag_mask);
        // Nonzero and finite: 0 < mag < inf (signed compares: mag has its sign bit clear).
        const __m256i live = _mm256_and_si256(_mm256_cmpgt_epi32(mag, _mm256_setzero_si256()),
                                              _mm256_cmpgt_epi32(inf, mag));
        _mm256_maskstore_epi32(p, lanes, _mm256_add_epi32(v, _mm256_and_si256(live, add)));
      }
    }
  }
}

}  // namespace

PromoteFn promote_avx2() { return promote; }

FoldFn fold_avx2() { return fold; }

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
