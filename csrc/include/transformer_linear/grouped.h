/*!
 * \file grouped.h
 * \brief Grouped FP8 GEMMs (mixture-of-experts): one GEMM per expert over the token rows routed to it.
 *
 * The tokens of every group are stacked in one (total, K) FP8 matrix `a`, quantized once, and the
 * groups are given by `offs`, int32 cumulative row ends as in torch._grouped_mm: group g is rows
 * [offs[g-1], offs[g]) (offs[-1] read as 0); empty groups are allowed. Scales use the blocks of
 * block.h, with one extra convention: a block size of 0 spans the whole dimension (one scale along
 * it, even when the dimension is empty). The kernel reads `offs` itself and checks it (0 <=
 * offs[0] <= ... <= offs[G-1] <= total), so callers never copy it to the host.
 */
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief d[rows of group g] = a[rows of g] @ b[g]^T, block-scaled, [+ bias[g]]; rows past offs[G-1] = 0.
 *
 * \param a            contiguous FP8 (total, K), total <= 2^31 - 1 (offs is int32).
 * \param a_scale_inv  contiguous float32 or uint8 E8M0 (ceil(total / a_block_rows), ceil(K / a_block_cols)).
 * \param b            contiguous FP8 (G, N, K): one (N, K) weight per group.
 * \param b_scale_inv  contiguous (G, ceil(N / b_block_rows), ceil(K / b_block_cols)), a_scale_inv's dtype.
 * \param offs         contiguous int32 (G).
 * \param a_block_rows, a_block_cols, b_block_rows, b_block_cols  the blocks (0: the whole dimension);
 *                     the K-blocks must divide each other.
 * \param bias         contiguous (G, N) of d's dtype, or undefined.
 * \param d            contiguous (total, N) float32, bfloat16 or float16.
 * \param stream       the thread count (CPU tensors only).
 */
void fp8_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                      const TensorDesc& b_scale_inv, const TensorDesc& offs, int64_t a_block_rows,
                      int64_t a_block_cols, int64_t b_block_rows, int64_t b_block_cols,
                      const TensorDesc& bias, const TensorDesc& d, Stream stream);

/*!
 * \brief The weight gradient of a grouped GEMM: d[g] = grad[rows of g]^T @ x[rows of g], scaled
 *        by grad_scale_inv * x_scale_inv (tensorwise): the groups split the contraction dimension.
 *        An empty group gives zeros.
 *
 * \param grad            contiguous FP8 (total, N).
 * \param grad_scale_inv  one float32 element.
 * \param x               contiguous FP8 (total, K).
 * \param x_scale_inv     one float32 element.
 * \param offs            contiguous int32 (G).
 * \param d               contiguous (G, N, K) float32, bfloat16 or float16.
 * \param stream          the thread count (CPU tensors only).
 */
void fp8_grouped_gemm_wgrad(const TensorDesc& grad, const TensorDesc& grad_scale_inv,
                            const TensorDesc& x, const TensorDesc& x_scale_inv,
                            const TensorDesc& offs, const TensorDesc& d, Stream stream);

/*!
 * \brief The block-scaled weight gradient of a grouped GEMM from grouped columnwise copies:
 *        d[g] = grad_t[:, tokens of g] @ x_t[:, tokens of g]^T, each product scaled by the two
 *        token blocks' scales. The copies are quantized in blocks of `token_block` tokens that
 *        restart at each group's first token (no block straddles two groups): group g's j-th
 *        block has scale column offs[g-1] / token_block + g + j. An empty group gives zeros.
 *
 * \param grad_t            contiguous FP8 (N, total), total <= 2^31 - 1.
 * \param grad_t_scale_inv  contiguous (N, total / token_block + G) float32, or uint8 E8M0 bits for
 *                          token_block 32; (N, G) for token_block 0 (one scale per group).
 * \param x_t               contiguous FP8 (K, total).
 * \param x_t_scale_inv     contiguous (K, ...) as grad_t_scale_inv.
 * \param offs              contiguous int32 (G).
 * \param token_block       128, 32 or 0 (the whole group).
 * \param d                 contiguous (G, N, K) float32, bfloat16 or float16.
 * \param stream            the thread count (CPU tensors only).
 */
void fp8_grouped_gemm_wgrad_blockwise(const TensorDesc& grad_t, const TensorDesc& grad_t_scale_inv,
                                      const TensorDesc& x_t, const TensorDesc& x_t_scale_inv,
                                      const TensorDesc& offs, int64_t token_block, const TensorDesc& d,
                                      Stream stream);

/*!
 * \brief The grouped columnwise copy of `input` (the operand layout of fp8_grouped_gemm_wgrad_blockwise):
 *        input (total, C) transposed into output_t (C, total) FP8, quantized in 1 x token_block blocks
 *        of tokens that restart at each group's first token, group g's j-th block scaled by
 *        scale_inv_t[:, offs[g-1] / token_block + g + j]; one scale per (column, group) for token_block 0.
 *        Tokens past offs[-1] give 0; scale columns no block uses hold 1. CPU tensors only: offs is
 *        read on the host.
 *
 * \param input          contiguous (total, C) float32, bfloat16 or float16, total <= 2^31 - 1.
 * \param offs           contiguous int32 (G), nondecreasing, each in [0, total].
 * \param token_block    128, 32 (E8M0 scales) or 0 (the whole group).
 * \param power_2_scale  round float32 scales down to powers of two.
 * \param e8m0_floor     E8M0 scales by the OCP floor rule instead of TE's ceil.
 * \param output_t       contiguous FP8 (C, total).
 * \param scale_inv_t    contiguous (C, total / token_block + G) float32, uint8 E8M0 bits for token_block
 *                       32; (C, G) float32 for token_block 0.
 * \param stream         the thread count.
 */
void quantize_grouped_columnwise(const TensorDesc& input, const TensorDesc& offs, int64_t token_block,
                                 bool power_2_scale, bool e8m0_floor, const TensorDesc& output_t,
                                 const TensorDesc& scale_inv_t, Stream stream);

}  // namespace tl
