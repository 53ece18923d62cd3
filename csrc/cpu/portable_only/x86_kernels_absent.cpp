// The x86 kernel entry points of a portable-only build (CMake's
// TL_CPU_X86_KERNELS=OFF, the default off x86): isa_supported() reports only
// the generic path there, so the dispatchers never call these; each one says
// so if it ever is.
#include "../cpu_features.h"
#include "../gemm_block_cpu.h"
#include "../gemm_cpu.h"
#include "../gemm_nvfp4_cpu.h"
#include "../quantize_block_cpu.h"
#include "../quantize_nvfp4_cpu_amax.h"
#include "../quantize_nvfp4_cpu_vec.h"
#include "../quantize_cpu_isa.h"
#include "transformer_linear/check.h"

namespace tl {
namespace cpu {
namespace {

[[noreturn]] void absent(const char* what) {
  TL_ERROR(RuntimeError, what, ": this build has the portable CPU path only (TL_CPU_X86_KERNELS=OFF)");
}

}  // namespace

QuantizeKernels avx2_quantize_kernels() { absent("avx2_quantize_kernels"); }
QuantizeKernels avx512_quantize_kernels() { absent("avx512_quantize_kernels"); }

namespace quantize_block {
RowKernels avx2_kernels(DType, DType) { absent("quantize_block::avx2_kernels"); }
RowKernels avx512_kernels(DType, DType) { absent("quantize_block::avx512_kernels"); }
}  // namespace quantize_block

namespace gemm {
KernelSet avx2_kernels() { absent("gemm::avx2_kernels"); }
KernelSet avx512_kernels() { absent("gemm::avx512_kernels"); }
KernelSet avx512_bf16_kernels() { absent("gemm::avx512_bf16_kernels"); }
KernelSet amx_kernels() { absent("gemm::amx_kernels"); }
bool amx_usable() { return false; }
}  // namespace gemm

namespace gemm_block {
PromoteFn promote_avx2() { absent("gemm_block::promote_avx2"); }
PromoteFn promote_avx512() { absent("gemm_block::promote_avx512"); }
FoldFn fold_avx2() { absent("gemm_block::fold_avx2"); }
FoldFn fold_avx512() { absent("gemm_block::fold_avx512"); }
}  // namespace gemm_block

namespace gemm_nvfp4 {
KernelSet avx2_kernels() { absent("gemm_nvfp4::avx2_kernels"); }
KernelSet avx512_kernels() { absent("gemm_nvfp4::avx512_kernels"); }
KernelSet avx512_bf16_kernels() { absent("gemm_nvfp4::avx512_bf16_kernels"); }
KernelSet amx_kernels() { absent("gemm_nvfp4::amx_kernels"); }
}  // namespace gemm_nvfp4

namespace nvfp4 {
VecKernels avx2_vec_kernels() { absent("nvfp4::avx2_vec_kernels"); }
VecKernels avx512_vec_kernels() { absent("nvfp4::avx512_vec_kernels"); }
AmaxKernels avx2_amax_kernels() { absent("nvfp4::avx2_amax_kernels"); }
AmaxKernels avx512_amax_kernels() { absent("nvfp4::avx512_amax_kernels"); }
}  // namespace nvfp4

}  // namespace cpu
}  // namespace tl
