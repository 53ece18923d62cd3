// The device-side setup of cuBLASLt's grouped matmul (gemm_grouped_cuda.cpp): from offs, each group's
// addresses, shapes and scales, in the device arrays cuBLASLt reads; no value of offs reaches the host.
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm_grouped_setup_cuda.h"

namespace tl {
namespace cuda {
namespace {

__global__ void grouped_setup_kernel(GroupedSetup s) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= s.groups) return;
  // Clamped as the Triton kernels clamp: never an address outside the operands.
  auto clamp = [&](int64_t v) { return v < 0 ? int64_t{0} : (v > s.m ? s.m : v); };
  const int64_t end = clamp(s.offs[g]);
  const int64_t start = g == 0 ? 0 : clamp(s.offs[g - 1]);
  const int64_t rows = end > start ? end - start : 0;
  s.a_ptrs[g] = s.b + static_cast<int64_t>(g) * s.n * s.k;  // cuBLAS's A: our b[g]
  s.b_ptrs[g] = s.a + start * s.k;                           // cuBLAS's B: our a[rows of g]
  s.d_ptrs[g] = s.d + start * s.n * s.d_elem_bytes;
  s.k_array[g] = s.k;
  s.n_array[g] = s.n;
  s.m_array[g] = rows;
  s.a_scales[g] = s.a_scale_inv[0];
}

}  // namespace

void grouped_setup(const GroupedSetup& s, cudaStream_t stream) {
  if (s.groups == 0) return;
  const int threads = 128;
  grouped_setup_kernel<<<(s.groups + threads - 1) / threads, threads, 0, stream>>>(s);
  TL_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cuda
}  // namespace tl
