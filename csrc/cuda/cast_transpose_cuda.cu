// Fused cast + transpose (the columnwise FP8 copy that dgrad and wgrad read
// K-major) with the bias gradient in the same pass.
//
// Each block owns a 64 x 64 tile; the tiles run along grid.x, row tiles
// fastest (no 65535 cap from grid.y on either dimension). A thread reads 4 rows x 8 columns with 8-element
// vector loads along rows (coalesced), writes the row-major FP8 output if
// asked, packs the 4 bytes of each column into one word in a swizzled shared
// tile, and after a barrier writes 8 consecutive transposed bytes per store.
// Column sums of the tile go to a per-tile partial row; a second, small
// kernel adds the partial rows in a fixed order, so dbias is deterministic and
// the input is read once.
#include "kernels.cuh"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cuda {
namespace {

constexpr int kTile = 64;
constexpr int kCtThreads = 128;
constexpr int kColGroups = kTile / kVec;      // 8 threads cover one tile row, 8 columns each
constexpr int kRowGroups = kCtThreads / kColGroups;  // 16 groups of 4 rows
constexpr int kRowsPerThread = kTile / kRowGroups;   // 4: one packed word per column
constexpr int kWordsPerCol = kTile / 4;              // 16 words hold a tile column's 64 bytes
static_assert(kRowsPerThread == 4, "one 32-bit word per column per thread");

// Word of tile column `col` holding rows 4 g .. 4 g + 3. Columns are 16 words
// (half a bank row), so the XOR mask spreads the stores of one warp (8 column
// groups x 4 row groups, same column offset j) over all 32 banks: bit 4 by
// (col >> 3) & 1, bits 2-3 by (col >> 4) & 3. It never touches bit 0, so the
// word pair a transposed 8-byte read takes stays adjacent and 8-byte aligned;
// that read (half a warp: two neighbouring columns, 8 pairs each) is
// conflict-free too.
__device__ __forceinline__ int tile_word(int col, int g) {
  const int mask = (((col >> 3) & 1) << 4) | (((col >> 4) & 3) << 2);
  return (col * kWordsPerCol + g) ^ mask;
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kCtThreads)
    cast_transpose_kernel(const typename In::storage* __restrict__ x, uint8_t* __restrict__ q,
                          uint8_t* __restrict__ qt, float* __restrict__ partial, int64_t rows,
                          int64_t cols, int64_t row_tiles, bool vec_load, bool vec_store,
                          const float* scale_ptr, float* scale_inv, uint32_t* amax) {
  using T = typename In::storage;
  __shared__ uint32_t tile[kTile * kWordsPerCol];
  __shared__ float warp_sums[kCtThreads / 32][kTile];
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  const int64_t row_tile = static_cast<int64_t>(blockIdx.x) % row_tiles;
  const int64_t row0 = row_tile * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) / row_tiles * kTile;
  const int l = threadIdx.x % kColGroups;  // columns 8 l .. 8 l + 7 of the tile
  const int g = threadIdx.x / kColGroups;  // rows 4 g .. 4 g + 3 of the tile
  const int64_t c = col0 + l * kVec;
  uint32_t m = 0;
  uint32_t packed[kVec] = {};  // packed[j] byte i: row 4 g + i, column 8 l + j
  float sums[kVec] = {};       // column sums over this thread's rows (dbias)

#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = row0 + g * kRowsPerThread + i;
    if (r >= rows) break;
    float v[kVec];
    if (vec_load && c + kVec <= cols) {
      const Vec<T, kVec> in = load_vec<T, kVec>(x + r * cols + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = In::load(in.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = c + j < cols ? In::load(x[r * cols + c + j]) : 0.0f;
    }
    Vec<uint8_t, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      m = max(m, abs_bits(v[j]));
      sums[j] += v[j];
      out.v[j] = Out::quantize(v[j], scale);
      packed[j] |= static_cast<uint32_t>(out.v[j]) << (8 * i);
    }
    if (q != nullptr) {
      if (vec_load && c + kVec <= cols) {
        store_vec(q + r * cols + c, out);
      } else {
        for (int j = 0; j < kVec && c + j < cols; ++j) q[r * cols + c + j] = out.v[j];
      }
    }
  }
  // Out-of-range elements were read as 0: they add nothing to the sums and
  // quantize to 0 bytes that no store below reaches.

  if (partial != nullptr) {
    // Sum the 4 row groups of each warp (fixed butterfly order), then the
    // 4 warps in index order: the same additions on every run.
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], 8);
      sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], 16);
    }
    if ((threadIdx.x & 31) < kColGroups) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) warp_sums[threadIdx.x / 32][l * kVec + j] = sums[j];
    }
  }
  if (qt != nullptr) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) tile[tile_word(l * kVec + j, g)] = packed[j];
  }
  __syncthreads();

  if (partial != nullptr && threadIdx.x < kTile && col0 + threadIdx.x < cols) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kCtThreads / 32; ++w) s += warp_sums[w][threadIdx.x];
    partial[row_tile * cols + col0 + threadIdx.x] = s;
  }

  if (qt != nullptr) {
    // output_t is (cols, rows): transposed row `c` holds column c of the input.
    constexpr int kSegments = kTile / kVec;  // 8-row segments per tile column
    const int seg = threadIdx.x % kSegments;
    const int64_t r = row0 + seg * kVec;
    for (int tc = threadIdx.x / kSegments; tc < kTile; tc += kCtThreads / kSegments) {
      const int64_t col = col0 + tc;
      if (col >= cols || r >= rows) break;
      const int word = tile_word(tc, 2 * seg);
      const uint32_t lo = tile[word], hi = tile[word + 1];
      uint8_t* dst = qt + col * rows + r;
      if (vec_store && r + kVec <= rows) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      } else {
        for (int j = 0; j < kVec && r + j < rows; ++j) {
          dst[j] = static_cast<uint8_t>((j < 4 ? lo >> (8 * j) : hi >> (8 * (j - 4))) & 0xffu);
        }
      }
    }
  }
  if (amax != nullptr) block_atomic_max(m, amax);
}

// Column sums of a (rows, cols) matrix: block b sums columns [32 b, 32 b + 32),
// 8 row phases of 32 threads each (a warp reads 32 adjacent columns:
// coalesced), the phases added in a fixed order. The matrix is the per-tile
// partial sums (a 64th of the input's rows), or the input itself when no
// scratch could be had.
template <typename In, typename Bias>
__global__ void __launch_bounds__(kThreads)
    column_sums_kernel(const typename In::storage* __restrict__ x, int64_t rows, int64_t cols,
                       typename Bias::storage* __restrict__ out) {
  constexpr int kCols = 32;
  constexpr int kPhases = kThreads / kCols;
  __shared__ float phase_sums[kPhases][kCols];
  const int tx = threadIdx.x % kCols;
  const int ty = threadIdx.x / kCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + tx;
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = ty; r < rows; r += kPhases) acc += In::load(x[r * cols + c]);
  }
  phase_sums[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPhases; ++i) s += phase_sums[i][tx];
    out[c] = Bias::store(s);
  }
}

}  // namespace

void cast_transpose(const QuantizeParams& p, const float* scale, float* scale_inv, uint32_t* amax,
                    cudaStream_t stream) {
  const int64_t row_tiles = (p.rows + kTile - 1) / kTile;
  const int64_t col_tiles = (p.cols + kTile - 1) / kTile;
  TL_CHECK(row_tiles * col_tiles <= 0x7fffffff, "quantize: input too large for the cast + transpose grid: ",
           p.rows, " x ", p.cols, " (rows x last dimension)");
  const unsigned grid = static_cast<unsigned>(row_tiles * col_tiles);
  uint8_t* q = p.output.defined() ? p.output.ptr<uint8_t>() : nullptr;
  uint8_t* qt = p.output_t.defined() ? p.output_t.ptr<uint8_t>() : nullptr;
  // Stream-ordered scratch for the per-tile column sums (graph-capturable);
  // 4 bytes per 64 input elements. Without it (a device without memory pools,
  // or no memory) the column sums take a second read of the input instead.
  struct Scratch {
    float* ptr = nullptr;
    cudaStream_t stream;
    ~Scratch() {
      if (ptr != nullptr) cudaFreeAsync(ptr, stream);
    }
  } scratch{nullptr, stream};
  if (p.dbias.defined() &&
      cudaMallocAsync(reinterpret_cast<void**>(&scratch.ptr),
                      static_cast<size_t>(row_tiles * p.cols) * sizeof(float), stream) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so the launch checks do not see it
    scratch.ptr = nullptr;
  }
  float* partial = scratch.ptr;
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    using T = typename In::storage;
    // Vector loads (and row-major stores) need only whole vectors along a row;
    // the 8-byte transposed stores need only whole vectors along a column.
    const bool vec_load = p.cols % kVec == 0 && vec_aligned<T>(p.input.data) && vec_aligned<uint8_t>(q);
    const bool vec_store = p.rows % kVec == 0 && vec_aligned<uint8_t>(qt);
    dispatch_fp8(p.fp8_dtype, "quantize: argument 'output_t'", [&](auto out_tag) {
      cast_transpose_kernel<In, decltype(out_tag)><<<grid, kCtThreads, 0, stream>>>(
          p.input.ptr<T>(), q, qt, partial, p.rows, p.cols, row_tiles, vec_load, vec_store, scale,
          scale_inv, amax);
      TL_CHECK_CUDA_LAUNCH();
    });
    if (!p.dbias.defined()) return;
    dispatch_high_precision(p.dbias.dtype, "quantize: argument 'dbias'", [&](auto bias_tag) {
      using Bias = decltype(bias_tag);
      auto* dbias = p.dbias.ptr<typename Bias::storage>();
      const unsigned blocks = static_cast<unsigned>((p.cols + 31) / 32);
      if (partial != nullptr) {
        column_sums_kernel<Float32, Bias><<<blocks, kThreads, 0, stream>>>(partial, row_tiles, p.cols, dbias);
      } else {
        column_sums_kernel<In, Bias><<<blocks, kThreads, 0, stream>>>(p.input.ptr<T>(), p.rows, p.cols, dbias);
      }
      TL_CHECK_CUDA_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace tl
