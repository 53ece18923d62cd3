// Launch context shared by the CUDA kernels: device guard, stream, device
// facts, block reductions, vector memory access.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "check_cuda.h"
#include "transformer_linear/tensor.h"

namespace tl {
namespace cuda {

/*! \brief Makes `device` current for the scope; restores the previous device after. */
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TL_CHECK_CUDA(cudaGetDevice(&previous_));
    if (device >= 0 && device != previous_) TL_CHECK_CUDA(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline cudaStream_t to_stream(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

/*! \brief Streaming multiprocessors of the current device (cached per device). */
int sm_count();
/*! \brief Compute capability of the current device as 10 * major + minor (cached per device). */
int sm_version();

/*! \brief Blocks for a grid-stride loop over `work` items of `threads` each. */
inline unsigned grid_for(int64_t work, int threads, int blocks_per_sm = 8) {
  const int64_t needed = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  return static_cast<unsigned>(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

inline bool aligned(const void* p, int bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

}  // namespace cuda
}  // namespace tl
