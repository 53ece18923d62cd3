/*!
 * \file runtime.h
 * \brief Process-wide settings of the CPU kernels and facts about the build.
 */
#pragma once

#include <string>

namespace tl {

/*! \brief Threads the CPU kernels use (the Python layer passes torch.get_num_threads()). */
void set_num_threads(int n);
/*! \brief Threads the CPU kernels use. */
int get_num_threads();

/*! \brief The CPU code path in use: "avx512_bf16", "avx512" or "generic". */
std::string cpu_isa();

/*!
 * \brief Force a CPU code path ("auto", "generic", "avx512", "avx512_bf16").
 *
 * The environment variable TL_CPU_ISA sets it at load time. Asking for a
 * path the CPU lacks raises a ValueError.
 */
void set_cpu_isa(const std::string& isa);

/*! \brief True when the module was built with the CUDA kernels. */
bool built_with_cuda();

}  // namespace tl
