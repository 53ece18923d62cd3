/*!
 * \file quantize_gemm.h
 * \brief The fused forward entry point: a high-precision input quantized (one scale for the tensor)
 *        and multiplied by an FP8 operand in one call.
 */
#pragma once

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief output = quantize(input * scale) (row-major FP8), then
 *        D = (output @ B^T) * (scale_inv * b_scale_inv) [+ bias].
 *
 * The results are bitwise those of quantize() (rowwise output only) followed by fp8_gemm(). On the
 * CPU the cast runs inside the GEMM: the thread that packs a block of A's rows casts those rows
 * first, from the high-precision input, so the FP8 copy is written once and read back from cache
 * rather than in a pass of its own; current scaling's amax pass runs before the GEMM (the scale
 * must be known first). On CUDA the two kernels run one after the other.
 *
 * \param input       contiguous (M, K) float32/bfloat16/float16.
 * \param scale       1-element float32: read (delayed scaling), or written (current scaling).
 * \param output      contiguous (M, K) float8_e4m3fn/float8_e5m2: the FP8 copy, the GEMM's A.
 * \param scale_inv   1-element float32 output: 1 / scale, the GEMM's a_scale_inv.
 * \param amax        1-element float32 output: max |input|; required with current scaling.
 * \param current_scaling  compute the scale from the input's amax (with `margin`).
 * \param margin      current scaling's power-of-two head room, in [0, 127).
 * \param b, b_scale_inv, bias, d, use_split_accumulator, workspace  as fp8_gemm()'s (no accumulate).
 * \param stream      CUDA stream; on the CPU the thread count of this call (0: OpenMP's).
 */
void quantize_fp8_gemm(const TensorDesc& input, const TensorDesc& scale, const TensorDesc& output,
                       const TensorDesc& scale_inv, const TensorDesc& amax, bool current_scaling, int margin,
                       const TensorDesc& b, const TensorDesc& b_scale_inv, const TensorDesc& bias,
                       const TensorDesc& d, bool use_split_accumulator, const TensorDesc& workspace,
                       Stream stream);

}  // namespace tl
