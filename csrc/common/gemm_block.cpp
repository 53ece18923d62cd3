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
  const std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  check_defined(op, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCPU, op,
                ": block-scaled operands must be on cpu here (the GPU kernel is "
                "transformer_linear.triton.fp8_gemm), got ",
                device_name(a.device));
  check_dtype(op, "a", a, kFp8);
  check_defined(op, "b", b);
  check_device(op, "b", b, a.device, a.device_index);
  check_dtype(op, "b", b, kFp8);
  GemmBlockParams p{};
  p.a = a;
  p.b = b;
  p.a_scale_inv = a_scale_inv;
  p.b_scale_inv = b_scale_inv;
  p.bias = bias;
  p.d = d;
  p.accumulate = accumulate;
  matrix_strides(op, "a", a, &p.a_row, &p.a_col);
  matrix_strides(op, "b", b, &p.b_row, &p.b_col);
  p.m = a.shape[0];
  p.k = a.shape[1];
  p.n = b.shape[0];
  TL_CHECK(b.shape[1] == p.k, op, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ",
           shape_str(b), " (expected b of shape [N, ", p.k, "] for a @ b.T)");
  p.a_block = block_layout(op, "a_scale_inv", a_scale_inv, p.m, p.k, a_block_rows, a_block_cols, a);
  p.b_block = block_layout(op, "b_scale_inv", b_scale_inv, p.n, p.k, b_block_rows, b_block_cols, a);
  const int64_t lo = std::min(p.a_block.cols, p.b_block.cols);
  const int64_t hi = std::max(p.a_block.cols, p.b_block.cols);
  TL_CHECK(hi % lo == 0 || hi >= p.k, op, ": the K-blocks of 'a' (", p.a_block.cols,
           ") and 'b' (", p.b_block.cols, ") must divide each other");
  check_defined(op, "d", d);
  check_device(op, "d", d, a.device, a.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {p.m, p.n});
  if (bias.defined()) {
    check_device(op, "bias", bias, a.device, a.device_index);
    TL_CHECK_TYPE(bias.dtype == d.dtype, op, ": argument 'bias' must have the output dtype ",
                  dtype_name(d.dtype), ", got ", dtype_name(bias.dtype));
    check_contiguous(op, "bias", bias);
    check_shape(op, "bias", bias, {p.n});
  }
  check_disjoint(op, {{"d", &d}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"bias", &bias}});
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_gemm_blockwise(p);
}

}  // namespace tl
