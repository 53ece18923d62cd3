/*!
 * \file block.h
 * \brief Block-scaled FP8: blockwise quantize and the block-scaled GEMM.
 *
 * A block-scaled tensor is an FP8 (M, K) matrix plus one scale_inv per
 * (bm, bk) block, stored as a (ceil(M / bm), ceil(K / bk)) row-major matrix
 * of float32 values or of E8M0 exponents (uint8 bits, 2^(bits - 127)).
 * Scale rules: block_math.h. Edge blocks are partial: they cover what is left.
 */
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief Quantize a 2-D tensor with one scale per block; row-major and/or transposed output in one pass.
 *
 * output[i, k] = saturate(rne(input[i, k] * scale(block of (i, k)))), and
 * output_t = the same applied to input^T (K, M) with its own blocks: the
 * columnwise copy that wgrad needs, quantized from the high-precision input.
 *
 * \param input        contiguous (M, K) float32, bfloat16 or float16.
 * \param output       contiguous (M, K) FP8, or undefined.
 * \param scale_inv    (ceil(M / block_rows), ceil(K / block_cols)) float32, or uint8 E8M0 bits;
 *                     required with `output`.
 * \param output_t     contiguous (K, M) FP8 of output's dtype, or undefined.
 * \param scale_inv_t  (ceil(K / block_rows_t), ceil(M / block_cols_t)), scale_inv's dtype;
 *                     required with `output_t`.
 * \param block_rows, block_cols      block of `output` (e.g. 1x128, 128x128, 1x32, 1xK).
 * \param block_rows_t, block_cols_t  block of `output_t`, in output_t's coordinates.
 * \param power_2_scale  float32 scales rounded down to powers of two (E8M0 always are).
 * \param e8m0_floor     E8M0 exponents by the OCP floor rule instead of the ceil rule.
 * \param stream       CUDA stream (ignored on the CPU; CUDA tensors are rejected: the GPU
 *                     path is the Triton kernel).
 */
void quantize_blockwise(const TensorDesc& input, const TensorDesc& output,
                        const TensorDesc& scale_inv, const TensorDesc& output_t,
                        const TensorDesc& scale_inv_t, int64_t block_rows, int64_t block_cols,
                        int64_t block_rows_t, int64_t block_cols_t, bool power_2_scale,
                        bool e8m0_floor, Stream stream);

/*!
 * \brief D = sum over K-blocks of (A_blk @ B_blk^T) * a_scale * b_scale [+ bias] [+ D].
 *
 * Each K-block's partial sum is accumulated in float32 and multiplied by its
 * two block scales before it is added to the float32 total (DeepGEMM's
 * promotion); the K-block is the smaller of the two operands' block widths
 * (which must divide each other), so any K works.
 *
 * \param a            FP8 (M, K), row-major or a column-major view.
 * \param a_scale_inv  float32 or uint8 E8M0 (ceil(M / a_block_rows), ceil(K / a_block_cols)).
 * \param b            FP8 (N, K), row-major or column-major.
 * \param b_scale_inv  the same for b, with b's blocks.
 * \param a_block_rows, a_block_cols, b_block_rows, b_block_cols  the blocks; a block at
 *                     least as large as the operand covers it (TensorWise, RowWise).
 * \param bias         (N) of D's dtype, or undefined.
 * \param d            (M, N) contiguous float32/bfloat16/float16 output.
 * \param accumulate   add to D's content.
 * \param stream       CUDA stream (CUDA tensors are rejected: the GPU path is Triton).
 */
void fp8_gemm_blockwise(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                        const TensorDesc& b_scale_inv, int64_t a_block_rows, int64_t a_block_cols,
                        int64_t b_block_rows, int64_t b_block_cols, const TensorDesc& bias,
                        const TensorDesc& d, bool accumulate, Stream stream);

}  // namespace tl
