// CPU FP8 GEMM (portable version; replaced by the blocked, packed kernels).
#include <vector>

#include "../common/backend.h"
#include "parallel.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {

void fp8_gemm(const GemmParams& p) {
  if (p.m == 0 || p.n == 0) return;
  float lut_a[256], lut_b[256];
  dispatch_fp8(p.a.dtype, "fp8_gemm: argument 'a'", [&](auto t) {
    for (int i = 0; i < 256; ++i) lut_a[i] = decltype(t)::load(static_cast<uint8_t>(i));
  });
  dispatch_fp8(p.b.dtype, "fp8_gemm: argument 'b'", [&](auto t) {
    for (int i = 0; i < 256; ++i) lut_b[i] = decltype(t)::load(static_cast<uint8_t>(i));
  });
  const float alpha = *p.a_scale_inv.ptr<float>() * *p.b_scale_inv.ptr<float>();
  const uint8_t* a = p.a.ptr<uint8_t>();
  const uint8_t* b = p.b.ptr<uint8_t>();
  dispatch_high_precision(p.d.dtype, "fp8_gemm: argument 'd'", [&](auto out_tag) {
    using Out = decltype(out_tag);
    using T = typename Out::storage;
    T* d = p.d.ptr<T>();
    const T* bias = p.bias.defined() ? p.bias.ptr<T>() : nullptr;
    parallel_for(p.m, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < p.n; ++j) {
          float acc = 0.0f;
          for (int64_t k = 0; k < p.k; ++k) {
            acc += lut_a[a[i * p.a_row + k * p.a_col]] * lut_b[b[j * p.b_row + k * p.b_col]];
          }
          float v = acc * alpha;
          if (bias) v = v + Out::load(bias[j]);
          if (p.accumulate) v = Out::load(d[i * p.n + j]) + v;
          d[i * p.n + j] = Out::store(v);
        }
      }
    });
  });
}

}  // namespace cpu
}  // namespace tl
