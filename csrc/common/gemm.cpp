// FP8 GEMM entry point: validate, then run the kernel of the operands' device.
#include "transformer_linear/gemm.h"

#include "../cpu/parallel.h"
#include "backend.h"
#include "validate.h"

namespace tl {

void fp8_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
              const TensorDesc& b_scale_inv, const TensorDesc& bias, const TensorDesc& d,
              bool accumulate, bool use_split_accumulator, const TensorDesc& workspace,
              Stream stream) {
  constexpr const char* op = "fp8_gemm";
  const std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  check_defined(op, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCPU || a.device == DeviceType::kCUDA, op,
                ": argument 'a' must be on cpu or cuda, got ", device_name(a.device));
  const DeviceType dev = a.device;
  const int dev_index = a.device_index;
  check_dtype(op, "a", a, kFp8);
  check_defined(op, "b", b);
  check_device(op, "b", b, dev, dev_index);
  check_dtype(op, "b", b, kFp8);

  GemmParams p{a, a_scale_inv, b, b_scale_inv, bias, d, workspace, 0, 0, 0, 0, 0, 0, 0,
               accumulate, use_split_accumulator, stream};
  matrix_strides(op, "a", a, &p.a_row, &p.a_col);
  matrix_strides(op, "b", b, &p.b_row, &p.b_col);
  p.m = a.shape[0];
  p.k = a.shape[1];
  p.n = b.shape[0];
  TL_CHECK(b.shape[1] == p.k, op, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ",
           shape_str(b), " (expected b of shape [N, ", p.k, "] for a @ b.T)");

  for (auto [name, t] : {std::pair{"a_scale_inv", &a_scale_inv}, {"b_scale_inv", &b_scale_inv}}) {
    check_scalar_fp32(op, name, *t);
    check_device(op, name, *t, dev, dev_index);
  }
  check_defined(op, "d", d);
  check_device(op, "d", d, dev, dev_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {p.m, p.n});
  if (bias.defined()) {
    check_device(op, "bias", bias, dev, dev_index);
    TL_CHECK_TYPE(bias.dtype == d.dtype, op, ": argument 'bias' must have the output dtype ",
                  dtype_name(d.dtype), ", got ", dtype_name(bias.dtype));
    check_contiguous(op, "bias", bias);
    check_shape(op, "bias", bias, {p.n});
  }
  if (workspace.defined()) {
    check_device(op, "workspace", workspace, dev, dev_index);
    check_dtype(op, "workspace", workspace, {DType::kUInt8});
    check_contiguous(op, "workspace", workspace);
  }
  check_disjoint(op, {{"d", &d}, {"workspace", &workspace}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"bias", &bias}});
  if (dev == DeviceType::kCUDA) {
#ifdef TL_WITH_CUDA
    return cuda::fp8_gemm(p);
#else
    fail_no_cuda(op);
#endif
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_gemm(p);
}

}  // namespace tl
