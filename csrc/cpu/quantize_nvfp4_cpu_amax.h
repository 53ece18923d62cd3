// NVFP4 global amaxes on the CPU: max |x| over rows, and max |H(x)| over the Hadamard transforms
// of 16-row bands (the columnwise copy's RHT blocks are 16 consecutive rows of one column),
// written once on GCC vectors of W float lanes and compiled in each instruction set's file
// (W = 4 portable, 8 AVX2, 16 AVX-512), so W also keeps each file's instantiations apart.
//
// The maximum is exact and does not depend on the order it is taken in, so every W and every
// thread count gives the same bits, and those of the torch ops (ops/nvfp4.py,
// formats/nvfp4.py): a band's transform takes the reference's arithmetic, signs first, then the
// butterfly stages 1, 2, 4, 8 apart in the same order (each column on its own, W columns side by
// side); the 0.25 scaling is applied to the maximum, with which it commutes (multiplying by 0.25
// rounds monotonically). NaN propagates: a NaN anywhere (or an inf that the butterfly turns into
// inf - inf) makes the result NaN; else an inf is the result.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quantize_nvfp4_cpu.h"
#include "transformer_linear/element_types.h"

namespace tl {
namespace cpu {
namespace nvfp4 {

/*! \brief A running max |v| and whether a NaN was seen (max ignores NaNs: x > max is false). */
struct AbsMax {
  float max = 0.0f;
  bool nan = false;
  void add(const AbsMax& o) {
    max = o.max > max ? o.max : max;
    nan |= o.nan;
  }
  float value() const { return nan ? std::nanf("") : max; }
};

/*! \brief Which rows of the input the amax reads (the others are +0) and which part it covers. */
struct AmaxRange {
  int64_t row_begin, row_end;    // rows read; rows outside are +0
  int64_t band_begin, band_end;  // RHT: the 16-row bands transformed
};

// The vector types of W float lanes (GCC takes vector_size only as a non-dependent constant).
template <int W>
struct AmaxTypes;

#define TL_NVFP4_AMAX_TYPES(W)                               \
  template <>                                                \
  struct AmaxTypes<W> {                                      \
    typedef float F __attribute__((vector_size(4 * W)));     \
    typedef int32_t I __attribute__((vector_size(4 * W)));   \
  };
TL_NVFP4_AMAX_TYPES(4)
TL_NVFP4_AMAX_TYPES(8)
TL_NVFP4_AMAX_TYPES(16)
#undef TL_NVFP4_AMAX_TYPES

template <int W>
struct AmaxVec {
  using F = typename AmaxTypes<W>::F;
  using I = typename AmaxTypes<W>::I;

  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(F));
    return v;
  }
  static F abs(F v) {
    I bits;
    std::memcpy(&bits, &v, sizeof(F));
    bits &= 0x7fffffff;
    std::memcpy(&v, &bits, sizeof(F));
    return v;
  }
  // acc = max(acc, |v|) with NaNs noted in `nan` (lanes of all ones).
  static void update(F& acc, I& nan, F v) {
    const F a = abs(v);
    acc = a > acc ? a : acc;
    nan |= a != a;
  }
  static AbsMax reduce(F acc, I nan) {
    AbsMax m;
    for (int i = 0; i < W; ++i) {
      m.max = acc[i] > m.max ? acc[i] : m.max;
      m.nan |= nan[i] != 0;
    }
    return m;
  }

  // Columns of a band chunk converted at once: 16 rows x 64 float32 (4 KiB) in L1.
  static constexpr int64_t kCols = 64;

  // `w` values of a row as float32: the row itself for float32 input, else converted into `buf`.
  template <typename In>
  static const float* row_floats(const typename In::storage* row, int64_t w, float* buf) {
    if constexpr (std::is_same_v<typename In::storage, float>) {
      (void)w;
      (void)buf;
      return row;
    } else {
      for (int64_t j = 0; j < w; ++j) buf[j] = In::load(row[j]);
      return buf;
    }
  }

  /*! \brief max |x| over rows [r0, r1) of x (rows of k elements). */
  template <typename In>
  static AbsMax rows(const typename In::storage* x, int64_t k, int64_t r0, int64_t r1) {
    F acc = {};
    I nan = {};
    AbsMax tail;
    alignas(64) float buf[kCols];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < k; c0 += kCols) {
        const int64_t w = std::min(kCols, k - c0);
        const float* v = row_floats<In>(x + r * k + c0, w, buf);
        int64_t j = 0;
        for (; j + W <= w; j += W) update(acc, nan, load(v + j));
        for (; j < w; ++j) {
          const float a = std::fabs(v[j]);
          tail.max = a > tail.max ? a : tail.max;
          tail.nan |= a != a;
        }
      }
    }
    AbsMax m = reduce(acc, nan);
    m.add(tail);
    return m;
  }

  // The unnormalized transform of 16 values (one per row), each lane a column of its own:
  // signs first, then the butterfly stages 1, 2, 4, 8 apart (nvfp4::hadamard16's order).
  template <typename T>
  static void butterfly(T (&v)[kBlock]) {
    for (int i = 0; i < kBlock; ++i) v[i] = v[i] * kRhtSigns[i];
    for (int half = 1; half < kBlock; half *= 2) {
      for (int base = 0; base < kBlock; base += 2 * half) {
        for (int i = base; i < base + half; ++i) {
          const T lo = v[i], hi = v[i + half];
          v[i] = lo + hi;
          v[i + half] = lo - hi;
        }
      }
    }
  }

  /*! \brief max |x| over rows [r0, r1) (into `plain`, when not null) and max |H(x)| (unscaled)
   *         over the bands [b0, b1), rows outside [range.row_begin, range.row_end) as +0. */
  template <typename In>
  static AbsMax bands(const typename In::storage* x, int64_t k, const AmaxRange& range, int64_t b0, int64_t b1,
                      AbsMax* plain) {
    F acc = {}, plain_acc = {};
    I nan = {}, plain_nan = {};
    AbsMax tail, plain_tail;
    alignas(64) float tile[kBlock][kCols];
    const float* rows[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t c0 = 0; c0 < k; c0 += kCols) {
        const int64_t w = std::min(kCols, k - c0);
        for (int i = 0; i < kBlock; ++i) {
          const int64_t r = b * kBlock + i;
          if (r >= range.row_begin && r < range.row_end) {
            rows[i] = row_floats<In>(x + r * k + c0, w, tile[i]);
          } else {
            std::fill_n(tile[i], w, 0.0f);
            rows[i] = tile[i];
          }
        }
        int64_t j = 0;
        for (; j + W <= w; j += W) {
          F v[kBlock];
          for (int i = 0; i < kBlock; ++i) v[i] = load(rows[i] + j);
          if (plain != nullptr) {
            for (int i = 0; i < kBlock; ++i) update(plain_acc, plain_nan, v[i]);
          }
          butterfly(v);
          for (int i = 0; i < kBlock; ++i) update(acc, nan, v[i]);
        }
        for (; j < w; ++j) {
          float v[kBlock];
          for (int i = 0; i < kBlock; ++i) v[i] = rows[i][j];
          if (plain != nullptr) {
            for (int i = 0; i < kBlock; ++i) {
              const float a = std::fabs(v[i]);
              plain_tail.max = a > plain_tail.max ? a : plain_tail.max;
              plain_tail.nan |= a != a;
            }
          }
          butterfly(v);
          for (int i = 0; i < kBlock; ++i) {
            const float a = std::fabs(v[i]);
            tail.max = a > tail.max ? a : tail.max;
            tail.nan |= a != a;
          }
        }
      }
    }
    if (plain != nullptr) {
      *plain = reduce(plain_acc, plain_nan);
      plain->add(plain_tail);
    }
    AbsMax m = reduce(acc, nan);
    m.add(tail);
    return m;
  }
};

/*! \brief One instruction set's amax kernels over a slice of the work (a thread's share). */
struct AmaxKernels {
  // max |x| over rows [r0, r1) of a (?, k) input.
  AbsMax (*rows)(const TensorDesc& x, int64_t k, int64_t r0, int64_t r1);
  // max |H(x)| (unscaled) over bands [b0, b1) (rows outside `range` +0); and, with `plain`, max |x|
  // over those bands' rows.
  AbsMax (*bands)(const TensorDesc& x, int64_t k, const AmaxRange& range, int64_t b0, int64_t b1, AbsMax* plain);
};

AmaxKernels portable_amax_kernels();
AmaxKernels avx2_amax_kernels();
AmaxKernels avx512_amax_kernels();

/*! \brief The AmaxKernels of AmaxVec<W>, the input's dtype dispatched (float32, bfloat16, float16). */
template <int W>
AmaxKernels make_amax_kernels() {
  AmaxKernels k;
  k.rows = [](const TensorDesc& x, int64_t cols, int64_t r0, int64_t r1) {
    switch (x.dtype) {
      case DType::kBFloat16: return AmaxVec<W>::template rows<BFloat16>(x.ptr<const uint16_t>(), cols, r0, r1);
      case DType::kFloat16: return AmaxVec<W>::template rows<Float16>(x.ptr<const uint16_t>(), cols, r0, r1);
      default: return AmaxVec<W>::template rows<Float32>(x.ptr<const float>(), cols, r0, r1);
    }
  };
  k.bands = [](const TensorDesc& x, int64_t cols, const AmaxRange& range, int64_t b0, int64_t b1, AbsMax* plain) {
    switch (x.dtype) {
      case DType::kBFloat16:
        return AmaxVec<W>::template bands<BFloat16>(x.ptr<const uint16_t>(), cols, range, b0, b1, plain);
      case DType::kFloat16:
        return AmaxVec<W>::template bands<Float16>(x.ptr<const uint16_t>(), cols, range, b0, b1, plain);
      default: return AmaxVec<W>::template bands<Float32>(x.ptr<const float>(), cols, range, b0, b1, plain);
    }
  };
  return k;
}

/*! \brief Global amaxes of an NVFP4 quantize, on the current instruction set and thread count.
 *
 * `amax` (when not null) gets max |x| over rows [range.row_begin, range.row_end); `amax_rht` (when
 * not null) max |H(x)| * 0.25 over the bands [range.band_begin, range.band_end), rows outside the
 * row range as +0 (both in one pass over the bands when both are asked for and the bands cover
 * the rows). NaN where a NaN was met.
 */
void nvfp4_amaxes(const TensorDesc& x, int64_t k, const AmaxRange& range, float* amax, float* amax_rht);

}  // namespace nvfp4
}  // namespace cpu
}  // namespace tl
