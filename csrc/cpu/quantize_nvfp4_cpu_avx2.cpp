// NVFP4 quantize vector kernels for avx2 (W = 8 float lanes): quantize_nvfp4_cpu_vec.h;
// its global amaxes: quantize_nvfp4_cpu_amax.h.
#include "quantize_nvfp4_cpu_amax.h"
#include "quantize_nvfp4_cpu_vec.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

VecKernels avx2_vec_kernels() { return Vec<8>::kernels(); }
AmaxKernels avx2_amax_kernels() { return make_amax_kernels<8>(); }

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
