// Quantize-family entry points: validate, then run the kernel of the input's device.
#include "transformer_linear/quantize.h"

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "backend.h"
#include "validate.h"

namespace tl {
namespace {

constexpr std::initializer_list<DType> kHighPrecision = {DType::kFloat32, DType::kBFloat16,
                                                         DType::kFloat16};
constexpr std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};

// Input checks shared by every entry: defined, on CPU or CUDA, contiguous.
void check_input(const char* op, const TensorDesc& input, std::initializer_list<DType> dtypes) {
  check_defined(op, "input", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU || input.device == DeviceType::kCUDA, op,
                ": argument 'input' must be on cpu or cuda, got ", device_name(input.device));
  check_dtype(op, "input", input, dtypes);
  check_contiguous(op, "input", input);
}

// Checks that `t` is given, on the input's device, and a 1-element float32.
void check_scalar_like(const char* op, const char* name, const TensorDesc& t,
                       const TensorDesc& input) {
  check_scalar_fp32(op, name, t);
  check_device(op, name, t, input.device, input.device_index);
}

}  // namespace

void amax(const TensorDesc& input, const TensorDesc& amax_out, Stream stream) {
  constexpr const char* op = "amax";
  check_input(op, input, kHighPrecision);
  check_scalar_like(op, "amax", amax_out, input);
  check_disjoint(op, {{"amax", &amax_out}}, {{"input", &input}});
  if (input.device == DeviceType::kCUDA) {
#ifdef TL_WITH_CUDA
    return cuda::amax(input, amax_out, stream);
#else
    fail_no_cuda(op);
#endif
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::amax(input, amax_out);
}

QuantizeParams checked_quantize_params(const char* op, const TensorDesc& input, const TensorDesc& scale,
                                       const TensorDesc& output, const TensorDesc& output_t,
                                       const TensorDesc& scale_inv, const TensorDesc& amax_out,
                                       const TensorDesc& dbias, bool current_scaling, int margin, Stream stream) {
  check_input(op, input, kHighPrecision);
  check_scalar_like(op, "scale", scale, input);
  check_scalar_like(op, "scale_inv", scale_inv, input);
  TL_CHECK(output.defined() || output_t.defined(), op,
           ": at least one of 'output' and 'output_t' is required");
  TL_CHECK(margin >= 0 && margin < 127, op, ": argument 'margin' must be in [0, 127), got ",
           margin);

  QuantizeParams p{input, scale, output, output_t, scale_inv, amax_out, dbias,
                   DType::kOther, current_scaling, margin, 0, 0, stream};
  p.cols = input.ndim == 0 ? 1 : input.shape[input.ndim - 1];
  p.rows = 1;
  for (int i = 0; i + 1 < input.ndim; ++i) p.rows *= input.shape[i];

  if (output.defined()) {
    check_defined(op, "output", output);
    check_device(op, "output", output, input.device, input.device_index);
    check_dtype(op, "output", output, kFp8);
    check_contiguous(op, "output", output);
    check_same_shape(op, "input", input, "output", output);
    p.fp8_dtype = output.dtype;
  }
  if (output_t.defined()) {
    check_defined(op, "output_t", output_t);
    check_device(op, "output_t", output_t, input.device, input.device_index);
    check_dtype(op, "output_t", output_t, kFp8);
    check_contiguous(op, "output_t", output_t);
    TL_CHECK(input.ndim >= 1, op,
             ": argument 'input' must have rank >= 1 for a transposed output, got a 0-dim tensor");
    check_shape(op, "output_t", output_t, {p.cols, p.rows});
    TL_CHECK_TYPE(!output.defined() || output.dtype == output_t.dtype, op,
                  ": 'output' and 'output_t' must have the same dtype, got ",
                  dtype_name(output.dtype), " and ", dtype_name(output_t.dtype));
    p.fp8_dtype = output_t.dtype;
  }
  if (amax_out.defined()) check_scalar_like(op, "amax", amax_out, input);
  TL_CHECK(!current_scaling || amax_out.defined(), op,
           ": current scaling needs the 'amax' output");
  if (dbias.defined()) {
    check_device(op, "dbias", dbias, input.device, input.device_index);
    check_dtype(op, "dbias", dbias, kHighPrecision);
    check_contiguous(op, "dbias", dbias);
    TL_CHECK(input.ndim >= 1, op,
             ": argument 'input' must have rank >= 1 for a bias gradient, got a 0-dim tensor");
    check_shape(op, "dbias", dbias, {p.cols});
  }
  // Current scaling writes the scale it computes into 'scale' (scratch).
  const TensorDesc none;
  check_disjoint(op,
                 {{"output", &output}, {"output_t", &output_t}, {"scale_inv", &scale_inv},
                  {"amax", &amax_out}, {"dbias", &dbias}, {"scale", current_scaling ? &scale : &none}},
                 {{"input", &input}, {"scale", current_scaling ? &none : &scale}});
  return p;
}

void quantize(const TensorDesc& input, const TensorDesc& scale, const TensorDesc& output,
              const TensorDesc& output_t, const TensorDesc& scale_inv, const TensorDesc& amax_out,
              const TensorDesc& dbias, bool current_scaling, int margin, Stream stream) {
  constexpr const char* op = "quantize";
  const QuantizeParams p = checked_quantize_params(op, input, scale, output, output_t, scale_inv, amax_out, dbias,
                                                   current_scaling, margin, stream);
  if (input.device == DeviceType::kCUDA) {
#ifdef TL_WITH_CUDA
    return cuda::quantize(p);
#else
    fail_no_cuda(op);
#endif
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output, output_t});
  cpu::quantize(p);
}

void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output,
                Stream stream) {
  constexpr const char* op = "dequantize";
  check_input(op, input, kFp8);
  check_scalar_like(op, "scale_inv", scale_inv, input);
  check_defined(op, "output", output);
  check_device(op, "output", output, input.device, input.device_index);
  check_dtype(op, "output", output, kHighPrecision);
  check_contiguous(op, "output", output);
  check_same_shape(op, "input", input, "output", output);
  check_disjoint(op, {{"output", &output}}, {{"input", &input}, {"scale_inv", &scale_inv}});
  if (input.device == DeviceType::kCUDA) {
#ifdef TL_WITH_CUDA
    return cuda::dequantize(input, scale_inv, output, stream);
#else
    fail_no_cuda(op);
#endif
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output});
  cpu::dequantize(input, scale_inv, output);
}

void transpose(const TensorDesc& input, const TensorDesc& output, Stream stream) {
  constexpr const char* op = "transpose";
  check_defined(op, "input", input);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, op, ": argument 'input' must be on cpu (on a GPU torch's copy ",
                "transposes), got ", device_name(input.device));
  check_dtype(op, "input", input, kFp8);
  TL_CHECK(input.ndim == 2 || input.ndim == 3, op, ": argument 'input' must be 2-D or 3-D, got ", input.ndim,
           "-D");
  check_contiguous(op, "input", input);
  check_defined(op, "output", output);
  check_device(op, "output", output, input.device, input.device_index);
  check_dtype(op, "output", output, {input.dtype});
  check_contiguous(op, "output", output);
  if (input.ndim == 2) {
    check_shape(op, "output", output, {input.shape[1], input.shape[0]});
  } else {
    check_shape(op, "output", output, {input.shape[0], input.shape[2], input.shape[1]});
  }
  check_disjoint(op, {{"output", &output}}, {{"input", &input}});
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::transpose(input, output);
}

void bias_grad(const TensorDesc& input, const TensorDesc& dbias, Stream stream) {
  constexpr const char* op = "bias_grad";
  check_input(op, input, kHighPrecision);
  TL_CHECK_TYPE(input.device == DeviceType::kCPU, op, ": argument 'input' must be on cpu (on a GPU torch's sum ",
                "reduces), got ", device_name(input.device));
  check_defined(op, "dbias", dbias);
  check_device(op, "dbias", dbias, input.device, input.device_index);
  check_dtype(op, "dbias", dbias, kHighPrecision);
  check_contiguous(op, "dbias", dbias);
  check_shape(op, "dbias", dbias, {input.ndim > 0 ? input.size(-1) : 1});
  check_disjoint(op, {{"dbias", &dbias}}, {{"input", &input}});
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::bias_grad(input, dbias);
}

}  // namespace tl
