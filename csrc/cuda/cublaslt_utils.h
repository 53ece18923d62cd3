// What the cuBLASLt callers (gemm_cuda.cpp, gemm_block_cuda.cpp) share: the
// per-thread handle, descriptor ownership, data types, alignment, the FP8
// tensor-core layout rule, and the bounded cache of heuristic answers.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_utils.h"

namespace tl {
namespace cuda {

/*! \brief cuBLAS's data type of an FP8 / fp16 / bf16 / fp32 tensor. */
cudaDataType_t cuda_type(DType d);

/*! \brief The cuBLASLt handle of the calling thread for the current device. */
cublasLtHandle_t lt_handle();

/*! \brief Largest power of two (<= 256) dividing the address: what the heuristic must assume of a buffer. */
uint32_t alignment_of(const void* p);

/*!
 * \brief The layout of an FP8 matmul D (M, N) = A (M, K) @ B (N, K)^T [+ bias]: the operands with
 *        their element strides (a[i, p] = a.data[i * a_row + p * a_col], likewise b), the output
 *        and the bias (undefined when there is none).
 */
struct Fp8MatmulLayout {
  const TensorDesc& a;
  int64_t a_row, a_col;
  const TensorDesc& b;
  int64_t b_row, b_col;
  const TensorDesc& d;
  const TensorDesc& bias;
  int64_t n, k;
};

/*!
 * \brief What cuBLASLt's FP8 tensor-core matmul needs that no copy of the operands can change: not
 *        e5m2 x e5m2, both operands K-major, N a multiple of 16, D and the bias 16-byte aligned, K > 0.
 *        With fp8_operands_aligned, the rule transformer_linear/layout.py's fp8_tensor_cores_take
 *        states for Python (M is free).
 */
bool fp8_layout_fits(const Fp8MatmulLayout& l);

/*!
 * \brief ... and what a zero-padded copy of the operands provides: K and the leading dimensions
 *        multiples of 16, the operand addresses 16-byte aligned.
 */
bool fp8_operands_aligned(const Fp8MatmulLayout& l);

template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { Destroy(p); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                   LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;

/*! \brief A matmul descriptor with fp32 compute and scale types. */
MatmulDesc make_matmul_desc();

/*! \brief A column-major (rows, cols) layout with leading dimension `ld`. */
Layout make_layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld);

template <typename V>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  TL_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

/*!
 * \brief Heuristic answers per problem (nullopt: cuBLASLt has none). The same
 *        key always describes the same descriptors, so the first answer is
 *        reused. Bounded, least recently used out: under dynamic shapes every
 *        token count is a new key, and the cache must not grow with the length
 *        of training.
 */
class AlgoCache {
 public:
  using Key = std::vector<int64_t>;
  using Entry = std::optional<cublasLtMatmulAlgo_t>;
  static constexpr size_t kCapacity = 1024;

  /*! \brief The cached answer for `key` (marked most recent), or nothing. */
  std::optional<Entry> find(const Key& key);
  /*! \brief Records (or replaces) the answer for `key`, dropping the least recent beyond capacity. */
  void put(const Key& key, const Entry& algo);
  size_t size();

 private:
  std::mutex mutex_;
  std::list<std::pair<Key, Entry>> order_;  // most recent first
  std::map<Key, std::list<std::pair<Key, Entry>>::iterator> index_;
};

/*! \brief One cuBLASLt matmul D = alpha * op(A) op(B) + beta * D, its descriptors built by the caller. */
struct LtMatmul {
  cublasLtMatmulDesc_t desc;
  const void* a;
  cublasLtMatrixLayout_t a_layout;
  const void* b;
  cublasLtMatrixLayout_t b_layout;
  void* d;
  cublasLtMatrixLayout_t d_layout;
  float beta;
  void* workspace;
  uint64_t workspace_bytes;
};

/*!
 * \brief Runs `mm` with the algorithm cached under `key` (found by the heuristic on
 *        first use, under the alignments of the operands' addresses). False when
 *        cuBLASLt has no algorithm (NOT_SUPPORTED / INVALID_VALUE from the
 *        heuristic) or declines at run time (remembered); other failures throw.
 */
bool run_lt_matmul(AlgoCache& cache, const AlgoCache::Key& key, const LtMatmul& mm, cudaStream_t stream);

}  // namespace cuda
}  // namespace tl
