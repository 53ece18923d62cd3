// Fused cast + transpose (the columnwise FP8 copy that dgrad and wgrad read
// K-major) and the bias gradient.
//
// Each block owns a 64 x 64 tile. It reads the tile once with 8-element
// vector loads along rows (coalesced), writes the row-major FP8 output if
// asked, parks the FP8 bytes transposed in shared memory, and writes them to
// output_t with 8-byte stores along the transposed rows (coalesced again).
#include "kernels.cuh"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cuda {
namespace {

constexpr int kTile = 64;
constexpr int kLanesPerRow = kTile / kVec;            // 8 threads cover one tile row
constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // 32 tile rows per pass
// Row padding of the shared tile: breaks the power-of-two stride between the
// threads of a warp and keeps every transposed row 8-byte aligned.
constexpr int kPad = 8;

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const typename In::storage* __restrict__ x, uint8_t* __restrict__ q,
                          uint8_t* __restrict__ qt, int64_t rows, int64_t cols, bool vec,
                          const float* scale_ptr, float* scale_inv, uint32_t* amax) {
  using T = typename In::storage;
  __shared__ alignas(16) uint8_t tile[kTile][kTile + kPad];  // tile[col][row]
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *scale_inv = 1.0f / scale;
  }
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int lane = (threadIdx.x % kLanesPerRow) * kVec;  // first of this thread's 8 columns / rows
  uint32_t m = 0;

  for (int tr = threadIdx.x / kLanesPerRow; tr < kTile; tr += kRowsPerPass) {
    const int64_t r = row0 + tr;
    const int64_t c = col0 + lane;
    if (r >= rows) break;
    Vec<uint8_t, kVec> out;
    if (vec && c + kVec <= cols) {
      const Vec<T, kVec> in = load_vec<T, kVec>(x + r * cols + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float v = In::load(in.v[j]);
        m = max(m, abs_bits(v));
        out.v[j] = Out::quantize(v, scale);
      }
      if (q != nullptr) store_vec(q + r * cols + c, out);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        out.v[j] = 0;
        if (c + j < cols) {
          const float v = In::load(x[r * cols + c + j]);
          m = max(m, abs_bits(v));
          out.v[j] = Out::quantize(v, scale);
          if (q != nullptr) q[r * cols + c + j] = out.v[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) tile[lane + j][tr] = out.v[j];
  }
  __syncthreads();

  // output_t is (cols, rows): transposed row `c` holds column c of the input.
  for (int tc = threadIdx.x / kLanesPerRow; tc < kTile; tc += kRowsPerPass) {
    const int64_t c = col0 + tc;
    const int64_t r = row0 + lane;
    if (c >= cols) break;
    uint8_t* dst = qt + c * rows + r;
    if (vec && r + kVec <= rows) {
      store_vec(dst, *reinterpret_cast<const Vec<uint8_t, kVec>*>(&tile[tc][lane]));
    } else {
      for (int j = 0; j < kVec && r + j < rows; ++j) dst[j] = tile[tc][lane + j];
    }
  }
  if (amax != nullptr) block_atomic_max(m, amax);
}

// Column sums: block b sums columns [32 b, 32 b + 32), 8 row phases of 32
// threads each (a warp reads 32 adjacent columns: coalesced). The partial
// sums are added in a fixed order, so results do not vary run to run.
template <typename In, typename Bias>
__global__ void __launch_bounds__(kThreads)
    column_sums_kernel(const typename In::storage* __restrict__ x, int64_t rows, int64_t cols,
                       typename Bias::storage* __restrict__ out) {
  constexpr int kCols = 32;
  constexpr int kPhases = kThreads / kCols;
  __shared__ float partial[kPhases][kCols];
  const int tx = threadIdx.x % kCols;
  const int ty = threadIdx.x / kCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + tx;
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = ty; r < rows; r += kPhases) acc += In::load(x[r * cols + c]);
  }
  partial[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPhases; ++i) s += partial[i][tx];
    out[c] = Bias::store(s);
  }
}

}  // namespace

void cast_transpose(const QuantizeParams& p, const float* scale, float* scale_inv, uint32_t* amax,
                    cudaStream_t stream) {
  const int64_t col_tiles = (p.cols + kTile - 1) / kTile;
  const int64_t row_tiles = (p.rows + kTile - 1) / kTile;
  TL_CHECK(row_tiles <= 65535, "quantize: a transposed output supports at most ", 65535 * kTile,
           " rows (input viewed as 2-D), got ", p.rows);
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  uint8_t* q = p.output.defined() ? p.output.ptr<uint8_t>() : nullptr;
  uint8_t* qt = p.output_t.ptr<uint8_t>();
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    using T = typename In::storage;
    // Whole-vector rows need both dimensions to be multiples of kVec.
    const bool vec = p.rows % kVec == 0 && p.cols % kVec == 0 && vec_aligned<T>(p.input.data) &&
                     vec_aligned<uint8_t>(q) && vec_aligned<uint8_t>(qt);
    dispatch_fp8(p.fp8_dtype, "quantize: argument 'output_t'", [&](auto out_tag) {
      cast_transpose_kernel<In, decltype(out_tag)><<<grid, kThreads, 0, stream>>>(
          p.input.ptr<T>(), q, qt, p.rows, p.cols, vec, scale, scale_inv, amax);
      TL_CHECK_CUDA_LAUNCH();
    });
  });
}

void column_sums(const QuantizeParams& p, cudaStream_t stream) {
  if (p.cols == 0) return;
  const unsigned grid = static_cast<unsigned>((p.cols + 31) / 32);
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_high_precision(p.dbias.dtype, "quantize: argument 'dbias'", [&](auto bias_tag) {
      using Bias = decltype(bias_tag);
      column_sums_kernel<In, Bias><<<grid, kThreads, 0, stream>>>(
          p.input.ptr<typename In::storage>(), p.rows, p.cols,
          p.dbias.ptr<typename Bias::storage>());
      TL_CHECK_CUDA_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace tl
