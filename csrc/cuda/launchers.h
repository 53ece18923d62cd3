// Host-side launchers one CUDA source offers the others (no device code here,
// so plain C++ files such as gemm_cuda.cpp can include it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/backend.h"

namespace tl {
namespace cuda {

// ---- launchers of cast_transpose_cuda.cu, used by quantize_cuda.cu ----

/*!
 * \brief Fused cast + transpose: writes p.output_t (and p.output when defined).
 * \param scale      device pointer to the scale to apply.
 * \param scale_inv  receives 1 / scale, or nullptr (already written).
 * \param amax       receives max |input| bits (pre-zeroed), or nullptr.
 */
void cast_transpose(const QuantizeParams& p, const float* scale, float* scale_inv, uint32_t* amax,
                    cudaStream_t stream);

/*! \brief p.dbias = column sums of p.input viewed as (rows, cols); deterministic order. */
void column_sums(const QuantizeParams& p, cudaStream_t stream);

// ---- launcher of gemm_fallback_cuda.cu, used by gemm_cuda.cpp ----

/*! \brief Tiled fp32-accumulate GEMM for every shape, layout and FP8 mix cuBLASLt does not take. */
void fp8_gemm_fallback(const GemmParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace tl
