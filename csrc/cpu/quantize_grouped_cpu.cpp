// CPU grouped columnwise quantize: the (total, c) input quantized into its (c, total) FP8 copy in
// blocks of token_block tokens that restart at every group's first token (formats/grouped_scaling.py).
// It runs the blockwise quantize's row kernels (quantize_block_cpu.h) of the current instruction set on
// bands of columns: per block, the columns' amaxes over its tokens (column_amax), their scales
// (block_scales, the block quantizers' rule, so the numbers are those of quantize_blockwise), the cast
// (column_cast) into a (tokens, columns) tile and its transpose into the output. Threads split the columns.
#include "quantize_grouped_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "parallel.h"
#include "quantize_block_cpu.h"
#include "transformer_linear/block_math.h"

namespace tl {
namespace cpu {
namespace {

using quantize_block::RowKernels;
using quantize_block::ScaleRule;

// Columns per band: a band's row runs (256 elements) are long enough for the vector kernels, and
// a cast tile (kTileRows x kBandCols bytes) stays in L1.
constexpr int64_t kBandCols = 256;
constexpr int64_t kTileRows = 128;

RowKernels kernels_for(DType in, DType out) {
  using namespace quantize_block;
  switch (current_isa()) {
    case Isa::kAvx2:
      return avx2_kernels(in, out);
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return avx512_kernels(in, out);
    default:
      return generic_kernels(in, out);
  }
}

}  // namespace

void quantize_grouped_columnwise(const QuantizeGroupedParams& p) {
  if (p.c == 0) return;
  const RowKernels kn = kernels_for(p.input.dtype, p.fp8_dtype);
  const float fp8_max = p.fp8_dtype == DType::kFloat8E4M3 ? fp8::kE4M3Max : fp8::kE5M2Max;
  const ScaleRule rule{fp8_max, p.fp8_dtype == DType::kFloat8E4M3 ? 8 : 15, p.e8m0, p.power_2_scale, p.e8m0_floor};
  const int32_t* offs = static_cast<const int32_t*>(p.offs.data);
  const auto* x = static_cast<const char*>(p.input.data);
  const int64_t in_size = element_size(p.input.dtype);
  auto* out = static_cast<uint8_t*>(p.output_t.data);
  auto* scale_inv = static_cast<uint8_t*>(p.scale_inv_t.data);
  const int64_t scale_size = p.e8m0 ? 1 : 4;
  const int64_t used = p.groups == 0 ? 0 : offs[p.groups - 1];  // tokens past it belong to no group
  // The scale_inv of a block no token reaches (amax 0): the grid's unused columns hold it.
  uint8_t unused_scale_inv[4];
  quantize_block::block_scale_of(0.0f, rule, unused_scale_inv, 0);

  const int64_t bands = (p.c + kBandCols - 1) / kBandCols;
  parallel_for(bands, 1, [&](int64_t b0, int64_t b1) {
    // Up to kTileRows / 32 blocks' amaxes and scales (one span), kBandCols apart.
    std::vector<float> amax(kTileRows / 32 * kBandCols), scale(kTileRows / 32 * kBandCols);
    std::vector<uint8_t> band_scale_inv(kBandCols * 4);
    std::vector<uint8_t> tile(kTileRows * kBandCols);
    for (int64_t band = b0; band < b1; ++band) {
      const int64_t c0 = band * kBandCols, w = std::min(kBandCols, p.c - c0);
      for (int64_t c = c0; c < c0 + w; ++c) {
        uint8_t* row = scale_inv + c * p.grid_cols * scale_size;
        for (int64_t j = 0; j < p.grid_cols; ++j) std::memcpy(row + j * scale_size, unused_scale_inv, scale_size);
        // (Guarded: an empty output's data pointer may be null, which memset must not be handed.)
        if (p.total > used) std::memset(out + c * p.total + used, 0, p.total - used);
      }
      for (int64_t g = 0; g < p.groups; ++g) {
        const int64_t start = g == 0 ? 0 : offs[g - 1], end = offs[g];
        const int64_t block = p.token_block == 0 ? std::max<int64_t>(end - start, 1) : p.token_block;
        const int64_t first_col = p.token_block == 0 ? g : start / p.token_block + g;
        // Spans of tokens scaled and cast together: kTileRows tokens (whole blocks of 128 or 32, the
        // group's last one maybe partial), or the whole group; each span's tiles are transposed whole.
        const int64_t span = p.token_block == 0 ? block : kTileRows;
        for (int64_t s0 = start; s0 < end; s0 += span) {
          const int64_t s1 = std::min(end, s0 + span);
          const int64_t blocks = (s1 - s0 + block - 1) / block;
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t r0 = s0 + b * block, r1 = std::min(s1, r0 + block);
            float* block_amax = amax.data() + b * kBandCols;
            std::fill(block_amax, block_amax + w, 0.0f);
            for (int64_t r = r0; r < r1; ++r) kn.column_amax(x + (r * p.c + c0) * in_size, w, block_amax);
            kn.block_scales(block_amax, w, rule, band_scale_inv.data(), scale.data() + b * kBandCols);
            const int64_t col = first_col + (r0 - start) / block;
            for (int64_t i = 0; i < w; ++i) {
              std::memcpy(scale_inv + ((c0 + i) * p.grid_cols + col) * scale_size,
                          band_scale_inv.data() + i * scale_size, scale_size);
            }
          }
          for (int64_t t0 = s0; t0 < s1; t0 += kTileRows) {
            const int64_t t1 = std::min(s1, t0 + kTileRows);
            for (int64_t r = t0; r < t1; ++r) {
              const float* row_scale = scale.data() + ((r - s0) / block) * kBandCols;
              kn.column_cast(x + (r * p.c + c0) * in_size, tile.data() + (r - t0) * w, w, row_scale);
            }
            kn.transpose(tile.data(), w, t1 - t0, w, out + c0 * p.total + t0, p.total);
          }
        }
        // An empty group's whole-group scale column (amax 0) was filled above.
      }
    }
  });
}

}  // namespace cpu
}  // namespace tl
