// AMX-BF16 micro-kernel of the CPU FP8 GEMM: the avx512_bf16 path on CPUs
// with AMX tiles (Sapphire Rapids and later). Compiled with the AVX-512
// flags; the tile code carries its own target attribute and is entered only
// after amx_usable() (CPUID plus the kernel's permission for the tile state).
//
// Tiles: A is packed 32 bf16 of k per 64-byte row (kpack = 32); B as bf16
// pairs (the VNNI layout tdpbf16ps wants, kpack = 2); a 32 x 32 fp32 block
// of C lives in four accumulator tiles. Like vdpbf16ps, tdpbf16ps flushes
// denormals, which FP8 inputs never produce (see gemm_cpu_avx512.cpp), and
// accumulates exact products in fp32.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "amx_tiles_avx512.h"
#include "gemm_cpu.h"

namespace tl {
namespace cpu {
namespace gemm {
namespace {

constexpr int kTile = amx::kTile;
constexpr int kTileK = 32;  // bf16 k values per A-tile row / per B tile
constexpr int kMr = 2 * kTile;
constexpr int kNr = 2 * kTile;

bool amx_supported_and_permitted() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  if (!amx_bf16 || !amx_tile) return false;
  // Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// B panel: bf16 pairs padded to whole 32-k tiles.
void pack_b_amx(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  pack_bf16_pairs_padded(src, rows, kc, r, (kc + kTileK - 1) / kTileK * (kTileK / 2), dst);
}

// Loaded before each run of micro-kernel calls: other code on the thread
// (e.g. oneDNN, the NVFP4 kernel) may have configured the tiles its own way.
TL_AMX_TARGET void configure_tiles() {
  // Static storage: GCC 12 drops stores to a local config as dead before ldtilecfg.
  static const amx::TileConfig config = amx::config_2x2(kTileK * 2, kTileK / 2);
  _tile_loadconfig(&config);
}

TL_AMX_TARGET void micro_amx(int64_t kc, const void* a_packed, const void* b_packed,
                             const float* c_in, int64_t ldc_in, float* c_out, int64_t ldc_out) {
  if (c_in) {
    amx::load_c(c_in, ldc_in);
  } else {
    amx::zero_c();
  }
  const uint8_t* a = static_cast<const uint8_t*>(a_packed);
  const uint8_t* b = static_cast<const uint8_t*>(b_packed);
  constexpr int64_t kARow = kTileK * 2, kBRow = kNr * 4;  // bytes per tile row in the panels
  const int64_t blocks = (kc + kTileK - 1) / kTileK;
  for (int64_t blk = 0; blk < blocks; ++blk, a += kMr * kARow, b += (kTileK / 2) * kBRow) {
    amx::step_2x2(a, kARow, b, kBRow);
  }
  amx::store_c(c_out, ldc_out);
}

}  // namespace

bool amx_usable() {
  static const bool available = amx_supported_and_permitted();
  const char* env = std::getenv("TL_CPU_AMX");
  return available && !(env && std::strcmp(env, "0") == 0);
}

KernelSet amx_kernels() {
  // KC = 2048: each micro-kernel call ends by storing its four accumulator tiles, which waits for
  // the TMUL pipeline to drain, and a K past KC sends partial sums through memory; 2048 k per call
  // (A and B panels of 128 KiB each, from L2) ran 2048^3 at 1.4x the rate of KC = 512 (one
  // thread, Sapphire Rapids class). 4096 (256 KiB panels) was slower again. The panels come from L2
  // near its bandwidth, so large outputs are written past it (StoreTiles' streaming entries).
  return KernelSet{kMr, kNr, kTileK, 2, 2048, 256, 2048, pack_bf16_k32,
                   pack_b_amx, micro_amx, configure_tiles, false, avx512_store_tiles(true), kTileK, 2};
}

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
