// AVX-512 range kernels of the CPU quantize family (quantize_cpu_avx512.cpp).
// quantize_cpu.cpp owns threading and calls these only when
// cpu::current_isa() != Isa::kGeneric. Results are bitwise those of the
// scalar functions in fp8_math.h, except the payload of a NaN amax.
#pragma once

#include <cstdint>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {
namespace avx512 {

// max |x[i]| over [begin, end) of a float32/bfloat16/float16 array (NaN-propagating).
float amax(DType in, const void* x, int64_t begin, int64_t end);

// q[i] = quantize(x[i] * scale) for i in [begin, end); returns max |x| over the
// range when `want_amax` (else 0). `stream` uses non-temporal stores for q,
// for outputs too large to stay in cache.
float cast(DType in, DType out, const void* x, uint8_t* q, float scale, int64_t begin, int64_t end,
           bool want_amax, bool stream);

// Rows cast_transpose casts at a time before transposing them.
constexpr int64_t kTransposeStripeRows = 64;

// Rows [r0, r1) of the (rows, cols) input: q (row-major, may be null) and
// qt (cols, rows). Returns max |x| over those rows. When q is null, `scratch`
// holds kTransposeStripeRows * cols bytes (the caller allocates it: this runs
// inside parallel regions, where an allocation failure must not be possible).
float cast_transpose(DType in, DType out, const void* x, uint8_t* q, uint8_t* qt, uint8_t* scratch,
                     float scale, int64_t rows, int64_t cols, int64_t r0, int64_t r1);

// y[i] = store(load(q[i]) * scale_inv) for i in [begin, end).
void dequantize(DType in, DType out, const uint8_t* q, float scale_inv, void* y, int64_t begin,
                int64_t end);

}  // namespace avx512
}  // namespace cpu
}  // namespace tl
