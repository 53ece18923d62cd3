// Runtime CPU-feature detection and the instruction-set paths of the CPU kernels.
#pragma once

namespace tl {
namespace cpu {

/*! \brief Code paths, from most portable to fastest. */
enum class Isa : int {
  kGeneric = 0,     //!< portable C++ (whatever the compiler's baseline target allows)
  kAvx512 = 1,      //!< AVX-512F/BW/VL/DQ + FMA, fp32 micro-kernels
  kAvx512Bf16 = 2,  //!< kAvx512 plus AVX512_BF16 (exact bf16 dot products for the GEMM)
};

bool isa_supported(Isa isa);
Isa best_supported_isa();
const char* isa_name(Isa isa);

/*! \brief The path the kernels take now (TL_CPU_ISA / set_cpu_isa, else the best supported). */
Isa current_isa();

}  // namespace cpu
}  // namespace tl
