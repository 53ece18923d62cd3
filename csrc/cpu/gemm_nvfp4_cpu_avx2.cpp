// AVX2 micro-kernel and packing of the NVFP4 CPU GEMM (see gemm_nvfp4_cpu.h): a 6 x 16 register
// tile (the tile of gemm_cpu_avx2.cpp), each 16-k block summed in registers from its first
// product by fused multiply-adds (exact there), then one addition of the block's sums into the
// fp32 total in memory, as the reference does.
//
// Packing decodes 16 E2M1 codes of a row at a time: vpermps looks their magnitudes up in a
// register (its index is the code's low 3 bits), the code's bit 3 becomes the sign, and one
// multiply applies the block's E4M3 scale: the same products as the portable table lookup
// (exact in fp32), so the same bits. 8 rows are transposed in registers into the panels'
// k-major layout. With the portable packing (a table lookup and a scalar store per value)
// packing took 13% of a 2048^3 GEMM's samples (perf, one thread, AMD Zen 3), with this 9%.
#include <immintrin.h>

#include <algorithm>

#include "gemm_nvfp4_cpu.h"
#include "pack_avx2.h"
#include "transformer_linear/fp8_math.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

// One 16-k block: acc = its products, summed from the first product (a multiply) in k order.
template <int MR, int NV>
inline void block_sums(const float* a, const float* b, __m256 (&acc)[MR][NV]) {
  {
    __m256 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_mul_ps(av, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int k = 1; k < kBlockK; ++k) {
    __m256 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + k * 8 * NV + 8 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + k * MR + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
}

// The block's sums start from its first product rather than from a zeroed register (an FMA
// into zero): the same exact sums but for the sign of an all-zero block's sum, which the
// addition into the total (never -0: it starts at +0) does not see. Measured with the 16-k
// loop fully unrolled: 70 -> 81 GFLOP/s for panels in L1/L2 (AMD Zen 3, one thread), the rate
// of a plain fp32 micro-kernel that sums all of K in registers.
template <int MR, int NV>
void micro_fp32(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK, a += kBlockK * MR, b += kBlockK * 8 * NV) {
    __m256 acc[MR][NV];
    block_sums<MR, NV>(a, b, acc);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* t = total + i * ld_total + 8 * v;
        _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), acc[i][v]));
      }
    }
  }
}

// Eight E2M1 codes (one per 32-bit lane) times the scale s, as fp32.
inline __m256 decode8(__m256i codes, __m256 s) {
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(codes, 3), 31));
  return _mm256_mul_ps(_mm256_xor_ps(magnitude, sign), s);
}

// kpack = 1 (fp32 panels): panel float [k * r + i] = value(row i, k) * its block scale.
void pack_fp32(const uint8_t* data, const uint8_t* scale, int64_t ld, int64_t row0, int64_t rows, int64_t pc,
               int64_t kc, int r, void* dst) {
  const int64_t row_bytes = ld / 2, row_scales = ld / kBlockK;
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  float* out = static_cast<float*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
    const int64_t valid = std::min<int64_t>(r, rows - p0);
    for (int i0 = 0; i0 < r; i0 += 8) {
      const int64_t stored = std::min(8, r - i0);
      for (int64_t kk = 0; kk < kc; kk += kBlockK) {
        __m256 lo[8], hi[8];  // rows i0..i0+7: k kk..kk+7, kk+8..kk+15
        for (int t = 0; t < 8; ++t) {
          if (i0 + t >= valid) {
            lo[t] = hi[t] = _mm256_setzero_ps();
            continue;
          }
          const int64_t row = row0 + p0 + i0 + t;
          const __m256 s = _mm256_set1_ps(fp8::float_from_e4m3_bits(scale[row * row_scales + (pc + kk) / kBlockK]));
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + row * row_bytes + (pc + kk) / 2));
          // Codes in k order: each byte's low nibble, then its high one.
          const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low_nibbles),
                                                  _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles));
          lo[t] = decode8(_mm256_cvtepu8_epi32(codes), s);
          hi[t] = decode8(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)), s);
        }
        avx2::transpose8x8(lo);
        avx2::transpose8x8(hi);
        for (int k = 0; k < 8; ++k) avx2::store_floats(out + (kk + k) * r + i0, lo[k], stored);
        for (int k = 0; k < 8; ++k) avx2::store_floats(out + (kk + 8 + k) * r + i0, hi[k], stored);
      }
    }
  }
}

constexpr int kMr = 6;
constexpr int kNv = 2;

}  // namespace

KernelSet avx2_kernels() {
  KernelSet ks{kMr, 8 * kNv, 1, 256, 144, 2048, micro_fp32<kMr, kNv>};
  ks.pack = pack_fp32;
  return ks;
}

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
