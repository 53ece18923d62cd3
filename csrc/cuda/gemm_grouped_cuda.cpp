// cuBLASLt's grouped FP8 matmul (see gemm_grouped_cuda.h); ops/grouped.py runs the Triton kernels where this
// declines.
//
// Layout, as in gemm_cuda.cpp: group g's D_g (M_g, N) row-major = A_g (M_g, K) @ B_g (N, K)^T is, column-major,
// D_g^T (N x M_g) = B_g (N x K, op T) @ A_g^T (K x M_g): cuBLAS's "A" is our b[g], its "B" our a's rows of g,
// and its "A" scale is b's (one per group), its "B" scale a's (repeated per group by the setup kernel). Only
// M_g differs between groups; cuBLASLt reads every group's shape from device arrays all the same.
#include "gemm_grouped_cuda.h"

#include <atomic>
#include <algorithm>
#include <climits>

#include "../common/validate.h"
#include "cublaslt_utils.h"
#include "cuda_utils.h"
#include "gemm_block_cuda.h"
#include "gemm_grouped_setup_cuda.h"

// The grouped batch mode, its layouts and per-batch scalar scales are in the cuBLAS 13.10 headers (.ci/build_cuda.sh
// pins them); older headers build without this path.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 131000
#define TL_CUBLAS_HAS_GROUPED 1
#endif

namespace tl {
namespace cuda {
namespace {

constexpr const char* kOp = "fp8_grouped_gemm";
constexpr int64_t kCublasGroupedVersion = 131000;

std::atomic<uint64_t> grouped_runs{0};

void check_operand(const char* name, const TensorDesc& t, const TensorDesc& like, std::initializer_list<DType> dtypes,
                   int rank) {
  check_defined(kOp, name, t);
  check_device(kOp, name, t, like.device, like.device_index);
  check_dtype(kOp, name, t, dtypes);
  check_rank(kOp, name, t, rank);
  check_contiguous(kOp, name, t);
}

#ifdef TL_CUBLAS_HAS_GROUPED
AlgoCache algo_cache;

Layout grouped_layout(cudaDataType_t type, int groups, const int64_t* rows, const int64_t* cols, const int64_t* ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  TL_CHECK_CUBLAS(cublasLtGroupedMatrixLayoutCreate(&raw, type, groups, rows, cols, ld));
  Layout layout(raw);
  const int32_t width = CUBLASLT_INTEGER_WIDTH_64;
  TL_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(raw, CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_COLS_ARRAY_INTEGER_WIDTH,
                                                   &width, sizeof(width)));
  TL_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(raw, CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY_INTEGER_WIDTH, &width,
                                                   sizeof(width)));
  return layout;
}

struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreference_t p) const { cublasLtMatmulPreferenceDestroy(p); }
};

// The heuristic's answer for the grouped problem, told the average group (M / G tokens: known on the host
// without reading offs).
AlgoCache::Entry grouped_heuristic(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a_layout,
                                   cublasLtMatrixLayout_t b_layout, cublasLtMatrixLayout_t d_layout, int64_t avg_m,
                                   int64_t n, int64_t k, uint64_t workspace_bytes) {
  cublasLtMatmulPreference_t raw = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&raw));
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, PreferenceDeleter> pref(raw);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    TL_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(raw, attr, &value, sizeof(value)));
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  set_pref(CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM, k);
  set_pref(CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS, n);
  set_pref(CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS, avg_m);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt_handle(), desc, a_layout, b_layout, d_layout,
                                                               d_layout, raw, 1, &result, &found);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) return result.algo;
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
      status != CUBLAS_STATUS_INVALID_VALUE) {
    TL_CHECK_CUBLAS(status);
  }
  return std::nullopt;
}
#endif

}  // namespace

bool fp8_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                      const TensorDesc& b_scale_inv, const TensorDesc& offs, const TensorDesc& d,
                      const TensorDesc& workspace, Stream stream) {
  check_defined(kOp, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCUDA, kOp, ": cuBLASLt's grouped matmul takes CUDA tensors, got 'a' on ",
                device_name(a.device));
  const std::initializer_list<DType> fp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  check_operand("a", a, a, fp8, 2);
  check_operand("b", b, a, fp8, 3);
  const int64_t m = a.shape[0], k = a.shape[1], groups = b.shape[0], n = b.shape[1];
  TL_CHECK(b.shape[2] == k, kOp, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ", shape_str(b));
  check_operand("a_scale_inv", a_scale_inv, a, {DType::kFloat32}, 1);
  check_shape(kOp, "a_scale_inv", a_scale_inv, {1});
  check_operand("b_scale_inv", b_scale_inv, a, {DType::kFloat32}, 1);
  check_shape(kOp, "b_scale_inv", b_scale_inv, {groups});
  check_operand("offs", offs, a, {DType::kInt32}, 1);
  check_shape(kOp, "offs", offs, {groups});
  check_operand("d", d, a, {DType::kFloat32, DType::kBFloat16, DType::kFloat16}, 2);
  check_shape(kOp, "d", d, {m, n});
  if (workspace.defined()) {
    check_device(kOp, "workspace", workspace, a.device, a.device_index);
    check_dtype(kOp, "workspace", workspace, {DType::kUInt8});
    check_contiguous(kOp, "workspace", workspace);
  }
  check_disjoint(kOp, {{"d", &d}, {"workspace", &workspace}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"offs", &offs}});
#ifndef TL_CUBLAS_HAS_GROUPED
  (void)workspace, (void)stream;
  return false;
#else
  if (m == 0 || n == 0 || groups == 0) return true;
  // What cuBLASLt's FP8 tensor cores need (gemm_cuda.cpp's rule): sm_89+, not e5m2 x e5m2, K-major operands
  // (ours are), N and K multiples of 16 and 16-byte aligned addresses (every group's: a's rows start at
  // multiples of K, d's at multiples of N).
  if (cublaslt_version() < kCublasGroupedVersion || sm_version() < 89) return false;
  if (a.dtype == DType::kFloat8E5M2 && b.dtype == DType::kFloat8E5M2) return false;
  if (n % 16 != 0 || k % 16 != 0 || k == 0) return false;
  if (!aligned(a.data, 16) || !aligned(b.data, 16) || !aligned(d.data, 16)) return false;
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX || groups > INT_MAX) return false;
  DeviceGuard guard(a.device_index);
  const cudaStream_t s = to_stream(stream);

  // Stream-ordered scratch for the per-group arrays (graph-capturable, as run_cublaslt_padded's).
  const size_t g = static_cast<size_t>(groups);
  const size_t ptr_bytes = 3 * g * sizeof(void*), dim_bytes = 3 * g * sizeof(int64_t), scale_bytes = g * sizeof(float);
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, ptr_bytes + dim_bytes + scale_bytes, s) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  struct Free {
    void* ptr;
    cudaStream_t stream;
    ~Free() { cudaFreeAsync(ptr, stream); }
  } free_scratch{scratch, s};
  auto** ptrs = static_cast<void**>(scratch);
  auto* dims = reinterpret_cast<int64_t*>(static_cast<char*>(scratch) + ptr_bytes);
  auto* a_scales = reinterpret_cast<float*>(static_cast<char*>(scratch) + ptr_bytes + dim_bytes);
  GroupedSetup setup{offs.ptr<int32_t>(), static_cast<int>(groups), m, n, k, element_size(d.dtype),
                     static_cast<const uint8_t*>(a.data), static_cast<const uint8_t*>(b.data),
                     static_cast<uint8_t*>(d.data), a_scale_inv.ptr<float>(), const_cast<const void**>(ptrs),
                     const_cast<const void**>(ptrs + g), ptrs + 2 * g, dims, dims + g, dims + 2 * g, a_scales};
  grouped_setup(setup, s);

  const MatmulDesc desc = make_matmul_desc();
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(0));
  const int32_t per_group = CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F;
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, per_group);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, per_group);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_scale_inv.data));
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_scales));
  const int gi = static_cast<int>(groups);
  // cuBLAS's A: (K x N, ld K) per group; B: (K x M_g, ld K); D: (N x M_g, ld N).
  const Layout a_layout = grouped_layout(cuda_type(b.dtype), gi, setup.k_array, setup.n_array, setup.k_array);
  const Layout b_layout = grouped_layout(cuda_type(a.dtype), gi, setup.k_array, setup.m_array, setup.k_array);
  const Layout d_layout = grouped_layout(cuda_type(d.dtype), gi, setup.n_array, setup.m_array, setup.n_array);

  void* ws = workspace.defined() ? workspace.data : nullptr;
  const uint64_t ws_bytes = workspace.defined() ? static_cast<uint64_t>(workspace.numel()) : 0;
  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  const AlgoCache::Key key = {device, groups, m, n, k, static_cast<int64_t>(a.dtype), static_cast<int64_t>(b.dtype),
                              static_cast<int64_t>(d.dtype), static_cast<int64_t>(ws_bytes)};
  AlgoCache::Entry algo;
  if (const std::optional<AlgoCache::Entry> cached = algo_cache.find(key)) {
    algo = *cached;
  } else {
    algo = grouped_heuristic(desc.get(), a_layout.get(), b_layout.get(), d_layout.get(), std::max<int64_t>(m / groups, 1),
                             n, k, ws_bytes);
    algo_cache.put(key, algo);
  }
  if (!algo) return false;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(lt_handle(), desc.get(), &alpha, setup.a_ptrs, a_layout.get(), setup.b_ptrs, b_layout.get(),
                     &beta, setup.d_ptrs, d_layout.get(), setup.d_ptrs, d_layout.get(), &*algo, ws, ws_bytes, s);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    algo_cache.put(key, std::nullopt);
    return false;
  }
  TL_CHECK_CUBLAS(status);
  grouped_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
#endif
}

uint64_t cublaslt_grouped_runs() { return grouped_runs.load(std::memory_order_relaxed); }

}  // namespace cuda
}  // namespace tl
