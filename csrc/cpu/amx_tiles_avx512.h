// The AMX tile code both AMX micro-kernels share (the FP8 GEMM's, gemm_cpu_amx_avx512.cpp, and the
// NVFP4 GEMM's, gemm_nvfp4_cpu_amx_avx512.cpp): the tile configuration and a 2 x 2 block of tiles,
// a 32 x 32 fp32 block of C in tiles 4-7 from A tiles 0-1 (16 rows each) and B tiles 2-3 (16
// columns each). Include only in files compiled with the AVX-512 flags; the functions carry the
// AMX target themselves and run only where gemm::amx_usable().
#pragma once

#include <immintrin.h>

#include <cstdint>

#define TL_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace tl {
namespace cpu {
namespace amx {

/*! \brief Rows of an A or C tile; fp32 columns of a C tile. */
constexpr int kTile = 16;

/*! \brief The 64-byte operand of ldtilecfg (palette 1). */
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

/*!
 * \brief Tile configuration of a 2 x 2 block: A tiles of 16 rows x `a_bytes`, B tiles of
 *        `b_rows` k-pairs x 16 columns, C tiles of 16 x 16 fp32.
 */
inline TileConfig config_2x2(int a_bytes, int b_rows) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) c.rows[t] = kTile, c.colsb[t] = static_cast<uint16_t>(a_bytes);
  for (int t = 2; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(b_rows), c.colsb[t] = kTile * 4;
  for (int t = 4; t < 8; ++t) c.rows[t] = kTile, c.colsb[t] = kTile * 4;
  return c;
}

/*!
 * \brief C tiles += the products of one k step: A rows `a_row` bytes apart (the second A tile
 *        16 rows on), B rows `b_row` bytes apart (the second B tile 64 bytes on).
 */
TL_AMX_TARGET inline void step_2x2(const uint8_t* a, int64_t a_row, const uint8_t* b, int64_t b_row) {
  _tile_loadd(0, a, a_row);
  _tile_loadd(1, a + kTile * a_row, a_row);
  _tile_loadd(2, b, b_row);
  _tile_loadd(3, b + kTile * 4, b_row);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(5, 0, 3);
  _tile_dpbf16ps(6, 1, 2);
  _tile_dpbf16ps(7, 1, 3);
}

/*! \brief C tiles = 0. */
TL_AMX_TARGET inline void zero_c() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

/*! \brief C tiles = the 32 x 32 fp32 block at c, rows `ldc` floats apart. */
TL_AMX_TARGET inline void load_c(const float* c, int64_t ldc) {
  const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
  _tile_loadd(4, c, stride);
  _tile_loadd(5, c + kTile, stride);
  _tile_loadd(6, c + kTile * ldc, stride);
  _tile_loadd(7, c + kTile * ldc + kTile, stride);
}

/*! \brief The 32 x 32 fp32 block at c (rows `ldc` floats apart) = C tiles. */
TL_AMX_TARGET inline void store_c(float* c, int64_t ldc) {
  const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
  _tile_stored(4, c, stride);
  _tile_stored(5, c + kTile, stride);
  _tile_stored(6, c + kTile * ldc, stride);
  _tile_stored(7, c + kTile * ldc + kTile, stride);
}

}  // namespace amx
}  // namespace cpu
}  // namespace tl
