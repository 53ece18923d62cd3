// Register-level helpers of the AVX2 GEMM packing routines (gemm_cpu_avx2.cpp, gemm_nvfp4_cpu_avx2.cpp):
// rows decoded 8 k at a time are transposed in registers into the packed panels' k-major layout.
// Include only from files compiled with -mavx2.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tl {
namespace cpu {
namespace avx2 {

/*! \brief In-place transpose of an 8 x 8 block of floats held as 8 row registers. */
inline void transpose8x8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int b = 0; b < 8; b += 4) {
    u[b] = _mm256_shuffle_ps(t[b], t[b + 2], 0x44);
    u[b + 1] = _mm256_shuffle_ps(t[b], t[b + 2], 0xee);
    u[b + 2] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0x44);
    u[b + 3] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

/*! \brief Stores the first n (<= 8) floats of v at p (no masked store: vmaskmovps is slow on AMD Zen). */
inline void store_floats(float* p, __m256 v, int64_t n) {
  if (n == 8) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
  }
}

}  // namespace avx2
}  // namespace cpu
}  // namespace tl
