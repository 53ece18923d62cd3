// AVX2 row kernels of the CPU blockwise quantize (quantize_block_cpu.h),
// 8 lanes at a time on quantize_lanes_avx2.h's loads and cast.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quantize_block_cpu.h"
#include "quantize_lanes_avx2.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace avx2 {
namespace {

// Running amaxes are non-negative floats or NaN, so their bits compare like the lanes'.
template <typename In>
void column_amax(const void* xv, int64_t n, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(amax + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax + i),
                        _mm256_max_epu32(a, abs_bits(load_hp<In>(x + i))));
  }
  for (; i < n; ++i) amax[i] = fp8::amax_update(amax[i], In::load(x[i]));
}

template <typename In, typename Out>
void column_cast(const void* xv, uint8_t* q, int64_t n, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = to_fp8<Out>(load_hp<In>(x + i), _mm256_loadu_ps(scale + i));
    const __m256i hi = to_fp8<Out>(load_hp<In>(x + i + 8), _mm256_loadu_ps(scale + i + 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), pack_bytes(lo, hi));
  }
  if (i < n) {
    const int64_t rest = n - i, n0 = std::min<int64_t>(rest, 8);
    const __m256i lo = to_fp8<Out>(load_hp<In>(x + i, n0), load_scales(scale + i, n0));
    const __m256i hi = rest > 8 ? to_fp8<Out>(load_hp<In>(x + i + 8, rest - 8), load_scales(scale + i + 8, rest - 8))
                                : _mm256_setzero_si256();
    alignas(16) uint8_t bytes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), pack_bytes(lo, hi));
    std::memcpy(q + i, bytes, static_cast<size_t>(rest));
  }
}

#include "quantize_block_cpu_vec.h"  // segment kernels and the RowKernels table

}  // namespace
}  // namespace avx2

namespace quantize_block {

RowKernels avx2_kernels(DType in, DType out) { return avx2::block_row_kernels(in, out); }

}  // namespace quantize_block
}  // namespace cpu
}  // namespace tl
