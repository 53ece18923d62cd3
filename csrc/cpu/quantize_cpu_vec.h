// The quantize range kernels (quantize_cpu_isa.h) built on one path's lane
// kernels. Textually included by each path's quantize_cpu_<isa>.cpp inside
// `namespace tl::cpu::<isa> { namespace {`, after its lane kernels
// (quantize_lanes_<isa>.h) and its dequantize_range, which the unqualified
// names below resolve to:
//   amax_range<In>(x, begin, end)
//   cast_range<In, Out, kAmax, kStream>(x, q, scale, begin, end)
//   dequantize_range<In, Out>(q, scale_inv, y, begin, end)
//   transpose_bytes(src, ld_src, rows, cols, dst, ld_dst)
// Each path thus compiles its own copy with its own instruction set, with
// internal linkage, so the linker never merges the two. The including file
// includes <algorithm>, quantize_cpu_isa.h and transformer_linear/dispatch.h.

// Rows are cast in stripes with the contiguous cast (into q, or a scratch
// stripe when only qt is wanted); the stripe, still in L2, is then written
// out transposed in 16x16 blocks.
template <typename In, typename Out>
float cast_transpose_rows(const typename In::storage* x, uint8_t* q, uint8_t* qt,
                          uint8_t* scratch, float scale, int64_t rows, int64_t cols, int64_t r0,
                          int64_t r1) {
  float amax = 0.0f;
  for (int64_t rb = r0; rb < r1; rb += kTransposeStripeRows) {
    const int64_t nr = std::min(r1, rb + kTransposeStripeRows) - rb;
    uint8_t* stripe = q != nullptr ? q + rb * cols : scratch;
    amax = fp8::amax_update(
        amax, cast_range<In, Out, true, false>(x + rb * cols, stripe, scale, 0, nr * cols));
    transpose_bytes(stripe, cols, nr, cols, qt + rb, rows);
  }
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
                     float scale, int64_t rows, int64_t cols, int64_t r0, int64_t r1) {
  return dispatch_in_out(in, out, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    return cast_transpose_rows<In, decltype(out_tag)>(static_cast<const typename In::storage*>(x),
                                                      q, qt, scratch, scale, rows, cols, r0, r1);
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

QuantizeKernels quantize_kernels() { return QuantizeKernels{amax, cast, cast_transpose, dequantize}; }
