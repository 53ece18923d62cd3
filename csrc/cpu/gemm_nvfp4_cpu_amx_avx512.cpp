// AMX-BF16 micro-kernel of the CPU NVFP4 GEMM (the avx512_bf16 path on CPUs with AMX tiles).
// Compiled with the AVX-512 flags; the tile code carries its own target attribute and runs only
// where gemm::amx_usable() (CPUID plus the kernel's permission for the tile state).
//
// The NVFP4 GEMM's bits are the reference's: each 16-k block's products summed from zero (exact:
// E2M1 values times E4M3 block scales are exact in bf16, their products in fp32, and a block's
// sum of 16 of them fits fp32's mantissa), then added to the fp32 total in K order. tdpbf16ps
// does exactly that when one instruction covers one 16-k block: per output element it sums the
// products of the even and of the odd k in two fp32 chains from zero, adds the two chains, and
// then adds that to the accumulator with one rounding (measured on Sapphire Rapids-class tiles:
// this model matched every one of 51200 elements of random bf16 tiles with carries, where plain
// sequential or fused orders did not). A block's chains are exact, so the accumulator tile gets
// total + block sum, rounded once: A tiles of 16 bf16 a row (one block), B tiles of its 8
// k-pairs, and the four 16 x 16 accumulators stay in the tiles for the whole KC panel. 32-k
// tiles (the FP8 GEMM's, gemm_cpu_amx_avx512.cpp) would add two blocks' products in one chain
// and round inside the pair.
//
// Packed layout (gemm_nvfp4_cpu.h): A panels with kpack = 16 (a row's 16 k of one block in one
// 32-byte tile row), B panels as bf16 pairs (kpack = 2: a block's 8 pairs x 32 columns, the VNNI
// layout of tdpbf16ps's B tile).
#include <immintrin.h>

#include "amx_tiles_avx512.h"
#include "gemm_cpu.h"
#include "gemm_nvfp4_cpu.h"
#include "pack_avx2.h"
#include "transformer_linear/fp8_math.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

constexpr int kTile = amx::kTile;
constexpr int kMr = 2 * kTile;  // rows of A per micro-kernel tile
constexpr int kNr = 2 * kTile;  // rows of B (columns of D)
constexpr int kPairs = kBlockK / 2;

// Tiles 0-1: A (16 rows x 16 bf16), 2-3: B (8 k-pairs x 16 columns), 4-7: the 32 x 32 totals.
// Loaded before each run of micro-kernel calls: other code on the thread (the FP8 GEMM's AMX
// kernel, oneDNN) may have configured the tiles its own way.
TL_AMX_TARGET void configure_tiles() {
  // Static storage: GCC 12 drops stores to a local config as dead before ldtilecfg.
  static const amx::TileConfig config = amx::config_2x2(kBlockK * 2, kPairs);
  _tile_loadconfig(&config);
}

// total (32 x 32, rows ld_total apart) += each 16-k block's sum, in K order: one tdpbf16ps a
// block and tile (see the top of the file).
TL_AMX_TARGET void micro_amx(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const uint8_t* a = static_cast<const uint8_t*>(a_packed);
  const uint8_t* b = static_cast<const uint8_t*>(b_packed);
  constexpr int64_t kBlockBytes = kMr * kBlockK * 2;  // one 16-k block of a panel (A and B alike)
  amx::load_c(total, ld_total);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK, a += kBlockBytes, b += kBlockBytes) {
    amx::step_2x2(a, kBlockK * 2, b, kNr * 4);
  }
  amx::store_c(total, ld_total);
}

// The 16 values of one row's 16-k block (8 bytes of E2M1 codes, low nibble first) times the
// block's scale, as bf16 (exact: at most 5 significant bits; the portable packing's truncation).
inline __m256i decode_block_bf16(const uint8_t* bytes8, __m512 scale) {
  const __m512 values = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,  //
                                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes8));
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low_nibbles),
                                          _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles));
  const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), values), scale);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

// Row `row`'s 16-k block at k, decoded (zeros for a row past the operand's: `valid` false).
inline __m256i row_block(const uint8_t* data, const uint8_t* scale, int64_t ld, int64_t row, bool valid, int64_t k) {
  if (!valid) return _mm256_setzero_si256();
  const float block_scale = fp8::float_from_e4m3_bits(scale[row * (ld / kBlockK) + k / kBlockK]);
  return decode_block_bf16(data + row * (ld / 2) + k / 2, _mm512_set1_ps(block_scale));
}

// A panels, kpack = 16: panel words [(b * r + i) * 16 + t] = bf16(row i, k 16 b + t).
void pack_k16(const uint8_t* data, const uint8_t* scale, int64_t ld, int64_t row0, int64_t rows, int64_t pc,
              int64_t kc, int r, void* dst) {
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r) {
    uint16_t* panel = out + (p0 / r) * kc * r;
    for (int i = 0; i < r; ++i) {
      for (int64_t kk = 0; kk < kc; kk += kBlockK) {
        const __m256i v = row_block(data, scale, ld, row0 + p0 + i, p0 + i < rows, pc + kk);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((kk / kBlockK) * r + i) * kBlockK), v);
      }
    }
  }
}

// B panels, bf16 pairs (kpack = 2): panel dwords [g * r + i] = bf16 pair (row i, k 2g and 2g + 1); r a
// multiple of 8. A block of 8 rows is decoded (a row's 16 bf16 are its 8 pairs) and transposed, so
// each of its 8 pair rows is one 32-byte store.
void pack_pairs(const uint8_t* data, const uint8_t* scale, int64_t ld, int64_t row0, int64_t rows, int64_t pc,
                int64_t kc, int r, void* dst) {
  uint32_t* out = static_cast<uint32_t*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r) {
    uint32_t* panel = out + (p0 / r) * (kc / 2) * r;
    for (int i0 = 0; i0 < r; i0 += 8) {
      for (int64_t kk = 0; kk < kc; kk += kBlockK) {
        __m256 v[8];  // the pairs as 32-bit lanes (moved, never computed on)
        for (int i = 0; i < 8; ++i) {
          v[i] = _mm256_castsi256_ps(row_block(data, scale, ld, row0 + p0 + i0 + i, p0 + i0 + i < rows, pc + kk));
        }
        avx2::transpose8x8(v);
        for (int g = 0; g < 8; ++g) _mm256_storeu_ps(reinterpret_cast<float*>(panel + (kk / 2 + g) * r + i0), v[g]);
      }
    }
  }
}

}  // namespace

KernelSet amx_kernels() {
  // The blocking of the FP8 GEMM's AMX set (gemm_cpu_amx_avx512.cpp): 2048-k panels (128 KiB each, from
  // L2) keep the totals in the tiles for a whole call; KC 512 ran 2048^3 at 0.7x this rate, 1024 and
  // 4096 no faster (two threads, Sapphire Rapids class). The outputs are streamed past the caches as
  // there, and the hardware prefetchers follow the long B panels without help (a software prefetch of
  // the next B panel made no measurable difference).
  KernelSet ks{kMr, kNr, 2, 2048, 256, 2048, micro_amx};
  ks.pack = pack_pairs;
  ks.pack_a = pack_k16;
  ks.prepare = configure_tiles;
  ks.prefetch_next_b = false;
  ks.store = gemm::avx512_store_tiles(true);
  return ks;
}

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
