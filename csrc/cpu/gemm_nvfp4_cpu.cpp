// CPU NVFP4 GEMM: d = (A @ B^T) * alpha [+ bias]. Micro-kernels: gemm_nvfp4_cpu.h.
//
// The output is cut into MC x NC tiles, run in parallel. For each chunk of KC columns
// of K, a tile's rows of A and of B are decoded into float32 panels, k-major, with each
// element's E4M3 block scale folded in (E2M1 times E4M3 is exact in float32). A 4 x 8
// register micro-kernel then sums each 16-element K block's products from zero (exact:
// every partial sum is an integer below 2^24 times a power of two, so the order inside
// a block does not matter, nor does fusing its multiply-adds) and adds the block to the
// float32 total in K order, as
// reference/nvfp4.py nvfp4_gemm does; the global scales (alpha) and the bias come in the
// float32 epilogue.
#include <algorithm>
#include <vector>

#include "../common/backend_nvfp4.h"
#include "cpu_features.h"
#include "gemm_nvfp4_cpu.h"
#include "parallel.h"
#include "quantize_nvfp4_cpu.h"
#include "transformer_linear/dispatch.h"
#include "transformer_linear/element_types.h"

namespace tl {
namespace cpu {
namespace {

using namespace nvfp4;
using gemm_nvfp4::kMC;
using gemm_nvfp4::kMR;
using gemm_nvfp4::kNC;
using gemm_nvfp4::kNR;

constexpr int64_t kKC = 256;  // a multiple of kBlock

struct Scratch {
  std::vector<float> a, b, acc;  // (kKC, kMC), (kKC, kNC) panels; (kMC, kNC) totals
};

// Rows [r0, r1) (at most `ld`) of a packed operand, K columns [k0, k1), decoded into
// panel[(k - k0) * ld + (r - r0)]; rows up to `ld` beyond r1 are zero.
void decode_panel(const uint8_t* data, const uint8_t* scale, int64_t k, int64_t r0, int64_t r1,
                  int64_t k0, int64_t k1, int64_t ld, float* panel) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = r0; r < r0 + ld; ++r) {
    float* col = panel + (r - r0);
    if (r >= r1) {
      for (int64_t kk = k0; kk < k1; ++kk) col[(kk - k0) * ld] = 0.0f;
      continue;
    }
    const uint8_t* row = data + r * (k / 2);
    for (int64_t kk = k0; kk < k1; kk += kBlock) {
      const float s = fp8::float_from_e4m3_bits(scale[r * blocks + kk / kBlock]);
      for (int i = 0; i < kBlock; i += 2) {
        const uint8_t byte = row[(kk + i) / 2];
        col[(kk + i - k0) * ld] = kE2M1Values[byte & 0xF] * s;
        col[(kk + i + 1 - k0) * ld] = kE2M1Values[byte >> 4] * s;
      }
    }
  }
}

// The portable gemm_nvfp4::MicroKernelFn.
void micro_kernel(const float* a, const float* b, int64_t kc, int64_t i0, int64_t j0, float* acc,
                  int64_t ld_acc) {
  float total[kMR][kNR];
  for (int i = 0; i < kMR; ++i) {
    for (int j = 0; j < kNR; ++j) total[i][j] = acc[(i0 + i) * ld_acc + j0 + j];
  }
  for (int64_t k0 = 0; k0 < kc; k0 += kBlock) {
    float part[kMR][kNR] = {};
    for (int64_t kk = k0; kk < k0 + kBlock; ++kk) {
      const float* av = a + kk * kMC + i0;
      const float* bv = b + kk * kNC + j0;
      for (int i = 0; i < kMR; ++i) {
        for (int j = 0; j < kNR; ++j) part[i][j] += av[i] * bv[j];
      }
    }
    for (int i = 0; i < kMR; ++i) {
      for (int j = 0; j < kNR; ++j) total[i][j] += part[i][j];
    }
  }
  for (int i = 0; i < kMR; ++i) {
    for (int j = 0; j < kNR; ++j) acc[(i0 + i) * ld_acc + j0 + j] = total[i][j];
  }
}

template <typename Out>
void run(const GemmNvfp4Params& p, gemm_nvfp4::MicroKernelFn kernel) {
  const int64_t tiles_m = (p.m + kMC - 1) / kMC, tiles_n = (p.n + kNC - 1) / kNC;
  const auto* a = p.a.ptr<const uint8_t>();
  const auto* b = p.b.ptr<const uint8_t>();
  const auto* sa = static_cast<const uint8_t*>(p.a_scale.data);
  const auto* sb = static_cast<const uint8_t*>(p.b_scale.data);
  const auto* bias = p.bias.defined() ? p.bias.ptr<const typename Out::storage>() : nullptr;
  auto* d = p.d.ptr<typename Out::storage>();
  parallel_for(tiles_m * tiles_n, 1, [&](int64_t t0, int64_t t1) {
    thread_local Scratch s;
    s.a.resize(kKC * kMC);
    s.b.resize(kKC * kNC);
    s.acc.resize(kMC * kNC);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = (t / tiles_n) * kMC, m1 = std::min(p.m, m0 + kMC);
      const int64_t n0 = (t % tiles_n) * kNC, n1 = std::min(p.n, n0 + kNC);
      std::fill(s.acc.begin(), s.acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < p.k; k0 += kKC) {
        const int64_t k1 = std::min(p.k, k0 + kKC);
        decode_panel(a, sa, p.k, m0, m1, k0, k1, kMC, s.a.data());
        decode_panel(b, sb, p.k, n0, n1, k0, k1, kNC, s.b.data());
        for (int64_t i = 0; i < m1 - m0; i += kMR) {
          for (int64_t j = 0; j < n1 - n0; j += kNR) {
            kernel(s.a.data(), s.b.data(), k1 - k0, i, j, s.acc.data(), kNC);
          }
        }
      }
      for (int64_t i = m0; i < m1; ++i) {
        for (int64_t j = n0; j < n1; ++j) {
          float v = s.acc[(i - m0) * kNC + (j - n0)] * p.alpha;
          if (bias) v = v + Out::load(bias[j]);
          d[i * p.n + j] = Out::store(v);
        }
      }
    }
  });
}

}  // namespace

void nvfp4_gemm(const GemmNvfp4Params& p) {
  if (p.m == 0 || p.n == 0) return;
  // Every vector path's CPU has AVX2 and FMA.
  const gemm_nvfp4::MicroKernelFn kernel =
      current_isa() == Isa::kGeneric ? micro_kernel : gemm_nvfp4::micro_kernel_avx2();
  dispatch_high_precision(p.d.dtype, "nvfp4_gemm: argument 'd'", [&](auto tag) { run<decltype(tag)>(p, kernel); });
}

}  // namespace cpu
}  // namespace tl
