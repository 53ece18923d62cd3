// Grouped NVFP4 entry points (the GEMM's forward / dgrad and wgrad forms, the compact columnwise
// copies of the tokens masked to each group: each group's 16-token bands only, group_bands): validate, read `offs` and the packed global scales on the host
// (CPU tensors: no device sync), then run the CPU kernels.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../cpu/memory_cpu.h"
#include "../cpu/parallel.h"
#include "../cpu/quantize_nvfp4_cpu.h"
#include "backend_nvfp4.h"
#include "transformer_linear/nvfp4.h"
#include "validate.h"

namespace tl {
namespace {

constexpr int64_t kBlock = cpu::nvfp4::kBlock;
// A packed scale tensor (ops/nvfp4.py pack_scales) starts with the float32 global decode
// scale as 8 elements of 4 bits each, least significant first; the block scales follow.
constexpr int64_t kGlobalElements = 8;

float packed_global_scale(const uint8_t* packed) {
  uint64_t bits = 0;  // as unpack_scales: the bytes shifted and summed, the low 32 bits kept
  for (int i = 0; i < kGlobalElements; ++i) bits += static_cast<uint64_t>(packed[i]) << (4 * i);
  const uint32_t low = static_cast<uint32_t>(bits);
  float value;
  std::memcpy(&value, &low, sizeof(value));
  return value;
}

void check_cpu(const char* op, const char* name, const TensorDesc& t) {
  check_defined(op, name, t);
  TL_CHECK_TYPE(t.device == DeviceType::kCPU, op, ": argument '", name, "' must be on cpu, got ",
                device_name(t.device));
}

// Packed data: uint8, `rank`-D, contiguous, on `like`'s device, a multiple of 16 values a row.
void check_data(const char* op, const char* name, const TensorDesc& t, int rank, const TensorDesc& like) {
  check_defined(op, name, t);
  check_device(op, name, t, like.device, like.device_index);
  check_dtype(op, name, t, {DType::kUInt8});
  check_rank(op, name, t, rank);
  check_contiguous(op, name, t);
  TL_CHECK(t.shape[rank - 1] % (kBlock / 2) == 0, op, ": argument '", name,
           "' must hold a multiple of 16 FP4 values per row (", kBlock / 2, " bytes), got shape ",
           shape_str(t));
}

// An E4M3 scale tensor on `like`'s device, contiguous.
void check_scale_tensor(const char* op, const char* name, const TensorDesc& t, const TensorDesc& like) {
  check_defined(op, name, t);
  check_device(op, name, t, like.device, like.device_index);
  check_dtype(op, name, t, {DType::kFloat8E4M3});
  check_contiguous(op, name, t);
}

// The global decode scales packed in `t` at `count` places `stride` elements apart (one per group, or
// one for a single copy), checked finite.
std::vector<float> packed_globals(const char* op, const char* name, const TensorDesc& t, int64_t count,
                                  int64_t stride, bool per_group) {
  const auto* raw = static_cast<const uint8_t*>(t.data);
  std::vector<float> globals(count);
  for (int64_t g = 0; g < count; ++g) {
    globals[g] = packed_global_scale(raw + g * stride);
    TL_CHECK(std::isfinite(globals[g]), op, ": the global decode scale packed in argument '", name, "'",
             per_group ? " for group " : "", per_group ? std::to_string(g) : std::string(), " must be finite, got ",
             globals[g]);
  }
  return globals;
}

// Packed scales of `groups` copies of (rows, cols) (1-D for one copy, groups < 0); returns each
// copy's global decode scale, checked finite.
std::vector<float> check_packed_scales(const char* op, const char* name, const TensorDesc& t, int64_t groups,
                                       int64_t rows, int64_t cols, const TensorDesc& like) {
  check_scale_tensor(op, name, t, like);
  const int64_t numel = kGlobalElements + rows * (cols / kBlock);
  if (groups < 0) {
    check_shape(op, name, t, {numel});
  } else {
    check_shape(op, name, t, {groups, numel});
  }
  return packed_globals(op, name, t, groups < 0 ? 1 : groups, numel, groups >= 0);
}

// Scales of a compact grouped copy of (rows, capacity) (group_bands): each group's packed global
// decode scale (8 elements) then the (rows, capacity / 16) block scales, 1-D; returns the global
// scales, checked finite.
std::vector<float> check_compact_scales(const char* op, const char* name, const TensorDesc& t, int64_t groups,
                                        int64_t rows, int64_t capacity, const TensorDesc& like) {
  check_scale_tensor(op, name, t, like);
  check_shape(op, name, t, {kGlobalElements * groups + rows * (capacity / kBlock)});
  return packed_globals(op, name, t, groups, kGlobalElements, true);
}

// The groups of a compact copy, from `offs` (checked 1-D), and the tokens its capacity stands for.
struct CompactSizes {
  int64_t groups, total;
};

CompactSizes compact_sizes(const char* op, const TensorDesc& offs, int64_t capacity) {
  check_defined(op, "offs", offs);
  check_rank(op, "offs", offs, 1);
  const int64_t groups = offs.shape[0];
  const int64_t total = groups == 0 ? 0 : capacity - kBlock * (groups - 1);
  TL_CHECK(total >= 0 && compact_tokens(total, groups) == capacity, op,
           ": the compact copies must hold total + 16 * (G - 1) tokens for G = ", groups,
           " groups (argument 'offs'), got ", capacity);
  return {groups, total};
}

// int32, one entry per group, nondecreasing cumulative row ends in [0, total].
void check_offs(const char* op, const TensorDesc& offs, int64_t groups, int64_t total, const TensorDesc& like) {
  TL_CHECK(check_host_offs(op, offs, total, like) == groups, op, ": argument 'offs' must have one entry per group (",
           groups, "), got shape ", shape_str(offs));
}

void check_out(const char* op, const TensorDesc& d, std::initializer_list<int64_t> shape, const TensorDesc& like) {
  check_defined(op, "d", d);
  check_device(op, "d", d, like.device, like.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, shape);
}

// The sizes of a grouped GEMM: groups, total tokens, and each group's N and K.
struct GroupedSizes {
  int64_t groups, total, n, k;
};

// Fills what both forms share (offsets, output, sizes) and runs the kernel on the op's threads.
void run(const char* op, GroupedGemmNvfp4Params& p, const TensorDesc& offs, const TensorDesc& d,
         GroupedSizes sizes, bool wgrad, Stream stream) {
  p.offs = static_cast<const int32_t*>(offs.data);
  p.d = d.data;
  p.out_dtype = d.dtype;
  p.groups = sizes.groups;
  p.total = sizes.total;
  p.n = sizes.n;
  p.k = sizes.k;
  p.wgrad = wgrad;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::nvfp4_grouped_gemm(p);
}

}  // namespace

void nvfp4_grouped_gemm(const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b,
                        const TensorDesc& b_scale_inv, const TensorDesc& offs, const TensorDesc& bias,
                        const TensorDesc& d, Stream stream) {
  constexpr const char* op = "nvfp4_grouped_gemm";
  check_cpu(op, "a", a);
  check_data(op, "a", a, 2, a);
  check_data(op, "b", b, 3, a);
  const int64_t total = a.shape[0], k = a.shape[1] * 2, groups = b.shape[0], n = b.shape[1];
  TL_CHECK(b.shape[2] * 2 == k, op, ": the K dimensions of 'a' ", shape_str(a), " and 'b' ", shape_str(b),
           " differ");
  const std::vector<float> ga = check_packed_scales(op, "a_scale_inv", a_scale_inv, -1, total, k, a);
  const std::vector<float> gb = check_packed_scales(op, "b_scale_inv", b_scale_inv, groups, n, k, a);
  check_offs(op, offs, groups, total, a);
  check_out(op, d, {total, n}, a);
  if (bias.defined()) {
    check_device(op, "bias", bias, a.device, a.device_index);
    TL_CHECK_TYPE(bias.dtype == d.dtype, op, ": argument 'bias' must have the output dtype ",
                  dtype_name(d.dtype), ", got ", dtype_name(bias.dtype));
    check_contiguous(op, "bias", bias);
    check_shape(op, "bias", bias, {groups, n});
  }
  check_disjoint(op, {{"d", &d}},
                 {{"a", &a}, {"a_scale_inv", &a_scale_inv}, {"b", &b}, {"b_scale_inv", &b_scale_inv},
                  {"offs", &offs}, {"bias", &bias}});
  const std::vector<float> ga_per_group(groups, ga[0]);
  const int64_t b_numel = kGlobalElements + n * (k / kBlock);
  GroupedGemmNvfp4Params p{};
  p.a = a.ptr<const uint8_t>();
  p.a_scale = static_cast<const uint8_t*>(a_scale_inv.data) + kGlobalElements;
  p.b = b.ptr<const uint8_t>();
  p.b_scale = static_cast<const uint8_t*>(b_scale_inv.data) + kGlobalElements;
  p.b_group_stride = n * (k / 2);
  p.b_scale_stride = b_numel;
  p.a_global = ga_per_group.data();
  p.b_global = gb.data();
  p.bias = bias.defined() ? bias.data : nullptr;
  run(op, p, offs, d, {groups, total, n, k}, /*wgrad=*/false, stream);
}

void nvfp4_grouped_gemm_wgrad(const TensorDesc& grad_t, const TensorDesc& grad_t_scale_inv,
                              const TensorDesc& x_t, const TensorDesc& x_t_scale_inv, const TensorDesc& offs,
                              const TensorDesc& d, Stream stream) {
  constexpr const char* op = "nvfp4_grouped_gemm_wgrad";
  check_cpu(op, "grad_t", grad_t);
  check_data(op, "grad_t", grad_t, 2, grad_t);
  check_data(op, "x_t", x_t, 2, grad_t);
  const int64_t n = grad_t.shape[0], capacity = grad_t.shape[1] * 2, k = x_t.shape[0];
  TL_CHECK(x_t.shape[1] * 2 == capacity, op, ": 'grad_t' and 'x_t' must have the same tokens, got ",
           shape_str(grad_t), " and ", shape_str(x_t));
  const CompactSizes sizes = compact_sizes(op, offs, capacity);
  const int64_t groups = sizes.groups, total = sizes.total;
  const std::vector<float> gg = check_compact_scales(op, "grad_t_scale_inv", grad_t_scale_inv, groups, n, capacity,
                                                     grad_t);
  const std::vector<float> gx = check_compact_scales(op, "x_t_scale_inv", x_t_scale_inv, groups, k, capacity, grad_t);
  check_offs(op, offs, groups, total, grad_t);
  check_out(op, d, {groups, n, k}, grad_t);
  check_disjoint(op, {{"d", &d}},
                 {{"grad_t", &grad_t}, {"grad_t_scale_inv", &grad_t_scale_inv}, {"x_t", &x_t},
                  {"x_t_scale_inv", &x_t_scale_inv}, {"offs", &offs}});
  GroupedGemmNvfp4Params p{};
  p.a = grad_t.ptr<const uint8_t>();
  p.a_scale = static_cast<const uint8_t*>(grad_t_scale_inv.data) + kGlobalElements * groups;
  p.b = x_t.ptr<const uint8_t>();
  p.b_scale = static_cast<const uint8_t*>(x_t_scale_inv.data) + kGlobalElements * groups;
  p.a_global = gg.data();
  p.b_global = gx.data();
  p.bias = nullptr;
  p.capacity = capacity;
  run(op, p, offs, d, {groups, total, n, k}, /*wgrad=*/true, stream);
}

void quantize_nvfp4_grouped_columnwise(const TensorDesc& input, const TensorDesc& offs, const TensorDesc& seeds,
                                       const TensorDesc& output_t, const TensorDesc& scale_t, bool rht,
                                       bool stochastic_rounding, Stream stream) {
  constexpr const char* op = "quantize_nvfp4_grouped_columnwise";
  check_cpu(op, "x", input);
  check_dtype(op, "x", input, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_rank(op, "x", input, 2);
  check_contiguous(op, "x", input);
  const int64_t rows = input.shape[0], k = input.shape[1], groups = offs.defined() ? offs.shape[0] : 0;
  check_offs(op, offs, groups, rows, input);
  // Any token count: the copies hold blocks of 16 tokens, so the rows are padded with zero rows (of no group)
  // to `total`, a multiple of 16, in a copy where rows are added (ops.grouped_nvfp4, formats.nvfp4.pad_rows).
  const int64_t total = (rows + kBlock - 1) / kBlock * kBlock;
  if (stochastic_rounding) {
    check_defined(op, "seeds", seeds);
    check_device(op, "seeds", seeds, input.device, input.device_index);
    check_dtype(op, "seeds", seeds, {DType::kInt64});
    check_contiguous(op, "seeds", seeds);
    check_shape(op, "seeds", seeds, {groups});
  }
  const int64_t capacity = compact_tokens(total, groups);
  check_defined(op, "output_t", output_t);
  check_device(op, "output_t", output_t, input.device, input.device_index);
  check_dtype(op, "output_t", output_t, {DType::kUInt8});
  check_contiguous(op, "output_t", output_t);
  check_shape(op, "output_t", output_t, {k, capacity / 2});
  check_defined(op, "scale_t", scale_t);
  check_device(op, "scale_t", scale_t, input.device, input.device_index);
  check_dtype(op, "scale_t", scale_t, {DType::kFloat8E4M3});
  check_contiguous(op, "scale_t", scale_t);
  check_shape(op, "scale_t", scale_t, {kGlobalElements * groups + k * (capacity / kBlock)});
  check_disjoint(op, {{"output_t", &output_t}, {"scale_t", &scale_t}},
                 {{"x", &input}, {"offs", &offs}, {"seeds", &seeds}});
  // The columns past the groups' bands (the capacity is an upper bound) are zero codes with zero scales.
  std::memset(output_t.data, 0, static_cast<size_t>(output_t.numel()));
  std::memset(scale_t.data, 0, static_cast<size_t>(scale_t.numel()));
  TensorDesc padded = input;
  cpu::Buffer padded_rows;
  if (total != rows) {
    const size_t row_bytes = static_cast<size_t>(k) * element_size(input.dtype);
    padded_rows = cpu::aligned_buffer(static_cast<size_t>(total) * row_bytes, op);
    std::memcpy(padded_rows.get(), input.data, static_cast<size_t>(rows) * row_bytes);
    std::memset(padded_rows.get() + rows * row_bytes, 0, static_cast<size_t>(total - rows) * row_bytes);
    padded.data = padded_rows.get();
    padded.shape[0] = total;
  }
  QuantizeGroupedNvfp4Params p{};
  p.input = padded;
  p.offs = static_cast<const int32_t*>(offs.data);
  p.seeds = stochastic_rounding ? static_cast<const int64_t*>(seeds.data) : nullptr;
  p.output_t = static_cast<uint8_t*>(output_t.data);
  p.global_t = static_cast<uint8_t*>(scale_t.data);
  p.scale_t = p.global_t + kGlobalElements * groups;
  p.groups = groups;
  p.total = total;
  p.k = k;
  p.capacity = capacity;
  p.rht = rht;
  p.stochastic_rounding = stochastic_rounding;
  const cpu::ThreadCountScope threads(cpu::call_threads(op, stream));
  cpu::advise_huge_pages({output_t});
  cpu::quantize_grouped_nvfp4(p);
}

}  // namespace tl
