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

// fp32 panels (kpack = 1): element (row, k) at [k * r + row], so one K-block's rows form
// one contiguous run of block_k * r floats whose exponents repeat every r elements. The run
// is walked with full 8-lane loads and stores against a pattern of exponent addends as long
// as a whole number of both vectors and panel rows; each element's exponent is added to the
// float's exponent field where the value is nonzero and finite. No masked loads or stores:
// vpmaskmovd stores are microcoded and slow on AMD Zen.
inline __m256i fold8(__m256i v, __m256i add) {
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff));
  // Nonzero and finite: 0 < mag < inf (signed compares: mag has its sign bit clear).
  const __m256i live = _mm256_and_si256(_mm256_cmpgt_epi32(mag, _mm256_setzero_si256()),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), mag));
  return _mm256_add_epi32(v, _mm256_and_si256(live, add));
}

void fold(void* panel, int elem_bytes, int64_t kc, int r, int kpack, const int32_t* row_exp,
          int64_t block_k) {
  if (elem_bytes != 4 || kpack != 1 || r > 64) {
    return fold_generic(panel, elem_bytes, kc, r, kpack, row_exp, block_k);
  }
  uint32_t* data = static_cast<uint32_t*>(panel);
  // Element x of a block gains add[x % period]: period = r when r is a whole number of vectors,
  // else 8 * r (a whole number of both).
  alignas(32) int32_t add[8 * 64];
  const int period = r % 8 == 0 ? r : 8 * r;
  for (int64_t k0 = 0; k0 < kc; k0 += block_k) {
    const int32_t* e = row_exp + (k0 / block_k) * r;
    for (int x0 = 0; x0 < period; x0 += r) {
      for (int i = 0; i < r; ++i) add[x0 + i] = e[i] * (1 << 23);
    }
    uint32_t* p = data + k0 * r;
    const int64_t len = (std::min(kc, k0 + block_k) - k0) * r;
    int64_t x = 0;
    for (; x + period <= len; x += period) {
      for (int v = 0; v < period; v += 8) {
        __m256i* q = reinterpret_cast<__m256i*>(p + x + v);
        _mm256_storeu_si256(q, fold8(_mm256_loadu_si256(q),
                                     _mm256_load_si256(reinterpret_cast<const __m256i*>(add + v))));
      }
    }
    for (; x + 8 <= len; x += 8) {  // x - (whole periods) stays a multiple of 8 below `period`
      __m256i* q = reinterpret_cast<__m256i*>(p + x);
      _mm256_storeu_si256(q, fold8(_mm256_loadu_si256(q),
                                   _mm256_load_si256(reinterpret_cast<const __m256i*>(add + x % period))));
    }
    for (; x < len; ++x) {
      const uint32_t mag = p[x] & 0x7fffffffu;
      if (mag != 0 && mag < 0x7f800000u) p[x] = static_cast<uint32_t>(static_cast<int64_t>(p[x]) + add[x % period]);
    }
  }
}

}  // namespace

PromoteFn promote_avx2() { return promote; }

FoldFn fold_avx2() { return fold; }

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
