#include "cpu_features.h"

#include <algorithm>
#include <cctype>

namespace tl {
namespace cpu {
namespace {

constexpr Isa kAllIsas[] = {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};

}  // namespace

bool isa_supported(Isa isa) {
#if !TL_CPU_X86_KERNELS
  // A portable-only build (not x86, or TL_CPU_X86_KERNELS=OFF) has no other path.
  return isa == Isa::kGeneric;
#endif
  switch (isa) {
    case Isa::kGeneric:
      return true;
    case Isa::kAvx2:
#if defined(__x86_64__) || defined(__i386__)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(__x86_64__) || defined(__i386__)
      // The AVX-512 files are compiled with F16C too (vcvtph2ps on fp16 inputs).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

bool parse_isa(const std::string& name, std::optional<Isa>* isa) {
  const auto first = name.find_first_not_of(" \t"), last = name.find_last_not_of(" \t");
  std::string key = first == std::string::npos ? "" : name.substr(first, last - first + 1);
  std::transform(key.begin(), key.end(), key.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (key.empty() || key == "auto") {
    isa->reset();
    return true;
  }
  for (Isa candidate : kAllIsas) {
    if (key == isa_name(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

}  // namespace cpu
}  // namespace tl
