// Internal interface of the NVFP4 CPU GEMM: the driver (gemm_nvfp4_cpu.cpp: tiling,
// decoding, threading, epilogue) and its micro-kernel, portable (gemm_nvfp4_cpu.cpp) or
// AVX2 (gemm_nvfp4_cpu_avx2.cpp). Both give the same bits: inside a 16-element K block
// every partial sum is exact in float32, so a fused multiply-add rounds nothing either.
#pragma once

#include <cstdint>

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {

/*! \brief Rows and columns of output one micro-kernel call computes. */
constexpr int kMR = 4, kNR = 8;
/*! \brief Panel strides: decoded A holds kMC rows per K, decoded B kNC columns per K. */
constexpr int64_t kMC = 64, kNC = 64;

/*!
 * \brief acc[(i0 + i) * ld_acc + j0 + j] += each 16-element K block of
 *        sum_k a[k * kMC + i0 + i] * b[k * kNC + j0 + j], block by block in K order
 *        (each block's sum starting from zero), for i < kMR, j < kNR, k < kc.
 */
using MicroKernelFn = void (*)(const float* a, const float* b, int64_t kc, int64_t i0, int64_t j0,
                               float* acc, int64_t ld_acc);

/*! \brief AVX2 + FMA micro-kernel; call only when the CPU has them. */
MicroKernelFn micro_kernel_avx2();

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
