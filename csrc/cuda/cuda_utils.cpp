#include "cuda_utils.h"

#include <memory>
#include <mutex>

#include "cuda_info.h"

namespace tl {
namespace cuda {
namespace {

struct DeviceFacts {
  int sm_count = 0;
  int sm_version = 0;
};

// Queried once per device: cudaDeviceGetAttribute is cheap, but not free on
// every launch. The table is sized to the device count once (call_once) and
// never resized; each entry is filled under the mutex and copied out, so a
// thread reading one device's facts never holds a reference another thread
// could invalidate (the bindings release the GIL).
DeviceFacts facts() {
  static std::once_flag sized;
  static std::mutex mutex;
  static std::unique_ptr<DeviceFacts[]> cache;
  static int device_count = 0;
  std::call_once(sized, [] {
    TL_CHECK_CUDA(cudaGetDeviceCount(&device_count));
    cache.reset(new DeviceFacts[device_count > 0 ? device_count : 1]);
  });
  int device = 0;
  TL_CHECK_CUDA(cudaGetDevice(&device));
  TL_CHECK_AS(RuntimeError, device >= 0 && device < device_count, "CUDA device ", device, " is not one of the ",
           device_count, " devices found");
  std::lock_guard<std::mutex> lock(mutex);
  DeviceFacts& f = cache[device];
  if (f.sm_count == 0) {
    int count = 0, major = 0, minor = 0;
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TL_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    f.sm_version = 10 * major + minor;
    f.sm_count = count;  // last: a non-zero count marks the entry complete
  }
  return f;
}

}  // namespace

int sm_count() { return facts().sm_count; }
int sm_version() { return facts().sm_version; }

int runtime_version() {
  int v = 0;
  TL_CHECK_CUDA(cudaRuntimeGetVersion(&v));
  return v;
}

int driver_version() {
  // 0 without a driver; no context is created.
  int v = 0;
  return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
}

std::string built_archs() { return TL_CUDA_ARCH_LIST; }

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
