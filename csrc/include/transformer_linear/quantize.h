/*!
 * \file quantize.h
 * \brief Quantize-family entry points: amax, quantize (delayed or current
 *        scaling, optional transposed output, amax and bias-gradient), dequantize,
 *        the transpose of quantized data, and the bias gradient on its own.
 *
 * Each entry validates its arguments (dtype, device, shape, layout) and then
 * runs the CPU or CUDA kernel for the tensors' device. Scales are read from
 * and written to tensor memory: no host round trip between steps.
 */
#pragma once

#include "transformer_linear/tensor.h"

namespace tl {

/*!
 * \brief amax = max |input|, NaN-propagating.
 * \param input  contiguous float32/bfloat16/float16 tensor, any shape (0 elements gives amax 0).
 * \param amax   1-element float32 output.
 * \param stream CUDA stream; on the CPU the thread count of this call (0: OpenMP's, of the calling thread).
 */
void amax(const TensorDesc& input, const TensorDesc& amax, Stream stream);

/*!
 * \brief FP8 quantization: q = saturate(round_nearest_even(input * scale)).
 *
 * The FP8 format is the dtype of `output` (or `output_t`). The input is read
 * once, however many of the outputs are asked for.
 *
 * \param input           contiguous float32/bfloat16/float16 tensor; viewed as
 *                        (rows, cols) = (numel / last dim, last dim) for the
 *                        transposed output and the bias gradient.
 * \param scale           1-element float32. Read when `current_scaling` is false;
 *                        written with the computed scale when it is true.
 * \param output          FP8 tensor of the input's shape, or undefined.
 * \param output_t        FP8 (cols, rows) tensor receiving the transpose, or undefined.
 * \param scale_inv       1-element float32 receiving 1 / scale.
 * \param amax            1-element float32 receiving max |input|, or undefined;
 *                        required when `current_scaling`.
 * \param dbias           (cols) tensor receiving the column sums of the input
 *                        (the bias gradient when input is grad_output), or undefined.
 * \param current_scaling compute scale = fp8_max / amax / 2^margin from this input first.
 * \param margin          the margin of the current-scaling formula (0 <= margin < 127).
 * \param stream          CUDA stream; on the CPU the thread count of this call (0: OpenMP's, of the calling thread).
 */
void quantize(const TensorDesc& input, const TensorDesc& scale, const TensorDesc& output,
              const TensorDesc& output_t, const TensorDesc& scale_inv, const TensorDesc& amax,
              const TensorDesc& dbias, bool current_scaling, int margin, Stream stream);

/*!
 * \brief output = float(input) * scale_inv, rounded to the output dtype.
 * \param input     contiguous FP8 tensor.
 * \param scale_inv 1-element float32.
 * \param output    contiguous float32/bfloat16/float16 tensor of the input's shape.
 * \param stream    CUDA stream; on the CPU the thread count of this call (0: OpenMP's, of the calling thread).
 */
void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output,
                Stream stream);

/*!
 * \brief output = input with its last two dimensions swapped, as a contiguous copy: the columnwise
 *        copy of data already quantized (a weight's square-block FP8 data, a gathered shard's).
 *
 * CPU only: on a GPU, torch's own copy runs the transpose at the memory's rate.
 *
 * \param input  contiguous FP8 tensor, (rows, cols) or a stack (n, rows, cols); any size may be 0.
 * \param output contiguous tensor of the input's dtype, (cols, rows) or (n, cols, rows), not
 *               overlapping the input.
 * \param stream the thread count of this call (0: OpenMP's, of the calling thread).
 */
void transpose(const TensorDesc& input, const TensorDesc& output, Stream stream);

/*!
 * \brief dbias = column sums of input, the bias gradient where no quantize pass computes it.
 *
 * Accumulated in float32 over fixed blocks of 256 rows, the blocks added in order (as `quantize`'s
 * `dbias`, to the bit): the result does not depend on the thread count. CPU only: on a GPU, torch's
 * reduction.
 *
 * \param input  contiguous float32/bfloat16/float16 tensor, viewed as (numel / last dim, last dim).
 * \param dbias  contiguous float32/bfloat16/float16 (last dim) tensor, not overlapping the input.
 * \param stream the thread count of this call (0: OpenMP's, of the calling thread).
 */
void bias_grad(const TensorDesc& input, const TensorDesc& dbias, Stream stream);

}  // namespace tl
