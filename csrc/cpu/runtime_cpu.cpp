// Process-wide CPU settings: the instruction-set path (threads: parallel.cpp).
#include <atomic>
#include <cstdlib>
#include <string>

#include "cpu_features.h"
#include "transformer_linear/check.h"
#include "transformer_linear/runtime.h"

namespace tl {
namespace {

cpu::Isa isa_from_name(const std::string& name) {
  if (name == "generic") return cpu::Isa::kGeneric;
  if (name == "avx512") return cpu::Isa::kAvx512;
  if (name == "avx512_bf16") return cpu::Isa::kAvx512Bf16;
  TL_ERROR(ValueError, "set_cpu_isa: unknown instruction set '", name,
           "'; expected auto, generic, avx512 or avx512_bf16");
}

cpu::Isa initial_isa() {
  const char* env = std::getenv("TL_CPU_ISA");
  if (env == nullptr || std::string(env).empty() || std::string(env) == "auto") {
    return cpu::best_supported_isa();
  }
  const cpu::Isa isa = isa_from_name(env);
  // An unsupported request from the environment falls back rather than
  // making the module unimportable; set_cpu_isa() raises instead.
  return cpu::isa_supported(isa) ? isa : cpu::best_supported_isa();
}

std::atomic<cpu::Isa>& active_isa() {
  static std::atomic<cpu::Isa> isa{initial_isa()};
  return isa;
}

}  // namespace

std::string cpu_isa() { return cpu::isa_name(active_isa().load()); }

void set_cpu_isa(const std::string& name) {
  if (name == "auto") {
    active_isa().store(cpu::best_supported_isa());
    return;
  }
  const cpu::Isa isa = isa_from_name(name);
  TL_CHECK(cpu::isa_supported(isa), "set_cpu_isa: this CPU does not support '", name, "'");
  active_isa().store(isa);
}

namespace cpu {
Isa current_isa() { return active_isa().load(std::memory_order_relaxed); }
}  // namespace cpu

bool built_with_cuda() {
#ifdef TL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace tl
