// CPU quantize family: amax, quantize (optionally with amax, transposed
// output and bias gradient), dequantize, transpose of FP8 data, bias gradient on its own. Element math:
// fp8_math.h.
#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include "../common/backend.h"
#include "cpu_features.h"
#include "parallel.h"
#include "quantize_cpu_isa.h"
#include "quantize_rows_cpu.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per thread at least
constexpr int64_t kTile = 64;        // transpose tile edge
// The FP8 transpose's unit of work: rows x columns of its input.
constexpr int64_t kTransposeRows = 256;
constexpr int64_t kTransposeCols = 64;
// Outputs larger than this bypass the cache (non-temporal stores): they
// would not stay there anyway, and skipping the read-for-ownership saves
// a fifth of the traffic of an fp32 -> fp8 cast.
constexpr int64_t kStreamBytes = 8 << 20;
// Input bytes per chunk of the amax and cast passes at most (threads claim
// chunks, so several per thread let the others go on past a descheduled one),
// and per piece of the amax pass's backward walk within a chunk
// (for_chunks_backward).
constexpr int64_t kChunkBytes = kClaimChunkBytes;

// The vector kernels of the path in use, or null on the portable path.
const QuantizeKernels* vector_kernels() {
  static const QuantizeKernels avx2 = isa_supported(Isa::kAvx2) ? avx2_quantize_kernels() : QuantizeKernels{};
  static const QuantizeKernels avx512 =
      isa_supported(Isa::kAvx512) ? avx512_quantize_kernels() : QuantizeKernels{};
  switch (current_isa()) {
    case Isa::kAvx2:
      return &avx2;
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return &avx512;
    default:
      return nullptr;
  }
}

// Uninitialized scratch of a * b * c bytes, or std::bad_alloc (Python
// MemoryError) when the size overflows or the memory cannot be had. nothrow
// new plus a check, so that a failure is an exception under AddressSanitizer
// as well (whose throwing operator new aborts instead).
std::unique_ptr<uint8_t[]> allocate_scratch(int64_t a, int64_t b, int64_t c) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(a, b, &bytes) || __builtin_mul_overflow(bytes, c, &bytes)) {
    throw std::bad_alloc();
  }
  std::unique_ptr<uint8_t[]> p(new (std::nothrow) uint8_t[static_cast<size_t>(bytes)]);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

template <typename In>
float amax_range(const typename In::storage* x, int64_t begin, int64_t end) {
  // Eight independent running maxima let the compiler vectorize the loop.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] = fp8::amax_update(acc[j], In::load(x[i + j]));
  }
  for (; i < end; ++i) acc[0] = fp8::amax_update(acc[0], In::load(x[i]));
  float r = 0.0f;
  for (float a : acc) r = fp8::amax_update(r, a);
  return r;
}

// How the amax and cast passes cut their input: `n` units of `unit` elements
// (whole rows where unit is the row length), in chunks of `chunk` units that
// the threads claim (parallel_for_claimed).
struct Chunking {
  int64_t n, unit, chunk;
};

// Chunks of at least `grain` units, at most kChunkBytes of input where that
// is more, about four per thread (one thread: as large as allowed); flat
// chunks (unit 1) span whole cache lines.
template <typename In>
Chunking chunking(int64_t n, int64_t unit, int threads, int64_t grain) {
  const int64_t unit_bytes = std::max<int64_t>(1, unit) * static_cast<int64_t>(sizeof(typename In::storage));
  int64_t chunk = claim_chunk(n, threads, grain, std::max(grain, kChunkBytes / unit_bytes));
  if (unit == 1) chunk = (chunk + 63) / 64 * 64;
  return Chunking{n, unit, chunk};
}

// Per-thread results are kept in a slot per OpenMP thread, so the slots are
// sized from the same `threads` that sizes the team (read once per call).
//
// The chunks are claimed from the end, and each is walked backward in pieces
// (each read forward): a tensor just written or read front to back (the output
// of the op before) has its end in cache, where this pass starts; the cast that
// follows current scaling's amax claims the same chunks from the start, which
// the cache then holds. The maximum does not depend on the order (but for
// which NaN's payload).
template <typename In>
float parallel_amax(const typename In::storage* x, const Chunking& c, int threads) {
  std::vector<float> partial(static_cast<size_t>(threads), 0.0f);
  const QuantizeKernels* vec = vector_kernels();
  // Piece bounds at multiples of 64 elements: whole cache lines.
  const int64_t piece = std::max<int64_t>(64, kChunkBytes / static_cast<int64_t>(sizeof(x[0])) / 64 * 64);
  parallel_for_claimed(threads, c.n, c.chunk, /*from_end=*/true, [&](int64_t b, int64_t e) {
    float amax = 0.0f;
    for_chunks_backward(b * c.unit, e * c.unit, piece, [&](int64_t lo, int64_t hi) {
      amax = fp8::amax_update(amax, vec ? vec->amax(In::dtype, x, lo, hi) : amax_range<In>(x, lo, hi));
    });
    float& slot = partial[static_cast<size_t>(omp_get_thread_num())];
    slot = fp8::amax_update(slot, amax);
  });
  float r = 0.0f;
  for (float a : partial) r = fp8::amax_update(r, a);
  return r;
}

// Row-major cast of [begin, end), returning the amax of what it read.
template <typename In, typename Out>
float cast_range(const typename In::storage* x, uint8_t* q, float scale, int64_t begin,
                 int64_t end) {
  float amax = 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    const float v = In::load(x[i]);
    amax = fp8::amax_update(amax, v);
    q[i] = Out::quantize(v, scale);
  }
  return amax;
}

// One pass over rows [r0, r1): row-major output, transposed output, amax.
template <typename In, typename Out>
float cast_transpose_rows(const typename In::storage* x, uint8_t* q, uint8_t* qt, float scale,
                          int64_t rows, int64_t cols, int64_t r0, int64_t r1) {
  float amax = 0.0f;
  uint8_t tile[kTile][kTile];
  for (int64_t rb = r0; rb < r1; rb += kTile) {
    const int64_t re = std::min(r1, rb + kTile);
    for (int64_t cb = 0; cb < cols; cb += kTile) {
      const int64_t ce = std::min(cols, cb + kTile);
      for (int64_t r = rb; r < re; ++r) {
        for (int64_t c = cb; c < ce; ++c) {
          const float v = In::load(x[r * cols + c]);
          amax = fp8::amax_update(amax, v);
          const uint8_t b = Out::quantize(v, scale);
          tile[c - cb][r - rb] = b;
          if (q) q[r * cols + c] = b;
        }
      }
      for (int64_t c = cb; c < ce; ++c) {
        std::copy(&tile[c - cb][0], &tile[c - cb][re - rb], qt + c * rows + rb);
      }
    }
  }
  return amax;
}

// Column sums in fp32 over fixed kSumRows-row blocks, added in block order, so that the bias gradient does
// not depend on the thread count or on which pass over the input adds the rows up. Within a block, runs of
// kSumRun rows are summed first and the runs added to the block's sums: the rounding error of a block then
// grows with 2 x 16 additions, not 256. The order is reference.bias_grad's (BIAS_GRAD_RUN, BIAS_GRAD_BLOCK).
constexpr int64_t kSumRows = 256;
constexpr int64_t kSumRun = 16;

template <typename In>
class ColumnSums {
 public:
  // The sums are allocated here, outside any parallel region (where a failure would abort).
  ColumnSums(int64_t rows, int64_t cols)
      : rows_(rows),
        cols_(cols),
        block_(static_cast<size_t>(std::max<int64_t>(1, blocks(rows)) * cols), 0.0f),
        run_(block_.size(), 0.0f) {}

  static int64_t blocks(int64_t rows) { return (rows + kSumRows - 1) / kSumRows; }

  // Adds row r; the rows of a block are added by one thread, in order.
  void add_row(const typename In::storage* x, int64_t r) {
    float* run = run_.data() + r / kSumRows * cols_;
    const typename In::storage* row = x + r * cols_;
    if (r % kSumRun == 0) {
      for (int64_t c = 0; c < cols_; ++c) run[c] = In::load(row[c]);
    } else {
      for (int64_t c = 0; c < cols_; ++c) run[c] += In::load(row[c]);
    }
    if (r % kSumRun == kSumRun - 1 || r + 1 == rows_) {
      float* acc = block_.data() + r / kSumRows * cols_;
      for (int64_t c = 0; c < cols_; ++c) acc[c] += run[c];
    }
  }

  template <typename Bias>
  void finish(typename Bias::storage* out) const {
    const int64_t n = static_cast<int64_t>(block_.size()) / std::max<int64_t>(cols_, 1);
    for (int64_t c = 0; c < cols_; ++c) {
      float s = 0.0f;
      for (int64_t blk = 0; blk < n; ++blk) s += block_[blk * cols_ + c];
      out[c] = Bias::store(s);
    }
  }

 private:
  int64_t rows_, cols_;
  std::vector<float> block_;  // the sums of each block's runs so far
  std::vector<float> run_;    // each block's current run of rows
};

// Rows a pass that also adds up the columns reads (amax or cast) in one kernel call before adding them:
// about this many bytes, so that they are still in L1 (and narrow rows do not cost a call each).
constexpr int64_t kSumGroupBytes = 16 << 10;

// fn(r0, r1) over groups of rows of blocks [b, e) (a group never spans two blocks), each block's in order.
template <typename In, typename Fn>
void for_row_groups(int64_t b, int64_t e, int64_t rows, int64_t cols, bool blocks_backward, Fn&& fn) {
  const int64_t group = std::max<int64_t>(
      1, kSumGroupBytes / std::max<int64_t>(1, cols * static_cast<int64_t>(sizeof(typename In::storage))));
  for (int64_t i = b; i < e; ++i) {
    const int64_t blk = blocks_backward ? e - 1 - (i - b) : i;
    const int64_t end = std::min(rows, (blk + 1) * kSumRows);
    for (int64_t r = blk * kSumRows; r < end; r += group) fn(r, std::min(end, r + group));
  }
}

// Chunks of whole kSumRows-row blocks for a pass that also adds up the columns (about four per thread, at
// most kChunkBytes of input where a block is smaller).
template <typename In>
int64_t block_chunk(int64_t rows, int64_t cols, int threads) {
  const int64_t block_bytes = std::max<int64_t>(1, kSumRows * cols * static_cast<int64_t>(sizeof(typename In::storage)));
  return claim_chunk(ColumnSums<In>::blocks(rows), threads, 1, std::max<int64_t>(1, kChunkBytes / block_bytes));
}

// parallel_amax of a (rows, cols) input that also adds every row to `sums` right after measuring it (from
// L1): one read of the input for both. Chunks of whole blocks, claimed from the end and walked backward a
// block at a time, each block's rows forward in groups (for_row_groups).
template <typename In>
float parallel_amax_and_sums(const typename In::storage* x, int64_t rows, int64_t cols, int threads,
                             ColumnSums<In>& sums) {
  std::vector<float> partial(static_cast<size_t>(threads), 0.0f);
  const QuantizeKernels* vec = vector_kernels();
  const int64_t blocks = ColumnSums<In>::blocks(rows);
  parallel_for_claimed(threads, blocks, block_chunk<In>(rows, cols, threads), /*from_end=*/true,
                       [&](int64_t b, int64_t e) {
    float amax = 0.0f;
    for_row_groups<In>(b, e, rows, cols, /*blocks_backward=*/true, [&](int64_t r0, int64_t r1) {
      const int64_t lo = r0 * cols, hi = r1 * cols;
      amax = fp8::amax_update(amax, vec ? vec->amax(In::dtype, x, lo, hi) : amax_range<In>(x, lo, hi));
      for (int64_t r = r0; r < r1; ++r) sums.add_row(x, r);
    });
    float& slot = partial[static_cast<size_t>(omp_get_thread_num())];
    slot = fp8::amax_update(slot, amax);
  });
  float r = 0.0f;
  for (float a : partial) r = fp8::amax_update(r, a);
  return r;
}

// The column sums as a pass of their own (where no other pass over the rows is fused with them).
template <typename In>
void add_all_rows(const typename In::storage* x, int64_t rows, ColumnSums<In>& sums) {
  parallel_for(ColumnSums<In>::blocks(rows), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t r = b0 * kSumRows; r < std::min(rows, b1 * kSumRows); ++r) sums.add_row(x, r);
  });
}

template <typename In, typename Out>
void quantize_impl(const QuantizeParams& p) {
  using InT = typename In::storage;
  const InT* x = p.input.ptr<InT>();
  const int64_t n = p.input.numel();
  float* scale_ptr = p.scale.ptr<float>();
  const int threads = std::max(1, get_num_threads());
  float scale;
  float known_amax = 0.0f;
  // The cast+transpose cuts whole rows: the amax pass cuts them alike.
  const bool transposed = p.output_t.defined() && p.cols > 0;
  const int64_t row_grain = std::max<int64_t>(kTile, kGrain / std::max<int64_t>(p.cols, 1));
  const Chunking chunks =
      transposed ? chunking<In>(p.rows, p.cols, threads, row_grain) : chunking<In>(n, 1, threads, kGrain);
  // The bias gradient's column sums ride along the pass that reads every row first: current scaling's amax
  // pass, or delayed scaling's row-major cast; the cast + transpose leaves them a pass of their own.
  std::optional<ColumnSums<In>> sums;
  if (p.dbias.defined()) sums.emplace(p.rows, p.cols);
  bool summed = false;
  if (p.current_scaling) {
    if (sums && !transposed) {
      known_amax = parallel_amax_and_sums<In>(x, p.rows, p.cols, threads, *sums);
      summed = true;
    } else {
      known_amax = parallel_amax<In>(x, chunks, threads);
    }
    scale = fp8::compute_scale(known_amax, Out::kMax, std::ldexp(1.0f, -p.margin), 1.0f);
    *scale_ptr = scale;
  } else {
    scale = *scale_ptr;
  }
  uint8_t* q = p.output.defined() ? p.output.ptr<uint8_t>() : nullptr;
  uint8_t* qt = p.output_t.defined() ? p.output_t.ptr<uint8_t>() : nullptr;

  std::vector<float> partial(static_cast<size_t>(threads), 0.0f);
  const QuantizeKernels* vec = vector_kernels();
  if (qt != nullptr) {
    const bool stream = n >= kStreamBytes;
    // The vector path casts a stripe of rows into scratch before transposing
    // it; the scratch is allocated here, outside the parallel region (an
    // allocation failure inside would abort).
    std::unique_ptr<uint8_t[]> scratch;
    int64_t stripe = 0;  // bytes per thread
    if (vec && p.rows > 0) {
      if (p.cols > (int64_t{1} << 56)) throw std::bad_alloc();  // transpose_scratch_ld would overflow
      const int64_t stripe_rows = std::min(transpose_stripe_rows(p.cols), p.rows);
      scratch = allocate_scratch(stripe_rows, transpose_scratch_ld(p.cols), threads);  // checks the products
      stripe = stripe_rows * transpose_scratch_ld(p.cols);
    }
    parallel_for_claimed(threads, chunks.n, chunks.chunk, /*from_end=*/false, [&](int64_t r0, int64_t r1) {
      const int t = omp_get_thread_num();
      const float amax =
          vec ? vec->cast_transpose(In::dtype, Out::dtype, x, q, qt, scratch.get() + t * stripe, scale, p.rows,
                                    p.cols, r0, r1, stream)
              : cast_transpose_rows<In, Out>(x, q, qt, scale, p.rows, p.cols, r0, r1);
      partial[static_cast<size_t>(t)] = fp8::amax_update(partial[static_cast<size_t>(t)], amax);
    });
  } else {
    // Under current scaling the amax is known already; only delayed scaling
    // fuses it into the cast.
    const bool want_amax = p.amax.defined() && !p.current_scaling;
    const bool stream = n >= kStreamBytes;
    const auto cast = [&](int64_t b, int64_t e) {
      return vec ? vec->cast(In::dtype, Out::dtype, x, q, scale, b, e, want_amax, stream)
                 : cast_range<In, Out>(x, q, scale, b, e);
    };
    if (sums && !summed) {
      // A group of rows at a time, each row added to the sums from L1 after the group's cast: chunks of
      // whole blocks.
      parallel_for_claimed(threads, ColumnSums<In>::blocks(p.rows), block_chunk<In>(p.rows, p.cols, threads),
                           /*from_end=*/false, [&](int64_t b, int64_t e) {
        float amax = 0.0f;
        for_row_groups<In>(b, e, p.rows, p.cols, /*blocks_backward=*/false, [&](int64_t r0, int64_t r1) {
          amax = fp8::amax_update(amax, cast(r0 * p.cols, r1 * p.cols));
          for (int64_t r = r0; r < r1; ++r) sums->add_row(x, r);
        });
        float& slot = partial[static_cast<size_t>(omp_get_thread_num())];
        slot = fp8::amax_update(slot, amax);
      });
      summed = true;
    } else {
      parallel_for_claimed(threads, chunks.n, chunks.chunk, /*from_end=*/false, [&](int64_t b, int64_t e) {
        float& slot = partial[static_cast<size_t>(omp_get_thread_num())];
        slot = fp8::amax_update(slot, cast(b, e));
      });
    }
  }
  if (p.amax.defined()) {
    float amax = 0.0f;
    for (float a : partial) amax = fp8::amax_update(amax, a);
    *p.amax.ptr<float>() = p.current_scaling ? known_amax : amax;
  }
  *p.scale_inv.ptr<float>() = 1.0f / scale;
  if (sums) {
    if (!summed) add_all_rows<In>(x, p.rows, *sums);
    dispatch_high_precision(p.dbias.dtype, "quantize: argument 'dbias'", [&](auto bias_tag) {
      using Bias = decltype(bias_tag);
      sums->template finish<Bias>(p.dbias.ptr<typename Bias::storage>());
    });
  }
}

// RowCast's cast of elements [begin, end), the pass quantize_impl runs over
// chunks (no streaming stores: the caller reads the rows back right away).
template <typename In, typename Out>
float cast_elements(const QuantizeParams& p, float scale, int64_t begin, int64_t end, bool want_amax) {
  const auto* x = p.input.ptr<typename In::storage>();
  uint8_t* q = p.output.ptr<uint8_t>();
  const QuantizeKernels* vec = vector_kernels();
  return vec ? vec->cast(In::dtype, Out::dtype, x, q, scale, begin, end, want_amax, /*stream=*/false)
             : cast_range<In, Out>(x, q, scale, begin, end);
}

}  // namespace

RowCast::RowCast(const QuantizeParams& p) : p_(p) {
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_fp8(p.fp8_dtype, "quantize: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      cast_ = &cast_elements<In, Out>;
      if (p.current_scaling) {
        const int threads = std::max(1, get_num_threads());
        known_amax_ = parallel_amax<In>(p.input.ptr<typename In::storage>(),
                                        chunking<In>(p.input.numel(), 1, threads, kGrain), threads);
        scale_ = fp8::compute_scale(known_amax_, Out::kMax, std::ldexp(1.0f, -p.margin), 1.0f);
        *p.scale.ptr<float>() = scale_;
      } else {
        scale_ = *p.scale.ptr<float>();
      }
    });
  });
  *p.scale_inv.ptr<float>() = 1.0f / scale_;
}

void RowCast::cast_rows(int64_t r0, int64_t r1) {
  if (r1 <= r0) return;
  const bool want_amax = p_.amax.defined() && !p_.current_scaling;
  const float amax = cast_(p_, scale_, r0 * p_.cols, r1 * p_.cols, want_amax);
  if (!want_amax) return;
  float seen = amax_.load(std::memory_order_relaxed);
  while (!amax_.compare_exchange_weak(seen, fp8::amax_update(seen, amax), std::memory_order_relaxed)) {
  }
}

void RowCast::finish() const {
  if (p_.amax.defined()) *p_.amax.ptr<float>() = p_.current_scaling ? known_amax_ : amax_.load();
}

void amax(const TensorDesc& input, const TensorDesc& amax_out) {
  dispatch_high_precision(input.dtype, "amax: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    const int threads = std::max(1, get_num_threads());
    *amax_out.ptr<float>() = parallel_amax<In>(input.ptr<typename In::storage>(),
                                               chunking<In>(input.numel(), 1, threads, kGrain), threads);
  });
}

void quantize(const QuantizeParams& p) {
  dispatch_high_precision(p.input.dtype, "quantize: argument 'input'", [&](auto in_tag) {
    dispatch_fp8(p.fp8_dtype, "quantize: argument 'output'", [&](auto out_tag) {
      quantize_impl<decltype(in_tag), decltype(out_tag)>(p);
    });
  });
}

void dequantize(const TensorDesc& input, const TensorDesc& scale_inv, const TensorDesc& output) {
  const float s = *scale_inv.ptr<float>();
  const uint8_t* q = input.ptr<uint8_t>();
  dispatch_fp8(input.dtype, "dequantize: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_high_precision(output.dtype, "dequantize: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      auto* y = output.ptr<typename Out::storage>();
      const QuantizeKernels* vec = vector_kernels();
      parallel_for(input.numel(), kGrain, [&](int64_t b, int64_t e) {
        if (vec) return vec->dequantize(In::dtype, Out::dtype, q, s, y, b, e);
        for (int64_t i = b; i < e; ++i) y[i] = Out::store(In::load(q[i]) * s);
      });
    });
  });
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols, through kTile x kTile tiles.
void transpose_bytes_portable(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                              int64_t ld_dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
    }
  }
}

void transpose(const TensorDesc& input, const TensorDesc& output) {
  const int64_t rows = input.size(-2), cols = input.size(-1);
  const int64_t matrices = input.ndim == 3 ? input.shape[0] : 1;
  if (rows == 0 || cols == 0 || matrices == 0) return;
  // Units of kTransposeRows x kTransposeCols bytes, a column of tiles after another: a unit reads a few
  // kilobytes of a few rows and writes as much to kTransposeCols output rows, where a unit of whole
  // columns would touch a page per input row (a TLB miss each, for rows a page long).
  const int64_t row_tiles = (rows + kTransposeRows - 1) / kTransposeRows;
  const int64_t col_tiles = (cols + kTransposeCols - 1) / kTransposeCols;
  const int64_t unit_bytes = std::min(rows, kTransposeRows) * std::min(cols, kTransposeCols);
  const int threads = std::max(1, get_num_threads());
  const int64_t units = matrices * col_tiles * row_tiles;
  const int64_t chunk = claim_chunk(units, threads, std::max<int64_t>(1, kGrain / unit_bytes),
                                    std::max<int64_t>(1, kChunkBytes / unit_bytes));
  const QuantizeKernels* vec = vector_kernels();
  const uint8_t* src = input.ptr<uint8_t>();
  uint8_t* dst = output.ptr<uint8_t>();
  parallel_for_claimed(threads, units, chunk, /*from_end=*/false, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t m = u / (col_tiles * row_tiles), tile = u % (col_tiles * row_tiles);
      const int64_t c0 = tile / row_tiles * kTransposeCols, r0 = tile % row_tiles * kTransposeRows;
      const int64_t nc = std::min(kTransposeCols, cols - c0), nr = std::min(kTransposeRows, rows - r0);
      const uint8_t* s = src + m * rows * cols + r0 * cols + c0;
      uint8_t* d = dst + m * rows * cols + c0 * rows + r0;
      if (vec) {
        vec->transpose(s, cols, nr, nc, d, rows);
      } else {
        transpose_bytes_portable(s, cols, nr, nc, d, rows);
      }
    }
  });
}

void bias_grad(const TensorDesc& input, const TensorDesc& dbias) {
  const int64_t cols = input.ndim > 0 ? input.size(-1) : 1;
  const int64_t rows = cols > 0 ? input.numel() / cols : 0;
  dispatch_high_precision(input.dtype, "bias_grad: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    ColumnSums<In> sums(rows, cols);
    add_all_rows<In>(input.ptr<typename In::storage>(), rows, sums);
    dispatch_high_precision(dbias.dtype, "bias_grad: argument 'dbias'", [&](auto bias_tag) {
      using Bias = decltype(bias_tag);
      sums.template finish<Bias>(dbias.ptr<typename Bias::storage>());
    });
  });
}

}  // namespace cpu
}  // namespace tl
