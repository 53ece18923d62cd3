// Internal interface of the NVFP4 CPU GEMM: the driver (gemm_nvfp4_cpu.cpp: blocking,
// decoding while packing, threading, epilogue) and the micro-kernels of each path,
// portable (gemm_nvfp4_cpu.cpp), AVX2 (gemm_nvfp4_cpu_avx2.cpp), AVX-512 fp32 and
// AVX512_BF16 (gemm_nvfp4_cpu_avx512.cpp), AMX (gemm_nvfp4_cpu_amx_avx512.cpp). All give
// the same bits: the packed operands
// hold E2M1 values times their E4M3 block scales (exact in fp32 and in bf16), so inside
// a 16-element K block every partial sum is exact, in any order, fused or not, and the
// only rounding is the addition of each block's sum to the fp32 total, in K order.
//
// Packed layout (as gemm_cpu.h): a block of `rows` x `kc` is packed into micro-panels of
// R rows, each kc * R elements, k-groups of `kpack` consecutive k stored row after row:
//   panel[g][r][t] = value(src[r, g * kpack + t])
// kpack = 1 for fp32 elements, 2 for bf16 pairs (vdpbf16ps, AMX's B tiles), 16 for AMX's A tiles (one
// 16-k block of a row in one tile row). Rows past `rows` are zero.
#pragma once

#include <cstdint>

#include "gemm_cpu.h"
#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {

/*! \brief Width of a K block (one E4M3 scale per 16 E2M1 values). */
constexpr int kBlockK = 16;

/*!
 * \brief For each 16-k block b of the kc (a multiple of 16) packed k values, in order:
 *        total[i * ld_total + j] += sum_{k in b} a[i, k] * b[j, k] (the block's sum from
 *        zero, then one fp32 addition), for one full mr x nr tile.
 */
using MicroFn = void (*)(int64_t kc, const void* a, const void* b, float* total, int64_t ld_total);

/*!
 * \brief Decodes rows [row0, row0 + rows) x k [pc, pc + kc) (kc a multiple of 16) of a packed
 *        NVFP4 operand (row i's codes at data + i * ld / 2, its E4M3 scales at scale + i * ld / 16),
 *        block scales applied, into micro-panels of r rows; rows up to the next multiple of r are zero.
 */
using PackFn = void (*)(const uint8_t* data, const uint8_t* scale, int64_t ld, int64_t row0, int64_t rows,
                        int64_t pc, int64_t kc, int r, void* dst);

/*! \brief The micro-kernel, packing and block sizes of one instruction-set path. */
struct KernelSet {
  int mr, nr;          // register tile (rows of A, rows of B)
  int kpack;           // k values per packed group: 1 (fp32) or 2 (bf16 pairs)
  int64_t kc, mc, nc;  // cache blocks: k per pass (a multiple of 16), rows of A, rows of B
  MicroFn micro;
  PackFn pack = nullptr;  // null: the portable packing (gemm_nvfp4_cpu.cpp)
  PackFn pack_a = nullptr;  // A's packing where it is not `pack` (AMX: kpack 16, a tile row a block)
  void (*prepare)() = nullptr;  // per thread, before a run of micro-kernel calls (AMX tile config)
  bool prefetch_next_b = true;  // as gemm::KernelSet::prefetch_next_b
  gemm::StoreTiles store{};     // the epilogue compiled for this path (empty: the portable one)

  /*! \brief Bytes of one packed element: fp32 for kpack 1, else bf16. */
  int elem_bytes() const { return kpack == 1 ? 4 : 2; }
};

/*! \brief Portable fp32 path (gemm_nvfp4_cpu.cpp). */
KernelSet generic_kernels();
/*! \brief AVX2 + FMA fp32 path; call only when the CPU has them. */
KernelSet avx2_kernels();
/*! \brief AVX-512F fp32 path; call only when the CPU has it. */
KernelSet avx512_kernels();
/*! \brief AVX512_BF16 vdpbf16ps path; call only when the CPU has it. */
KernelSet avx512_bf16_kernels();
/*! \brief AMX-BF16 path of the avx512_bf16 ISA; call only where gemm::amx_usable(). */
KernelSet amx_kernels();
/*! \brief The path of the current ISA (TL_CPU_ISA / the CPU's features). */
KernelSet current_kernels();

/*!
 * \brief One validated GEMM d = (A @ B^T) * alpha [+ bias] on raw pointers: A rows of `k`
 *        packed values starting `a_ld` values apart (a_ld / 2 bytes, a_ld / 16 scales), the
 *        same for B; d (m, n) contiguous, bias (n) or null, both of the output dtype. A
 *        sub-range of K (a column offset folded into the pointers, k < ld) contracts those
 *        K blocks only, each output element as the full GEMM sums the same blocks.
 */
struct GemmView {
  const uint8_t* a;
  const uint8_t* a_scale;
  int64_t a_ld;
  const uint8_t* b;
  const uint8_t* b_scale;
  int64_t b_ld;
  const void* bias;
  void* d;
  float alpha;
  int64_t m, n, k;
};

/*!
 * \brief Run one GemmView with the kernels `ks` on the calling thread's thread count
 *        (tl::get_num_threads()); every element's bits are independent of m, n and the
 *        thread count.
 */
void gemm(const GemmView& v, DType out, const KernelSet& ks);

}  // namespace gemm_nvfp4
}  // namespace cpu
}  // namespace tl
