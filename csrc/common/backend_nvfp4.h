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
  // Grouped columnwise copies (quantize_grouped_nvfp4): quantize only the 16-row bands
  // [band_begin, band_end), reading rows outside [keep_begin, keep_end) as +0 (a group's
  // tokens masked to it); band_end < 0: every band, every row read.
  int64_t band_begin = 0, band_end = -1, keep_begin = 0, keep_end = -1;
};

struct GemmNvfp4Params {
  TensorDesc a, a_scale, b, b_scale, bias, d;  // a (m, k / 2), b (n, k / 2)
  float alpha;                                 // a_global_scale * b_global_scale
  int64_t m, n, k;
};

// Grouped NVFP4 GEMM. Forward / dgrad (wgrad false): d (total, n) rows [offs[g-1], offs[g]) =
// a's rows (total, k / 2) times b[g]^T (G, n, k / 2) [+ bias[g]], rows past offs[G-1] zero.
// Wgrad: d[g] (n, k) = a[g] (G, n, total / 2) times b[g]^T (G, k, total / 2) over the 16-token
// blocks that hold group g's tokens (every other block of a[g] and b[g] is zero).
// Scales: block scales (one per 16 values of a row) at `*_scale` + group * `*_scale_stride`;
// global decode scales per group (a's one for every group in forward).
struct GroupedGemmNvfp4Params {
  const uint8_t* a;
  const uint8_t* a_scale;
  int64_t a_group_stride, a_scale_stride;  // wgrad: bytes / scales between groups; forward: 0
  const uint8_t* b;
  const uint8_t* b_scale;
  int64_t b_group_stride, b_scale_stride;
  const float* a_global;  // (groups) decode scales
  const float* b_global;
  const int32_t* offs;
  const void* bias;  // (groups, n) or null
  void* d;
  DType out_dtype;
  int64_t groups, total, n, k;
  bool wgrad;
};

// Columnwise NVFP4 copies of `input` (total, k) masked to each group (1x16 blocks along the
// tokens): output_t (groups, k, total / 2) and packed scales (groups, 8 + k * total / 16),
// zeroed by the caller; each group's global amax and stochastic-rounding seed as given.
struct QuantizeGroupedNvfp4Params {
  TensorDesc input;
  const int32_t* offs;
  const int64_t* seeds;  // (groups) with stochastic_rounding, else null
  uint8_t* output_t;
  uint8_t* scale_t;
  int64_t groups, total, k;
  bool rht, stochastic_rounding;
};

namespace cpu {
void quantize_grouped_nvfp4(const QuantizeGroupedNvfp4Params& p);
void quantize_nvfp4(const QuantizeNvfp4Params& p);
void nvfp4_gemm(const GemmNvfp4Params& p);
void nvfp4_grouped_gemm(const GroupedGemmNvfp4Params& p);
}  // namespace cpu

}  // namespace tl
