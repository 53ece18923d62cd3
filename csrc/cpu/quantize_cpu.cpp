// CPU quantize family: amax, quantize (optionally with amax, transposed
// output and bias gradient), dequantize. Element math: fp8_math.h.
#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <vector>

#include "../common/backend.h"
#include "cpu_features.h"
#include "parallel.h"
#include "quantize_cpu_isa.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per thread at least
constexpr int64_t kTile = 64;        // transpose tile edge
// Outputs larger than this bypass the cache (non-temporal stores): they
// would not stay there anyway, and skipping the read-for-ownership saves
// a fifth of the traffic of an fp32 -> fp8 cast.
constexpr int64_t kStreamBytes = 8 << 20;
// Input bytes per chunk of the amax pass, which walks each thread's range
// backward (for_chunks_backward): 256 KiB chunks measured 2-6% slower than
// one forward walk on an input not in cache (the prefetchers ramp up again at
// each chunk), 2 MiB as fast.
constexpr int64_t kAmaxChunkBytes = 2 << 20;

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

// Per-thread results are written to a slot per OpenMP thread, so the slots
// are sized from the same `threads` that sizes the team (read once per call).
//
// The input is `n` units of `unit` elements (whole rows where unit is the row
// length), split among threads as parallel_for(threads, n, grain) splits them:
// the partition of the cast that follows current scaling's amax, so that each
// core reads again what it read. Each thread walks its part backward, in
// chunks (each read forward): the cache then holds the part's beginning, where
// the cast starts; and a tensor just written or read front to back (the
// output of the op before) has its end in cache, where this pass starts.
// The maximum does not depend on the order (but for which NaN's payload).
template <typename In>
float parallel_amax(const typename In::storage* x, int64_t n, int threads, int64_t unit = 1,
                    int64_t grain = kGrain) {
  std::vector<float> partial(static_cast<size_t>(threads), 0.0f);
  const QuantizeKernels* vec = vector_kernels();
  // Chunk bounds at multiples of 64 elements: whole cache lines.
  const int64_t chunk = std::max<int64_t>(64, kAmaxChunkBytes / static_cast<int64_t>(sizeof(x[0])) / 64 * 64);
  parallel_for(threads, n, grain, [&](int64_t b, int64_t e) {
    float amax = 0.0f;
    for_chunks_backward(b * unit, e * unit, chunk, [&](int64_t lo, int64_t hi) {
      amax = fp8::amax_update(amax, vec ? vec->amax(In::dtype, x, lo, hi) : amax_range<In>(x, lo, hi));
    });
    partial[static_cast<size_t>(omp_get_thread_num())] = amax;
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

// Column sums in fp32 over fixed 256-row blocks, added in block order, so the
// result does not depend on the thread count.
template <typename In, typename Bias>
void column_sums(const typename In::storage* x, int64_t rows, int64_t cols,
                 typename Bias::storage* out) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  std::vector<float> partial(static_cast<size_t>(std::max<int64_t>(blocks, 1) * cols), 0.0f);
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* acc = partial.data() + blk * cols;
      for (int64_t r = blk * kBlock; r < std::min(rows, (blk + 1) * kBlock); ++r) {
        for (int64_t c = 0; c < cols; ++c) acc[c] += In::load(x[r * cols + c]);
      }
    }
  });
  for (int64_t c = 0; c < cols; ++c) {
    float s = 0.0f;
    for (int64_t blk = 0; blk < blocks; ++blk) s += partial[blk * cols + c];
    out[c] = Bias::store(s);
  }
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
  // The cast+transpose splits rows among threads: the amax pass splits them alike.
  const int64_t row_grain = std::max<int64_t>(kTile, kGrain / std::max<int64_t>(p.cols, 1));
  if (p.current_scaling) {
    known_amax = p.output_t.defined() && p.cols > 0 ? parallel_amax<In>(x, p.rows, threads, p.cols, row_grain)
                                                    : parallel_amax<In>(x, n, threads);
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
    parallel_for(threads, p.rows, row_grain, [&](int64_t r0, int64_t r1) {
      const int t = omp_get_thread_num();
      partial[static_cast<size_t>(t)] =
          vec ? vec->cast_transpose(In::dtype, Out::dtype, x, q, qt, scratch.get() + t * stripe, scale, p.rows,
                                    p.cols, r0, r1, stream)
              : cast_transpose_rows<In, Out>(x, q, qt, scale, p.rows, p.cols, r0, r1);
    });
  } else {
    // Under current scaling the amax is known already; only delayed scaling
    // fuses it into the cast.
    const bool want_amax = p.amax.defined() && !p.current_scaling;
    const bool stream = n >= kStreamBytes;
    parallel_for(threads, n, kGrain, [&](int64_t b, int64_t e) {
      partial[static_cast<size_t>(omp_get_thread_num())] =
          vec ? vec->cast(In::dtype, Out::dtype, x, q, scale, b, e, want_amax, stream)
              : cast_range<In, Out>(x, q, scale, b, e);
    });
  }
  if (p.amax.defined()) {
    float amax = 0.0f;
    for (float a : partial) amax = fp8::amax_update(amax, a);
    *p.amax.ptr<float>() = p.current_scaling ? known_amax : amax;
  }
  *p.scale_inv.ptr<float>() = 1.0f / scale;
  if (p.dbias.defined()) {
    dispatch_high_precision(p.dbias.dtype, "quantize: argument 'dbias'", [&](auto bias_tag) {
      using Bias = decltype(bias_tag);
      column_sums<In, Bias>(x, p.rows, p.cols, p.dbias.ptr<typename Bias::storage>());
    });
  }
}

}  // namespace

void amax(const TensorDesc& input, const TensorDesc& amax_out) {
  dispatch_high_precision(input.dtype, "amax: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    *amax_out.ptr<float>() = parallel_amax<In>(input.ptr<typename In::storage>(), input.numel(),
                                               std::max(1, get_num_threads()));
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

}  // namespace cpu
}  // namespace tl
