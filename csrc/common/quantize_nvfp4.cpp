// NVFP4 quantize entry point: validate, write the global decode scales, run the CPU kernel.
#include <cmath>
#include <utility>

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "../cpu/quantize_nvfp4_cpu.h"
#include "../cpu/quantize_nvfp4_cpu_amax.h"
#include "backend_nvfp4.h"
#include "transformer_linear/nvfp4.h"
#include "validate.h"

namespace tl {
namespace {

constexpr const char* kOp = "quantize_nvfp4";

// Validate a global amax (float32 CPU scalar, finite, >= 0) and return its value.
float amax_value(const char* name, const TensorDesc& amax, const TensorDesc& like) {
  check_scalar_fp32(kOp, name, amax);
  check_device(kOp, name, amax, like.device, like.device_index);
  const float v = *amax.ptr<const float>();
  TL_CHECK(std::isfinite(v) && v >= 0.0f, kOp, ": argument '", name,
           "' must be finite and non-negative (the global scale is 448 * 6 / amax), got ", v);
  return v;
}

// Validate one copy's data (uint8 (rows, cols / 2)), scales (e4m3 (rows, cols / 16)) and
// global scale (float32 scalar out).
void check_copy(const char* data_name, const TensorDesc& data, const char* scale_name,
                const TensorDesc& scale, const char* global_name, const TensorDesc& global,
                int64_t rows, int64_t cols, const TensorDesc& like) {
  check_device(kOp, data_name, data, like.device, like.device_index);
  check_dtype(kOp, data_name, data, {DType::kUInt8});
  check_contiguous(kOp, data_name, data);
  check_shape(kOp, data_name, data, {rows, cols / 2});
  check_defined(kOp, scale_name, scale);
  check_device(kOp, scale_name, scale, like.device, like.device_index);
  check_dtype(kOp, scale_name, scale, {DType::kFloat8E4M3});
  check_contiguous(kOp, scale_name, scale);
  check_shape(kOp, scale_name, scale, {rows, cols / cpu::nvfp4::kBlock});
  check_scalar_fp32(kOp, global_name, global);
  check_device(kOp, global_name, global, like.device, like.device_index);
}

}  // namespace

void quantize_nvfp4(const TensorDesc& input, const TensorDesc& amax, const TensorDesc& amax_t,
                    const TensorDesc& output, const TensorDesc& scale,
                    const TensorDesc& global_scale, const TensorDesc& output_t,
                    const TensorDesc& scale_t, const TensorDesc& global_scale_t, bool scaling_2d,
                    bool rht, bool stochastic_rounding, int64_t seed, int64_t offset,
                    Stream stream) {
  constexpr int64_t kBlock = cpu::nvfp4::kBlock;
  check_defined(kOp, "x", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, kOp, ": argument 'x' must be on cpu, got ",
                device_name(input.device));
  check_dtype(kOp, "x", input, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_rank(kOp, "x", input, 2);
  check_contiguous(kOp, "x", input);
  TL_CHECK(output.defined() || output_t.defined(), kOp,
           ": at least one of 'output' and 'output_t' is required");
  TL_CHECK(!(rht && scaling_2d), kOp, ": 'rht' and 'scaling_2d' cannot be combined");
  TL_CHECK(offset >= 0, kOp, ": argument 'offset' must be non-negative, got ", offset);
  // Checked where no copy reads them too (rowwise only, 16x16 tiles): every tensor handed in is valid.
  for (auto [name, t] : {std::pair{"amax", &amax}, {"amax_t", &amax_t}}) {
    check_scalar_fp32(kOp, name, *t);
    check_device(kOp, name, *t, input.device, input.device_index);
  }
  QuantizeNvfp4Params p{};
  p.input = input;
  p.m = input.shape[0];
  p.k = input.shape[1];
  p.scaling_2d = scaling_2d;
  p.rht = rht;
  p.stochastic_rounding = stochastic_rounding;
  p.seed = static_cast<uint64_t>(seed);
  p.offset = static_cast<uint64_t>(offset);
  const bool rows_quantized = output.defined() || scaling_2d;
  TL_CHECK(!rows_quantized || p.k % kBlock == 0, kOp, ": the columns of 'x' (", p.k,
           ") must be a multiple of 16 for the rowwise copy");
  TL_CHECK(!output_t.defined() || p.m % kBlock == 0, kOp, ": the rows of 'x' (", p.m,
           ") must be a multiple of 16 for the columnwise copy");
  if (rows_quantized) p.s_enc = cpu::nvfp4::global_encode_scale(amax_value("amax", amax, input));
  if (output.defined()) {
    check_copy("output", output, "scale", scale, "global_scale", global_scale, p.m, p.k, input);
    p.output = output;
    p.scale = scale;
  }
  if (output_t.defined()) {
    check_copy("output_t", output_t, "scale_t", scale_t, "global_scale_t", global_scale_t, p.k,
               p.m, input);
    p.output_t = output_t;
    p.scale_t = scale_t;
    p.s_enc_t = scaling_2d ? p.s_enc
                           : cpu::nvfp4::global_encode_scale(amax_value("amax_t", amax_t, input));
  }
  check_disjoint(kOp,
                 {{"output", &output}, {"scale", &scale}, {"global_scale", &global_scale},
                  {"output_t", &output_t}, {"scale_t", &scale_t},
                  {"global_scale_t", &global_scale_t}},
                 {{"x", &input}, {"amax", &amax}, {"amax_t", &amax_t}});
  if (output.defined()) *global_scale.ptr<float>() = 1.0f / p.s_enc;
  if (output_t.defined()) *global_scale_t.ptr<float>() = 1.0f / p.s_enc_t;
  const cpu::ThreadCountScope threads(cpu::call_threads(kOp, stream));
  cpu::advise_huge_pages({output, output_t});
  cpu::quantize_nvfp4(p);
}

void nvfp4_amax(const TensorDesc& input, const TensorDesc& amax, const TensorDesc& amax_rht, Stream stream) {
  constexpr const char* op = "nvfp4_amax";
  check_defined(op, "x", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, op, ": argument 'x' must be on cpu, got ",
                device_name(input.device));
  check_dtype(op, "x", input, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_rank(op, "x", input, 2);
  check_contiguous(op, "x", input);
  TL_CHECK(amax.defined() || amax_rht.defined(), op, ": at least one of 'amax' and 'amax_rht' is required");
  const int64_t m = input.shape[0], k = input.shape[1];
  for (const auto& [name, out] : {std::pair<const char*, const TensorDesc*>{"amax", &amax}, {"amax_rht", &amax_rht}}) {
    if (!out->defined()) continue;
    check_scalar_fp32(op, name, *out);
    check_device(op, name, *out, input.device, input.device_index);
  }
  TL_CHECK(!amax_rht.defined() || m % cpu::nvfp4::kBlock == 0, op, ": the rows of 'x' (", m,
           ") must be a multiple of 16 for the transformed columnwise amax");
  check_disjoint(op, {{"amax", &amax}, {"amax_rht", &amax_rht}}, {{"x", &input}});
  float* amax_out = amax.defined() ? amax.ptr<float>() : nullptr;
  float* rht_out = amax_rht.defined() ? amax_rht.ptr<float>() : nullptr;
  if (m == 0 || k == 0) {
    if (amax_out != nullptr) *amax_out = 0.0f;
    if (rht_out != nullptr) *rht_out = 0.0f;
    return;
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::nvfp4::nvfp4_amaxes(input, k, cpu::nvfp4::AmaxRange{0, m, 0, m / cpu::nvfp4::kBlock}, amax_out, rht_out);
}

}  // namespace tl
