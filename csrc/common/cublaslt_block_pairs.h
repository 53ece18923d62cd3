// The pairs of block scalings cuBLASLt's block-scaled FP8 matmul runs, with the
// cuBLAS version and the GPUs each pair needs: the one table. The CUDA GEMM
// (cuda/gemm_block_cuda.cpp) runs by it, and the Python side asks it
// (_C.cublaslt_block_pair_runs) before it hands a block-scaled GEMM to cuBLASLt
// rather than the Triton kernel. Plain C++ in every build, so a CPU-only build
// answers too and the decision is testable without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace tl {

/*! \brief The block scalings of cuBLASLt's block-scaled matmul, as torch's scaled_mm names them. */
enum class BlockScaling { kRowWise, kBlock1x128, kBlock128x128, kBlock1x32 };

/*! \brief The scaling named "RowWise", "BlockWise1x128", "BlockWise128x128" or "BlockWise1x32", or nothing. */
std::optional<BlockScaling> parse_block_scaling(const std::string& name);

/*! \brief What cuBLASLt needs to run a pair of scalings (a's, b's). */
struct CublasLtBlockPair {
  int64_t min_cublas_version;  // CUBLAS_VERSION encoding: major * 10000 + minor * 100 + patch
  bool (*runs_on)(int major, int minor);  // the GPUs (compute capability) cuBLASLt runs it on
};

/*! \brief The table's entry for (a, b); nothing where cuBLASLt has no block-scaled matmul for the pair. */
std::optional<CublasLtBlockPair> cublaslt_block_pair(BlockScaling a, BlockScaling b);

/*!
 * \brief Whether cuBLASLt of `cublas_version` (headers and library both at least that) runs the
 *        pair named (a_scaling, b_scaling) on a GPU of compute capability (major, minor); false
 *        for any name or pair outside the table (TensorWise, mixed pairs).
 */
bool cublaslt_block_pair_runs(const std::string& a_scaling, const std::string& b_scaling, int major, int minor,
                              int64_t cublas_version);

}  // namespace tl
