// NVFP4 quantize vector kernels for avx512 (W = 16 float lanes): quantize_nvfp4_cpu_vec.h;
// its global amaxes: quantize_nvfp4_cpu_amax.h.
#include "quantize_nvfp4_cpu_amax.h"
#include "quantize_nvfp4_cpu_vec.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

VecKernels avx512_vec_kernels() { return Vec<16>::kernels(); }
AmaxKernels avx512_amax_kernels() { return make_amax_kernels<16>(); }

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
