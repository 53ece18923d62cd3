// FP8 (e4m3) -> fp32 decode for the AVX2 GEMM's packing, three ways: F16C
// (binary16 fields + vcvtph2ps, what csrc/cpu/gemm_cpu_avx2.cpp uses), a
// vgatherdps from the 256-entry fp32 table, and a scalar table lookup. All
// three are checked bitwise against each other first. Standalone:
//
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/fp8_decode benchmarks/fp8_decode_avx2.cpp && /tmp/fp8_decode
//
// AMD EPYC Zen 3 (avx2 fma f16c, no AVX-512), 16 Ki values in cache, best of 200, shared machine:
//   f16c 0.39 ns/value, gather 1.08 ns/value, scalar 0.60 ns/value
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <vector>
#include <cmath>
static float table[256];
__attribute__((noinline)) void dec_f16c(const uint8_t* p, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    __m128i b = _mm_loadl_epi64((const __m128i*)(p + i));
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(mag, 7))), _mm256_set1_ps(256.0f));
    const __m128i nan16 = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16));
    _mm256_storeu_ps(out + i, _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), nan));
  }
}
__attribute__((noinline)) void dec_gather(const uint8_t* p, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    __m128i b = _mm_loadl_epi64((const __m128i*)(p + i));
    _mm256_storeu_ps(out + i, _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(b), 4));
  }
}
__attribute__((noinline)) void dec_scalar(const uint8_t* p, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = table[p[i]];
}
int main() {
  for (int i = 0; i < 256; ++i) {  // e4m3
    int s = i >> 7, e = (i >> 3) & 15, m = i & 7;
    float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
    if ((i & 0x7f) == 0x7f) v = NAN;
    table[i] = s ? -v : v;
  }
  const int64_t n = 1 << 14;  // in L1/L2
  std::vector<uint8_t> src(n); std::vector<float> a(n), b(n), c(n);
  for (int64_t i = 0; i < n; ++i) src[i] = (uint8_t)(i * 37 + 11);
  dec_f16c(src.data(), a.data(), n); dec_gather(src.data(), b.data(), n); dec_scalar(src.data(), c.data(), n);
  int bad = 0; for (int64_t i = 0; i < n; ++i) if (memcmp(&a[i], &c[i], 4) && !(std::isnan(a[i]) && std::isnan(c[i]))) bad++;
  for (int64_t i = 0; i < n; ++i) if (memcmp(&b[i], &c[i], 4)) bad++;
  printf("mismatches %d\n", bad);
  auto time = [&](const char* name, void (*f)(const uint8_t*, float*, int64_t)) {
    double best = 1e9;
    for (int r = 0; r < 200; ++r) {
      auto t0 = std::chrono::steady_clock::now(); f(src.data(), a.data(), n);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < best) best = s;
    }
    printf("%-8s %.3f ns/value\n", name, best / n * 1e9);
  };
  time("f16c", dec_f16c); time("gather", dec_gather); time("scalar", dec_scalar);
  time("f16c", dec_f16c); time("gather", dec_gather); time("scalar", dec_scalar);
}
