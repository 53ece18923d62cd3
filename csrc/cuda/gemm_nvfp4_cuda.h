#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cuda {

/*!
 * \brief d (M, N) float32 = NVFP4 a (M, K) @ b (N, K)^T through cuBLASLt's block-scaled FP4 matmul
 *        (CUDA_R_4F_E2M1 operands, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 block scales; sm_100+,
 *        cuBLAS 12.8+), the twin of cpu/gemm_nvfp4_cpu.cpp without the epilogue: the caller applies
 *        the global scales and the bias in float32 (as reference/nvfp4.py does). False (d untouched)
 *        when this build, the loaded cuBLASLt or the operands' layout cannot run it.
 *
 * a: (M, K/2) uint8 and b: (N, K/2) uint8, row-major, two E2M1 codes a byte (first in the low nibble).
 * a_scale / b_scale: uint8 E4M3 bits in cuBLASLt's 128x4-tile layout, round_up(R, 128) *
 * round_up(K / 16, 4) elements for an operand of R rows (ops/nvfp4_cuda.py converts them).
 *
 * Validated (clear errors): devices, dtypes, shapes, scale sizes and 16-byte alignment, d, overlap of d with
 * the inputs. Declined (false): headers or library older than 12.8; K not a multiple of 32, N not a multiple of
 * 16 or unaligned addresses (cuBLASLt's FP4 layout rules); dimensions beyond int32; no algorithm.
 *
 * \param workspace  contiguous uint8 cuBLASLt workspace on a's device, or undefined.
 */
bool nvfp4_gemm(const TensorDesc& a, const TensorDesc& a_scale, const TensorDesc& b, const TensorDesc& b_scale,
                const TensorDesc& d, const TensorDesc& workspace, Stream stream);

}  // namespace cuda
}  // namespace tl
