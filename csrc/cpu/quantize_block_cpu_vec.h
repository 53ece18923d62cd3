// The blockwise row kernels (quantize_block_cpu.h) built on one path's lane
// kernels. Textually included, like quantize_cpu_vec.h, by each path's
// quantize_block_cpu_<isa>.cpp inside `namespace tl::cpu::<isa> { namespace {`
// after its column_amax<In>, column_cast<In, Out>, row_blocks<In, Out>,
// transpose_out, scales and fence; amax_range, cast_range
// and transpose_bytes are the path's lane kernels (quantize_lanes_<isa>.h).
// The including file includes <algorithm>, quantize_block_cpu.h and
// transformer_linear/dispatch.h.

template <typename In>
void segment_amax(const void* xv, int64_t n, int64_t seg, float* amax) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    amax[j] = fp8::amax_update(amax[j], amax_range<In>(x, b, std::min(n, b + seg)));
  }
}

template <typename In, typename Out>
void segment_cast(const void* xv, uint8_t* q, int64_t n, int64_t seg, const float* scale) {
  const auto* x = static_cast<const typename In::storage*>(xv);
  for (int64_t j = 0, b = 0; b < n; ++j, b += seg) {
    cast_range<In, Out, false, false>(x, q, scale[j], b, std::min(n, b + seg));
  }
}

quantize_block::RowKernels block_row_kernels(DType in, DType out) {
  return dispatch_high_precision(in, "quantize_blockwise: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    return dispatch_fp8(out, "quantize_blockwise: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      return quantize_block::RowKernels{segment_amax<In>,     segment_cast<In, Out>, column_amax<In>,
                                        column_cast<In, Out>, transpose_bytes,       row_blocks<In, Out>,
                                        transpose_out,        scales,                fence};
    });
  });
}
