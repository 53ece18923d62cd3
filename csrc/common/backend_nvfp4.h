// Internal interface between the NVFP4 entry points (common/*_nvfp4.cpp) and the CPU
// kernels (cpu/*_nvfp4_cpu.cpp). Everything here is validated.
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

struct QuantizeNvfp4Params {
  TensorDesc input;                   // contiguous (m, k), high precision
  TensorDesc output, scale;           // (m, k / 2) uint8 + (m, k / 16) e4m3, or undefined
  TensorDesc output_t, scale_t;       // (k, m / 2) uint8 + (k, m / 16) e4m3, or undefined
  float s_enc, s_enc_t;               // global encode scales (rowwise, columnwise)
  int64_t m, k;
  bool scaling_2d, rht, stochastic_rounding;
  uint64_t seed, offset;
};

struct GemmNvfp4Params {
  TensorDesc a, a_scale, b, b_scale, bias, d;  // a (m, k / 2), b (n, k / 2)
  float alpha;                                 // a_global_scale * b_global_scale
  int64_t m, n, k;
};

namespace cpu {
void quantize_nvfp4(const QuantizeNvfp4Params& p);
void nvfp4_gemm(const GemmNvfp4Params& p);
}  // namespace cpu

}  // namespace tl
