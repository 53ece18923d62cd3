// Vector range kernels of the CPU quantize family, one set per instruction-set
// path (quantize_cpu_avx2.cpp, quantize_cpu_avx512.cpp; both built from
// quantize_cpu_vec.h). quantize_cpu.cpp owns threading and picks the set of
// cpu::current_isa(). Results are bitwise those of the scalar functions in
// fp8_math.h, except the payload of a NaN amax.
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {

// cast_transpose casts up to kTransposeStripeRows rows at a time before
// transposing them (a whole number of 64-byte lines of each transposed output
// row: the more rows a stripe has, the fewer times each output page is
// visited, and with 4 KiB pages each visit is a TLB miss).
constexpr int64_t kTransposeStripeRows = 256;

// Row stride of cast_transpose's scratch stripe for `cols` columns: whole
// lines plus one, so that the stripe's rows fall into different cache sets
// whatever `cols` is, and a 16-byte load at any column < cols stays inside.
inline int64_t transpose_scratch_ld(int64_t cols) { return (cols + 63) / 64 * 64 + 64; }

// Rows of a stripe for `cols` columns: a multiple of 64, as many as keep the
// stripe within about 1 MiB (the L2 of most x86 cores), 64 at least.
inline int64_t transpose_stripe_rows(int64_t cols) {
  const int64_t fit = (int64_t{1} << 20) / transpose_scratch_ld(cols) / 64 * 64;
  return fit < 64 ? 64 : (fit > kTransposeStripeRows ? kTransposeStripeRows : fit);
}

/*! \brief The quantize range kernels of one instruction-set path. */
struct QuantizeKernels {
  /*! \brief max |x[i]| over [begin, end) of a float32/bfloat16/float16 array (NaN-propagating). */
  float (*amax)(DType in, const void* x, int64_t begin, int64_t end);
  /*!
   * \brief q[i] = quantize(x[i] * scale) for i in [begin, end); returns max |x| over the range
   *        when `want_amax` (else 0). `stream` uses non-temporal stores for q, for outputs too
   *        large to stay in cache.
   */
  float (*cast)(DType in, DType out, const void* x, uint8_t* q, float scale, int64_t begin,
                int64_t end, bool want_amax, bool stream);
  /*!
   * \brief Rows [r0, r1) of the (rows, cols) input: q (row-major, may be null) and qt
   *        (cols, rows). Returns max |x| over those rows. `scratch` holds
   *        min(transpose_stripe_rows(cols), rows) * transpose_scratch_ld(cols) bytes (the caller allocates it:
   *        this runs inside parallel regions, where an allocation failure must not be
   *        possible). `stream` writes whole output lines with non-temporal stores, for
   *        outputs too large to stay in cache.
   */
  float (*cast_transpose)(DType in, DType out, const void* x, uint8_t* q, uint8_t* qt,
                          uint8_t* scratch, float scale, int64_t rows, int64_t cols, int64_t r0,
                          int64_t r1, bool stream);
  /*! \brief y[i] = store(load(q[i]) * scale_inv) for i in [begin, end). */
  void (*dequantize)(DType in, DType out, const uint8_t* q, float scale_inv, void* y,
                     int64_t begin, int64_t end);
  /*! \brief dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols (bytes). */
  void (*transpose)(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                    int64_t ld_dst);
};

/*! \brief AVX2 + FMA + F16C kernels; call only when the CPU has them. */
QuantizeKernels avx2_quantize_kernels();
/*! \brief AVX-512 kernels; call only when the CPU has them. */
QuantizeKernels avx512_quantize_kernels();

}  // namespace cpu
}  // namespace tl
