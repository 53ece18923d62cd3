// Internal interface between the validating entry points (common/*.cpp) and
// the device kernels (cpu/*, cuda/*). Everything reaching a backend has been
// validated: dtypes, devices, shapes and layouts are as documented in the
// public headers.
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {

struct QuantizeParams {
  TensorDesc input;      // contiguous, high precision
  TensorDesc scale;      // 1-element fp32 (read, or written when current_scaling)
  TensorDesc output;     // contiguous FP8, or undefined
  TensorDesc output_t;   // contiguous FP8 (cols, rows), or undefined
  TensorDesc scale_inv;  // 1-element fp32
  TensorDesc amax;       // 1-element fp32, or undefined
  TensorDesc dbias;      // (cols), or undefined
  DType fp8_dtype;       // format of output / output_t
  bool current_scaling;
  int margin;
  int64_t rows;  // numel / cols
  int64_t cols;  // last dimension (1 for a 0-dim input)
  Stream stream;
};

struct GemmParams {
  TensorDesc a, a_scale_inv, b, b_scale_inv, bias, d, workspace;
  int64_t m, n, k;
  // Element strides of the operands: a[i, p] = a.data[i * a_row + p * a_col],
  // b[j, p] = b.data[j * b_row + p * b_col]. One of each pair is 1.
  int64_t a_row, a_col, b_row, b_col;
  bool accumulate;
  bool use_split_accumulator;
  Stream stream;
};

// The validating halves of the quantize and GEMM entries (quantize.cpp, gemm.cpp), which the fused
// forward entry (quantize_gemm.cpp) runs both of: each throws tl::Error naming `op` and the argument.
QuantizeParams checked_quantize_params(const char* op, const TensorDesc& input, const TensorDesc& scale,
                                       const TensorDesc& output, const TensorDesc& output_t,
                                       const TensorDesc& scale_inv, const TensorDesc& amax_out,
                                       const TensorDesc& dbias, bool current_scaling, int margin, Stream stream);
GemmParams checked_gemm_params(const char* op, const TensorDesc& a, const TensorDesc& a_scale_inv,
                               const TensorDesc& b, const TensorDesc& b_scale_inv, const TensorDesc& bias,
                               const TensorDesc& d, bool accumulate, bool use_split_accumulator,
                               const TensorDesc& workspace, Stream stream);

namespace cpu {
void amax(const TensorDesc& input, const TensorDesc& amax);
void quantize(const QuantizeParams& p);
void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output);
void transpose(const TensorDesc& input, const TensorDesc& output);
void bias_grad(const TensorDesc& input, const TensorDesc& dbias);
void fp8_gemm(const GemmParams& p);
// q's rowwise cast and the GEMM g whose A is q.output, one pass over the input: see quantize_gemm.h.
void quantize_fp8_gemm(const QuantizeParams& q, const GemmParams& g);
}  // namespace cpu

namespace cuda {
void amax(const TensorDesc& input, const TensorDesc& amax, Stream stream);
void quantize(const QuantizeParams& p);
void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output,
                Stream stream);
void fp8_gemm(const GemmParams& p);
}  // namespace cuda

}  // namespace tl
