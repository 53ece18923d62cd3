// cuBLASLt's grouped FP8 matmul (experimental in cuBLAS 13.x: CUBLASLT_BATCH_MODE_GROUPED layouts whose
// per-group shapes and addresses are device arrays, CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F scales).
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cuda {

/*!
 * \brief d[rows of group g] = (a[rows of g] @ b[g]^T) * a_scale_inv * b_scale_inv[g], one cuBLASLt grouped
 *        matmul (tensorwise scales: one for a, one per group for b). The group sizes never reach the host:
 *        a setup kernel turns offs into cuBLASLt's device arrays of shapes, addresses and scales (offs values
 *        clamped to [0, M], as the Triton kernels clamp them). Rows past offs[-1] are left untouched (the
 *        caller zeroes d); the bias is the caller's (ops/grouped.py adds it per group).
 *
 * a: (M, K) FP8 row-major; b: (G, N, K) FP8 contiguous; a_scale_inv: (1,) float32; b_scale_inv: (G,) float32;
 * offs: (G,) int32 cumulative row ends; d: (M, N) float32 / bfloat16 / float16 row-major.
 *
 * Validated (clear errors): devices, dtypes, shapes, contiguity. Declined (false, d untouched): headers or
 * loaded library without the grouped matmul (cuBLAS < 13.10); a GPU below sm_89; e5m2 x e5m2; N or K not a
 * multiple of 16, or unaligned addresses; dimensions beyond int32; no algorithm; no scratch memory.
 *
 * \param workspace  contiguous uint8 cuBLASLt workspace on a's device, or undefined.
 */
bool fp8_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                      const TensorDesc& b_scale_inv, const TensorDesc& offs, const TensorDesc& d,
                      const TensorDesc& workspace, Stream stream);

/*! \brief How many grouped GEMMs cuBLASLt ran (tests assert the path). */
uint64_t cublaslt_grouped_runs();

}  // namespace cuda
}  // namespace tl
