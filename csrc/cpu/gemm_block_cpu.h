// Internal interface of the block-scaled CPU GEMM: the driver (gemm_block_cpu.cpp)
// and its AVX-512 promotion step (gemm_block_cpu_avx512.cpp).
#pragma once

#include <cstdint>

namespace tl {
namespace cpu {
namespace gemm_block {

/*!
 * \brief acc[i * ld + j] += part[i * ld + j] * (sa[i] * sb[j]) for i < rows, j < cols:
 *        one K-block's partial sums promoted into the fp32 total with their block scales.
 */
using PromoteFn = void (*)(const float* part, const float* sa, const float* sb, int rows, int cols,
                           int ld, float* acc);

/*! \brief AVX-512F promotion; call only when the CPU has it. */
PromoteFn promote_avx512();

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
