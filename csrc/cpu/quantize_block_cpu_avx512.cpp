// AVX-512 row kernels of the CPU blockwise quantize (quantize_block_cpu.h),
// 16 lanes at a time on quantize_lanes_avx512.h's loads and cast.
#include <immintrin.h>

#include <algorithm>

#include "quantize_block_cpu.h"
#include "quantize_lanes_avx512.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx512 {
namespace {

// Running amaxes are non-negative floats or NaN, so their bits compare like the lanes'.
template <typename In>
void column_amax(const void* xv, int64_t n, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i a = _mm512_loadu_si512(amax + i);
    _mm512_storeu_si512(amax + i, _mm512_max_epu32(a, abs_bits(load_hp<In>(x + i))));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512i a = _mm512_maskz_loadu_epi32(m, amax + i);
    _mm512_mask_storeu_epi32(amax + i, m, _mm512_max_epu32(a, abs_bits(load_hp<In>(x + i, m))));
  }
}

template <typename In, typename Out>
void column_cast(const void* xv, uint8_t* q, int64_t n, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = to_fp8<Out>(load_hp<In>(x + i), _mm512_loadu_ps(scale + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm_mask_storeu_epi8(q + i, m, to_fp8<Out>(load_hp<In>(x + i, m), _mm512_maskz_loadu_ps(m, scale + i)));
  }
}

#include "quantize_block_cpu_vec.h"  // segment kernels and the RowKernels table

}  // namespace
}  // namespace avx512

namespace quantize_block {

RowKernels avx512_kernels(DType in, DType out) { return avx512::block_row_kernels(in, out); }

}  // namespace quantize_block
}  // namespace cpu
}  // namespace tl
