// FP8 GEMM entry point: validate, then run the kernel of the operands' device.
#include "transformer_linear/gemm.h"

#include "../cpu/parallel.h"
#include "backend.h"
#include "validate.h"

namespace tl {

GemmParams checked_gemm_params(const char* op, const TensorDesc& a, const TensorDesc& a_scale_inv,
                               const TensorDesc& b, const TensorDesc& b_scale_inv, const TensorDesc& bias,
                               const TensorDesc& d, bool accumulate, bool use_split_accumulator,
                               const TensorDesc& workspace, Stream stream) {
  check_defined(op, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCPU || a.device == DeviceType::kCUDA, op,
                ": argument 'a' must be on cpu or cuda, got ", device_name(a.device));
  const DeviceType dev = a.device;
  const int dev_index = a.device_index;
  const GemmShape s = check_gemm_operands(op, a, b);
  const GemmParams p{a,   a_scale_inv, b,       b_scale_inv, bias,    d,       workspace,
                     s.m, s.n,         s.k,     s.a_row,     s.a_col, s.b_row, s.b_col,
                     accumulate,       use_split_accumulator,         stream};

  for (auto [name, t] : {std::pair{"a_scale_inv", &a_scale_inv}, {"b_scale_inv", &b_scale_inv}}) {
    check_scalar_fp32(op, name, *t);
    check_device(op, name, *t, dev, dev_index);
  }
  check_gemm_output(op, d, bias, p.m, p.n, a);
  if (workspace.defined()) {
    check_device(op, "workspace", workspace, dev, dev_index);
    check_dtype(op, "workspace", workspace, {DType::kUInt8});
    check_contiguous(op, "workspace", workspace);
  }
  check_disjoint(op, {{"d", &d}, {"workspace", &workspace}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"bias", &bias}});
  return p;
}

void fp8_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
              const TensorDesc& b_scale_inv, const TensorDesc& bias, const TensorDesc& d,
              bool accumulate, bool use_split_accumulator, const TensorDesc& workspace,
              Stream stream) {
  constexpr const char* op = "fp8_gemm";
  const GemmParams p = checked_gemm_params(op, a, a_scale_inv, b, b_scale_inv, bias, d, accumulate,
                                           use_split_accumulator, workspace, stream);
  if (a.device == DeviceType::kCUDA) {
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
