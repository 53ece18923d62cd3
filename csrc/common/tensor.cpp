#include "transformer_linear/tensor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>

#include "transformer_linear/check.h"

namespace tl {

int element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
    default:
      return 0;
  }
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kFloat64: return "float64";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kInt16: return "int16";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    default: return "an unsupported dtype";
  }
}

const char* device_name(DeviceType device) {
  switch (device) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda";
    default: return "an unsupported device";
  }
}

static std::string dims_str(const int64_t* dims, int n) {
  std::ostringstream ss;
  ss << "[";
  for (int i = 0; i < n; ++i) ss << (i ? ", " : "") << dims[i];
  ss << "]";
  return ss.str();
}

std::string shape_str(const TensorDesc& t) { return dims_str(t.shape, t.ndim); }
std::string strides_str(const TensorDesc& t) { return dims_str(t.strides, t.ndim); }

}  // namespace tl

namespace tl {
namespace {

// No user-space address reaches this: x86-64 gives processes at most 2^56
// bytes (5-level paging), AArch64 at most 2^52. Elsewhere, the wrap-around.
#if defined(__x86_64__) || defined(__aarch64__)
constexpr uintptr_t kAddressLimit = uintptr_t{1} << 57;
#else
constexpr uintptr_t kAddressLimit = std::numeric_limits<uintptr_t>::max();
#endif

}  // namespace

void check_addressable(const TensorDesc& t) {
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return;  // no element is ever addressed
  }
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) {
    TL_CHECK(!__builtin_mul_overflow(numel, t.shape[i], &numel), "tensor descriptor: shape ",
             shape_str(t), " has more elements than int64 can count");
  }
  // Furthest element offsets in elements, after and before `data` (strides
  // of size-1 dimensions are never used: torch leaves them arbitrary).
  int64_t after = 0, before = 0;
  bool ok = true;
  for (int i = 0; i < t.ndim && ok; ++i) {
    if (t.shape[i] <= 1) continue;
    const int64_t stride = t.strides[i];
    int64_t& furthest = stride < 0 ? before : after;
    int64_t span = 0;
    ok = stride != std::numeric_limits<int64_t>::min() &&
         !__builtin_mul_overflow(t.shape[i] - 1, stride < 0 ? -stride : stride, &span) &&
         !__builtin_add_overflow(furthest, span, &furthest);
  }
  // Byte offsets of the last byte of the furthest elements.
  const int64_t elem = element_size(t.dtype) > 0 ? element_size(t.dtype) : 1;
  int64_t last_byte = 0, first_byte = 0;
  ok = ok && !__builtin_mul_overflow(after, elem, &last_byte) &&
       !__builtin_add_overflow(last_byte, elem - 1, &last_byte) &&
       !__builtin_mul_overflow(before, elem, &first_byte);
  TL_CHECK(ok, "tensor descriptor: shape ", shape_str(t), " with strides ", strides_str(t),
           " reaches byte offsets beyond int64");
  if (t.data == nullptr) return;  // the entry points reject a null pointer with elements
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  TL_CHECK(address >= static_cast<uintptr_t>(first_byte) &&
               kAddressLimit - std::min(address, kAddressLimit) > static_cast<uintptr_t>(last_byte),
           "tensor descriptor: shape ", shape_str(t), " with strides ", strides_str(t),
           " at address ", t.data, " reaches past the end of the address space");
}

}  // namespace tl
