// Which instruction-set path the CPU kernels take.
//
// A path can be forced (TL_CPU_ISA at load time, set_cpu_isa() later).
// Otherwise it is measured: feature flags say what a CPU can run, not what
// it runs fastest (vdpbf16ps runs at twice the fp32-FMA rate on AMD Zen 4
// and at about half of it on Sapphire Rapids without AMX tiles), so the
// first call that needs the path times a small FP8 GEMM on every supported
// path and keeps the fastest for the life of the process.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cpu_features.h"
#include "gemm_cpu.h"
#include "transformer_linear/check.h"
#include "transformer_linear/runtime.h"

namespace tl {
namespace cpu {
namespace {

constexpr int kProbeRounds = 5;  // best of 5 interleaved runs: robust to a busy machine

const char* const kExpected = "expected auto, generic, avx2, avx512 or avx512_bf16, in any case";

// TL_CPU_ISA, read once. A value that cannot be honoured falls back to the
// measured choice, with a warning the Python module emits once at import.
struct EnvRequest {
  std::string value;
  std::optional<Isa> isa;
  std::string warning;
};

const EnvRequest& env_request() {
  static const EnvRequest request = [] {
    EnvRequest r;
    const char* env = std::getenv("TL_CPU_ISA");
    if (env == nullptr) return r;
    r.value = env;
    if (!parse_isa(r.value, &r.isa)) {
      r.warning = detail::concat("TL_CPU_ISA='", r.value, "' is not an instruction set (", kExpected,
                                 "): ignoring it and choosing the fastest supported path");
    } else if (r.isa && !isa_supported(*r.isa)) {
      r.warning = detail::concat("TL_CPU_ISA='", r.value,
                                 "': this CPU does not support it; ignoring it and choosing the "
                                 "fastest supported path");
      r.isa.reset();
    }
    return r;
  }();
  return request;
}

// The forced path, encoded as (isa << 1) | from_environment; -1 when none is.
int encode(Isa isa, bool from_env) { return (static_cast<int>(isa) << 1) | (from_env ? 1 : 0); }

std::atomic<int>& forced() {
  static std::atomic<int> state{env_request().isa ? encode(*env_request().isa, true) : -1};
  return state;
}

IsaChoice measure() {
  IsaChoice c;
  const std::vector<Isa> paths = supported_isas();
  if (paths.size() == 1) {
    c.isa = paths[0];
    c.source = "only_supported";
    c.reason = detail::concat("only ", isa_name(c.isa), " is supported on this CPU");
    return c;
  }
  c.timed = paths;
  c.seconds = gemm::time_paths(paths, kProbeRounds);
  size_t best = 0;
  for (size_t i = 1; i < paths.size(); ++i) {
    if (c.seconds[i] <= c.seconds[best]) best = i;  // ties go to the more specialised path
  }
  c.isa = paths[best];
  c.source = "measured";
  std::string timings;
  for (size_t i = paths.size(); i-- > 0;) {
    char ms[32];
    std::snprintf(ms, sizeof(ms), "%.3f", c.seconds[i] * 1e3);
    timings += detail::concat(timings.empty() ? "" : ", ", isa_name(paths[i]), " (",
                              gemm::kernel_name(paths[i]), ") ", ms, " ms");
  }
  c.reason = detail::concat("fastest on a ", gemm::probe_shape(), " FP8 GEMM, best of ",
                            kProbeRounds, " single-threaded runs: ", timings);
  return c;
}

// Measured once, at the first call that needs it; thread-safe (a static local).
const IsaChoice& measured() {
  static const IsaChoice choice = measure();
  return choice;
}

}  // namespace

Isa current_isa() {
  const int f = forced().load(std::memory_order_relaxed);
  return f >= 0 ? static_cast<Isa>(f >> 1) : measured().isa;
}

IsaChoice isa_choice() {
  const int f = forced().load(std::memory_order_relaxed);
  if (f < 0) {
    IsaChoice c = measured();
    if (!env_request().warning.empty()) c.reason = env_request().warning + "; " + c.reason;
    return c;
  }
  IsaChoice c;
  c.isa = static_cast<Isa>(f >> 1);
  c.source = "forced";
  c.reason = (f & 1) ? detail::concat("forced by TL_CPU_ISA='", env_request().value, "'")
                     : detail::concat("forced by set_cpu_isa('", isa_name(c.isa), "')");
  return c;
}

}  // namespace cpu

namespace {

// The path `name` asks for (nullopt: automatic); ValueError if unknown.
std::optional<cpu::Isa> requested_isa(const std::string& name, const char* what) {
  std::optional<cpu::Isa> isa;
  TL_CHECK(cpu::parse_isa(name, &isa), what, ": unknown instruction set '", name, "'; ",
           cpu::kExpected);
  return isa;
}

}  // namespace

std::string cpu_isa() { return cpu::isa_name(cpu::current_isa()); }

void set_cpu_isa(const std::string& name) {
  const std::optional<cpu::Isa> isa = requested_isa(name, "set_cpu_isa");
  if (!isa) {
    cpu::forced().store(-1);
    return;
  }
  TL_CHECK(cpu::isa_supported(*isa), "set_cpu_isa: this CPU does not support '", name, "'");
  cpu::forced().store(cpu::encode(*isa, false));
}

bool cpu_isa_supported(const std::string& name) {
  const std::optional<cpu::Isa> isa = requested_isa(name, "cpu_isa_supported");
  return !isa || cpu::isa_supported(*isa);
}

CpuIsaInfo cpu_isa_info() {
  const cpu::IsaChoice c = cpu::isa_choice();
  CpuIsaInfo info;
  info.isa = cpu::isa_name(c.isa);
  info.source = c.source;
  info.reason = c.reason;
  info.gemm_kernel = cpu::gemm::kernel_name(c.isa);
  for (cpu::Isa isa : cpu::supported_isas()) info.supported.push_back(cpu::isa_name(isa));
  for (size_t i = 0; i < c.timed.size(); ++i) {
    info.probe_seconds.emplace_back(cpu::isa_name(c.timed[i]), c.seconds[i]);
  }
  info.probe_shape = cpu::gemm::probe_shape();
  return info;
}

std::string cpu_isa_env_warning() { return cpu::env_request().warning; }

}  // namespace tl
