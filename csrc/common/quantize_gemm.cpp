// Fused forward entry point: validate as quantize and fp8_gemm do, then run
// the fused CPU kernel, or the two CUDA kernels in turn.
#include "transformer_linear/quantize_gemm.h"

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "backend.h"
#include "validate.h"

namespace tl {

void quantize_fp8_gemm(const TensorDesc& input, const TensorDesc& scale, const TensorDesc& output,
                       const TensorDesc& scale_inv, const TensorDesc& amax, bool current_scaling, int margin,
                       const TensorDesc& b, const TensorDesc& b_scale_inv, const TensorDesc& bias,
                       const TensorDesc& d, bool use_split_accumulator, const TensorDesc& workspace,
                       Stream stream) {
  constexpr const char* op = "quantize_fp8_gemm";
  const TensorDesc none;
  check_defined(op, "output", output);
  const QuantizeParams q = checked_quantize_params(op, input, scale, output, none, scale_inv, amax, none,
                                                   current_scaling, margin, stream);
  TL_CHECK(input.ndim == 2, op, ": argument 'input' must be 2-D (M, K), got rank ", input.ndim);
  // The quantize's outputs are the GEMM's A and a_scale_inv: the GEMM's checks cover the rest, and
  // its output may alias none of the quantize's tensors either.
  const GemmParams g = checked_gemm_params(op, output, scale_inv, b, b_scale_inv, bias, d, /*accumulate=*/false,
                                           use_split_accumulator, workspace, stream);
  // Current scaling writes its scale into 'scale' (scratch): an output then.
  check_disjoint(op,
                 {{"d", &d}, {"output", &output}, {"scale_inv", &scale_inv}, {"amax", &amax},
                  {"scale", current_scaling ? &scale : &none}},
                 {{"input", &input}, {"scale", current_scaling ? &none : &scale}, {"b", &b},
                  {"b_scale_inv", &b_scale_inv}, {"bias", &bias}});
  if (input.device == DeviceType::kCUDA) {
#ifdef TL_WITH_CUDA
    cuda::quantize(q);
    return cuda::fp8_gemm(g);
#else
    fail_no_cuda(op);
#endif
  }
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output, d});
  cpu::quantize_fp8_gemm(q, g);
}

}  // namespace tl
