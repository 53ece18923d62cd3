// CPU fused forward: a tensorwise quantize whose cast runs inside the FP8
// GEMM that reads its output. The quantize pass on its own reads the
// high-precision input and writes the FP8 copy to memory, and the GEMM then
// reads that copy back when it packs A; here each block of A's rows is cast by
// the thread about to pack it, so the packing reads rows still in cache, and
// one parallel region (with its wait for the slowest thread) is gone. The
// bits are those of quantize then fp8_gemm: the same cast kernels, the same
// GEMM. Current scaling's amax pass still runs first: the scale must be known
// before the first row is cast.
#include "../common/backend.h"
#include "gemm_cpu.h"
#include "quantize_rows_cpu.h"

namespace tl {
namespace cpu {

void quantize_fp8_gemm(const QuantizeParams& q, const GemmParams& g) {
  RowCast cast(q);  // the scale, and scale_inv (the GEMM's a_scale_inv)
  gemm::fp8_gemm_filling_a(g, [&cast](int64_t r0, int64_t r1) { cast.cast_rows(r0, r1); });
  cast.finish();
}

}  // namespace cpu
}  // namespace tl
