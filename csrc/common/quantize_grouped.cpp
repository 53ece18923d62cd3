// Grouped columnwise quantize entry point: validate (offs values included, read on the host), then run
// the CPU kernel (the GPU path is made of PyTorch ops, transformer_linear/ops/grouped_quantize.py).
#include <cstdint>
#include <limits>

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "../cpu/quantize_grouped_cpu.h"
#include "transformer_linear/grouped.h"
#include "validate.h"

namespace tl {

void quantize_grouped_columnwise(const TensorDesc& input, const TensorDesc& offs, int64_t token_block,
                                 bool power_2_scale, bool e8m0_floor, const TensorDesc& output_t,
                                 const TensorDesc& scale_inv_t, Stream stream) {
  constexpr const char* op = "quantize_grouped_columnwise";
  check_defined(op, "input", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, op, ": argument 'input' must be a CPU tensor");
  check_dtype(op, "input", input, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_rank(op, "input", input, 2);
  check_contiguous(op, "input", input);
  TL_CHECK(token_block == 0 || token_block == 32 || token_block == 128, op,
           ": argument 'token_block' must be 128, 32 or 0 (the whole group), got ", token_block);
  const int64_t total = input.shape[0], c = input.shape[1];
  TL_CHECK(total <= std::numeric_limits<int32_t>::max(), op, ": argument 'input' has ", total,
           " rows, more than the int32 'offs' can address (2^31 - 1)");
  const int64_t groups = check_host_offs(op, offs, total, input);
  const int64_t grid_cols = token_block == 0 ? groups : total / token_block + groups;
  check_defined(op, "output_t", output_t);
  check_device(op, "output_t", output_t, input.device, input.device_index);
  check_dtype(op, "output_t", output_t, {DType::kFloat8E4M3, DType::kFloat8E5M2});
  check_contiguous(op, "output_t", output_t);
  check_shape(op, "output_t", output_t, {c, total});
  check_defined(op, "scale_inv_t", scale_inv_t);
  check_device(op, "scale_inv_t", scale_inv_t, input.device, input.device_index);
  check_dtype(op, "scale_inv_t", scale_inv_t, {token_block == 32 ? DType::kUInt8 : DType::kFloat32});
  check_contiguous(op, "scale_inv_t", scale_inv_t);
  check_shape(op, "scale_inv_t", scale_inv_t, {c, grid_cols});
  check_disjoint(op, {{"output_t", &output_t}, {"scale_inv_t", &scale_inv_t}},
                 {{"input", &input}, {"offs", &offs}});
  QuantizeGroupedParams p{};
  p.input = input;
  p.offs = offs;
  p.output_t = output_t;
  p.scale_inv_t = scale_inv_t;
  p.fp8_dtype = output_t.dtype;
  p.total = total;
  p.c = c;
  p.groups = groups;
  p.grid_cols = grid_cols;
  p.token_block = token_block;
  p.e8m0 = token_block == 32;
  p.power_2_scale = power_2_scale;
  p.e8m0_floor = e8m0_floor;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output_t});
  cpu::quantize_grouped_columnwise(p);
}

}  // namespace tl
