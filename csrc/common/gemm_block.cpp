// Block-scaled FP8 GEMM entry point: validate, then run the CPU kernel.
#include <algorithm>

#include "../cpu/parallel.h"
#include "backend_block.h"
#include "transformer_linear/block.h"
#include "validate.h"

namespace tl {

void fp8_gemm_blockwise(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                        const TensorDesc& b_scale_inv, int64_t a_block_rows, int64_t a_block_cols,
                        int64_t b_block_rows, int64_t b_block_cols, const TensorDesc& bias,
                        const TensorDesc& d, bool accumulate, Stream stream) {
  constexpr const char* op = "fp8_gemm";
  check_defined(op, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCPU, op,
                ": block-scaled operands must be on cpu here (the GPU kernel is "
                "transformer_linear.ops.triton.gemm_block), got ",
                device_name(a.device));
  const GemmShape s = check_gemm_operands(op, a, b);
  GemmBlockParams p{};
  p.a = a;
  p.b = b;
  p.a_scale_inv = a_scale_inv;
  p.b_scale_inv = b_scale_inv;
  p.bias = bias;
  p.d = d;
  p.accumulate = accumulate;
  p.m = s.m;
  p.n = s.n;
  p.k = s.k;
  p.a_row = s.a_row;
  p.a_col = s.a_col;
  p.b_row = s.b_row;
  p.b_col = s.b_col;
  p.a_block = block_layout(op, "a_scale_inv", a_scale_inv, p.m, p.k, a_block_rows, a_block_cols, a);
  p.b_block = block_layout(op, "b_scale_inv", b_scale_inv, p.n, p.k, b_block_rows, b_block_cols, a);
  const int64_t lo = std::min(p.a_block.cols, p.b_block.cols);
  const int64_t hi = std::max(p.a_block.cols, p.b_block.cols);
  TL_CHECK(hi % lo == 0 || hi >= p.k, op, ": the K-blocks of 'a' (", p.a_block.cols,
           ") and 'b' (", p.b_block.cols, ") must divide each other");
  check_gemm_output(op, d, bias, p.m, p.n, a);
  check_disjoint(op, {{"d", &d}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"bias", &bias}});
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_gemm_blockwise(p);
}

}  // namespace tl
