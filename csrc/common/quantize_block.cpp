// Blockwise quantize entry point: validate, then run the CPU kernel.
#include <algorithm>

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "backend_block.h"
#include "transformer_linear/block.h"
#include "validate.h"

namespace tl {

BlockLayout block_layout(const char* op, const char* name, const TensorDesc& scale, int64_t rows,
                         int64_t cols, int64_t block_rows, int64_t block_cols,
                         const TensorDesc& like) {
  TL_CHECK(block_rows >= 1 && block_cols >= 1, op, ": the block of '", name,
           "' must be positive, got ", block_rows, "x", block_cols);
  check_defined(op, name, scale);
  check_device(op, name, scale, like.device, like.device_index);
  check_dtype(op, name, scale, {DType::kFloat32, DType::kUInt8});
  check_contiguous(op, name, scale);
  BlockLayout l;
  l.rows = std::min(block_rows, std::max<int64_t>(rows, 1));
  l.cols = std::min(block_cols, std::max<int64_t>(cols, 1));
  l.grid_rows = (rows + l.rows - 1) / l.rows;
  l.grid_cols = (cols + l.cols - 1) / l.cols;
  l.e8m0 = scale.dtype == DType::kUInt8;
  check_shape(op, name, scale, {l.grid_rows, l.grid_cols});
  return l;
}

void quantize_blockwise(const TensorDesc& input, const TensorDesc& output,
                        const TensorDesc& scale_inv, const TensorDesc& output_t,
                        const TensorDesc& scale_inv_t, int64_t block_rows, int64_t block_cols,
                        int64_t block_rows_t, int64_t block_cols_t, bool power_2_scale,
                        bool e8m0_floor, Stream stream) {
  constexpr const char* op = "quantize_blockwise";
  check_defined(op, "x", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, op,
                ": argument 'x' must be on cpu (the GPU kernels are transformer_linear.triton), got ",
                device_name(input.device));
  check_dtype(op, "x", input, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_rank(op, "x", input, 2);
  check_contiguous(op, "x", input);
  TL_CHECK(output.defined() || output_t.defined(), op,
           ": at least one of 'output' and 'output_t' is required");
  QuantizeBlockParams p{};
  p.input = input;
  p.m = input.shape[0];
  p.k = input.shape[1];
  p.power_2_scale = power_2_scale;
  p.e8m0_floor = e8m0_floor;
  p.fp8_dtype = DType::kOther;
  for (auto [name, t] : {std::pair{"output", &output}, {"output_t", &output_t}}) {
    if (!t->defined()) continue;
    check_device(op, name, *t, input.device, input.device_index);
    check_dtype(op, name, *t, {DType::kFloat8E4M3, DType::kFloat8E5M2});
    check_contiguous(op, name, *t);
    TL_CHECK_TYPE(p.fp8_dtype == DType::kOther || p.fp8_dtype == t->dtype, op,
                  ": 'output' and 'output_t' must have the same dtype");
    p.fp8_dtype = t->dtype;
  }
  if (output.defined()) {
    check_shape(op, "output", output, {p.m, p.k});
    p.output = output;
    p.scale_inv = scale_inv;
    p.block = block_layout(op, "scale_inv", scale_inv, p.m, p.k, block_rows, block_cols, input);
  }
  if (output_t.defined()) {
    check_shape(op, "output_t", output_t, {p.k, p.m});
    p.output_t = output_t;
    p.scale_inv_t = scale_inv_t;
    p.block_t =
        block_layout(op, "scale_inv_t", scale_inv_t, p.k, p.m, block_rows_t, block_cols_t, input);
  }
  TL_CHECK_TYPE(!(output.defined() && output_t.defined()) || scale_inv.dtype == scale_inv_t.dtype,
                op, ": 'scale_inv' and 'scale_inv_t' must have the same dtype");
  check_disjoint(op,
                 {{"output", &output}, {"scale_inv", &scale_inv}, {"output_t", &output_t},
                  {"scale_inv_t", &scale_inv_t}},
                 {{"x", &input}});
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output, output_t});
  cpu::quantize_blockwise(p);
}

}  // namespace tl
