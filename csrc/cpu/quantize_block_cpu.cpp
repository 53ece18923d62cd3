// CPU blockwise quantize: one scale per block, row-major and/or transposed
// output from one pass over the input. Scale math: block_math.h.
//
// The input is walked in tiles that hold whole blocks of both outputs
// (lcm of the block edges, clamped to the matrix), so each tile is read from
// memory once: its block amaxes are computed, then both casts run while it
// is in cache. Tiles run in parallel.
#include <algorithm>
#include <numeric>
#include <vector>

#include "../common/backend_block.h"
#include "cpu_features.h"
#include "parallel.h"
#include "quantize_cpu_avx512.h"
#include "transformer_linear/block_math.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace {

struct Tile {
  int64_t r0, r1, c0, c1;
};

// Scale of one block from its amax; writes the block's scale_inv (float32 or E8M0 bits).
float block_scale_out(float amax, float fp8_max, int emax, const BlockLayout& l, void* scale_inv,
                      int64_t index, bool power_2, bool e8m0_floor) {
  if (l.e8m0) {
    const int e = fp8::e8m0_exponent(amax, fp8_max, emax, e8m0_floor);
    static_cast<uint8_t*>(scale_inv)[index] = static_cast<uint8_t>(e + fp8::kE8M0Bias);
    return fp8::exp2_int(-e);
  }
  const float scale = fp8::block_scale(amax, fp8_max, power_2);
  static_cast<float*>(scale_inv)[index] = 1.0f / scale;
  return scale;
}

template <typename In, typename Out>
class TileQuantizer {
 public:
  using T = typename In::storage;
  explicit TileQuantizer(const QuantizeBlockParams& p)
      : p_(p), x_(p.input.ptr<T>()), vec_(current_isa() != Isa::kGeneric) {}

  void run(const Tile& t) const {
    if (p_.output.defined()) rowwise(t);
    if (!p_.output_t.defined()) return;
    if ((t.r1 - t.r0) * (t.c1 - t.c0) <= kMaxBuffered) {
      columnwise_buffered(t);
    } else {
      columnwise(t);
    }
  }

 private:
  static constexpr int kEmax = Out::kMax > 1000.0f ? 15 : 8;  // floor(log2(fp8_max))

  float segment_amax(int64_t begin, int64_t end) const {
    if (vec_) return avx512::amax(In::dtype, x_, begin, end);
    float a = 0.0f;
    for (int64_t i = begin; i < end; ++i) a = fp8::amax_update(a, In::load(x_[i]));
    return a;
  }

  void segment_cast(uint8_t* q, float scale, int64_t begin, int64_t end) const {
    if (vec_) {
      avx512::cast(In::dtype, Out::dtype, x_, q, scale, begin, end, false, false);
      return;
    }
    for (int64_t i = begin; i < end; ++i) q[i] = Out::quantize(In::load(x_[i]), scale);
  }

  // Blocks of `output` inside the tile: contiguous row segments of the input.
  void rowwise(const Tile& t) const {
    const BlockLayout& l = p_.block;
    uint8_t* q = p_.output.ptr<uint8_t>();
    for (int64_t rb = t.r0; rb < t.r1; rb += l.rows) {
      const int64_t re = std::min(t.r1, rb + l.rows);
      for (int64_t cb = t.c0; cb < t.c1; cb += l.cols) {
        const int64_t ce = std::min(t.c1, cb + l.cols);
        float amax = 0.0f;
        for (int64_t r = rb; r < re; ++r) {
          amax = fp8::amax_update(amax, segment_amax(r * p_.k + cb, r * p_.k + ce));
        }
        const float scale =
            block_scale_out(amax, Out::kMax, kEmax, l, p_.scale_inv.data,
                            (rb / l.rows) * l.grid_cols + cb / l.cols, p_.power_2_scale,
                            p_.e8m0_floor);
        for (int64_t r = rb; r < re; ++r) segment_cast(q, scale, r * p_.k + cb, r * p_.k + ce);
      }
    }
  }

  // Tiles up to this many elements are transposed into a float buffer first, so the
  // columnwise blocks become contiguous runs for the vector amax and cast.
  static constexpr int64_t kMaxBuffered = 128 * 128;

  void columnwise_buffered(const Tile& t) const {
    const BlockLayout& l = p_.block_t;
    const int64_t h = t.r1 - t.r0, w = t.c1 - t.c0;
    thread_local std::vector<float> buffer;
    buffer.resize(kMaxBuffered);
    float* xt = buffer.data();  // xt[c * h + r] = x[t.r0 + r, t.c0 + c]
    constexpr int64_t kSub = 16;  // transpose in 16 x 16 sub-tiles that stay in L1
    for (int64_t r0 = 0; r0 < h; r0 += kSub) {
      for (int64_t c0 = 0; c0 < w; c0 += kSub) {
        const int64_t r1 = std::min(h, r0 + kSub), c1 = std::min(w, c0 + kSub);
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = x_ + (t.r0 + r) * p_.k + t.c0;
          for (int64_t c = c0; c < c1; ++c) xt[c * h + r] = In::load(row[c]);
        }
      }
    }
    uint8_t* qt = p_.output_t.ptr<uint8_t>();
    for (int64_t cb = 0; cb < w; cb += l.rows) {
      const int64_t ce = std::min(w, cb + l.rows);
      for (int64_t rb = 0; rb < h; rb += l.cols) {
        const int64_t re = std::min(h, rb + l.cols);
        float amax = 0.0f;
        for (int64_t c = cb; c < ce; ++c) amax = fp8::amax_update(amax, float_amax(xt + c * h, rb, re));
        const int64_t index = ((t.c0 + cb) / l.rows) * l.grid_cols + (t.r0 + rb) / l.cols;
        const float scale = block_scale_out(amax, Out::kMax, kEmax, l, p_.scale_inv_t.data, index,
                                            p_.power_2_scale, p_.e8m0_floor);
        for (int64_t c = cb; c < ce; ++c) float_cast(xt + c * h, qt + (t.c0 + c) * p_.m + t.r0, scale, rb, re);
      }
    }
  }

  // amax / cast of float runs xs[begin, end) (into q[begin, end)).
  float float_amax(const float* xs, int64_t begin, int64_t end) const {
    if (vec_) return avx512::amax(DType::kFloat32, xs, begin, end);
    float a = 0.0f;
    for (int64_t i = begin; i < end; ++i) a = fp8::amax_update(a, xs[i]);
    return a;
  }

  void float_cast(const float* xs, uint8_t* q, float scale, int64_t begin, int64_t end) const {
    if (vec_) {
      avx512::cast(DType::kFloat32, Out::dtype, xs, q, scale, begin, end, false, false);
      return;
    }
    for (int64_t i = begin; i < end; ++i) q[i] = Out::quantize(xs[i], scale);
  }

  // Blocks of `output_t` inside the tile: in input coordinates, l.cols rows x l.rows columns.
  void columnwise(const Tile& t) const {
    const BlockLayout& l = p_.block_t;
    const int64_t w = t.c1 - t.c0;
    const int64_t bands = (t.r1 - t.r0 + l.cols - 1) / l.cols;
    // Column amaxes per band of l.cols rows, reduced to blocks of l.rows columns.
    std::vector<float> col_amax(bands * w, 0.0f);
    for (int64_t r = t.r0; r < t.r1; ++r) {
      float* acc = col_amax.data() + ((r - t.r0) / l.cols) * w;
      const T* row = x_ + r * p_.k + t.c0;
      for (int64_t c = 0; c < w; ++c) acc[c] = fp8::amax_update(acc[c], In::load(row[c]));
    }
    const int64_t groups = (w + l.rows - 1) / l.rows;
    std::vector<float> scale(bands * groups);
    for (int64_t b = 0; b < bands; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f;
        const int64_t ge = std::min(w, (g + 1) * l.rows);
        for (int64_t c = g * l.rows; c < ge; ++c) amax = fp8::amax_update(amax, col_amax[b * w + c]);
        const int64_t index = (t.c0 / l.rows + g) * l.grid_cols + t.r0 / l.cols + b;
        scale[b * groups + g] = block_scale_out(amax, Out::kMax, kEmax, l, p_.scale_inv_t.data,
                                                index, p_.power_2_scale, p_.e8m0_floor);
      }
    }
    uint8_t* qt = p_.output_t.ptr<uint8_t>();
    for (int64_t c = t.c0; c < t.c1; ++c) {
      const float* s = scale.data() + (c - t.c0) / l.rows;
      uint8_t* out = qt + c * p_.m;
      for (int64_t r = t.r0; r < t.r1; ++r) {
        out[r] = Out::quantize(In::load(x_[r * p_.k + c]), s[((r - t.r0) / l.cols) * groups]);
      }
    }
  }

  const QuantizeBlockParams& p_;
  const T* x_;
  bool vec_;
};

// Tile edges: multiples of every block edge along that dimension, clamped to the matrix.
int64_t tile_edge(int64_t a, int64_t b, int64_t extent) {
  const int64_t l = std::lcm(a, b);
  return std::max<int64_t>(1, std::min(l, extent));
}

}  // namespace

void quantize_blockwise(const QuantizeBlockParams& p) {
  if (p.m == 0 || p.k == 0) return;
  const bool row = p.output.defined(), col = p.output_t.defined();
  const int64_t h = tile_edge(row ? p.block.rows : 1, col ? p.block_t.cols : 1, p.m);
  const int64_t w = tile_edge(row ? p.block.cols : 1, col ? p.block_t.rows : 1, p.k);
  const int64_t tr = (p.m + h - 1) / h, tc = (p.k + w - 1) / w;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (h * w));
  dispatch_high_precision(p.input.dtype, "quantize_blockwise: argument 'input'", [&](auto in) {
    dispatch_fp8(p.fp8_dtype, "quantize_blockwise: argument 'output'", [&](auto out) {
      const TileQuantizer<decltype(in), decltype(out)> tq(p);
      parallel_for(tr * tc, grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = (t / tc) * h, c0 = (t % tc) * w;
          tq.run(Tile{r0, std::min(p.m, r0 + h), c0, std::min(p.k, c0 + w)});
        }
      });
    });
  });
}

}  // namespace cpu
}  // namespace tl
