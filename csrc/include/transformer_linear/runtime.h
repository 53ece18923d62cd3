/*!
 * \file runtime.h
 * \brief Settings of the CPU kernels and facts about the build.
 */
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tl {

/*!
 * \brief Threads the CPU kernels use in the call in progress on the calling thread.
 *
 * Every CPU call carries its thread count in its launch argument (the
 * Python layer passes torch.get_num_threads()); the entry point installs it
 * for the calling thread only. Outside a call, and for calls that pass 0,
 * this is OpenMP's thread count of the calling thread (omp_get_max_threads()).
 */
int get_num_threads();

/*!
 * \brief Set OpenMP's thread count of the calling thread (n >= 1): the count of
 *        CPU calls from this thread whose launch argument is 0 (raw callers).
 */
void set_num_threads(int n);

/*! \brief The CPU code path in use: "avx512_bf16", "avx512" or "generic". */
std::string cpu_isa();

/*!
 * \brief Force a CPU code path ("generic", "avx512", "avx512_bf16"; any case), or
 *        "auto" to go back to the measured choice.
 *
 * Without a forced path, the first call that needs one times a small FP8 GEMM
 * on every path the CPU supports and keeps the fastest (once per process).
 * The environment variable TL_CPU_ISA forces a path at load time; a value
 * that is unknown or names a path the CPU lacks is ignored, and the module
 * warns once when imported (cpu_isa_env_warning()). Unknown names raise a
 * ValueError here, and so does asking for a path the CPU lacks.
 */
void set_cpu_isa(const std::string& isa);

/*! \brief Whether this CPU can run path `isa` ("auto" always); ValueError for unknown names. */
bool cpu_isa_supported(const std::string& isa);

/*! \brief How the CPU code path in use was chosen. */
struct CpuIsaInfo {
  std::string isa;          //!< as cpu_isa()
  std::string source;       //!< "forced", "measured" or "only_supported"
  std::string reason;       //!< one line for people: who forced it, or the timings that chose it
  std::string gemm_kernel;  //!< the GEMM micro-kernel of that path on this CPU
  std::vector<std::string> supported;                         //!< paths this CPU can run
  std::vector<std::pair<std::string, double>> probe_seconds;  //!< measured paths (else empty)
  std::string probe_shape;  //!< "MxNxK" of the timed GEMM
};
CpuIsaInfo cpu_isa_info();

/*! \brief Why TL_CPU_ISA was ignored, or "" when it was honoured or unset. */
std::string cpu_isa_env_warning();

/*! \brief True when the module was built with the CUDA kernels. */
bool built_with_cuda();

}  // namespace tl
