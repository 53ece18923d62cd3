// Grouped FP8 GEMM entry points: validate, then run the CPU kernel (the GPU path is Triton).
#include "transformer_linear/grouped.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "../cpu/gemm_grouped_cpu.h"
#include "../cpu/parallel.h"
#include "validate.h"

namespace tl {
namespace {

constexpr int64_t kWhole = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
const std::initializer_list<DType> kFp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};

// The blocks of a scale grid (stored `groups` times over, back to back) for a (rows, cols)
// operand; a block size of 0 spans the whole dimension: one scale along it, even when it is empty.
BlockLayout scale_grid(const char* op, const char* name, const TensorDesc& scale, int64_t groups,
                       int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                       const TensorDesc& like) {
  TL_CHECK(block_rows >= 0 && block_cols >= 0, op, ": the block of '", name,
           "' must not be negative, got ", block_rows, "x", block_cols);
  check_defined(op, name, scale);
  check_device(op, name, scale, like.device, like.device_index);
  check_dtype(op, name, scale, {DType::kFloat32, DType::kUInt8});
  check_contiguous(op, name, scale);
  BlockLayout l;
  l.rows = block_rows == 0 ? kWhole : block_rows;
  l.cols = block_cols == 0 ? kWhole : block_cols;
  l.grid_rows = block_rows == 0 ? 1 : (rows + block_rows - 1) / block_rows;
  l.grid_cols = block_cols == 0 ? 1 : (cols + block_cols - 1) / block_cols;
  l.e8m0 = scale.dtype == DType::kUInt8;
  if (groups < 0) {
    check_shape(op, name, scale, {l.grid_rows, l.grid_cols});
  } else {
    check_shape(op, name, scale, {groups, l.grid_rows, l.grid_cols});
  }
  return l;
}

void check_offs(const char* op, const TensorDesc& offs, const TensorDesc& like) {
  check_defined(op, "offs", offs);
  check_device(op, "offs", offs, like.device, like.device_index);
  check_dtype(op, "offs", offs, {DType::kInt32});
  check_rank(op, "offs", offs, 1);
  check_contiguous(op, "offs", offs);
}

// The token rows are addressed by int32 offsets: more of them than int32 holds cannot be grouped.
void check_total_rows(const char* op, const char* name, const TensorDesc& t) {
  TL_CHECK(t.shape[0] <= kInt32Max, op, ": argument '", name, "' has ", t.shape[0],
           " rows, more than the int32 'offs' can address (2^31 - 1)");
}

void check_cpu(const char* op, const char* name, const TensorDesc& t) {
  check_defined(op, name, t);
  TL_CHECK_TYPE(t.device == DeviceType::kCPU, op, ": argument '", name,
                "' must be on cpu here (the GPU kernel is transformer_linear.triton), got ",
                device_name(t.device));
}

}  // namespace

void fp8_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                      const TensorDesc& b_scale_inv, const TensorDesc& offs, int64_t a_block_rows,
                      int64_t a_block_cols, int64_t b_block_rows, int64_t b_block_cols,
                      const TensorDesc& bias, const TensorDesc& d, Stream stream) {
  constexpr const char* op = "fp8_grouped_gemm";
  check_cpu(op, "a", a);
  check_dtype(op, "a", a, kFp8);
  check_rank(op, "a", a, 2);
  check_contiguous(op, "a", a);
  check_total_rows(op, "a", a);
  check_defined(op, "b", b);
  check_device(op, "b", b, a.device, a.device_index);
  check_dtype(op, "b", b, kFp8);
  check_rank(op, "b", b, 3);
  check_contiguous(op, "b", b);
  check_offs(op, offs, a);
  GroupedGemmParams p{};
  p.total = a.shape[0];
  p.k = a.shape[1];
  p.groups = b.shape[0];
  p.n = b.shape[1];
  TL_CHECK(b.shape[2] == p.k, op, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ",
           shape_str(b), " (expected b of shape [G, N, ", p.k, "])");
  TL_CHECK(offs.shape[0] == p.groups, op, ": argument 'offs' must have one entry per group of 'b' (",
           p.groups, "), got shape ", shape_str(offs));
  p.a_block = scale_grid(op, "a_scale_inv", a_scale_inv, -1, p.total, p.k, a_block_rows, a_block_cols, a);
  p.b_block = scale_grid(op, "b_scale_inv", b_scale_inv, p.groups, p.n, p.k, b_block_rows, b_block_cols, a);
  TL_CHECK_TYPE(p.a_block.e8m0 == p.b_block.e8m0, op,
                ": 'a_scale_inv' and 'b_scale_inv' must have the same dtype");
  const int64_t lo = std::min(p.a_block.cols, p.b_block.cols);
  const int64_t hi = std::max(p.a_block.cols, p.b_block.cols);
  TL_CHECK(hi % lo == 0 || hi >= p.k, op, ": the K-blocks of 'a' (", p.a_block.cols, ") and 'b' (",
           p.b_block.cols, ") must divide each other");
  check_defined(op, "d", d);
  check_device(op, "d", d, a.device, a.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {p.total, p.n});
  if (bias.defined()) {
    check_device(op, "bias", bias, a.device, a.device_index);
    TL_CHECK_TYPE(bias.dtype == d.dtype, op, ": argument 'bias' must have the output dtype ",
                  dtype_name(d.dtype), ", got ", dtype_name(bias.dtype));
    check_contiguous(op, "bias", bias);
    check_shape(op, "bias", bias, {p.groups, p.n});
  }
  check_disjoint(op, {{"d", &d}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"offs", &offs}, {"bias", &bias}});
  p.a = a;
  p.a_scale_inv = a_scale_inv;
  p.b = b;
  p.b_scale_inv = b_scale_inv;
  p.offs = offs;
  p.bias = bias;
  p.d = d;
  p.wgrad = false;
  p.token_blocks = false;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_grouped_gemm(p);
}

void fp8_grouped_gemm_wgrad(const TensorDesc& grad, const TensorDesc& grad_scale_inv,
                            const TensorDesc& x, const TensorDesc& x_scale_inv,
                            const TensorDesc& offs, const TensorDesc& d, Stream stream) {
  constexpr const char* op = "fp8_grouped_gemm_wgrad";
  check_cpu(op, "grad", grad);
  for (auto [name, t] : {std::pair{"grad", &grad}, {"x", &x}}) {
    check_defined(op, name, *t);
    check_device(op, name, *t, grad.device, grad.device_index);
    check_dtype(op, name, *t, kFp8);
    check_rank(op, name, *t, 2);
    check_contiguous(op, name, *t);
    check_total_rows(op, name, *t);
  }
  TL_CHECK(x.shape[0] == grad.shape[0], op, ": 'grad' and 'x' must have the same rows (tokens), got ",
           shape_str(grad), " and ", shape_str(x));
  for (auto [name, t] : {std::pair{"grad_scale_inv", &grad_scale_inv}, {"x_scale_inv", &x_scale_inv}}) {
    check_scalar_fp32(op, name, *t);
    check_device(op, name, *t, grad.device, grad.device_index);
  }
  check_offs(op, offs, grad);
  GroupedGemmParams p{};
  p.total = grad.shape[0];
  p.n = grad.shape[1];
  p.k = x.shape[1];
  p.groups = offs.shape[0];
  // Tensorwise: one block over each whole operand.
  p.a_block = BlockLayout{kWhole, kWhole, 1, 1, false};
  p.b_block = p.a_block;
  check_defined(op, "d", d);
  check_device(op, "d", d, grad.device, grad.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {p.groups, p.n, p.k});
  check_disjoint(op, {{"d", &d}},
                 {{"grad", &grad}, {"grad_scale_inv", &grad_scale_inv}, {"x", &x},
                  {"x_scale_inv", &x_scale_inv}, {"offs", &offs}});
  p.a = grad;
  p.a_scale_inv = grad_scale_inv;
  p.b = x;
  p.b_scale_inv = x_scale_inv;
  p.offs = offs;
  p.d = d;
  p.wgrad = true;
  p.token_blocks = false;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_grouped_gemm(p);
}

void fp8_grouped_gemm_wgrad_blockwise(const TensorDesc& grad_t, const TensorDesc& grad_t_scale_inv,
                                      const TensorDesc& x_t, const TensorDesc& x_t_scale_inv,
                                      const TensorDesc& offs, int64_t token_block, const TensorDesc& d,
                                      Stream stream) {
  constexpr const char* op = "fp8_grouped_gemm_wgrad_blockwise";
  check_cpu(op, "grad_t", grad_t);
  for (auto [name, t] : {std::pair{"grad_t", &grad_t}, {"x_t", &x_t}}) {
    check_defined(op, name, *t);
    check_device(op, name, *t, grad_t.device, grad_t.device_index);
    check_dtype(op, name, *t, kFp8);
    check_rank(op, name, *t, 2);
    check_contiguous(op, name, *t);
  }
  TL_CHECK(x_t.shape[1] == grad_t.shape[1], op, ": 'grad_t' and 'x_t' must have the same columns (tokens), got ",
           shape_str(grad_t), " and ", shape_str(x_t));
  TL_CHECK(grad_t.shape[1] <= kInt32Max, op, ": argument 'grad_t' has ", grad_t.shape[1],
           " tokens, more than the int32 'offs' can address (2^31 - 1)");
  TL_CHECK(token_block == 0 || token_block == 32 || token_block == 128, op,
           ": argument 'token_block' must be 128, 32 or 0 (the whole group), got ", token_block);
  check_offs(op, offs, grad_t);
  GroupedGemmParams p{};
  p.n = grad_t.shape[0];
  p.total = grad_t.shape[1];
  p.k = x_t.shape[0];
  p.groups = offs.shape[0];
  p.token_block = token_block == 0 ? kWhole : token_block;
  // One scale per (row, token block of a group): blocks of 1 x token_block in a grid of
  // total / token_block + groups columns (groups for the whole group).
  const int64_t grid_cols = token_block == 0 ? p.groups : p.total / token_block + p.groups;
  for (auto [name, t, rows, layout] :
       {std::tuple{"grad_t_scale_inv", &grad_t_scale_inv, p.n, &p.a_block},
        {"x_t_scale_inv", &x_t_scale_inv, p.k, &p.b_block}}) {
    check_defined(op, name, *t);
    check_device(op, name, *t, grad_t.device, grad_t.device_index);
    check_dtype(op, name, *t, {token_block == 32 ? DType::kUInt8 : DType::kFloat32});
    check_contiguous(op, name, *t);
    check_shape(op, name, *t, {rows, grid_cols});
    *layout = BlockLayout{1, p.token_block, rows, grid_cols, token_block == 32};
  }
  check_defined(op, "d", d);
  check_device(op, "d", d, grad_t.device, grad_t.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {p.groups, p.n, p.k});
  check_disjoint(op, {{"d", &d}},
                 {{"grad_t", &grad_t}, {"grad_t_scale_inv", &grad_t_scale_inv}, {"x_t", &x_t},
                  {"x_t_scale_inv", &x_t_scale_inv}, {"offs", &offs}});
  p.a = grad_t;
  p.a_scale_inv = grad_t_scale_inv;
  p.b = x_t;
  p.b_scale_inv = x_t_scale_inv;
  p.offs = offs;
  p.d = d;
  p.wgrad = true;
  p.token_blocks = true;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::fp8_grouped_gemm(p);
}

}  // namespace tl
