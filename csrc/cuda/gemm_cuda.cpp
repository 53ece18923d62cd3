// CUDA FP8 GEMM: cuBLASLt where its FP8 path applies, else the tiled kernel of
// gemm_fallback_cuda.cu. Never an error for a valid shape.
//
// Layout. D (M, N) row-major = A (M, K) @ B (N, K)^T. In cuBLAS's column-major
// terms the same memory is D^T (N x M) = B (N x K) @ A^T (K x M), so cuBLAS's
// "A" is our B with op T and its "B" is our A with op N: the "TN" layout that
// FP8 needs on sm_89 / sm_90, reached when both our operands are K-contiguous.
// Our M is cuBLAS's n, which FP8 does not need aligned: any token count takes
// cuBLASLt. N must be a multiple of 16; K and the leading dimensions must be
// too, or the operands are copied zero-padded (run_cublaslt_padded).
#include <atomic>

#include "cublaslt_utils.h"
#include "cuda_info.h"
#include "gemm_block_cuda.h"
#include "cuda_utils.h"
#include "launchers.h"

namespace tl {
namespace cuda {
namespace {

Fp8MatmulLayout fp8_layout(const GemmParams& p) {
  return {p.a, p.a_row, p.a_col, p.b, p.b_row, p.b_col, p.d, p.bias, p.n, p.k};
}

// What cuBLASLt's FP8 matmul needs on every FP8-capable GPU (sm_89+) that no
// copy of the operands can change.
bool fp8_tensor_cores_apply(const GemmParams& p) { return fp8_layout_fits(fp8_layout(p)) && sm_version() >= 89; }

// ... and what a zero-padded copy of the operands provides (run_cublaslt_padded makes one where not).
bool operands_fit(const GemmParams& p) { return fp8_operands_aligned(fp8_layout(p)); }

AlgoCache algo_cache;

// How many GEMMs each path ran (tests assert the path; see cuda_info.h).
std::atomic<uint64_t> cublaslt_runs{0};
std::atomic<uint64_t> fallback_runs{0};
std::atomic<uint64_t> padded_runs{0};

// Runs the GEMM through cuBLASLt; false when cuBLASLt declines the problem.
bool run_cublaslt(const GemmParams& p, cudaStream_t stream) {
  const bool has_bias = p.bias.defined();
  const bool fast_accum = !p.use_split_accumulator;
  void* workspace = p.workspace.defined() ? p.workspace.data : nullptr;
  const uint64_t workspace_bytes = p.workspace.defined() ? static_cast<uint64_t>(p.workspace.numel()) : 0;

  const MatmulDesc desc = make_matmul_desc();
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  // Fast accumulation keeps partial sums in the tensor cores' reduced
  // precision; split accumulation promotes them to fp32 (dgrad / wgrad).
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum));
  // Device pointers: the scales are never read on the host.
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b_scale_inv.data));
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a_scale_inv.data));
  if (has_bias) {
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(p.bias.data));
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.bias.dtype));
  }
  const Layout a_layout = make_layout(cuda_type(p.b.dtype), p.k, p.n, p.b_row);
  const Layout b_layout = make_layout(cuda_type(p.a.dtype), p.k, p.m, p.a_row);
  const Layout d_layout = make_layout(cuda_type(p.d.dtype), p.n, p.m, p.n);

  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  const AlgoCache::Key key = {device, p.m, p.n, p.k, p.a_row, p.b_row, static_cast<int64_t>(p.a.dtype),
                              static_cast<int64_t>(p.b.dtype), static_cast<int64_t>(p.d.dtype), has_bias,
                              p.accumulate, fast_accum, static_cast<int64_t>(workspace_bytes),
                              alignment_of(p.b.data), alignment_of(p.a.data), alignment_of(p.d.data),
                              has_bias ? alignment_of(p.bias.data) : 0};
  const LtMatmul mm{desc.get(), p.b.data, a_layout.get(), p.a.data, b_layout.get(), p.d.data, d_layout.get(),
                    p.accumulate ? 1.0f : 0.0f, workspace, workspace_bytes};
  return run_lt_matmul(algo_cache, key, mm, stream);
}

// cuBLASLt with the bias: its FP8 bias epilogue takes no fp32 bias, so an
// fp32 output runs the GEMM bare and adds the bias in a second, output-sized
// pass. False when cuBLASLt declines.
bool run_cublaslt_with_bias(const GemmParams& p, cudaStream_t stream) {
  const bool bias_after = p.bias.defined() && p.d.dtype == DType::kFloat32;
  GemmParams bare = p;
  if (bias_after) bare.bias = TensorDesc{};
  if (!run_cublaslt(bare, stream)) return false;
  if (bias_after) add_bias_rows(p.d.ptr<float>(), p.bias.ptr<float>(), p.m, p.n, stream);
  return true;
}

// Operands whose K, leading dimension or address is off a multiple of 16 (a
// wgrad over a ragged token count, a sliced view): K-major copies zero-padded
// to K16 = K rounded up to 16 in stream-ordered scratch (graph-capturable),
// then cuBLASLt over K16 (the zeros add nothing). The copies move (M + N) * K16
// bytes, against 2 M N K16 flops of GEMM. False when the scratch cannot be had
// or cuBLASLt declines: the tiled kernel, which needs no memory, runs instead.
bool run_cublaslt_padded(const GemmParams& p, cudaStream_t stream) {
  const int64_t k16 = (p.k + 15) / 16 * 16;
  const size_t a_bytes = static_cast<size_t>((p.m * k16 + 255) / 256 * 256);
  const size_t b_bytes = static_cast<size_t>(p.n * k16);
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, a_bytes + b_bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so the next launch check does not see it
    return false;
  }
  struct Free {
    void* ptr;
    cudaStream_t stream;
    ~Free() { cudaFreeAsync(ptr, stream); }
  } free_scratch{scratch, stream};
  auto* a16 = static_cast<uint8_t*>(scratch);
  uint8_t* b16 = a16 + a_bytes;
  pad_k(p.a.ptr<uint8_t>(), p.m, p.k, p.a_row, a16, k16, stream);
  pad_k(p.b.ptr<uint8_t>(), p.n, p.k, p.b_row, b16, k16, stream);
  GemmParams padded = p;
  padded.a.data = a16;
  padded.b.data = b16;
  padded.k = k16;
  padded.a_row = padded.b_row = k16;
  return run_cublaslt_with_bias(padded, stream);
}

}  // namespace

void fp8_gemm(const GemmParams& p) {
  if (p.m == 0 || p.n == 0) return;
  DeviceGuard guard(p.a.device_index);
  const cudaStream_t stream = to_stream(p.stream);
  if (fp8_tensor_cores_apply(p)) {
    const bool fit = operands_fit(p);
    if (fit ? run_cublaslt_with_bias(p, stream) : run_cublaslt_padded(p, stream)) {
      cublaslt_runs.fetch_add(1, std::memory_order_relaxed);
      if (!fit) padded_runs.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  fp8_gemm_fallback(p, stream);
  fallback_runs.fetch_add(1, std::memory_order_relaxed);
}

GemmPathCounts gemm_path_counts() {
  return {cublaslt_runs.load(std::memory_order_relaxed), fallback_runs.load(std::memory_order_relaxed),
          padded_runs.load(std::memory_order_relaxed), algo_cache.size(), cublaslt_block_runs()};
}

void reset_gemm_path_counts() {
  cublaslt_runs.store(0, std::memory_order_relaxed);
  fallback_runs.store(0, std::memory_order_relaxed);
  padded_runs.store(0, std::memory_order_relaxed);
  reset_cublaslt_block_runs();
}

}  // namespace cuda
}  // namespace tl
