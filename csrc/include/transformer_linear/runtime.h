/*!
 * \file runtime.h
 * \brief Settings of the CPU kernels and facts about the build.
 */
#pragma once

#include <string>

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
 * \brief Force a CPU code path ("auto", "generic", "avx512", "avx512_bf16").
 *
 * The environment variable TL_CPU_ISA sets it at load time. Asking for a
 * path the CPU lacks raises a ValueError.
 */
void set_cpu_isa(const std::string& isa);

/*! \brief True when the module was built with the CUDA kernels. */
bool built_with_cuda();

}  // namespace tl
