// CPU blockwise quantize: one scale per block, row-major and/or transposed
// output. Scale math: block_math.h; row kernels (vector or portable):
// quantize_block_cpu.h.
//
// One pass over the input where the columnwise blocks span few rows (1x128,
// 128x128, 1x32): the input is walked in tiles that hold whole blocks of both
// outputs (a multiple of every block edge, at least 128 rows when the
// transposed copy is wanted):
//   - 1 x n row-major blocks: one kernel call a row quantizes its blocks
//     (amaxes, scales, casts); with the transposed copy, the tile is a stripe
//     of long rows (kStripeElems, as the tensorwise cast+transpose), the row
//     pass also folds each row into the column amaxes of its band, and the
//     rows are then read again (from L2 / L3), cast with their columns' scales
//     into a line-padded byte stripe and transposed into output_t in whole lines;
//   - blocks of several rows (128 x 128): tiles of about 128 KiB, an amax pass,
//     then the cast from cache (packing the rows measured slower here); the
//     transposed copy has the same blocks, so it is the row-major bytes
//     transposed, with the same scales (where the path has copy_out, the tile
//     is cast into a scratch tile, then copied to output and transposed, so
//     that both go out with non-temporal stores);
//   - other shapes: column amaxes of each band from cache, the rows cast with
//     one scale per column into a stripe, the stripe transposed.
// Short runs of a tile's rows are prefetched ahead by the driver.
// Outputs of 8 MiB or more are written with non-temporal stores where
// aligned, as the tensorwise quantize does. Tiles run in parallel.
//
// Columnwise blocks that span all rows of a tall input (rowwise scaling's
// transposed copy: one scale per column of x) need every row before any
// cast, so they take two passes: the first (fused with the row-major blocks)
// reduces per-thread column amaxes over chunks of rows, the second casts
// stripes of rows with the finished column scales and transposes them.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "../common/backend_block.h"
#include "cpu_features.h"
#include "parallel.h"
#include "quantize_block_cpu.h"
#include "transformer_linear/block_math.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace quantize_block {
namespace {

// ---- portable row kernels ------------------------------------------------

template <typename In>
void segment_amax(const void* xv, int64_t n, int64_t seg, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    float a = amax[j];
    for (int64_t i = b; i < std::min(n, b + seg); ++i) a = fp8::amax_update(a, In::load(x[i]));
    amax[j] = a;
  }
}

template <typename In, typename Out>
void segment_cast(const void* xv, uint8_t* q, int64_t n, int64_t seg, const float* scale, bool /*stream*/) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t i = 0; i < n; ++i) q[i] = Out::quantize(In::load(x[i]), scale[i / seg]);
}

template <typename In>
void column_amax(const void* xv, int64_t n, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t i = 0; i < n; ++i) amax[i] = fp8::amax_update(amax[i], In::load(x[i]));
}

template <typename In, typename Out>
void column_cast(const void* xv, uint8_t* q, int64_t n, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t i = 0; i < n; ++i) q[i] = Out::quantize(In::load(x[i]), scale[i]);
}

void transpose(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
               int64_t ld_dst) {
  constexpr int64_t kSub = 16;  // sub-tiles whose rows and columns both stay in L1
  for (int64_t r0 = 0; r0 < rows; r0 += kSub) {
    for (int64_t c0 = 0; c0 < cols; c0 += kSub) {
      for (int64_t c = c0; c < std::min(cols, c0 + kSub); ++c) {
        for (int64_t r = r0; r < std::min(rows, r0 + kSub); ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
      }
    }
  }
}

template <typename In, typename Out>
void row_blocks(const void* xv, uint8_t* q, int64_t n, int64_t seg, const ScaleRule& rule, void* scale_inv,
                int64_t first, float* col_amax, bool /*stream*/) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    const int64_t e = std::min(n, b + seg);
    float a = 0.0f;
    for (int64_t i = b; i < e; ++i) {
      const float v = In::load(x[i]);
      a = fp8::amax_update(a, v);
      if (col_amax) col_amax[i] = fp8::amax_update(col_amax[i], v);
    }
    const float scale = block_scale_of(a, rule, scale_inv, first + j);
    for (int64_t i = b; i < e; ++i) q[i] = Out::quantize(In::load(x[i]), scale);
  }
}

void transpose_out(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld_dst,
                   bool /*stream*/) {
  transpose(src, ld_src, rows, cols, dst, ld_dst);
}

void scales(const float* amax, int64_t n, const ScaleRule& rule, void* scale_inv, float* scale) {
  for (int64_t j = 0; j < n; ++j) scale[j] = block_scale_of(amax[j], rule, scale_inv, j);
}

void no_fence() {}

// ---- driver --------------------------------------------------------------

// Elements per tile: the tile's input (128 KiB of fp32) stays in L2 between
// the row-major pass and the columnwise one.
constexpr int64_t kTileElems = 32 * 1024;
// Rows per tile when the transposed copy is written: each row of output_t
// then gets whole 64-byte lines.
constexpr int64_t kMinTransposeRows = 128;
// Elements per stripe of the 1 x n blocks with their transposed copy (and of rowwise scaling's
// second pass): 128 rows of 4096 columns, whose input (2 MiB of fp32) is read again from L2 / L3
// and whose FP8 bytes (512 KiB) stay in L2 for the transpose.
constexpr int64_t kStripeElems = 512 * 1024;
// Columnwise blocks spanning more rows than this (and all of them) take two passes.
constexpr int64_t kMaxBandRows = 256;
// Outputs of at least this many bytes are written with non-temporal stores
// (as the tensorwise quantize does): no read for ownership of their lines, and
// no eviction of the input being read.
constexpr int64_t kStreamBytes = 8 << 20;
// How far ahead the row loops prefetch the input.
constexpr int64_t kPrefetchBytes = 8 << 10;

struct Tile {
  int64_t r0, r1, c0, c1;
};

// Per-thread scratch, grown once (this runs inside parallel regions, where
// parallel_for rethrows an allocation failure after the region).
struct Scratch {
  std::vector<float> amax, scale;
  std::vector<uint8_t> stripe;
  float* floats(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// A software prefetch into all cache levels (GCC drops __builtin_prefetch in
// the row loops at -O3, so on x86 it is spelled out).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// The smallest multiple of `base` that is at least `want`, or `extent` when that is smaller.
int64_t grow(int64_t base, int64_t want, int64_t extent) {
  return std::min(extent, std::max<int64_t>(1, ceil_div(want, base)) * base);
}

class Quantizer {
 public:
  Quantizer(const QuantizeBlockParams& p, const RowKernels& kn)
      : p_(p),
        kn_(kn),
        x_(static_cast<const uint8_t*>(p.input.data)),
        esize_(element_size(p.input.dtype)),
        fp8_max_(p.fp8_dtype == DType::kFloat8E4M3 ? fp8::kE4M3Max : fp8::kE5M2Max),
        emax_(p.fp8_dtype == DType::kFloat8E4M3 ? 8 : 15),  // floor(log2(fp8_max))
        rule_{fp8_max_, emax_, p.block.e8m0, p.power_2_scale, p.e8m0_floor},
        stream_(p.m * p.k >= kStreamBytes) {}

  const void* at(int64_t r, int64_t c) const { return x_ + (r * p_.k + c) * esize_; }

  // Scale of one block from its amax; writes the block's scale_inv (float32 or E8M0 bits).
  float scale_of(float amax, const BlockLayout& l, void* scale_inv, int64_t index) const {
    const ScaleRule rule{fp8_max_, emax_, l.e8m0, p_.power_2_scale, p_.e8m0_floor};
    return block_scale_of(amax, rule, scale_inv, index);
  }

  // Row-major 1 x n blocks of rows [r0, r1) x columns [c0, c1), one kernel call a row.
  // With `col_amax`, also folds row r into col_amax + ((r - r0) / band_rows) * (c1 - c0).
  void row_blocks(const Tile& t, float* col_amax, int64_t band_rows) const {
    const BlockLayout& l = p_.block;
    const int64_t w = t.c1 - t.c0;
    uint8_t* q = p_.output.ptr<uint8_t>();
    const int64_t ahead = prefetch_rows(w);
    for (int64_t r = t.r0; r < t.r1; ++r) {
      prefetch_ahead(t, r, ahead);
      float* ca = col_amax ? col_amax + ((r - t.r0) / band_rows) * w : nullptr;
      kn_.row_blocks(at(r, t.c0), q + r * p_.k + t.c0, w, l.cols, rule_, p_.scale_inv.data,
                     r * l.grid_cols + t.c0 / l.cols, ca, stream_);
    }
  }

  // Rows of a tile can be short runs of the input (a tile spans a few KiB of
  // each of its rows), too short for the hardware prefetchers to ramp up, so
  // the row loops prefetch about kPrefetchBytes ahead: row r + ahead, and past
  // the tile's last row the first rows of the tile to its right (the next
  // tile of this thread).
  // Runs of a page or more need no help (row kernels prefetch their own): 0 rows ahead.
  int64_t prefetch_rows(int64_t w) const {
    if (kernel_prefetches(w * esize_)) return 0;
    return std::clamp<int64_t>(ceil_div(kPrefetchBytes, w * esize_), 1, 32);
  }

  void prefetch_ahead(const Tile& t, int64_t r, int64_t ahead) const {
    if (ahead == 0) return;
    int64_t rp = r + ahead, c0 = t.c0, c1 = t.c1;
    if (rp >= t.r1) {
      if (t.c1 >= p_.k) return;
      rp = t.r0 + (rp - t.r1);
      c0 = t.c1;
      c1 = std::min(p_.k, t.c1 + (t.c1 - t.c0));
      if (rp >= t.r1) return;
    }
    const char* b = static_cast<const char*>(at(rp, c0));
    const int64_t bytes = (c1 - c0) * esize_;
    for (int64_t i = 0; i < bytes; i += 64) prefetch_line(b + i);
  }

  // 1 x n row-major blocks and their transposed copy of a stripe of whole bands of long rows
  // (kStripeElems), as the tensorwise cast+transpose does: the row pass (row kernels on long
  // runs, which prefetch their own input) folds each band's column amaxes; then the rows are
  // read again (from L2 / L3) for the columnwise cast (cast_stripe_transposed). Short tiles of
  // packed rows measured 1.3-1.5x slower: their row pass reads short runs of many rows.
  void row_blocks_then_columns(const Tile& t, Scratch& s) const {
    const int64_t band_rows = p_.block_t.cols, w = t.c1 - t.c0, h = t.r1 - t.r0;
    const int64_t bands = ceil_div(h, band_rows);
    float* amax = s.floats(s.amax, bands * w);
    float* scale = s.floats(s.scale, bands * w);
    std::fill(amax, amax + bands * w, 0.0f);
    row_blocks(t, amax, band_rows);
    for (int64_t b = 0; b < bands; ++b) column_scales(amax + b * w, t.c0, w, t.r0 / band_rows + b, scale + b * w);
    cast_stripe_transposed(t, scale, w, band_rows, s);
  }

  // output_t of the tile from the column scales (row r's at scale + ((r - r0) / band_rows) * scale_row_step):
  // its rows cast into a line-padded byte stripe (rows ld bytes apart, so that a column of it does
  // not map to one cache set), transposed into output_t in whole lines.
  void cast_stripe_transposed(const Tile& t, const float* scale, int64_t scale_row_step, int64_t band_rows,
                              Scratch& s) const {
    const int64_t w = t.c1 - t.c0, h = t.r1 - t.r0, ld = ceil_div(w, 64) * 64 + 64;
    if (static_cast<int64_t>(s.stripe.size()) < h * ld + 64) s.stripe.resize(h * ld + 64);
    uint8_t* stripe = s.stripe.data() + ((64 - (reinterpret_cast<uintptr_t>(s.stripe.data()) & 63)) & 63);
    const int64_t ahead = prefetch_rows(w);
    for (int64_t r = t.r0; r < t.r1; ++r) {
      prefetch_ahead(t, r, ahead);
      kn_.column_cast(at(r, t.c0), stripe + (r - t.r0) * ld, w, scale + ((r - t.r0) / band_rows) * scale_row_step);
    }
    kn_.transpose_out(stripe, ld, h, w, p_.output_t.ptr<uint8_t>() + t.c0 * p_.m + t.r0, p_.m, stream_);
  }

  // Whether the transposed copy's blocks are the row-major blocks transposed
  // (128 x 128): the same amaxes give the same scales, so output_t is output transposed.
  bool transposed_blocks() const {
    return p_.output.defined() && p_.output_t.defined() && p_.block_t.rows == p_.block.cols &&
           p_.block_t.cols == p_.block.rows && p_.block_t.e8m0 == p_.block.e8m0;
  }

  uint8_t* output_at(const Tile& t) const { return p_.output.ptr<uint8_t>() + t.r0 * p_.k + t.c0; }

  // Both outputs of a tile of blocks of several rows (128 x 128) whose transposed copy is the
  // row-major bytes transposed: the rows are cast into a scratch tile (in cache), which is copied
  // to output and transposed into output_t, both with non-temporal stores for large outputs: the
  // output's lines are neither read for ownership nor read back from memory.
  void rowwise_and_transposed(const Tile& t, Scratch& s) const {
    const int64_t w = t.c1 - t.c0, h = t.r1 - t.r0;
    if (static_cast<int64_t>(s.stripe.size()) < h * w) s.stripe.resize(h * w);
    rowwise(t, s, nullptr, s.stripe.data(), w, false);
    kn_.copy_out(s.stripe.data(), w, h, w, output_at(t), p_.k, stream_);
    transpose_blocks(t, s.stripe.data(), w);
  }

  // output_t and scale_inv_t of the tile from its row-major blocks (transposed_blocks()), whose
  // bytes are at src (row r at src + (r - r0) * ld_src).
  void transpose_blocks(const Tile& t, const uint8_t* src, int64_t ld_src) const {
    const BlockLayout &l = p_.block, &lt = p_.block_t;
    for (int64_t br = t.r0 / l.rows; br < ceil_div(t.r1, l.rows); ++br) {
      for (int64_t bc = t.c0 / l.cols; bc < ceil_div(t.c1, l.cols); ++bc) {
        const int64_t from = br * l.grid_cols + bc, to = bc * lt.grid_cols + br;
        if (l.e8m0) {
          p_.scale_inv_t.ptr<uint8_t>()[to] = p_.scale_inv.ptr<uint8_t>()[from];
        } else {
          p_.scale_inv_t.ptr<float>()[to] = p_.scale_inv.ptr<float>()[from];
        }
      }
    }
    kn_.transpose_out(src, ld_src, t.r1 - t.r0, t.c1 - t.c0, p_.output_t.ptr<uint8_t>() + t.c0 * p_.m + t.r0, p_.m,
                      stream_);
  }

  // Row-major blocks of the tile (whole blocks: rows from a multiple of the block
  // height, columns from a multiple of its width). With `col_amax`, also folds
  // every row into the running column amaxes of columns [c0, c1).
  // The FP8 rows go to q (row r at q + (r - r0) * ldq), with non-temporal stores when `stream`.
  void rowwise(const Tile& t, Scratch& s, float* col_amax, uint8_t* q, int64_t ldq, bool stream) const {
    const BlockLayout& l = p_.block;
    const int64_t w = t.c1 - t.c0, nb = ceil_div(w, l.cols);
    float* amax = s.floats(s.amax, nb);
    float* scale = s.floats(s.scale, nb);
    const int64_t ahead = prefetch_rows(w);
    for (int64_t rb = t.r0; rb < t.r1; rb += l.rows) {
      const int64_t re = std::min(t.r1, rb + l.rows);
      std::fill(amax, amax + nb, 0.0f);
      for (int64_t r = rb; r < re; ++r) {
        prefetch_ahead(t, r, ahead);
        kn_.segment_amax(at(r, t.c0), w, l.cols, amax);
        if (col_amax) kn_.column_amax(at(r, t.c0), w, col_amax);
      }
      const int64_t first = (rb / l.rows) * l.grid_cols + t.c0 / l.cols;
      for (int64_t j = 0; j < nb; ++j) scale[j] = scale_of(amax[j], l, p_.scale_inv.data, first + j);
      for (int64_t r = rb; r < re; ++r) kn_.segment_cast(at(r, t.c0), q + (r - t.r0) * ldq, w, l.cols, scale, stream);
    }
  }

  // Columnwise scales of one band of rows from the amaxes of columns [c0, c0 + w)
  // (c0 a multiple of the block's column count): one scale per column.
  void column_scales(const float* amax, int64_t c0, int64_t w, int64_t band, float* scale) const {
    const BlockLayout& l = p_.block_t;  // l.rows columns of x per block
    if (l.rows == 1) {
      // One column a block (1x128, 1x32): the kernel's scales, their scale_inv through
      // a buffer (the scale_inv of adjacent columns are a band count apart).
      const ScaleRule rule{fp8_max_, emax_, l.e8m0, p_.power_2_scale, p_.e8m0_floor};
      thread_local std::vector<float> buffer;
      if (static_cast<int64_t>(buffer.size()) < w) buffer.resize(w);
      kn_.block_scales(amax, w, rule, buffer.data(), scale);
      const int64_t first = c0 * l.grid_cols + band;
      if (l.e8m0) {
        const auto* bits = reinterpret_cast<const uint8_t*>(buffer.data());
        for (int64_t c = 0; c < w; ++c) p_.scale_inv_t.ptr<uint8_t>()[first + c * l.grid_cols] = bits[c];
      } else {
        for (int64_t c = 0; c < w; ++c) p_.scale_inv_t.ptr<float>()[first + c * l.grid_cols] = buffer[c];
      }
      return;
    }
    for (int64_t g = 0; g < w; g += l.rows) {
      const int64_t ge = std::min(w, g + l.rows);
      float a = 0.0f;
      for (int64_t c = g; c < ge; ++c) a = fp8::amax_update(a, amax[c]);
      const float sc = scale_of(a, l, p_.scale_inv_t.data, ((c0 + g) / l.rows) * l.grid_cols + band);
      std::fill(scale + g, scale + ge, sc);
    }
  }

  // Cast rows [r0, r1) x columns [c0, c1) with one scale per column, transposed into output_t.
  void cast_transposed(const Tile& t, const float* scale, int64_t scale_row_step, int64_t band_rows,
                       Scratch& s) const {
    const int64_t w = t.c1 - t.c0;
    if (static_cast<int64_t>(s.stripe.size()) < (t.r1 - t.r0) * w) s.stripe.resize((t.r1 - t.r0) * w);
    for (int64_t r = t.r0; r < t.r1; ++r) {
      const float* row_scale = scale + ((r - t.r0) / band_rows) * scale_row_step;
      kn_.column_cast(at(r, t.c0), s.stripe.data() + (r - t.r0) * w, w, row_scale);
    }
    kn_.transpose(s.stripe.data(), w, t.r1 - t.r0, w, p_.output_t.ptr<uint8_t>() + t.c0 * p_.m + t.r0, p_.m);
  }

  // Columnwise blocks of the tile, band by band (the tile holds whole bands).
  void columnwise(const Tile& t, Scratch& s) const {
    const int64_t band_rows = p_.block_t.cols, w = t.c1 - t.c0;
    const int64_t bands = ceil_div(t.r1 - t.r0, band_rows);
    float* amax = s.floats(s.amax, w);
    float* scale = s.floats(s.scale, bands * w);
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t rb = t.r0 + b * band_rows, re = std::min(t.r1, rb + band_rows);
      std::fill(amax, amax + w, 0.0f);
      for (int64_t r = rb; r < re; ++r) kn_.column_amax(at(r, t.c0), w, amax);
      column_scales(amax, t.c0, w, rb / band_rows, scale + b * w);
    }
    cast_transposed(t, scale, w, band_rows, s);
  }

  void one_pass() const;
  void two_pass() const;

 private:
  const QuantizeBlockParams& p_;
  const RowKernels kn_;
  const uint8_t* x_;
  const int64_t esize_;
  const float fp8_max_;
  const int emax_;
  const ScaleRule rule_;  // of the row-major blocks
  const bool stream_;
};

// Runs fn(tile, scratch) over a grid of h x w tiles on up to `threads` threads, which claim runs of
// consecutive tiles (at most kClaimRunElems elements, about four per thread) one at a time, so that a
// thread the OS deschedules holds back only its run (parallel_for_claimed).
template <typename Fn>
void for_each_quantize_tile(int threads, int64_t m, int64_t k, int64_t h, int64_t w, Fn&& fn) {
  const int64_t tr = ceil_div(m, h), tc = ceil_div(k, w);
  const int64_t grain = std::max<int64_t>(1, kTileElems / 2 / (h * w));
  const int64_t run = claim_chunk(tr * tc, threads, grain, std::max<int64_t>(grain, kClaimRunElems / (h * w)));
  parallel_for_claimed(threads, tr * tc, run, /*from_end=*/false, [&](int64_t t0, int64_t t1) {
    thread_local Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = (t / tc) * h, c0 = (t % tc) * w;
      fn(Tile{r0, std::min(m, r0 + h), c0, std::min(k, c0 + w)}, scratch);
    }
  });
}

void Quantizer::one_pass() const {
  const bool row = p_.output.defined(), col = p_.output_t.defined();
  // Whole blocks of both outputs: block_t is (columns of x, rows of x).
  int64_t h = std::min(p_.m, std::lcm(row ? p_.block.rows : 1, col ? p_.block_t.cols : 1));
  int64_t w = std::min(p_.k, std::lcm(row ? p_.block.cols : 1, col ? p_.block_t.rows : 1));
  if (col) h = grow(h, kMinTransposeRows, p_.m);
  const bool row_vectors = row && p_.block.rows == 1;  // 1 x n row-major blocks
  const bool fused = row_vectors && col && p_.block_t.cols % 16 == 0;
  const int64_t tile_elems = fused ? kStripeElems : kTileElems;
  w = grow(w, tile_elems / h, p_.k);
  h = grow(h, tile_elems / w, p_.m);
  const bool reuse = transposed_blocks();
  for_each_quantize_tile(get_num_threads(), p_.m, p_.k, h, w, [&](const Tile& t, Scratch& s) {
    if (fused) {
      row_blocks_then_columns(t, s);
    } else if (reuse && kn_.copy_out) {
      rowwise_and_transposed(t, s);
    } else {
      if (row_vectors) {
        row_blocks(t, nullptr, 1);
      } else if (row) {
        rowwise(t, s, nullptr, output_at(t), p_.k, stream_ && !reuse);
      }
      if (reuse) {
        transpose_blocks(t, output_at(t), p_.k);
      } else if (col) {
        columnwise(t, s);
      }
    }
    kn_.fence();
  });
}

void Quantizer::two_pass() const {
  const bool row = p_.output.defined();
  const int64_t k = p_.k;
  // Pass 1: row-major blocks and per-thread column amaxes over chunks of whole rows
  // (no more threads, and so amax rows, than chunks).
  const int64_t h = grow(row ? p_.block.rows : 1, kTileElems / k, p_.m);
  const int threads = static_cast<int>(std::clamp<int64_t>(ceil_div(p_.m, h), 1, get_num_threads()));
  std::vector<float> partial(static_cast<size_t>(threads) * k, 0.0f);
  for_each_quantize_tile(threads, p_.m, k, h, k, [&](const Tile& t, Scratch& s) {
    float* col_amax = partial.data() + static_cast<int64_t>(omp_get_thread_num()) * k;
    if (row && p_.block.rows == 1) {
      row_blocks(t, col_amax, t.r1 - t.r0);
      kn_.fence();
    } else if (row) {
      rowwise(t, s, col_amax, output_at(t), p_.k, stream_);
      kn_.fence();
    } else {
      for (int64_t r = t.r0; r < t.r1; ++r) kn_.column_amax(at(r, 0), k, col_amax);
    }
  });
  for (int i = 1; i < threads; ++i) {
    const float* other = partial.data() + int64_t{i} * k;
    for (int64_t c = 0; c < k; ++c) partial[c] = fp8::amax_update(partial[c], other[c]);
  }
  std::vector<float> scale(k);
  column_scales(partial.data(), 0, k, 0, scale.data());
  // Pass 2: cast and transpose, stripes of long rows as in row_blocks_then_columns.
  const int64_t w = grow(1, kStripeElems / kMinTransposeRows, k);
  for_each_quantize_tile(get_num_threads(), p_.m, k, kMinTransposeRows, w, [&](const Tile& t, Scratch& s) {
    cast_stripe_transposed(t, scale.data() + t.c0, 0, kMinTransposeRows, s);
    kn_.fence();
  });
}

}  // namespace

RowKernels generic_kernels(DType in, DType out) {
  return dispatch_high_precision(in, "quantize_blockwise: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    return dispatch_fp8(out, "quantize_blockwise: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      return RowKernels{segment_amax<In>, segment_cast<In, Out>, column_amax<In>, column_cast<In, Out>, transpose,
                        row_blocks<In, Out>, transpose_out,         scales,          no_fence,        nullptr};
    });
  });
}

}  // namespace quantize_block

void quantize_blockwise(const QuantizeBlockParams& p) {
  if (p.m == 0 || p.k == 0) return;
  using namespace quantize_block;
  RowKernels kn;
  switch (current_isa()) {
    case Isa::kAvx2:
      kn = avx2_kernels(p.input.dtype, p.fp8_dtype);
      break;
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      kn = avx512_kernels(p.input.dtype, p.fp8_dtype);
      break;
    default:
      kn = generic_kernels(p.input.dtype, p.fp8_dtype);
  }
  const Quantizer quantizer(p, kn);
  // Columnwise blocks spanning every row of a tall input: the column scales need them all.
  const bool whole_columns = p.output_t.defined() && p.block_t.grid_cols == 1 && p.m > kMaxBandRows;
  if (whole_columns) {
    quantizer.two_pass();
  } else {
    quantizer.one_pass();
  }
}

}  // namespace cpu
}  // namespace tl
