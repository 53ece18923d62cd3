// Internal interface between the block-scaled entry points (common/*_block.cpp)
// and the CPU kernels (cpu/*_block_cpu*.cpp). Everything here is validated.
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

/*! \brief The blocks of one scale matrix: scale (r, c) covers rows [r * rows, ...) x cols [c * cols, ...). */
struct BlockLayout {
  int64_t rows, cols;  // block shape, clamped to the matrix
  int64_t grid_rows, grid_cols;  // shape of the scale matrix
  bool e8m0;  // uint8 E8M0 bits instead of float32
};

struct QuantizeBlockParams {
  TensorDesc input;                 // contiguous (m, k), high precision
  TensorDesc output, scale_inv;     // (m, k) FP8 + scales, or undefined
  TensorDesc output_t, scale_inv_t; // (k, m) FP8 + scales, or undefined
  BlockLayout block, block_t;       // block_t in output_t's coordinates
  DType fp8_dtype;
  int64_t m, k;
  bool power_2_scale, e8m0_floor;
};

struct GemmBlockParams {
  TensorDesc a, a_scale_inv, b, b_scale_inv, bias, d;
  BlockLayout a_block, b_block;
  int64_t m, n, k;
  int64_t a_row, a_col, b_row, b_col;  // element strides, as in GemmParams
  bool accumulate;
};

/*!
 * \brief Validate a scale matrix for a (rows, cols) operand with (block_rows, block_cols)
 *        blocks (float32 or uint8 E8M0, contiguous, on `like`'s device) and describe it.
 */
BlockLayout block_layout(const char* op, const char* name, const TensorDesc& scale, int64_t rows,
                         int64_t cols, int64_t block_rows, int64_t block_cols,
                         const TensorDesc& like);

namespace cpu {
void quantize_blockwise(const QuantizeBlockParams& p);
void fp8_gemm_blockwise(const GemmBlockParams& p);
}  // namespace cpu

}  // namespace tl
