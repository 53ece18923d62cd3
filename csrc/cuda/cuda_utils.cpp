#include "cuda_utils.h"

#include <mutex>
#include <vector>

namespace tl {
namespace cuda {
namespace {

struct DeviceFacts {
  int sm_count = 0;
  int sm_version = 0;
};

// Queried once per device: cudaDeviceGetAttribute is cheap, but not free on
// every launch.
const DeviceFacts& facts() {
  static std::mutex mutex;
  static std::vector<DeviceFacts> cache;
  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() <= static_cast<size_t>(device)) cache.resize(device + 1);
  DeviceFacts& f = cache[device];
  if (f.sm_count == 0) {
    int major = 0, minor = 0;
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, device));
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    f.sm_version = 10 * major + minor;
  }
  return f;
}

}  // namespace

int sm_count() { return facts().sm_count; }
int sm_version() { return facts().sm_version; }

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

}  // namespace cuda
}  // namespace tl
