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
 * \brief One tiled pass writing whichever of p.output, p.output_t and p.dbias
 *        (column sums, deterministic order) are defined; p.input is not empty.
 * \param scale      device pointer to the scale to apply.
 * \param scale_inv  receives 1 / scale, or nullptr (already written).
 * \param amax       receives max |input| bits (pre-zeroed), or nullptr.
 */
void cast_transpose(const QuantizeParams& p, const float* scale, float* scale_inv, uint32_t* amax,
                    cudaStream_t stream);

// ---- launchers of gemm_fallback_cuda.cu, used by gemm_cuda.cpp ----

/*! \brief Tiled fp32-accumulate GEMM for every shape, layout and FP8 mix cuBLASLt does not take. */
void fp8_gemm_fallback(const GemmParams& p, cudaStream_t stream);

/*! \brief dst (rows, k16) row-major = src (rows, k) with row stride `ld`, zero-filled to k16 (a multiple of 4). */
void pad_k(const uint8_t* src, int64_t rows, int64_t k, int64_t ld, uint8_t* dst, int64_t k16,
           cudaStream_t stream);

/*! \brief d[r, c] += bias[c] for a row-major (rows, cols) fp32 d: the bias of an fp32-output cuBLASLt GEMM. */
void add_bias_rows(float* d, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace cuda
}  // namespace tl
