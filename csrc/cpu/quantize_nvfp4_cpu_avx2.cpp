// NVFP4 quantize vector kernels for avx2 (W = 8 float lanes): quantize_nvfp4_cpu_vec.h.
#include "quantize_nvfp4_cpu_vec.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

VecKernels avx2_vec_kernels() { return Vec<8>::kernels(); }

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
