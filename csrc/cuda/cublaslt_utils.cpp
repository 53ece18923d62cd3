#include "cublaslt_utils.h"

#include <unordered_map>

namespace tl {
namespace cuda {

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
cublasLtHandle_t lt_handle() {
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

uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && !aligned(p, static_cast<int>(a))) a >>= 1;
  return a;
}

bool fp8_layout_fits(const Fp8MatmulLayout& l) {
  const bool both_e5m2 = l.a.dtype == DType::kFloat8E5M2 && l.b.dtype == DType::kFloat8E5M2;
  const bool k_major = l.a_col == 1 && l.b_col == 1;
  const bool output16 = l.n % 16 == 0 && aligned(l.d.data, 16) && (!l.bias.defined() || aligned(l.bias.data, 16));
  return !both_e5m2 && k_major && output16 && l.k > 0;
}

bool fp8_operands_aligned(const Fp8MatmulLayout& l) {
  return l.k % 16 == 0 && l.a_row % 16 == 0 && l.b_row % 16 == 0 && aligned(l.a.data, 16) && aligned(l.b.data, 16);
}

MatmulDesc make_matmul_desc() {
  cublasLtMatmulDesc_t raw = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  return MatmulDesc(raw);
}

Layout make_layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  return Layout(l);
}

std::optional<AlgoCache::Entry> AlgoCache::find(const Key& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  order_.splice(order_.begin(), order_, it->second);
  return it->second->second;
}

void AlgoCache::put(const Key& key, const Entry& algo) {
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

size_t AlgoCache::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_.size();
}

namespace {

using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

// cuBLASLt's first algorithm for the problem, or nothing when it has none:
// NOT_SUPPORTED / INVALID_VALUE mean "no kernel for this combination" (e.g. a
// bias type, a scaling mode on this GPU); other failures throw.
AlgoCache::Entry heuristic_algo(const LtMatmul& mm) {
  cublasLtMatmulPreference_t raw_pref = nullptr;
  TL_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&raw_pref));
  Preference pref(raw_pref);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    TL_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(raw_pref, attr, &value, sizeof(value)));
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, mm.workspace_bytes);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(mm.a));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(mm.b));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(mm.d));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(mm.d));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt_handle(), mm.desc, mm.a_layout, mm.b_layout, mm.d_layout, mm.d_layout, raw_pref, 1, &result, &found);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) return result.algo;
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
      status != CUBLAS_STATUS_INVALID_VALUE) {
    TL_CHECK_CUBLAS(status);
  }
  return std::nullopt;
}

}  // namespace

bool run_lt_matmul(AlgoCache& cache, const AlgoCache::Key& key, const LtMatmul& mm, cudaStream_t stream) {
  AlgoCache::Entry algo;
  if (const std::optional<AlgoCache::Entry> cached = cache.find(key)) {
    algo = *cached;
  } else {
    algo = heuristic_algo(mm);
    cache.put(key, algo);
  }
  if (!algo) return false;
  const float alpha = 1.0f;
  // C is D itself (beta = 1: wgrad accumulates into main_grad).
  const cublasStatus_t status =
      cublasLtMatmul(lt_handle(), mm.desc, &alpha, mm.a, mm.a_layout, mm.b, mm.b_layout, &mm.beta, mm.d,
                     mm.d_layout, mm.d, mm.d_layout, &*algo, mm.workspace, mm.workspace_bytes, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    cache.put(key, std::nullopt);
    return false;
  }
  TL_CHECK_CUBLAS(status);
  return true;
}

}  // namespace cuda
}  // namespace tl
