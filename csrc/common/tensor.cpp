#include <sstream>

#include "transformer_linear/tensor.h"

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
