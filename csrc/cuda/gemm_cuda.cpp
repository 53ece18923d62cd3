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
#include <cublasLt.h>

#include <array>
#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "cuda_info.h"
#include "cuda_utils.h"
#include "launchers.h"

namespace tl {
namespace cuda {
namespace {

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// One handle per thread and device. Handles are leaked on purpose: destroying
// them from thread_local destructors at process exit can run after the CUDA
// runtime has been torn down.
cublasLtHandle_t handle() {
  thread_local std::unordered_map<int, cublasLtHandle_t> handles;
  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  TL_CHECK_CUBLAS(cublasLtCreate(&h));
  handles.emplace(device, h);
  return h;
}

// Largest power of two (<= 256) dividing the address: what the heuristic must
// assume of each buffer.
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && !aligned(p, static_cast<int>(a))) a >>= 1;
  return a;
}

// What cuBLASLt's FP8 matmul needs on every FP8-capable GPU (sm_89+) that no
// copy of the operands can change.
bool fp8_tensor_cores_apply(const GemmParams& p) {
  const bool both_e5m2 = p.a.dtype == DType::kFloat8E5M2 && p.b.dtype == DType::kFloat8E5M2;
  const bool k_major = p.a_col == 1 && p.b_col == 1;
  const bool output16 = p.n % 16 == 0 && aligned(p.d.data, 16) && (!p.bias.defined() || aligned(p.bias.data, 16));
  return !both_e5m2 && k_major && output16 && p.k > 0 && sm_version() >= 89;
}

// ... and what a zero-padded copy of the operands provides: K, the leading
// dimensions and the operand addresses in multiples of 16.
bool operands_fit(const GemmParams& p) {
  return p.k % 16 == 0 && p.a_row % 16 == 0 && p.b_row % 16 == 0 && aligned(p.a.data, 16) &&
         aligned(p.b.data, 16);
}

template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { Destroy(p); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                   LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

Layout make_layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  return Layout(l);
}

template <typename V>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  TL_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// Heuristic results per problem: the same key always describes the same
// descriptors, so the first answer is reused (nullopt: cuBLASLt has none).
// Bounded (least recently used out): under dynamic shapes every token count
// is a new key, and the cache must not grow with the length of training.
using AlgoKey = std::array<int64_t, 17>;
using CachedAlgo = std::optional<cublasLtMatmulAlgo_t>;

class AlgoCache {
 public:
  static constexpr size_t kCapacity = 1024;

  /*! \brief The cached answer for `key` (marked most recent), or nothing. */
  std::optional<CachedAlgo> find(const AlgoKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(key);
    if (it == index_.end()) return std::nullopt;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return order_.size();
  }

  /*! \brief Records (or replaces) the answer for `key`, dropping the least recent beyond capacity. */
  void put(const AlgoKey& key, const CachedAlgo& algo) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = algo;
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    order_.emplace_front(key, algo);
    index_.emplace(key, order_.begin());
    if (order_.size() > kCapacity) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

 private:
  std::mutex mutex_;
  std::list<std::pair<AlgoKey, CachedAlgo>> order_;  // most recent first
  std::map<AlgoKey, std::list<std::pair<AlgoKey, CachedAlgo>>::iterator> index_;
};

AlgoCache algo_cache;

// How many GEMMs each path ran (tests assert the path; see cuda_info.h).
std::atomic<uint64_t> cublaslt_runs{0};
std::atomic<uint64_t> fallback_runs{0};
std::atomic<uint64_t> padded_runs{0};

// Runs the GEMM through cuBLASLt; false when cuBLASLt declines the problem.
bool run_cublaslt(const GemmParams& p, cudaStream_t stream) {
  const bool has_bias = p.bias.defined();
  const bool fast_accum = !p.use_split_accumulator;
  const cudaDataType_t d_type = cuda_type(p.d.dtype);
  void* workspace = p.workspace.defined() ? p.workspace.data : nullptr;
  const uint64_t workspace_bytes = p.workspace.defined() ? static_cast<uint64_t>(p.workspace.numel()) : 0;

  cublasLtMatmulDesc_t raw_desc = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MatmulDesc desc(raw_desc);
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  // Fast accumulation keeps partial sums in the tensor cores' reduced
  // precision; split accumulation promotes them to fp32 (dgrad / wgrad).
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum));
  // Device pointers: the scales are never read on the host.
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b_scale_inv.data));
  set_attr(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a_scale_inv.data));
  if (has_bias) {
    set_attr(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_attr(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(p.bias.data));
    set_attr(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.bias.dtype));
  }
  const Layout a_layout = make_layout(cuda_type(p.b.dtype), p.k, p.n, p.b_row);
  const Layout b_layout = make_layout(cuda_type(p.a.dtype), p.k, p.m, p.a_row);
  const Layout d_layout = make_layout(d_type, p.n, p.m, p.n);

  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  const uint32_t align_a = alignment_of(p.b.data), align_b = alignment_of(p.a.data);
  const uint32_t align_d = alignment_of(p.d.data);
  const AlgoKey key = {device, p.m, p.n, p.k, p.a_row, p.b_row, static_cast<int64_t>(p.a.dtype),
                       static_cast<int64_t>(p.b.dtype), static_cast<int64_t>(p.d.dtype), has_bias,
                       p.accumulate, fast_accum, static_cast<int64_t>(workspace_bytes), align_a,
                       align_b, align_d, has_bias ? alignment_of(p.bias.data) : 0};
  std::optional<cublasLtMatmulAlgo_t> algo;
  if (const std::optional<CachedAlgo> cached = algo_cache.find(key)) {
    if (!*cached) return false;
    algo = *cached;
  }
  if (!algo) {
    cublasLtMatmulPreference_t raw_pref = nullptr;
    TL_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&raw_pref));
    Preference pref(raw_pref);
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      TL_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(raw_pref, attr, &value, sizeof(value)));
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle(), raw_desc, a_layout.get(), b_layout.get(), d_layout.get(),
                                       d_layout.get(), raw_pref, 1, &result, &found);
    // NOT_SUPPORTED / INVALID_VALUE here mean "no FP8 kernel for this
    // combination" (e.g. a bias type): the tiled kernel takes it.
    if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
      algo = result.algo;
    } else if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
               status != CUBLAS_STATUS_INVALID_VALUE) {
      TL_CHECK_CUBLAS(status);
    }
    algo_cache.put(key, algo);
    if (!algo) return false;
  }

  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;  // C is D itself: wgrad accumulates into main_grad
  const cublasStatus_t status =
      cublasLtMatmul(handle(), raw_desc, &alpha, p.b.data, a_layout.get(), p.a.data, b_layout.get(),
                     &beta, p.d.data, d_layout.get(), p.d.data, d_layout.get(), &*algo, workspace,
                     workspace_bytes, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    algo_cache.put(key, std::nullopt);
    return false;
  }
  TL_CHECK_CUBLAS(status);
  return true;
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
          padded_runs.load(std::memory_order_relaxed), algo_cache.size()};
}

void reset_gemm_path_counts() {
  cublaslt_runs.store(0, std::memory_order_relaxed);
  fallback_runs.store(0, std::memory_order_relaxed);
  padded_runs.store(0, std::memory_order_relaxed);
}

}  // namespace cuda
}  // namespace tl
