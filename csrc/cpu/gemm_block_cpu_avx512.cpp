// AVX-512 promotion step of the block-scaled CPU GEMM (see gemm_block_cpu.h).
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
    const __m512 a = _mm512_set1_ps(sa[i]);
    const float* p = part + i * ld_part;
    float* c = acc + i * ld_acc;
    for (int j = 0; j < cols; j += 16) {
      const __mmask16 m = cols - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - j)) - 1);
      const __m512 s = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, sb + j));
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), s);
      if (!first) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, c + j), v);
      _mm512_mask_storeu_ps(c + j, m, v);
    }
  }
}

void fold(void* panel, int elem_bytes, int64_t kc, int r, int kpack, const int32_t* row_exp,
          int64_t block_k) {
  if (elem_bytes != 2 || block_k % kpack != 0) {
    return fold_generic(panel, elem_bytes, kc, r, kpack, row_exp, block_k);
  }
  uint16_t* data = static_cast<uint16_t*>(panel);
  const int64_t groups = (kc + kpack - 1) / kpack, group_elems = int64_t{r} * kpack;
  const int64_t groups_per_block = block_k / kpack;
  const auto fold_vector = [](uint16_t* p, __mmask32 m, __m512i add) {
    const __m512i v = _mm512_maskz_loadu_epi16(m, p);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7fff));
    // Nonzero and finite (exponent field not all ones).
    const __mmask32 live = _mm512_mask_cmpneq_epi16_mask(m, mag, _mm512_setzero_si512()) &
                           _mm512_cmplt_epi16_mask(mag, _mm512_set1_epi16(0x7f80));
    _mm512_mask_storeu_epi16(p, m, _mm512_mask_add_epi16(v, live, v, add));
  };
  if (kpack % 32 == 0) {  // AMX A panels: a row's k values of a group fill whole vectors, one exponent each
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t* e = row_exp + (g / groups_per_block) * r;
      for (int row = 0; row < r; ++row) {
        const __m512i add = _mm512_set1_epi16(static_cast<int16_t>(e[row] * 128));
        uint16_t* p = data + g * group_elems + int64_t{row} * kpack;
        for (int t = 0; t < kpack; t += 32) fold_vector(p + t, ~__mmask32{0}, add);
      }
    }
    return;
  }
  alignas(64) int16_t add[64 * 64];  // r * kpack <= 64 * 64
  for (int64_t g0 = 0; g0 < groups; g0 += groups_per_block) {
    const int32_t* e = row_exp + (g0 / groups_per_block) * r;
    for (int64_t x = 0; x < group_elems; ++x) add[x] = static_cast<int16_t>(e[x / kpack] * 128);
    const int64_t g1 = std::min(groups, g0 + groups_per_block);
    for (int64_t g = g0; g < g1; ++g) {
      uint16_t* p = data + g * group_elems;
      for (int64_t x = 0; x < group_elems; x += 32) {
        const __mmask32 m = group_elems - x >= 32 ? ~__mmask32{0}
                                                  : static_cast<__mmask32>((1u << (group_elems - x)) - 1);
        fold_vector(p + x, m, _mm512_maskz_loadu_epi16(m, add + x));
      }
    }
  }
}

}  // namespace

PromoteFn promote_avx512() { return promote; }

FoldFn fold_avx512() { return fold; }

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
