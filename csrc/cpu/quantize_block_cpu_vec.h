// The blockwise row kernels (quantize_block_cpu.h) built on one path's lane
// kernels. Textually included, like quantize_cpu_vec.h, by each path's
// quantize_block_cpu_<isa>.cpp inside `namespace tl::cpu::<isa> { namespace {`
// after its segment_amax<In>, segment_cast<In, Out>, column_amax<In>,
// column_cast<In, Out>, row_blocks<In, Out>, transpose_out, scales, fence and
// copy_out_kernel() (a RowKernels::copy_out, or nullptr);
// transpose_bytes is the path's lane kernel (quantize_lanes_<isa>.h).
// The including file includes <algorithm>, quantize_block_cpu.h and
// transformer_linear/dispatch.h.

quantize_block::RowKernels block_row_kernels(DType in, DType out) {
  return dispatch_high_precision(in, "quantize_blockwise: argument 'input'", [&](auto in_tag) {
    using In = decltype(in_tag);
    return dispatch_fp8(out, "quantize_blockwise: argument 'output'", [&](auto out_tag) {
      using Out = decltype(out_tag);
      return quantize_block::RowKernels{segment_amax<In>,     segment_cast<In, Out>, column_amax<In>,
                                        column_cast<In, Out>, transpose_bytes,       row_blocks<In, Out>,
                                        transpose_out,        scales,                fence,
                                        copy_out_kernel()};
    });
  });
}
