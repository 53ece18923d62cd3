// Check macros for CUDA runtime and cuBLAS(Lt) calls: a failure throws
// tl::RuntimeError (Python RuntimeError) naming the call, the error and file:line.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include "transformer_linear/check.h"

namespace tl {
namespace cuda {
/*! \brief Readable name of a cuBLAS status (cublasGetStatusName lives in libcublas, not libcublasLt). */
const char* cublas_status_name(cublasStatus_t status);
}  // namespace cuda
}  // namespace tl

#define TL_CHECK_CUDA(call)                                                            \
  do {                                                                                 \
    const cudaError_t tl_status_ = (call);                                             \
    if (tl_status_ != cudaSuccess) {                                                   \
      TL_ERROR(RuntimeError, "CUDA call failed: ", #call, ": ", cudaGetErrorName(tl_status_), \
               " (", cudaGetErrorString(tl_status_), ")");                             \
    }                                                                                  \
  } while (0)

/*! \brief Check the launch that just happened (bad configuration, no kernel image for this GPU). */
#define TL_CHECK_CUDA_LAUNCH()                                                         \
  do {                                                                                 \
    const cudaError_t tl_status_ = cudaGetLastError();                                 \
    if (tl_status_ != cudaSuccess) {                                                   \
      TL_ERROR(RuntimeError, "CUDA kernel launch failed: ", cudaGetErrorName(tl_status_), " (", \
               cudaGetErrorString(tl_status_), ")",                                    \
               tl_status_ == cudaErrorNoKernelImageForDevice                           \
                   ? "; rebuild with TL_CUDA_ARCHS naming this GPU's architecture"     \
                   : "");                                                              \
    }                                                                                  \
  } while (0)

#define TL_CHECK_CUBLAS(call)                                                          \
  do {                                                                                 \
    const cublasStatus_t tl_status_ = (call);                                          \
    if (tl_status_ != CUBLAS_STATUS_SUCCESS) {                                         \
      TL_ERROR(RuntimeError, "cuBLAS call failed: ", #call, ": status ",               \
               static_cast<int>(tl_status_), " (", ::tl::cuda::cublas_status_name(tl_status_), ")"); \
    }                                                                                  \
  } while (0)
