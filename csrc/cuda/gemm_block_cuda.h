// cuBLASLt's own block-scaled FP8 matmul (gemm_block_cuda.cpp), the CUDA twin
// of cpu/gemm_block_cpu.cpp. Plain C++ (no CUDA headers), so the bindings can
// include it. The Python side (transformer_linear/ops/gemm_block_cuda.py) decides
// when it applies and hands the scales over in cuBLASLt's layouts.
#pragma once

#include <cstdint>
#include <string>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cuda {

/*!
 * \brief d (M, N) = block-scaled a (M, K) @ b (N, K)^T [+ bias] through cuBLASLt's
 *        block-scaled matmul; false (d untouched) when cuBLASLt, this build or
 *        this GPU cannot run the problem, so the caller runs another kernel.
 *
 * Scalings are torch.nn.functional.scaled_mm's ScalingType names; the pairs,
 * with the cuBLAS version each needs, are the table of
 * common/cublaslt_block_pairs.h. For an operand of R rows (M for a, N for b), with
 * Kb = ceil(K / block width), each scale arrives contiguous in cuBLASLt's layout:
 *
 *   RowWise           float32 (R, 1)
 *   BlockWise1x128    float32 (Kb, round_up(R, 4)): R-major
 *   BlockWise128x128  float32 (ceil(R / 128), round_up(Kb, 4))
 *   BlockWise1x32     uint8 E8M0 bits, round_up(R, 128) * round_up(Kb, 4)
 *                     elements in 128x4 tiles (scaled_mm's swizzle)
 *
 * Validated (clear errors): dtypes, devices, shapes (int64 overflow included),
 * the scale layouts above and their 16-byte alignment, the pair, d and bias,
 * overlap of d with the inputs. Declined (false): a mode this build's cuBLAS
 * headers lack; a loaded libcublasLt older than the pair's version; operands
 * outside the FP8 tensor-core layout rule (cublaslt_utils.h: K-major, K, N,
 * the leading dimensions and the addresses in multiples of 16, not e5m2 x
 * e5m2); a dimension beyond int32; no algorithm from the heuristic.
 *
 * \param workspace  contiguous uint8 cuBLASLt workspace on a's device, or undefined.
 */
bool fp8_gemm_blockwise(const TensorDesc& a, const TensorDesc& a_scale_inv, const std::string& a_scaling,
                        const TensorDesc& b, const TensorDesc& b_scale_inv, const std::string& b_scaling,
                        const TensorDesc& bias, const TensorDesc& d, const TensorDesc& workspace,
                        Stream stream);

/*! \brief Block-scaled GEMMs that cuBLASLt ran since the last reset (process-wide). */
uint64_t cublaslt_block_runs();
void reset_cublaslt_block_runs();

/*! \brief CUBLAS_VERSION of the headers this build was compiled against (e.g. 130100). */
int cublas_header_version();
/*! \brief cublasLtGetVersion() of the loaded libcublasLt, same encoding. */
int64_t cublaslt_version();

}  // namespace cuda
}  // namespace tl
