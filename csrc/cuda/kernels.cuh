// Device helpers shared by the CUDA kernel files (the launchers they offer
// each other are in launchers.h). Element math comes from fp8_math.h /
// element_types.h, as on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/backend.h"
#include "cuda_utils.h"
#include "launchers.h"
#include "transformer_linear/element_types.h"

namespace tl {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of the elementwise kernels
constexpr int kVec = 8;        // elements per thread and vector access

/*!
 * \brief |x| as ordered bits. Non-negative floats order like their bit
 * patterns, and every NaN (all-ones exponent, non-zero mantissa) orders above
 * +inf, so an unsigned max over these is a NaN-propagating max of |x| and
 * atomicMax on the bits works as a float atomic max.
 */
__device__ __forceinline__ uint32_t abs_bits(float x) { return fp8::bits_of(x) & 0x7fffffffu; }

/*! \brief Max of `v` over a 1-D block, then one atomicMax into `*out` (every thread must call). */
__device__ __forceinline__ void block_atomic_max(uint32_t v, uint32_t* out) {
  __shared__ uint32_t warp_max[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) >> 5) ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    if (lane == 0 && v != 0u) atomicMax(out, v);  // 0 is the initial value: skip the atomic
  }
}

/*! \brief N elements for one vector access; 16-byte alignment is what the loads rely on. */
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

/*! \brief Blocks for the grid-stride elementwise kernels over n elements. */
inline unsigned elementwise_grid(int64_t n, bool vec) {
  return grid_for(vec ? (n + kVec - 1) / kVec : n, kThreads);
}

/*! \brief True when `p` may be accessed as Vec<T, kVec> at every multiple of kVec elements. */
template <typename T>
inline bool vec_aligned(const void* p) {
  constexpr int bytes = sizeof(T) * kVec < 16 ? sizeof(T) * kVec : 16;
  return p == nullptr || aligned(p, bytes);
}

}  // namespace cuda
}  // namespace tl
