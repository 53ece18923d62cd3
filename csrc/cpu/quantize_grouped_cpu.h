// Internal interface between the grouped columnwise quantize entry point (common/quantize_grouped.cpp)
// and its CPU kernel (cpu/quantize_grouped_cpu.cpp). Everything here is validated, `offs` values
// included (the entry point reads them on the host).
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

struct QuantizeGroupedParams {
  TensorDesc input;        // (total, c) float32 / bfloat16 / float16, contiguous
  TensorDesc offs;         // (groups) int32 cumulative row ends, nondecreasing, <= total
  TensorDesc output_t;     // (c, total) FP8 bytes
  TensorDesc scale_inv_t;  // (c, grid_cols) float32, or uint8 E8M0 bits when e8m0
  DType fp8_dtype;
  int64_t total, c, groups, grid_cols;
  int64_t token_block;  // 128, 32, or 0: the whole group
  bool e8m0, power_2_scale, e8m0_floor;
};

namespace cpu {
void quantize_grouped_columnwise(const QuantizeGroupedParams& p);
}  // namespace cpu

}  // namespace tl
