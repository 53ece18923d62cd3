// Internal interface of the CPU blockwise quantize: the driver
// (quantize_block_cpu.cpp: tiling, threading, scales) and the row kernels it
// runs on contiguous runs of one input row, portable (quantize_block_cpu.cpp)
// AVX2 (quantize_block_cpu_avx2.cpp) or AVX-512 (quantize_block_cpu_avx512.cpp). Both compute the scalar
// functions of fp8_math.h bitwise; only the payload of a NaN amax may differ
// (it gives the same scale).
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {
namespace quantize_block {

/*! \brief Row kernels of one (input dtype, FP8 dtype) pair; `x` points at input elements. */
struct RowKernels {
  /*!
   * \brief amax[j] = max(amax[j], max |x[i]| over segment j = [j * seg, min(n, (j + 1) * seg)))
   *        for every segment of [0, n) (NaN-propagating).
   */
  void (*segment_amax)(const void* x, int64_t n, int64_t seg, float* amax);
  /*! \brief q[i] = quantize(x[i], scale[i / seg]) for i < n. */
  void (*segment_cast)(const void* x, uint8_t* q, int64_t n, int64_t seg, const float* scale);
  /*! \brief amax[i] = max(amax[i], |x[i]|) for i < n (NaN-propagating). */
  void (*column_amax)(const void* x, int64_t n, float* amax);
  /*! \brief q[i] = quantize(x[i], scale[i]) for i < n. */
  void (*column_cast)(const void* x, uint8_t* q, int64_t n, const float* scale);
  /*! \brief dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols. */
  void (*transpose)(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                    int64_t ld_dst);
};

/*! \brief Portable kernels. */
RowKernels generic_kernels(DType in, DType out);

/*! \brief AVX2 kernels; call only when the CPU has AVX2, FMA and F16C. */
RowKernels avx2_kernels(DType in, DType out);

/*! \brief AVX-512 kernels; call only when the CPU has AVX-512 (BW, VL, F16C). */
RowKernels avx512_kernels(DType in, DType out);

}  // namespace quantize_block
}  // namespace cpu
}  // namespace tl
