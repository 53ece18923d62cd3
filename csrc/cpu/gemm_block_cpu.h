// Internal interface of the block-scaled CPU GEMM: the driver (gemm_block_cpu.cpp)
// and its vector promotion and folding steps (gemm_block_cpu_avx2.cpp,
// gemm_block_cpu_avx512.cpp).
#pragma once

#include <cstdint>

namespace tl {
namespace cpu {
namespace gemm_block {

/*!
 * \brief acc[i * ld_acc + j] (+)= part[i * ld_part + j] * (sa[i] * sb[j]) for i < rows, j < cols:
 *        one K-block's partial sums promoted into the fp32 total with their block scales
 *        (`first`: the total starts here, no addition).
 */
using PromoteFn = void (*)(const float* part, int ld_part, const float* sa, const float* sb,
                           int rows, int cols, bool first, float* acc, int64_t ld_acc);

/*! \brief Portable promotion (gemm_block_cpu.cpp). */
void promote_generic(const float* part, int ld_part, const float* sa, const float* sb, int rows,
                     int cols, bool first, float* acc, int64_t ld_acc);

/*! \brief AVX2 promotion; call only when the CPU has it. */
PromoteFn promote_avx2();
/*! \brief AVX-512F promotion; call only when the CPU has it. */
PromoteFn promote_avx512();

/*!
 * \brief Multiply a packed micro-panel (gemm_cpu.h layout, kpack k values per group) by
 *        power-of-two block scales in place: element (row, k) gains exponent
 *        row_exp[(k / block_k) * r + row]. Exact: the caller checked that every nonzero
 *        finite product is a normal number; zeros, infinities and NaNs are left alone.
 *
 * \param elem_bytes 2 (bf16 panels) or 4 (fp32 panels).
 */
using FoldFn = void (*)(void* panel, int elem_bytes, int64_t kc, int r, int kpack,
                        const int32_t* row_exp, int64_t block_k);

/*!
 * \brief Exponents one folded panel may need: (KC / smallest K-block + 1) x panel rows, at most
 *        (2048 / 32 + 1) x 32 (AMX's KC and tile, MXFP8's K-block) or (512 / 32 + 1) x 64.
 */
constexpr int64_t kMaxFoldExps = 65 * 32;

/*! \brief Portable folding (gemm_block_cpu.cpp). */
void fold_generic(void* panel, int elem_bytes, int64_t kc, int r, int kpack, const int32_t* row_exp,
                  int64_t block_k);

/*! \brief AVX2 folding of fp32 panels (others go to fold_generic); call only when the CPU has it. */
FoldFn fold_avx2();
/*! \brief AVX-512BW folding of bf16 panels (others go to fold_generic); call only when the CPU has it. */
FoldFn fold_avx512();

}  // namespace gemm_block
}  // namespace cpu
}  // namespace tl
