// In-register transpose of a 16x16 byte block (SSE2), shared by the vector
// byte transposes of the AVX2 and AVX-512 quantize lanes.
#pragma once

#include <emmintrin.h>

namespace tl {
namespace cpu {
namespace sse2 {

// One round of the 16x16 byte transpose: interleave row i with row i + 8.
inline void interleave_round(const __m128i (&in)[16], __m128i (&out)[16]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    out[2 * i] = _mm_unpacklo_epi8(in[i], in[i + 8]);
    out[2 * i + 1] = _mm_unpackhi_epi8(in[i], in[i + 8]);
  }
}

// Four interleaving rounds move element (r, c) to (c, r). Written without a
// loop over the rounds so that the compiler keeps all 16 rows in registers (a
// rounds loop spills them to the stack, and the reloads stall on store
// forwarding).
inline void transpose16x16(__m128i (&rows)[16]) {
  __m128i tmp[16];
  interleave_round(rows, tmp);
  interleave_round(tmp, rows);
  interleave_round(rows, tmp);
  interleave_round(tmp, rows);
}

}  // namespace sse2
}  // namespace cpu
}  // namespace tl
