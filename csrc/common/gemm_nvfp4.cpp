// NVFP4 GEMM entry point: validate, then run the CPU kernel.
#include <cmath>

#include "../cpu/parallel.h"
#include "../cpu/quantize_nvfp4_cpu.h"
#include "backend_nvfp4.h"
#include "transformer_linear/nvfp4.h"
#include "validate.h"

namespace tl {
namespace {

constexpr const char* kOp = "nvfp4_gemm";

// Validate one operand: packed uint8 (rows, k / 2) and its e4m3 (rows, k / 16) scales and
// float32 global scale (finite); returns the global scale.
float check_operand(const char* name, const TensorDesc& data, const char* scale_name,
                    const TensorDesc& scale, const char* global_name, const TensorDesc& global,
                    const TensorDesc& like) {
  check_defined(kOp, name, data);
  check_device(kOp, name, data, like.device, like.device_index);
  check_dtype(kOp, name, data, {DType::kUInt8});
  check_rank(kOp, name, data, 2);
  check_contiguous(kOp, name, data);
  TL_CHECK(data.shape[1] % (cpu::nvfp4::kBlock / 2) == 0, kOp, ": argument '", name,
           "' must hold a multiple of 16 FP4 values per row (", cpu::nvfp4::kBlock / 2,
           " bytes), got shape ", shape_str(data));
  check_defined(kOp, scale_name, scale);
  check_device(kOp, scale_name, scale, like.device, like.device_index);
  check_dtype(kOp, scale_name, scale, {DType::kFloat8E4M3});
  check_contiguous(kOp, scale_name, scale);
  check_shape(kOp, scale_name, scale, {data.shape[0], data.shape[1] * 2 / cpu::nvfp4::kBlock});
  check_scalar_fp32(kOp, global_name, global);
  check_device(kOp, global_name, global, like.device, like.device_index);
  const float g = *global.ptr<const float>();
  TL_CHECK(std::isfinite(g), kOp, ": argument '", global_name, "' must be finite, got ", g);
  return g;
}

}  // namespace

void nvfp4_gemm(const TensorDesc& a, const TensorDesc& a_scale, const TensorDesc& a_global_scale,
                const TensorDesc& b, const TensorDesc& b_scale, const TensorDesc& b_global_scale,
                const TensorDesc& bias, const TensorDesc& d, Stream stream) {
  check_defined(kOp, "a", a);
  TL_CHECK_TYPE(a.device == DeviceType::kCPU, kOp, ": argument 'a' must be on cpu, got ",
                device_name(a.device));
  GemmNvfp4Params p{};
  const float ga = check_operand("a", a, "a_scale", a_scale, "a_global_scale", a_global_scale, a);
  const float gb = check_operand("b", b, "b_scale", b_scale, "b_global_scale", b_global_scale, a);
  TL_CHECK(a.shape[1] == b.shape[1], kOp, ": the K dimensions of 'a' ", shape_str(a), " and 'b' ",
           shape_str(b), " differ");
  p.m = a.shape[0];
  p.n = b.shape[0];
  p.k = a.shape[1] * 2;
  check_gemm_output(kOp, d, bias, p.m, p.n, a);
  check_disjoint(kOp, {{"d", &d}},
                 {{"a", &a}, {"a_scale", &a_scale}, {"a_global_scale", &a_global_scale},
                  {"b", &b}, {"b_scale", &b_scale}, {"b_global_scale", &b_global_scale},
                  {"bias", &bias}});
  p.a = a;
  p.a_scale = a_scale;
  p.b = b;
  p.b_scale = b_scale;
  p.bias = bias;
  p.d = d;
  p.alpha = ga * gb;
  const cpu::ThreadCountScope threads(cpu::call_threads(kOp, stream));
  cpu::nvfp4_gemm(p);
}

}  // namespace tl
