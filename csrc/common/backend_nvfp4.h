// Internal interface between the NVFP4 entry points (common/*_nvfp4.cpp) and the CPU
// kernels (cpu/*_nvfp4_cpu.cpp). Everything here is validated.
#pragma once

#include <cstdint>
#include <vector>

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
  // Where output_t / scale_t put the columnwise block of input rows [r0, r0 + 16) of column c:
  // at value t_pos(c, r0) (its scale at t_pos / 16) of rows t_ld long (0: m) whose value 0 is
  // input row t_row0 (a grouped compact copy holds its bands only). Random bits do not depend
  // on it: they stay those of the element's index c * m + r in the whole copy.
  int64_t t_ld = 0, t_row0 = 0;
  int64_t t_pos(int64_t c, int64_t r0) const { return c * (t_ld > 0 ? t_ld : m) + (r0 - t_row0); }
};

struct GemmNvfp4Params {
  TensorDesc a, a_scale, b, b_scale, bias, d;  // a (m, k / 2), b (n, k / 2)
  float alpha;                                 // a_global_scale * b_global_scale
  int64_t m, n, k;
};

// The 16-token bands holding group g's tokens [start, end) (none for an empty group):
// tokens [band_begin, band_end) = [floor(start / 16) * 16, ceil(end / 16) * 16), stored in a
// compact grouped copy at token `column` (the bands of the groups before it, one after another).
struct GroupBands {
  int64_t start, end, band_begin, band_end, column;
};

// Every group's bands from `offs` (validated). The quantize and the wgrad GEMM both place the
// groups with it; ops/grouped_nvfp4.py computes the same on the device.
inline std::vector<GroupBands> group_bands(const int32_t* offs, int64_t groups) {
  constexpr int64_t block = 16;
  std::vector<GroupBands> bands(static_cast<size_t>(groups));
  int64_t column = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t start = g == 0 ? 0 : offs[g - 1], end = offs[g];
    const int64_t b0 = start / block * block, b1 = start == end ? b0 : (end + block - 1) / block * block;
    bands[g] = {start, end, b0, b1, column};
    column += b1 - b0;
  }
  return bands;
}

// Tokens a compact grouped copy of `total` tokens in `groups` groups holds, an upper bound of the
// groups' bands together (each boundary between groups adds at most one shared band): a size
// fixed by the shapes, so that no one reads offs to allocate it.
inline int64_t compact_tokens(int64_t total, int64_t groups) {
  return groups == 0 ? 0 : total + 16 * (groups - 1);
}

// Grouped NVFP4 GEMM. Forward / dgrad (wgrad false): d (total, n) rows [offs[g-1], offs[g]) =
// a's rows (total, k / 2) times b[g]^T (G, n, k / 2) [+ bias[g]], rows past offs[G-1] zero.
// Scales: block scales (one per 16 values of a row) at `*_scale` + group * `*_scale_stride`;
// global decode scales per group (a's one for every group in forward).
// Wgrad: d[g] (n, k) = a (n, capacity / 2) times b^T (k, capacity / 2), compact grouped copies,
// over group g's bands (group_bands): columns [column, column + band_end - band_begin) of both;
// block scales (rows, capacity / 16) at `*_scale`; the group strides unused.
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
  int64_t capacity;  // wgrad: the compact copies' tokens (compact_tokens)
  bool wgrad;
};

// Columnwise NVFP4 copies of `input` (total, k) masked to each group (1x16 blocks along the
// tokens), compact: each group's bands (group_bands) of its copy in output_t (k, capacity / 2)
// and block scales (k, capacity / 16), zeroed by the caller, with each group's packed global
// decode scale (8 elements) in global_t (groups, 8); each group's global amax and
// stochastic-rounding seed as given.
struct QuantizeGroupedNvfp4Params {
  TensorDesc input;
  const int32_t* offs;
  const int64_t* seeds;  // (groups) with stochastic_rounding, else null
  uint8_t* output_t;
  uint8_t* scale_t;
  uint8_t* global_t;
  int64_t groups, total, k, capacity;
  bool rht, stochastic_rounding;
};

namespace cpu {
void quantize_grouped_nvfp4(const QuantizeGroupedNvfp4Params& p);
void quantize_nvfp4(const QuantizeNvfp4Params& p);
void nvfp4_gemm(const GemmNvfp4Params& p);
void nvfp4_grouped_gemm(const GroupedGemmNvfp4Params& p);
}  // namespace cpu

}  // namespace tl
