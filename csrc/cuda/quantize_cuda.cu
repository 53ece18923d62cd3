// CUDA quantize family: amax, quantize (delayed or current scaling, optional
// fused amax), dequantize. The fused cast + transpose, which also computes the
// bias gradient, is in cast_transpose_cuda.cu. Element math: fp8_math.h, as on the CPU.
//
// Nothing here reads a device value on the host: current scaling runs
// amax kernel -> compute_scale kernel (writes scale, scale_inv) -> cast kernel
// (reads the scale from memory), all queued on the caller's stream.
#include <cmath>

#include "kernels.cuh"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cuda {
namespace {

// Grid-stride loop over n elements: `vec_body(i)` handles the kVec elements
// from i (vector path), `scalar_body(i)` one element (tail, or everything when
// a pointer is not vector-aligned).
template <typename VecBody, typename ScalarBody>
__device__ __forceinline__ void for_each_element(int64_t n, bool vec, VecBody&& vec_body,
                                                 ScalarBody&& scalar_body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = vec ? n / kVec : 0;
  for (int64_t c = tid; c < chunks; c += stride) vec_body(c * kVec);
  for (int64_t i = chunks * kVec + tid; i < n; i += stride) scalar_body(i);
}

template <typename In>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const typename In::storage* __restrict__ x, int64_t n, bool vec, uint32_t* amax) {
  using T = typename In::storage;
  uint32_t m = 0;
  for_each_element(
      n, vec,
      [&](int64_t i) {
        const Vec<T, kVec> in = load_vec<T, kVec>(x + i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) m = max(m, abs_bits(In::load(in.v[j])));
      },
      [&](int64_t i) { m = max(m, abs_bits(In::load(x[i]))); });
  block_atomic_max(m, amax);
}

// One thread: scale from amax with the shared formula, and its inverse.
__global__ void compute_scale_kernel(const float* amax, float fp8_max, float margin_factor,
                                     float* scale, float* scale_inv) {
  const float s = fp8::compute_scale(*amax, fp8_max, margin_factor, 1.0f);
  *scale = s;
  *scale_inv = 1.0f / s;
}

// Row-major cast; with kAmax also max |x| of what it read.
template <typename In, typename Out, bool kAmax>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const typename In::storage* __restrict__ x, uint8_t* __restrict__ q, int64_t n,
                bool vec, const float* scale_ptr, float* scale_inv, uint32_t* amax) {
  using T = typename In::storage;
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  uint32_t m = 0;
  for_each_element(
      n, vec,
      [&](int64_t i) {
        const Vec<T, kVec> in = load_vec<T, kVec>(x + i);
        Vec<uint8_t, kVec> out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float v = In::load(in.v[j]);
          if (kAmax) m = max(m, abs_bits(v));
          out.v[j] = Out::quantize(v, scale);
        }
        store_vec(q + i, out);
      },
      [&](int64_t i) {
        const float v = In::load(x[i]);
        if (kAmax) m = max(m, abs_bits(v));
        q[i] = Out::quantize(v, scale);
      });
  if (kAmax) block_atomic_max(m, amax);
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, typename Out::storage* __restrict__ y,
                      int64_t n, bool vec, const float* scale_inv_ptr) {
  using T = typename Out::storage;
  const float s = *scale_inv_ptr;
  for_each_element(
      n, vec,
      [&](int64_t i) {
        const Vec<uint8_t, kVec> in = load_vec<uint8_t, kVec>(q + i);
        Vec<T, kVec> out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) out.v[j] = Out::store(In::load(in.v[j]) * s);
        store_vec(y + i, out);
      },
      [&](int64_t i) { y[i] = Out::store(In::load(q[i]) * s); });
}

// Zeroes the amax output (the kernels atomicMax into it) and runs the
// reduction over the input.
template <typename In>
void launch_amax(const TensorDesc& input, uint32_t* amax, cudaStream_t stream) {
  using T = typename In::storage;
  TL_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(uint32_t), stream));
  const int64_t n = input.numel();
  if (n == 0) return;
  const bool vec = vec_aligned<T>(input.data);
  amax_kernel<In><<<elementwise_grid(n, vec), kThreads, 0, stream>>>(
      input.ptr<T>(), n, vec, amax);
  TL_CHECK_CUDA_LAUNCH();
}

template <typename In, typename Out>
void quantize_impl(const QuantizeParams& p, cudaStream_t stream) {
  using T = typename In::storage;
  uint32_t* amax = p.amax.defined() ? p.amax.ptr<uint32_t>() : nullptr;
  float* scale = p.scale.ptr<float>();
  float* scale_inv = p.scale_inv.ptr<float>();
  if (p.current_scaling) {
    launch_amax<In>(p.input, amax, stream);
    compute_scale_kernel<<<1, 1, 0, stream>>>(p.amax.ptr<float>(), Out::kMax,
                                              std::ldexp(1.0f, -p.margin), scale, scale_inv);
    TL_CHECK_CUDA_LAUNCH();
    scale_inv = nullptr;  // written
    amax = nullptr;       // known
  } else if (amax != nullptr) {
    TL_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(uint32_t), stream));
  }

  const int64_t n = p.input.numel();
  if ((p.output_t.defined() || p.dbias.defined()) && n > 0) {
    return cast_transpose(p, scale, scale_inv, amax, stream);
  }
  if (p.dbias.defined() && p.cols > 0) {  // no rows: the column sums are 0 in every dtype
    TL_CHECK_CUDA(cudaMemsetAsync(p.dbias.data, 0, static_cast<size_t>(p.cols * element_size(p.dbias.dtype)),
                                  stream));
  }
  // Row-major only (or an empty tensor: the cast kernel still writes scale_inv).
  uint8_t* q = p.output.defined() ? p.output.ptr<uint8_t>() : nullptr;
  const bool vec = vec_aligned<T>(p.input.data) && vec_aligned<uint8_t>(q);
  const unsigned grid = elementwise_grid(n, vec);
  if (amax != nullptr) {
    cast_kernel<In, Out, true><<<grid, kThreads, 0, stream>>>(p.input.ptr<T>(), q, n, vec, scale,
                                                               scale_inv, amax);
  } else {
    cast_kernel<In, Out, false><<<grid, kThreads, 0, stream>>>(p.input.ptr<T>(), q, n, vec, scale,
                                                                scale_inv, nullptr);
  }
  TL_CHECK_CUDA_LAUNCH();
}

}  // namespace

void amax(const TensorDesc& input, const TensorDesc& amax_out, Stream stream) {
  DeviceGuard guard(input.device_index);
  dispatch_high_precision(input.dtype, "amax: argument 'input'", [&](auto in_tag) {
    launch_amax<decltype(in_tag)>(input, amax_out.ptr<uint32_t>(), to_stream(stream));
  });
}

void quantize(const QuantizeParams& p) {
  DeviceGuard guard(p.input.device_index);
  const cudaStream_t stream = to_stream(p.stream);
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    dispatch_fp8(p.fp8_dtype, "quantize: argument 'output'", [&](auto out_tag) {
      quantize_impl<decltype(in_tag), decltype(out_tag)>(p, stream);
    });
  });
}

void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output,
                Stream stream) {
  DeviceGuard guard(input.device_index);
  const int64_t n = input.numel();
  if (n == 0) return;
  dispatch_fp8(input.dtype, "dequantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_high_precision(output.dtype, "dequantize: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      using T = typename Out::storage;
      const bool vec = vec_aligned<uint8_t>(input.data) && vec_aligned<T>(output.data);
      dequantize_kernel<In, Out>
          <<<elementwise_grid(n, vec), kThreads, 0, to_stream(stream)>>>(
              input.ptr<uint8_t>(), output.ptr<T>(), n, vec, scale_inv.ptr<float>());
      TL_CHECK_CUDA_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace tl
