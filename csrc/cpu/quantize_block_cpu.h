// Internal interface of the CPU blockwise quantize: the driver
// (quantize_block_cpu.cpp: tiling, threading, scales) and the row kernels it
// runs on contiguous runs of one input row, portable (quantize_block_cpu.cpp)
// AVX2 (quantize_block_cpu_avx2.cpp) or AVX-512 (quantize_block_cpu_avx512.cpp). Both compute the scalar
// functions of fp8_math.h bitwise; only the payload of a NaN amax may differ
// (it gives the same scale).
#pragma once

#include <cstdint>

#include "transformer_linear/block_math.h"
#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {
namespace quantize_block {

/*! \brief How a block's amax becomes its scale and the scale_inv stored for it. */
struct ScaleRule {
  float fp8_max;
  int emax;  // floor(log2(fp8_max))
  bool e8m0, power_2, e8m0_floor;
};

/*!
 * \brief Scale of one block from its amax; writes the block's scale_inv (float32, or E8M0 bits
 *        when rule.e8m0) at scale_inv[index].
 */
inline float block_scale_of(float amax, const ScaleRule& rule, void* scale_inv, int64_t index) {
  if (rule.e8m0) {
    const int e = fp8::e8m0_exponent(amax, rule.fp8_max, rule.emax, rule.e8m0_floor);
    static_cast<uint8_t*>(scale_inv)[index] = static_cast<uint8_t>(e + fp8::kE8M0Bias);
    return fp8::exp2_int(-e);
  }
  const float scale = fp8::block_scale(amax, rule.fp8_max, rule.power_2);
  static_cast<float*>(scale_inv)[index] = 1.0f / scale;
  return scale;
}

/*!
 * \brief Row runs of at least this many bytes are prefetched by the row kernels (RowKernels::row_blocks),
 *        shorter ones by the driver (a tile's short runs are too short for the hardware prefetchers).
 */
constexpr int64_t kPrefetchBelowBytes = 4 << 10;

/*! \brief Whether RowKernels::row_blocks prefetches its input itself for a row of `bytes`. */
inline bool kernel_prefetches(int64_t bytes) { return bytes >= kPrefetchBelowBytes; }

/*! \brief Software prefetch of the `kBytes` (a multiple of 64) from p into all cache levels. */
template <int64_t kBytes>
inline void prefetch_lines(const void* p) {
  static_assert(kBytes % 64 == 0, "whole lines");
#pragma GCC unroll 4
  for (int64_t b = 0; b < kBytes; b += 64) {
    // GCC drops __builtin_prefetch in these loops at -O3, so on x86 it is spelled out.
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(*(static_cast<const char*>(p) + b)));
#else
    __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
#endif
  }
}

/*! \brief Row kernels of one (input dtype, FP8 dtype) pair; `x` points at input elements. */
struct RowKernels {
  /*!
   * \brief amax[j] = max(amax[j], max |x[i]| over segment j = [j * seg, min(n, (j + 1) * seg)))
   *        for every segment of [0, n) (NaN-propagating).
   */
  void (*segment_amax)(const void* x, int64_t n, int64_t seg, float* amax);
  /*!
   * \brief q[i] = quantize(x[i], scale[i / seg]) for i < n; with `stream`, non-temporal stores to q where
   *        aligned (the caller runs `fence` before the results are read).
   */
  void (*segment_cast)(const void* x, uint8_t* q, int64_t n, int64_t seg, const float* scale, bool stream);
  /*! \brief amax[i] = max(amax[i], |x[i]|) for i < n (NaN-propagating). */
  void (*column_amax)(const void* x, int64_t n, float* amax);
  /*! \brief q[i] = quantize(x[i], scale[i]) for i < n; every scale[i] positive and finite (block scales are). */
  void (*column_cast)(const void* x, uint8_t* q, int64_t n, const float* scale);
  /*! \brief dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols. */
  void (*transpose)(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                    int64_t ld_dst);
  /*!
   * \brief The 1 x seg blocks of one row in one call: for each segment j of [0, n) (as in
   *        segment_amax), its amax, its scale block_scale_of(amax, rule, scale_inv, first + j), and
   *        q[i] = quantize(x[i], scale). With `col_amax`, also col_amax[i] = max(col_amax[i], |x[i]|).
   *        With `stream`, q is written with non-temporal stores where aligned; the caller runs
   *        `fence` before the results are read.
   */
  void (*row_blocks)(const void* x, uint8_t* q, int64_t n, int64_t seg, const ScaleRule& rule, void* scale_inv,
                     int64_t first, float* col_amax, bool stream);
  /*! \brief transpose, with non-temporal stores to dst where aligned when `stream`. */
  void (*transpose_out)(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                        int64_t ld_dst, bool stream);
  /*!
   * \brief scale[j] = block_scale_of(amax[j], rule, scale_inv, j) for j < n: the scales of n blocks, their
   *        scale_inv at scale_inv[0, n) (float32, or E8M0 bytes when rule.e8m0).
   */
  void (*block_scales)(const float* amax, int64_t n, const ScaleRule& rule, void* scale_inv, float* scale);
  /*! \brief Orders the non-temporal stores of this thread before what follows (sfence, or nothing). */
  void (*fence)();
  /*!
   * \brief dst[r * ld_dst + c] = src[r * ld_src + c] for r < rows, c < cols, with non-temporal stores where
   *        aligned when `stream`. Null where the path has none: the driver then casts 128 x 128 blocks
   *        straight into output and transposes output_t from it.
   */
  void (*copy_out)(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld_dst,
                   bool stream);
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
