/*!
 * \file gemm.h
 * \brief The FP8 GEMM entry point.
 */
#pragma once

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief D = (A @ B^T) * (a_scale_inv * b_scale_inv) [+ bias] [+ D], fp32 accumulation.
 *
 * Operands may be row-major or column-major views (one unit stride), so the
 * transposes that dgrad and wgrad need are strided views, never copies on
 * the CPU. Any M, N, K; K == 0 gives bias (or D unchanged when accumulating).
 *
 * \param a            FP8 (M, K).
 * \param a_scale_inv  1-element float32.
 * \param b            FP8 (N, K); may be the other FP8 format than `a`.
 * \param b_scale_inv  1-element float32.
 * \param bias         (N) tensor of D's dtype, or undefined.
 * \param d            (M, N) contiguous float32/bfloat16/float16 output.
 * \param accumulate   add the product to D's current content (wgrad into main_grad).
 * \param use_split_accumulator  CUDA: promote partial sums to fp32 regularly
 *                     (slower, more exact); the CPU always accumulates in fp32.
 * \param workspace    CUDA: a uint8 scratch tensor for cuBLASLt, or undefined.
 * \param stream       CUDA stream; on the CPU the thread count of this call (0: OpenMP's, of the calling thread).
 */
void fp8_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
              const TensorDesc& b_scale_inv, const TensorDesc& bias, const TensorDesc& d,
              bool accumulate, bool use_split_accumulator, const TensorDesc& workspace,
              Stream stream);

}  // namespace tl
