// The FP8 GEMM for what cuBLASLt's FP8 path does not take: GPUs below sm_89,
// e5m2 x e5m2, column-major operands, N not a multiple of 16, K == 0, and K,
// leading dimensions or addresses off 16 when no zero-padded copy could be
// made. Also the padding copy and the bias pass of the cuBLASLt path. Correct for every
// shape, not fast: a 64 x 64 shared-memory tile per block, 4 x 4 outputs per
// thread, FP8 decoded on load with the shared element math, fp32 FMA
// accumulation. Same epilogue as the CPU kernel: acc * alpha [+ bias] [+ D].
#include <algorithm>

#include "kernels.cuh"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cuda {
namespace {

constexpr int kBM = 64;  // output rows per block
constexpr int kBN = 64;  // output columns per block
constexpr int kBK = 16;  // K per shared-memory stage
constexpr int kSide = 16;  // threads per block side: 16 x 16 threads, 4 x 4 outputs each
constexpr int kGemmThreads = kSide * kSide;

// Loads a (rows_in_tile x kBK) slice of an operand into smem[k][row], reading
// along whichever dimension is contiguous so that neighbouring threads read
// neighbouring bytes.
template <typename Tag, int kRows>
__device__ __forceinline__ void load_tile(float (*smem)[kRows + 1], const uint8_t* __restrict__ src,
                                          int64_t row0, int64_t k0, int64_t rows, int64_t k,
                                          int64_t row_stride, int64_t k_stride) {
  constexpr int kElems = kRows * kBK / kGemmThreads;
#pragma unroll
  for (int l = 0; l < kElems; ++l) {
    const int e = threadIdx.x + l * kGemmThreads;
    const bool k_contiguous = k_stride == 1;
    const int kk = k_contiguous ? e % kBK : e / kRows;
    const int rr = k_contiguous ? e / kBK : e % kRows;
    const int64_t r = row0 + rr, p = k0 + kk;
    smem[kk][rr] = (r < rows && p < k) ? Tag::load(src[r * row_stride + p * k_stride]) : 0.0f;
  }
}

template <typename A, typename B, typename Out>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_kernel(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                const float* __restrict__ a_scale_inv, const float* __restrict__ b_scale_inv,
                const typename Out::storage* __restrict__ bias, typename Out::storage* d, int64_t m,
                int64_t n, int64_t k, int64_t a_row, int64_t a_col, int64_t b_row, int64_t b_col,
                bool accumulate) {
  __shared__ float as[kBK][kBM + 1];
  __shared__ float bs[kBK][kBN + 1];
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int tx = threadIdx.x % kSide;  // output columns tx + 16 j: coalesced stores
  const int ty = threadIdx.x / kSide;  // output rows ty + 16 i
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kBK) {
    load_tile<A, kBM>(as, a, m0, k0, m, k, a_row, a_col);
    load_tile<B, kBN>(bs, b, n0, k0, n, k, b_row, b_col);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + kSide * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + kSide * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
  const float alpha = *a_scale_inv * *b_scale_inv;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = m0 + ty + kSide * i;
    if (r >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = n0 + tx + kSide * j;
      if (c >= n) continue;
      float v = acc[i][j] * alpha;
      if (bias != nullptr) v = v + Out::load(bias[c]);
      if (accumulate) v = Out::load(d[r * n + c]) + v;
      d[r * n + c] = Out::store(v);
    }
  }
}

// d[r, c] += bias[c] over a row-major fp32 matrix, 4 columns per access when
// the row length and both pointers allow float4.
__global__ void __launch_bounds__(kThreads)
    add_bias_rows_kernel(float* __restrict__ d, const float* __restrict__ bias, int64_t rows,
                         int64_t cols, bool vec4) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec4) {
    const int64_t n4 = rows * cols / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 v = reinterpret_cast<float4*>(d)[i];
      const float4 b = reinterpret_cast<const float4*>(bias)[i % (cols / 4)];
      v.x += b.x;
      v.y += b.y;
      v.z += b.z;
      v.w += b.w;
      reinterpret_cast<float4*>(d)[i] = v;
    }
  } else {
    for (int64_t i = tid; i < rows * cols; i += stride) d[i] += bias[i % cols];
  }
}

// dst row r = src row r (k bytes from src + r * ld, any alignment) then zeros
// up to k16; one 4-byte word of dst per thread step. Rows on grid.y
// (grid-stride), words on grid.x: no division per element.
__global__ void __launch_bounds__(kThreads)
    pad_k_kernel(const uint8_t* __restrict__ src, int64_t rows, int64_t k, int64_t ld,
                 uint32_t* __restrict__ dst, int64_t k16) {
  const int64_t words = k16 / 4;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint8_t* row = src + r * ld;
    for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
         w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      uint32_t v = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = 4 * w + j;
        if (c < k) v |= static_cast<uint32_t>(row[c]) << (8 * j);
      }
      dst[r * words + w] = v;
    }
  }
}

}  // namespace

void pad_k(const uint8_t* src, int64_t rows, int64_t k, int64_t ld, uint8_t* dst, int64_t k16,
           cudaStream_t stream) {
  const int64_t words = k16 / 4;
  const int64_t x_blocks = (words + kThreads - 1) / kThreads;
  const int64_t y_cap = std::max<int64_t>(1, static_cast<int64_t>(sm_count()) * 8 / x_blocks);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(x_blocks, 65535)),
                  static_cast<unsigned>(std::min<int64_t>({rows, y_cap, 65535})));
  pad_k_kernel<<<grid, kThreads, 0, stream>>>(src, rows, k, ld, reinterpret_cast<uint32_t*>(dst), k16);
  TL_CHECK_CUDA_LAUNCH();
}

void add_bias_rows(float* d, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  const bool vec4 = cols % 4 == 0 && aligned(d, 16) && aligned(bias, 16);
  const int64_t work = vec4 ? rows * cols / 4 : rows * cols;
  add_bias_rows_kernel<<<grid_for(work, kThreads), kThreads, 0, stream>>>(d, bias, rows, cols, vec4);
  TL_CHECK_CUDA_LAUNCH();
}

void fp8_gemm_fallback(const GemmParams& p, cudaStream_t stream) {
  const int64_t m_tiles = (p.m + kBM - 1) / kBM;
  const int64_t n_tiles = (p.n + kBN - 1) / kBN;
  TL_CHECK(n_tiles <= 65535, "fp8_gemm: N = ", p.n, " exceeds the fallback kernel's limit of ",
           65535 * kBN);
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles));
  dispatch_fp8(p.a.dtype, "fp8_gemm: argument 'a'", [&](auto a_tag) {
    dispatch_fp8(p.b.dtype, "fp8_gemm: argument 'b'", [&](auto b_tag) {
      dispatch_high_precision(p.d.dtype, "fp8_gemm: argument 'd'", [&](auto out_tag) {
        using Out = decltype(out_tag);
        using T = typename Out::storage;
        gemm_kernel<decltype(a_tag), decltype(b_tag), Out><<<grid, kGemmThreads, 0, stream>>>(
            p.a.ptr<uint8_t>(), p.b.ptr<uint8_t>(), p.a_scale_inv.ptr<float>(),
            p.b_scale_inv.ptr<float>(), p.bias.defined() ? p.bias.ptr<T>() : nullptr, p.d.ptr<T>(),
            p.m, p.n, p.k, p.a_row, p.a_col, p.b_row, p.b_col, p.accumulate);
        TL_CHECK_CUDA_LAUNCH();
      });
    });
  });
}

}  // namespace cuda
}  // namespace tl
