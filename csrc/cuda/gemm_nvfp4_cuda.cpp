// CUDA NVFP4 GEMM through cuBLASLt's block-scaled FP4 matmul (see gemm_nvfp4_cuda.h). The Triton kernel
// (transformer_linear/ops/triton/gemm_nvfp4.py) takes whatever this declines.
//
// Layout, as in gemm_block_cuda.cpp: D (M, N) row-major = A (M, K) @ B (N, K)^T is, column-major,
// D^T (N x M) = B (N x K) @ A^T (K x M): cuBLAS's "A" is our b (op T) and its "B" our a (op N), so
// cuBLAS's A scale is b's and its B scale a's. FP4 leading dimensions count elements, not bytes.
#include "gemm_nvfp4_cuda.h"

#include <climits>

#include "../common/validate.h"
#include "cublaslt_utils.h"
#include "cuda_utils.h"
#include "gemm_block_cuda.h"

// CUDA_R_4F_E2M1 and the VEC16_UE4M3 scale mode arrived with cuBLAS 12.8.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120800
#define TL_CUBLAS_HAS_NVFP4 1
#endif

namespace tl {
namespace cuda {
namespace {

constexpr const char* kOp = "nvfp4_gemm";

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void check_scale(const char* name, const TensorDesc& s, int64_t rows, int64_t k, const TensorDesc& like) {
  check_defined(kOp, name, s);
  check_device(kOp, name, s, like.device, like.device_index);
  check_contiguous(kOp, name, s);
  check_dtype(kOp, name, s, {DType::kUInt8});
  check_shape(kOp, name, s, {round_up(rows, 128) * round_up(k / 16, 4)});
  TL_CHECK(s.numel() == 0 || aligned(s.data, 16), kOp, ": argument '", name,
           "' must be 16-byte aligned for cuBLASLt's block-scaled matmul");
}

void check_operand(const char* name, const TensorDesc& t, const TensorDesc& like) {
  check_defined(kOp, name, t);
  check_device(kOp, name, t, like.device, like.device_index);
  check_dtype(kOp, name, t, {DType::kUInt8});
  check_rank(kOp, name, t, 2);
  check_contiguous(kOp, name, t);
}

#ifdef TL_CUBLAS_HAS_NVFP4
AlgoCache algo_cache;
#endif

}  // namespace

bool nvfp4_gemm(const TensorDesc& a, const TensorDesc& a_scale, const TensorDesc& b, const TensorDesc& b_scale,
                const TensorDesc& d, const TensorDesc& workspace, Stream stream) {
  check_defined(kOp, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCUDA, kOp, ": cuBLASLt's NVFP4 matmul takes CUDA tensors, got 'a' on ",
                device_name(a.device));
  check_operand("a", a, a);
  check_operand("b", b, a);
  const int64_t m = a.shape[0], k = 2 * a.shape[1], n = b.shape[0];
  TL_CHECK(b.shape[1] == a.shape[1], kOp, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ",
           shape_str(b));
  TL_CHECK(k % 16 == 0, kOp, ": K (", k, ") must be a multiple of 16");
  check_scale("a_scale", a_scale, m, k, a);
  check_scale("b_scale", b_scale, n, k, a);
  check_defined(kOp, "d", d);
  check_device(kOp, "d", d, a.device, a.device_index);
  check_dtype(kOp, "d", d, {DType::kFloat32});
  check_contiguous(kOp, "d", d);
  check_shape(kOp, "d", d, {m, n});
  if (workspace.defined()) {
    check_device(kOp, "workspace", workspace, a.device, a.device_index);
    check_dtype(kOp, "workspace", workspace, {DType::kUInt8});
    check_contiguous(kOp, "workspace", workspace);
  }
  check_disjoint(kOp, {{"d", &d}, {"workspace", &workspace}},
                 {{"a", &a}, {"a_scale", &a_scale}, {"b", &b}, {"b_scale", &b_scale}});
#ifndef TL_CUBLAS_HAS_NVFP4
  (void)workspace, (void)stream;
  return false;
#else
  const bool fits = k % 32 == 0 && n % 16 == 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX &&
                    aligned(a.data, 16) && aligned(b.data, 16) && aligned(d.data, 16);
  if (cublaslt_version() < 120800 || !fits) return false;
  if (m == 0 || n == 0) return true;

  DeviceGuard guard(a.device_index);
  const cudaStream_t cuda_stream = to_stream(stream);
  void* workspace_ptr = workspace.defined() ? workspace.data : nullptr;
  const uint64_t workspace_bytes = workspace.defined() ? static_cast<uint64_t>(workspace.numel()) : 0;

  const MatmulDesc desc = make_matmul_desc();
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  // cuBLAS's A is our b, its B our a (see the top of this file).
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_scale.data));
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_scale.data));
  const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode);
  const Layout a_layout = make_layout(CUDA_R_4F_E2M1, k, n, k);
  const Layout b_layout = make_layout(CUDA_R_4F_E2M1, k, m, k);
  const Layout d_layout = make_layout(CUDA_R_32F, n, m, n);

  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  const AlgoCache::Key key = {device, m, n, k, static_cast<int64_t>(workspace_bytes), alignment_of(b.data),
                              alignment_of(a.data), alignment_of(d.data)};
  const LtMatmul mm{desc.get(), b.data, a_layout.get(), a.data, b_layout.get(), d.data, d_layout.get(),
                    0.0f, workspace_ptr, workspace_bytes};
  return run_lt_matmul(algo_cache, key, mm, cuda_stream);
#endif
}

}  // namespace cuda
}  // namespace tl
