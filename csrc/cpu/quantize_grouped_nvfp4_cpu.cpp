// CPU grouped columnwise NVFP4 quantize: for each group, the columnwise copy (1x16 blocks along
// the tokens) of the tokens masked to the group, as quantize_nvfp4 makes it of the masked tensor,
// touching only the 16-token bands that hold the group's tokens.
//
// The masked tensor's global amax is the maximum over the group's rows (its other rows are +0);
// with the Hadamard transform, over the transformed blocks of the group's bands (the others
// transform to 0), the transform of a band computed with the group's rows only, as the kernel
// transforms it. Its bands outside the group quantize to zero codes and zero scales (a block of
// zeros: amax 0, scale 0, code 0 in either rounding), which the caller's zeroed output holds
// already; the group's bands go through the quantize kernel with the tensor's full token
// count, so every element keeps its index in the copy and its stochastic-rounding bits.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/backend_nvfp4.h"
#include "parallel.h"
#include "quantize_nvfp4_cpu.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"
#include "transformer_linear/fp8_math.h"

namespace tl {
namespace cpu {
namespace {

using nvfp4::kBlock;

// Columns of a band transformed at once: 16 rows x 64 float32 (4 KiB) in L1.
constexpr int64_t kAmaxCols = 64;

// Running max of |values| and whether any was not finite (NaN or inf), elementwise so that the
// loops vectorize; a non-finite amax is an error, so its value need not be kept.
struct AbsMax {
  float max = 0.0f;
  bool non_finite = false;
  void add(float v) {
    const float a = std::fabs(v);
    max = a > max ? a : max;
    non_finite |= !(a <= fp8::kFloatMax);
  }
  void add(const AbsMax& o) {
    max = o.max > max ? o.max : max;
    non_finite |= o.non_finite;
  }
};

// max |x| over rows [start, end), or over the Hadamard transforms of the 16-row bands
// [band0, band1) with rows outside [start, end) as +0 (the transform's fixed stage order, as
// nvfp4::hadamard16 and formats/nvfp4.py, on a band's columns side by side; the 0.25 scaling
// is applied to the maximum, which it commutes with). NaN when any of them is not finite.
template <typename In>
float group_amax(const QuantizeGroupedNvfp4Params& p, int64_t start, int64_t end, int64_t band0, int64_t band1) {
  using T = typename In::storage;
  const T* x = p.input.ptr<const T>();
  const int64_t k = p.k;
  const int threads = get_num_threads();
  std::vector<AbsMax> partial(std::max(threads, 1));
  if (!p.rht) {
    parallel_for(threads, end - start, 16, [&](int64_t i0, int64_t i1) {
      AbsMax m;
      for (int64_t r = start + i0; r < start + i1; ++r) {
        const T* row = x + r * k;
        for (int64_t c = 0; c < k; ++c) m.add(In::load(row[c]));
      }
      partial[omp_get_thread_num()].add(m);
    });
  } else {
    parallel_for(threads, band1 - band0, 1, [&](int64_t b0, int64_t b1) {
      AbsMax m;
      alignas(64) float v[kBlock][kAmaxCols];
      for (int64_t b = band0 + b0; b < band0 + b1; ++b) {
        for (int64_t c0 = 0; c0 < k; c0 += kAmaxCols) {
          const int64_t w = std::min(kAmaxCols, k - c0);
          for (int i = 0; i < kBlock; ++i) {
            const int64_t r = b * kBlock + i;
            if (r >= start && r < end) {
              const T* row = x + r * k + c0;
              for (int64_t j = 0; j < w; ++j) v[i][j] = In::load(row[j]) * nvfp4::kRhtSigns[i];
            } else {
              std::fill_n(v[i], w, 0.0f);
            }
          }
          for (int half = 1; half < kBlock; half *= 2) {
            for (int base = 0; base < kBlock; base += 2 * half) {
              for (int i = base; i < base + half; ++i) {
                for (int64_t j = 0; j < w; ++j) {
                  const float lo = v[i][j], hi = v[i + half][j];
                  v[i][j] = lo + hi;
                  v[i + half][j] = lo - hi;
                }
              }
            }
          }
          for (int i = 0; i < kBlock; ++i) {
            for (int64_t j = 0; j < w; ++j) m.add(v[i][j]);
          }
        }
      }
      partial[omp_get_thread_num()].add(m);
    });
  }
  AbsMax amax;
  for (const AbsMax& m : partial) amax.add(m);
  if (amax.non_finite) return std::nanf("");
  return p.rht ? amax.max * 0.25f : amax.max;
}

}  // namespace

void quantize_grouped_nvfp4(const QuantizeGroupedNvfp4Params& p) {
  const int64_t scale_stride = 8 + p.k * (p.total / kBlock);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t start = g == 0 ? 0 : p.offs[g - 1], end = p.offs[g];
    const int64_t band0 = start / kBlock, band1 = start == end ? band0 : (end + kBlock - 1) / kBlock;
    const float amax = dispatch_high_precision(p.input.dtype, "quantize_grouped_nvfp4: argument 'x'", [&](auto tag) {
      return group_amax<decltype(tag)>(p, start, end, band0, band1);
    });
    TL_CHECK(std::isfinite(amax), "quantize_grouped_nvfp4: the global amax of group ", g,
             " must be finite and non-negative (the global scale is 448 * 6 / amax), got ", amax);
    const float s_enc = nvfp4::global_encode_scale(amax);
    // The global decode scale, packed as pack_scales does: 8 elements of 4 bits, least significant first.
    const uint32_t bits = fp8::bits_of(1.0f / s_enc);
    uint8_t* scale_t = p.scale_t + g * scale_stride;
    for (int i = 0; i < 8; ++i) scale_t[i] = static_cast<uint8_t>((bits >> (4 * i)) & 0xF);
    if (band0 == band1) continue;
    QuantizeNvfp4Params q{};
    q.input = p.input;
    q.output_t = p.input;  // the group's copy: only data (and dtype-free pointer use) is read
    q.output_t.dtype = DType::kUInt8;
    q.output_t.data = p.output_t + g * p.k * (p.total / 2);
    q.output_t.ndim = 2;
    q.output_t.shape[0] = p.k;
    q.output_t.shape[1] = p.total / 2;
    q.output_t.strides[0] = p.total / 2;
    q.output_t.strides[1] = 1;
    q.scale_t = q.output_t;
    q.scale_t.dtype = DType::kFloat8E4M3;
    q.scale_t.data = scale_t + 8;
    q.scale_t.shape[1] = p.total / kBlock;
    q.scale_t.strides[0] = p.total / kBlock;
    q.s_enc = s_enc;
    q.s_enc_t = s_enc;
    q.m = p.total;
    q.k = p.k;
    q.scaling_2d = false;
    q.rht = p.rht;
    q.stochastic_rounding = p.stochastic_rounding;
    q.seed = p.stochastic_rounding ? static_cast<uint64_t>(p.seeds[g]) : 0;
    q.offset = 0;
    q.band_begin = band0;
    q.band_end = band1;
    q.keep_begin = start;
    q.keep_end = end;
    quantize_nvfp4(q);
  }
}

}  // namespace cpu
}  // namespace tl
