// CUDA block-scaled FP8 GEMM through cuBLASLt's block-scaled matmul (MXFP8's
// 1x32 E8M0 blocks; 1x128 / 128x128 float32 blocks; rowwise), the twin of
// cpu/gemm_block_cpu.cpp. The Triton kernel takes whatever this declines.
//
// Layout, as in gemm_cuda.cpp: D (M, N) row-major = A (M, K) @ B (N, K)^T is,
// column-major, D^T (N x M) = B (N x K) @ A^T (K x M): cuBLAS's "A" is our b
// (op T) and its "B" is our a (op N), so cuBLAS's A scale / mode is b's and
// its B scale / mode is a's. The scale layouts cuBLASLt reads (see
// gemm_block_cuda.h) are those of torch's scaled_mm and TE's GEMM-ready block
// tensors; the Python side converts to them.
#include "gemm_block_cuda.h"

#include <atomic>
#include <climits>
#include <optional>

#include "../common/cublaslt_block_pairs.h"
#include "../common/validate.h"
#include "cublaslt_utils.h"
#include "cuda_utils.h"
#include "launchers.h"

// The block-scale modes arrived with cuBLAS 12.8 (MXFP8) and 12.9 (1x128,
// 128x128, outer vectors); older headers build without them.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120800
#define TL_CUBLAS_HAS_MXFP8 1
#endif
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define TL_CUBLAS_HAS_BLOCK128 1
#endif

namespace tl {
namespace cuda {
namespace {

constexpr const char* kOp = "fp8_gemm";

BlockScaling parse_scaling(const std::string& name, const char* arg) {
  const std::optional<BlockScaling> scaling = parse_block_scaling(name);
  if (scaling) return *scaling;
  TL_ERROR(ValueError, kOp, ": argument '", arg, "' must be RowWise, BlockWise1x128, BlockWise128x128 or ",
           "BlockWise1x32, got '", name, "'");
}

int64_t checked_mul(int64_t x, int64_t y) {
  int64_t out = 0;
  TL_CHECK(!__builtin_mul_overflow(x, y, &out), kOp, ": scale size ", x, " * ", y, " overflows int64");
  return out;
}

int64_t ceil_div(int64_t x, int64_t m) { return x / m + (x % m != 0); }
int64_t round_up(int64_t x, int64_t m) { return checked_mul(ceil_div(x, m), m); }

// Validate one operand's scale tensor against the layout of its scaling
// (gemm_block_cuda.h) for an operand of `rows` rows and inner dimension k.
void check_scale(const char* name, const TensorDesc& s, BlockScaling scaling, int64_t rows, int64_t k,
                 const TensorDesc& like) {
  check_defined(kOp, name, s);
  check_device(kOp, name, s, like.device, like.device_index);
  check_contiguous(kOp, name, s);
  switch (scaling) {
    case BlockScaling::kRowWise:
      check_dtype(kOp, name, s, {DType::kFloat32});
      check_shape(kOp, name, s, {rows, 1});
      break;
    case BlockScaling::kBlock1x128:
      check_dtype(kOp, name, s, {DType::kFloat32});
      check_shape(kOp, name, s, {ceil_div(k, 128), round_up(rows, 4)});
      break;
    case BlockScaling::kBlock128x128:
      check_dtype(kOp, name, s, {DType::kFloat32});
      check_shape(kOp, name, s, {ceil_div(rows, 128), round_up(ceil_div(k, 128), 4)});
      break;
    case BlockScaling::kBlock1x32:
      check_dtype(kOp, name, s, {DType::kUInt8});
      check_shape(kOp, name, s, {checked_mul(round_up(rows, 128), round_up(ceil_div(k, 32), 4))});
      break;
  }
  TL_CHECK(s.numel() == 0 || aligned(s.data, 16), kOp, ": argument '", name,
           "' must be 16-byte aligned for cuBLASLt's block-scaled matmul");
}

// cuBLASLt's mode for a scaling, or nothing when this build's headers lack it (the
// loaded library's version is checked against the pair's, cublaslt_block_pairs.h).
std::optional<int32_t> scale_mode(BlockScaling scaling) {
  switch (scaling) {
#ifdef TL_CUBLAS_HAS_BLOCK128
    case BlockScaling::kRowWise: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case BlockScaling::kBlock1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case BlockScaling::kBlock128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
#endif
#ifdef TL_CUBLAS_HAS_MXFP8
    case BlockScaling::kBlock1x32: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
#endif
    default: break;
  }
  return std::nullopt;
}

// What cuBLASLt's FP8 tensor-core matmul needs of the operands and output
// (the copies gemm_cuda.cpp makes for tensorwise GEMMs would have to move the
// scales too; the Triton kernel takes these cases instead).
bool operands_fit(const TensorDesc& a, int64_t a_row, int64_t a_col, const TensorDesc& b, int64_t b_row,
                  int64_t b_col, const TensorDesc& d, const TensorDesc& bias, int64_t m, int64_t n, int64_t k) {
  const Fp8MatmulLayout layout{a, a_row, a_col, b, b_row, b_col, d, bias, n, k};
  const bool int32_dims = m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && a_row <= INT_MAX && b_row <= INT_MAX;
  return fp8_layout_fits(layout) && fp8_operands_aligned(layout) && int32_dims;
}

AlgoCache algo_cache;
std::atomic<uint64_t> block_runs{0};

}  // namespace

bool fp8_gemm_blockwise(const TensorDesc& a, const TensorDesc& a_scale_inv, const std::string& a_scaling,
                        const TensorDesc& b, const TensorDesc& b_scale_inv, const std::string& b_scaling,
                        const TensorDesc& bias, const TensorDesc& d, const TensorDesc& workspace,
                        Stream stream) {
  const std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  check_defined(kOp, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCUDA, kOp, ": cuBLASLt's block-scaled matmul takes CUDA tensors, got 'a' on ",
                device_name(a.device));
  check_dtype(kOp, "a", a, kFp8);
  check_defined(kOp, "b", b);
  check_device(kOp, "b", b, a.device, a.device_index);
  check_dtype(kOp, "b", b, kFp8);
  int64_t a_row = 0, a_col = 0, b_row = 0, b_col = 0;
  matrix_strides(kOp, "a", a, &a_row, &a_col);
  matrix_strides(kOp, "b", b, &b_row, &b_col);
  const int64_t m = a.shape[0], k = a.shape[1], n = b.shape[0];
  TL_CHECK(b.shape[1] == k, kOp, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ", shape_str(b),
           " (expected b of shape [N, ", k, "] for a @ b.T)");
  const BlockScaling sa = parse_scaling(a_scaling, "a_scaling"), sb = parse_scaling(b_scaling, "b_scaling");
  const std::optional<CublasLtBlockPair> pair = cublaslt_block_pair(sa, sb);
  TL_CHECK(pair, kOp, ": cuBLASLt has no block-scaled matmul for the scaling pair (", a_scaling, ", ", b_scaling,
           ")");
  check_scale("a_scale_inv", a_scale_inv, sa, m, k, a);
  check_scale("b_scale_inv", b_scale_inv, sb, n, k, a);
  check_defined(kOp, "d", d);
  check_device(kOp, "d", d, a.device, a.device_index);
  check_dtype(kOp, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(kOp, "d", d);
  check_shape(kOp, "d", d, {m, n});
  if (bias.defined()) {
    check_device(kOp, "bias", bias, a.device, a.device_index);
    TL_CHECK_TYPE(bias.dtype == d.dtype, kOp, ": argument 'bias' must have the output dtype ", dtype_name(d.dtype),
                  ", got ", dtype_name(bias.dtype));
    check_contiguous(kOp, "bias", bias);
    check_shape(kOp, "bias", bias, {n});
  }
  if (workspace.defined()) {
    check_device(kOp, "workspace", workspace, a.device, a.device_index);
    check_dtype(kOp, "workspace", workspace, {DType::kUInt8});
    check_contiguous(kOp, "workspace", workspace);
  }
  check_disjoint(kOp, {{"d", &d}, {"workspace", &workspace}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"bias", &bias}});

  const std::optional<int32_t> mode_a = scale_mode(sa), mode_b = scale_mode(sb);
  if (!mode_a || !mode_b || cublaslt_version() < pair->min_cublas_version ||
      !operands_fit(a, a_row, a_col, b, b_row, b_col, d, bias, m, n, k)) {
    return false;
  }
  if (m == 0 || n == 0) return true;

  DeviceGuard guard(a.device_index);
  const cudaStream_t cuda_stream = to_stream(stream);
  // cuBLASLt's FP8 bias epilogue takes no fp32 bias: an fp32 output adds it after.
  const bool bias_after = bias.defined() && d.dtype == DType::kFloat32;
  const bool bias_epilogue = bias.defined() && !bias_after;
  void* workspace_ptr = workspace.defined() ? workspace.data : nullptr;
  const uint64_t workspace_bytes = workspace.defined() ? static_cast<uint64_t>(workspace.numel()) : 0;

  const MatmulDesc desc = make_matmul_desc();
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  // cuBLAS's A is our b, its B our a (see the top of this file).
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_scale_inv.data));
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_scale_inv.data));
#ifdef TL_CUBLAS_HAS_MXFP8
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, *mode_b);
  set_attr(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, *mode_a);
  if (sa == BlockScaling::kBlock1x32 && cublaslt_version() <= 120803) {
    // cuBLASLt <= 12.8.3 keys its heuristic cache without the scale mode; an
    // attribute block scaling ignores keeps MXFP8 apart (as TE does).
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE, static_cast<int64_t>(1));
  }
#endif
  if (bias_epilogue) {
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias.data));
    set_attr(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(bias.dtype));
  }
  const Layout a_layout = make_layout(cuda_type(b.dtype), k, n, b_row);
  const Layout b_layout = make_layout(cuda_type(a.dtype), k, m, a_row);
  const Layout d_layout = make_layout(cuda_type(d.dtype), n, m, n);

  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  const AlgoCache::Key key = {device, m, n, k, a_row, b_row, static_cast<int64_t>(a.dtype),
                              static_cast<int64_t>(b.dtype), static_cast<int64_t>(d.dtype),
                              static_cast<int64_t>(sa), static_cast<int64_t>(sb), bias_epilogue,
                              static_cast<int64_t>(workspace_bytes), alignment_of(b.data), alignment_of(a.data),
                              alignment_of(d.data), bias_epilogue ? alignment_of(bias.data) : 0};
  const LtMatmul mm{desc.get(), b.data, a_layout.get(), a.data, b_layout.get(), d.data, d_layout.get(),
                    0.0f, workspace_ptr, workspace_bytes};
  if (!run_lt_matmul(algo_cache, key, mm, cuda_stream)) return false;
  if (bias_after) add_bias_rows(d.ptr<float>(), bias.ptr<float>(), m, n, cuda_stream);
  block_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t cublaslt_block_runs() { return block_runs.load(std::memory_order_relaxed); }
void reset_cublaslt_block_runs() { block_runs.store(0, std::memory_order_relaxed); }

int cublas_header_version() {
#ifdef CUBLAS_VERSION
  return CUBLAS_VERSION;
#else
  return 0;
#endif
}

int64_t cublaslt_version() { return static_cast<int64_t>(cublasLtGetVersion()); }

}  // namespace cuda
}  // namespace tl
