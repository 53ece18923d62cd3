// The quantize range kernels (quantize_cpu_isa.h) built on one path's lane
// kernels. Textually included by each path's quantize_cpu_<isa>.cpp inside
// `namespace tl::cpu::<isa> { namespace {`, after its lane kernels
// (quantize_lanes_<isa>.h) and its dequantize_range, which the unqualified
// names below resolve to:
//   amax_range<In>(x, begin, end)
//   cast_range<In, Out, kAmax, kStream>(x, q, scale, begin, end)
//   dequantize_range<In, Out>(q, scale_inv, y, begin, end)
//   stream_line(dst, src): one 64-byte line, non-temporal, dst 64-aligned
//   transpose_bytes(src, ld_src, rows, cols, dst, ld_dst): a byte matrix transposed
// Each path thus compiles its own copy with its own instruction set, with
// internal linkage, so the linker never merges the two. The including file
// includes <algorithm>, <cstring>, quantize_cpu_isa.h, transpose_bytes_sse2.h
// and transformer_linear/dispatch.h.

// Cast + transpose in stripes of transpose_stripe_rows(cols) rows. A stripe's rows
// are cast, reading the input front to back as the row-major cast does, into
// `scratch`, whose row stride is padded by a cache line: with a power-of-two
// stride such as 4096 every row of the stripe would fall into one L1 set, more
// lines than it has ways, and the transpose would read from L2 or memory. The
// row-major output is copied from each scratch row while it is in L1. The
// stripe, still in L2, then goes out transposed: 16x16 byte blocks in
// registers, gathered per 16 output rows into whole 64-byte lines, written with
// non-temporal stores when the outputs are too large to stay in cache
// (`stream`): each output line is written once, in full, so the
// read-for-ownership of a cached store would be wasted traffic.

// dst[0, n) = src[0, n): whole aligned lines with non-temporal stores when
// `stream`, the ragged ends (and everything otherwise) with plain ones.
inline void copy_out(uint8_t* dst, const uint8_t* src, int64_t n, bool stream) {
  if (!stream) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return;
  }
  const int64_t head = std::min<int64_t>(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
  std::memcpy(dst, src, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + 64 <= n; i += 64) stream_line(dst + i, src + i);
  std::memcpy(dst + i, src + i, static_cast<size_t>(n - i));
}

// qt[c * ld_dst + r] = stripe[r * ld + c] for r < nr (<= kTransposeStripeRows),
// c < nc. Reads up to 15 bytes past column nc of each row (the scratch padding).
inline void transpose_stripe(const uint8_t* stripe, int64_t ld, int64_t nr, int64_t nc, uint8_t* qt,
                             int64_t ld_dst, bool stream) {
  alignas(64) uint8_t lines[16 * kTransposeStripeRows];
  for (int64_t c = 0; c < nc; c += 16) {
    for (int64_t r = 0; r < nr; r += 16) {
      __m128i block[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        block[i] = r + i < nr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(stripe + (r + i) * ld + c))
                              : _mm_setzero_si128();
      }
      sse2::transpose16x16(block);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        _mm_store_si128(reinterpret_cast<__m128i*>(lines + j * kTransposeStripeRows + r), block[j]);
      }
    }
    const int64_t ncols = std::min<int64_t>(16, nc - c);
    for (int64_t j = 0; j < ncols; ++j) {
      uint8_t* out = qt + (c + j) * ld_dst;
      const uint8_t* line = lines + j * kTransposeStripeRows;
      if (stream && nr % 64 == 0 && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
        for (int64_t b = 0; b < nr; b += 64) stream_line(out + b, line + b);
      } else {
        std::memcpy(out, line, static_cast<size_t>(nr));
      }
    }
  }
}

template <typename In, typename Out>
float cast_transpose_rows(const typename In::storage* x, uint8_t* q, uint8_t* qt, uint8_t* scratch,
                          float scale, int64_t rows, int64_t cols, int64_t r0, int64_t r1, bool stream) {
  static_assert(kTransposeStripeRows % 64 == 0, "transpose_stripe writes whole 64-byte lines");
  const int64_t ld = transpose_scratch_ld(cols);
  const int64_t stripe_rows = transpose_stripe_rows(cols);
  float amax = 0.0f;
  for (int64_t rb = r0; rb < r1; rb += stripe_rows) {
    const int64_t nr = std::min(r1, rb + stripe_rows) - rb;
    for (int64_t r = 0; r < nr; ++r) {
      uint8_t* row = scratch + r * ld;
      amax = fp8::amax_update(amax, cast_range<In, Out, true, false>(x + (rb + r) * cols, row, scale, 0, cols));
      if (q != nullptr) copy_out(q + (rb + r) * cols, row, cols, stream);
    }
    transpose_stripe(scratch, ld, nr, cols, qt + rb, rows, stream);
  }
  if (stream) _mm_sfence();
  return amax;
}

template <typename Fn>
decltype(auto) dispatch_in_out(DType in, DType out, Fn&& fn) {
  return dispatch_high_precision(in, "quantize: argument 'input'", [&](auto in_tag) {
    return dispatch_fp8(out, "quantize: argument 'output'",
                        [&](auto out_tag) { return fn(in_tag, out_tag); });
  });
}

float amax(DType in, const void* x, int64_t begin, int64_t end) {
  return dispatch_high_precision(in, "amax: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    return amax_range<In>(static_cast<const typename In::storage*>(x), begin, end);
  });
}

float cast(DType in, DType out, const void* x, uint8_t* q, float scale, int64_t begin, int64_t end,
           bool want_amax, bool stream) {
  return dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    const auto* xs = static_cast<const typename In::storage*>(x);
    if (want_amax) {
      return stream ? cast_range<In, Out, true, true>(xs, q, scale, begin, end)
                    : cast_range<In, Out, true, false>(xs, q, scale, begin, end);
    }
    return stream ? cast_range<In, Out, false, true>(xs, q, scale, begin, end)
                  : cast_range<In, Out, false, false>(xs, q, scale, begin, end);
  });
}

float cast_transpose(DType in, DType out, const void* x, uint8_t* q, uint8_t* qt, uint8_t* scratch,
                     float scale, int64_t rows, int64_t cols, int64_t r0, int64_t r1, bool stream) {
  return dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    return cast_transpose_rows<In, decltype(out_tag)>(static_cast<const typename In::storage*>(x),
                                                      q, qt, scratch, scale, rows, cols, r0, r1, stream);
  });
}

void dequantize(DType in, DType out, const uint8_t* q, float scale_inv, void* y, int64_t begin,
                int64_t end) {
  dispatch_fp8(in, "dequantize: argument 'input'", [&](auto in_tag) {
    dispatch_high_precision(out, "dequantize: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      dequantize_range<decltype(in_tag), Out>(q, scale_inv, static_cast<typename Out::storage*>(y),
                                              begin, end);
    });
  });
}

QuantizeKernels quantize_kernels() {
  return QuantizeKernels{amax, cast, cast_transpose, dequantize, transpose_bytes};
}
