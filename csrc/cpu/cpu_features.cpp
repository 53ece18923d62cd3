#include "cpu_features.h"

namespace tl {
namespace cpu {

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kGeneric:
      return true;
    case Isa::kAvx512:
#if defined(__x86_64__) || defined(__i386__)
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
#else
      return false;
#endif
    case Isa::kAvx512Bf16:
#if defined(__x86_64__) || defined(__i386__)
      return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512bf16");
#else
      return false;
#endif
  }
  return false;
}

Isa best_supported_isa() {
  if (isa_supported(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  return Isa::kGeneric;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    default: return "generic";
  }
}

}  // namespace cpu
}  // namespace tl
