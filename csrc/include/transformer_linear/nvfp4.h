/*!
 * \file nvfp4.h
 * \brief NVFP4: quantize to FP4 E2M1 with E4M3 block scales and a float32 global scale, and
 *        the NVFP4 block-scaled GEMM (CPU kernels).
 *
 * Packed data is uint8 (M, K / 2): two E2M1 codes per byte, the first element in the low
 * nibble (torch.float4_e2m1fn_x2 viewed as uint8). Block scales are float8_e4m3fn
 * (rows, cols / 16), one per 16 consecutive elements of a row (16x16 scaling repeats each
 * tile's scale on its 16 rows). transformer_linear/reference/nvfp4.py defines every rule.
 */
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief Quantize a 2-D tensor to NVFP4: a rowwise copy of input (M, K) and/or a columnwise
 *        copy of input^T (K, M), each with its own 1x16 blocks (or 16x16 tiles).
 *
 * \param input          contiguous (M, K) float32, bfloat16 or float16 on the CPU.
 * \param amax           float32 scalar, finite and >= 0: global amax of the rowwise copy
 *                       (and of the 16x16 columnwise copy).
 * \param amax_t         float32 scalar: global amax of the 1x16 columnwise copy (after the
 *                       Hadamard transform with `rht`); required with `output_t` unless 16x16.
 * \param output         uint8 (M, K / 2), or undefined; K % 16 == 0.
 * \param scale          float8_e4m3fn (M, K / 16), with `output`.
 * \param global_scale   float32 scalar out: the decode scale 1 / S_enc, with `output`.
 * \param output_t, scale_t, global_scale_t  the same for the columnwise copy: (K, M / 2),
 *                       (K, M / 16); M % 16 == 0.
 * \param scaling_2d     one scale per 16x16 tile.
 * \param rht            random Hadamard transform of the columnwise copy (not with 16x16).
 * \param stochastic_rounding  round with Philox4x32-10 bits from (seed, offset).
 * \param offset         Philox offset, in [0, 2^63).
 * \param stream         thread count of the call (CPU tensors only).
 */
void quantize_nvfp4(const TensorDesc& input, const TensorDesc& amax, const TensorDesc& amax_t,
                    const TensorDesc& output, const TensorDesc& scale,
                    const TensorDesc& global_scale, const TensorDesc& output_t,
                    const TensorDesc& scale_t, const TensorDesc& global_scale_t, bool scaling_2d,
                    bool rht, bool stochastic_rounding, int64_t seed, int64_t offset,
                    Stream stream);

/*!
 * \brief The global amaxes an NVFP4 quantize of `input` takes: max |input| and/or max |H(input^T)|,
 *        the Hadamard transform of the columnwise copy's 16-element blocks (16 rows of a column),
 *        one pass over the input when both are asked for.
 *
 * Bitwise transformer_linear/ops/nvfp4.py's torch form (formats/nvfp4.py: signs, then the
 * butterfly stages 1, 2, 4, 8 apart, then 0.25): NaN where the input holds a NaN (or an inf
 * that the transform turns into inf - inf), an inf where it holds one, 0 for an empty input.
 *
 * \param input     contiguous (M, K) float32, bfloat16 or float16 on the CPU; M % 16 == 0 with
 *                  `amax_rht`.
 * \param amax      float32 scalar out: max |input|, or undefined.
 * \param amax_rht  float32 scalar out: max |H(input^T)|, or undefined.
 * \param stream    thread count of the call.
 */
void nvfp4_amax(const TensorDesc& input, const TensorDesc& amax, const TensorDesc& amax_rht, Stream stream);

/*!
 * \brief d = (A @ B^T) * (a_global_scale * b_global_scale) [+ bias] for NVFP4 operands.
 *
 * Each 16-element K block's products (block scales folded into the decoded operands) sum
 * exactly in float32; the blocks are accumulated in float32 in K order; the global scales
 * and the bias are applied in the float32 epilogue.
 *
 * \param a             uint8 packed (M, K / 2), contiguous; K % 16 == 0.
 * \param a_scale       float8_e4m3fn (M, K / 16), contiguous.
 * \param a_global_scale  float32 scalar, finite.
 * \param b, b_scale, b_global_scale  the same for B (N, K / 2).
 * \param bias          (N) of d's dtype, or undefined.
 * \param d             contiguous (M, N) float32, bfloat16 or float16.
 * \param stream        thread count of the call (CPU tensors only).
 */
void nvfp4_gemm(const TensorDesc& a, const TensorDesc& a_scale, const TensorDesc& a_global_scale,
                const TensorDesc& b, const TensorDesc& b_scale, const TensorDesc& b_global_scale,
                const TensorDesc& bias, const TensorDesc& d, Stream stream);

/*!
 * \brief Grouped NVFP4 GEMM (mixture of experts), forward and dgrad form: for each group g,
 *        d[rows of g] = a[rows of g] @ b[g]^T * (a's global scale * b[g]'s) [+ bias[g]]; rows
 *        past offs[G - 1] are zero. Each row has the bits of nvfp4_gemm on that row and b[g].
 *
 * Scales are packed (transformer_linear/ops/nvfp4.py pack_scales): the float32 global decode
 * scale as 8 elements of 4 bits, then the E4M3 block scales row-major.
 *
 * \param a            uint8 packed (total, K / 2), contiguous, on the CPU; K % 16 == 0.
 * \param a_scale_inv  float8_e4m3fn (8 + total * K / 16), its packed scales.
 * \param b            uint8 packed (G, N, K / 2), contiguous.
 * \param b_scale_inv  float8_e4m3fn (G, 8 + N * K / 16), each group's packed scales.
 * \param offs         int32 (G) cumulative row ends, nondecreasing, in [0, total]; read on the host.
 * \param bias         (G, N) of d's dtype, or undefined.
 * \param d            contiguous (total, N) float32, bfloat16 or float16.
 * \param stream       thread count of the call.
 */
void nvfp4_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                        const TensorDesc& b_scale_inv, const TensorDesc& offs, const TensorDesc& bias,
                        const TensorDesc& d, Stream stream);

/*!
 * \brief Grouped NVFP4 weight-gradient GEMM: d[g] = grad_t[g] @ x_t[g]^T * (their global scales),
 *        contracting over the tokens, from compact grouped columnwise copies (as
 *        quantize_nvfp4_grouped_columnwise makes them): group g's copy of the tokens masked to it
 *        holds only its 16-token bands [floor(offs[g-1] / 16) * 16, ceil(offs[g] / 16) * 16),
 *        stored after the bands of the groups before it. The other blocks of a masked copy are zero
 *        and add nothing, so d[g] has the bits of nvfp4_gemm of the masked copies.
 *
 * \param grad_t            uint8 packed (N, C / 2), contiguous, on the CPU; C = total + 16 (G - 1)
 *                          (0 for G = 0), the compact copies' token capacity.
 * \param grad_t_scale_inv  float8_e4m3fn (8 G + N * C / 16): each group's packed global decode scale
 *                          (8 elements, as pack_scales), then the (N, C / 16) block scales.
 * \param x_t               uint8 packed (K, C / 2).
 * \param x_t_scale_inv     float8_e4m3fn (8 G + K * C / 16).
 * \param offs              int32 (G) cumulative token ends, nondecreasing, in [0, total]; read on the host.
 * \param d                 contiguous (G, N, K) float32, bfloat16 or float16.
 * \param stream            thread count of the call.
 */
void nvfp4_grouped_gemm_wgrad(const TensorDesc& grad_t, const TensorDesc& grad_t_scale_inv,
                              const TensorDesc& x_t, const TensorDesc& x_t_scale_inv, const TensorDesc& offs,
                              const TensorDesc& d, Stream stream);

/*!
 * \brief Compact columnwise NVFP4 copies (1x16 blocks along the tokens) of the tokens masked to each
 *        group: group g's copy is the 16-token bands holding its tokens (columns [floor(start / 16) * 16,
 *        ceil(end / 16) * 16) of quantize_nvfp4(x masked to group g, its amax, columnwise), with `rht`
 *        its transformed amax, with `stochastic_rounding` seeds[g] and offset 0, the random bits of
 *        each element's index in the whole masked copy), stored after the groups before it; the rest
 *        of a masked copy is zero codes with zero scales and is not stored. Layout:
 *        nvfp4_grouped_gemm_wgrad's operands.
 *
 * \param input     contiguous (total, K) float32, bfloat16 or float16 on the CPU; total % 16 == 0.
 * \param offs      int32 (G) cumulative row ends, nondecreasing, in [0, total]; read on the host.
 * \param seeds     int64 (G) with `stochastic_rounding`, else undefined.
 * \param output_t  uint8 (K, C / 2) out, C = total + 16 (G - 1) (0 for G = 0); past the groups' bands, 0.
 * \param scale_t   float8_e4m3fn (8 G + K * C / 16) out: each group's packed global decode scale, then
 *                  the (K, C / 16) block scales.
 * \param stream    thread count of the call.
 */
void quantize_nvfp4_grouped_columnwise(const TensorDesc& input, const TensorDesc& offs, const TensorDesc& seeds,
                                       const TensorDesc& output_t, const TensorDesc& scale_t, bool rht,
                                       bool stochastic_rounding, Stream stream);

}  // namespace tl
