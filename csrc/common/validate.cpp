#include "validate.h"

#include <cstdint>
#include <limits>
#include <sstream>

namespace tl {

void check_defined(const char* op, const char* name, const TensorDesc& t) {
  TL_CHECK(t.defined(), op, ": argument '", name, "' is required");
  TL_CHECK(t.data != nullptr || t.numel() == 0, op, ": argument '", name,
           "' has a null data pointer");
}

void check_device(const char* op, const char* name, const TensorDesc& t, DeviceType device,
                  int device_index) {
  TL_CHECK_TYPE(t.device == device && (device != DeviceType::kCUDA || t.device_index == device_index),
                op, ": argument '", name, "' must be on ", device_name(device),
                device == DeviceType::kCUDA ? ":" + std::to_string(device_index) : std::string(),
                " like the input, got ", device_name(t.device),
                t.device == DeviceType::kCUDA ? ":" + std::to_string(t.device_index) : std::string());
  // Every tensor whose device is checked is one the kernel reads or writes: a null data pointer
  // must not reach it, also where an optional argument was checked only for being given.
  TL_CHECK(t.data != nullptr || t.numel() == 0, op, ": argument '", name,
           "' has a null data pointer");
}

void check_dtype(const char* op, const char* name, const TensorDesc& t,
                 std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return;
  }
  std::ostringstream ss;
  bool first = true;
  for (DType d : allowed) {
    ss << (first ? "" : " or ") << dtype_name(d);
    first = false;
  }
  TL_ERROR(TypeError, op, ": argument '", name, "' must have dtype ", ss.str(), ", got ",
           dtype_name(t.dtype));
}

void check_contiguous(const char* op, const char* name, const TensorDesc& t) {
  for (int i = 0; i < t.ndim; ++i) {
    TL_CHECK(t.strides[i] >= 0, op, ": argument '", name, "' has a negative stride (strides ",
             strides_str(t), ")");
  }
  TL_CHECK(t.is_contiguous(), op, ": argument '", name,
           "' must be contiguous (row-major), got shape ", shape_str(t), " with strides ",
           strides_str(t), "; call .contiguous() first");
}

void check_scalar_fp32(const char* op, const char* name, const TensorDesc& t) {
  check_defined(op, name, t);
  check_dtype(op, name, t, {DType::kFloat32});
  TL_CHECK(t.numel() == 1 && t.ndim <= 1, op, ": argument '", name,
           "' must be a one-element float32 tensor of shape [] or [1], got shape ", shape_str(t));
}

void check_rank(const char* op, const char* name, const TensorDesc& t, int ndim) {
  TL_CHECK(t.ndim == ndim, op, ": argument '", name, "' must be ", ndim, "-D, got ", t.ndim,
           "-D with shape ", shape_str(t));
}

void check_shape(const char* op, const char* name, const TensorDesc& t,
                 std::initializer_list<int64_t> shape) {
  bool same = static_cast<int>(shape.size()) == t.ndim;
  int i = 0;
  for (int64_t s : shape) same = same && t.shape[i++] == s;
  if (same) return;
  TensorDesc expected;
  expected.ndim = static_cast<int32_t>(shape.size());
  i = 0;
  for (int64_t s : shape) expected.shape[i++] = s;
  TL_ERROR(ValueError, op, ": argument '", name, "' must have shape ", shape_str(expected),
           ", got ", shape_str(t));
}

void check_same_shape(const char* op, const char* name_a, const TensorDesc& a, const char* name_b,
                      const TensorDesc& b) {
  bool same = a.ndim == b.ndim;
  for (int i = 0; same && i < a.ndim; ++i) same = a.shape[i] == b.shape[i];
  TL_CHECK(same, op, ": argument '", name_b, "' must have the shape of '", name_a, "' ",
           shape_str(a), ", got ", shape_str(b));
}

void matrix_strides(const char* op, const char* name, const TensorDesc& t, int64_t* row_stride,
                    int64_t* col_stride) {
  check_rank(op, name, t, 2);
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const int64_t rs = t.strides[0], cs = t.strides[1];
  TL_CHECK(rs >= 0 && cs >= 0, op, ": argument '", name, "' has a negative stride (strides ",
           strides_str(t), ")");
  // Size-1 dimensions may carry any stride (torch gives them arbitrary ones).
  const bool row_major = (cols <= 1 || cs == 1) && (rows <= 1 || rs >= cols);
  const bool col_major = (rows <= 1 || rs == 1) && (cols <= 1 || cs >= rows);
  TL_CHECK(row_major || col_major, op, ": argument '", name,
           "' must be row-major or column-major (one unit stride), got shape ", shape_str(t),
           " with strides ", strides_str(t));
  if (row_major) {
    *row_stride = rows <= 1 ? cols : rs;
    *col_stride = 1;
  } else {
    *row_stride = 1;
    *col_stride = cols <= 1 ? rows : cs;
  }
}

namespace {

// [first byte, one past the last byte) of the elements `t` addresses, in
// unsigned arithmetic (a descriptor's sizes are validated by the caster).
std::pair<uint64_t, uint64_t> byte_span(const TensorDesc& t) {
  uint64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    last += static_cast<uint64_t>(t.shape[i] - 1) * static_cast<uint64_t>(t.strides[i]);
  }
  const uint64_t size = static_cast<uint64_t>(element_size(t.dtype));
  const uint64_t begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + (last + 1) * size};
}

bool overlap(const TensorDesc& a, const TensorDesc& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.device != b.device || a.device_index != b.device_index) return false;
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

GemmShape check_gemm_operands(const char* op, const TensorDesc& a, const TensorDesc& b) {
  const std::initializer_list<DType> fp8 = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  check_dtype(op, "a", a, fp8);
  check_defined(op, "b", b);
  check_device(op, "b", b, a.device, a.device_index);
  check_dtype(op, "b", b, fp8);
  GemmShape s{};
  matrix_strides(op, "a", a, &s.a_row, &s.a_col);
  matrix_strides(op, "b", b, &s.b_row, &s.b_col);
  s.m = a.shape[0];
  s.k = a.shape[1];
  s.n = b.shape[0];
  TL_CHECK(b.shape[1] == s.k, op, ": inner dimensions differ: 'a' is ", shape_str(a), " and 'b' is ",
           shape_str(b), " (expected b of shape [N, ", s.k, "] for a @ b.T)");
  return s;
}

void check_gemm_output(const char* op, const TensorDesc& d, const TensorDesc& bias, int64_t m,
                       int64_t n, const TensorDesc& like) {
  check_defined(op, "d", d);
  check_device(op, "d", d, like.device, like.device_index);
  check_dtype(op, "d", d, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_contiguous(op, "d", d);
  check_shape(op, "d", d, {m, n});
  if (!bias.defined()) return;
  check_device(op, "bias", bias, like.device, like.device_index);
  TL_CHECK_TYPE(bias.dtype == d.dtype, op, ": argument 'bias' must have the output dtype ",
                dtype_name(d.dtype), ", got ", dtype_name(bias.dtype));
  check_contiguous(op, "bias", bias);
  check_shape(op, "bias", bias, {n});
}

int64_t check_host_offs(const char* op, const TensorDesc& offs, int64_t total, const TensorDesc& like) {
  check_defined(op, "offs", offs);
  check_device(op, "offs", offs, like.device, like.device_index);
  check_dtype(op, "offs", offs, {DType::kInt32});
  check_rank(op, "offs", offs, 1);
  check_contiguous(op, "offs", offs);
  TL_CHECK(total <= std::numeric_limits<int32_t>::max(), op, ": ", total,
           " rows are more than the int32 'offs' can address (2^31 - 1)");
  const int64_t groups = offs.shape[0];
  const auto* ends = static_cast<const int32_t*>(offs.data);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t prev = g == 0 ? 0 : ends[g - 1];
    TL_CHECK(ends[g] >= prev && ends[g] <= total, op,
             ": argument 'offs' must be nondecreasing cumulative row ends in [0, ", total, "], got offs[", g,
             "] = ", ends[g], " after ", prev);
  }
  return groups;
}

void check_disjoint(const char* op, std::initializer_list<NamedDesc> outputs,
                    std::initializer_list<NamedDesc> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const auto& [name, t] : inputs) {
      TL_CHECK(!overlap(*out->second, *t), op, ": output '", out->first,
               "' shares memory with argument '", name,
               "'; an output must not overlap any other argument");
    }
    for (auto other = out + 1; other != outputs.end(); ++other) {
      TL_CHECK(!overlap(*out->second, *other->second), op, ": output '", out->first,
               "' shares memory with output '", other->first,
               "'; an output must not overlap any other argument");
    }
  }
}

void fail_no_cuda(const char* op) {
  TL_ERROR(TypeError, op,
           ": got CUDA tensors, but this build of transformer_linear has no CUDA kernels; "
           "rebuild with a CUDA toolkit and TL_CUDA=1");
}

}  // namespace tl
