// pybind11 conversion of the descriptor tuple built by transformer_linear/ops/descriptors.py:
//   (data_ptr: int, dtype: int, shape: tuple[int], strides: tuple[int], device: int, device_index: int)
// None stands for an absent optional tensor.
#pragma once

#include <pybind11/pybind11.h>

#include "transformer_linear/check.h"
#include "transformer_linear/tensor.h"

namespace pybind11 {
namespace detail {

template <>
struct type_caster<tl::TensorDesc> {
  PYBIND11_TYPE_CASTER(tl::TensorDesc, const_name("TensorDesc"));

  bool load(handle src, bool) {
    value = tl::TensorDesc{};
    if (src.is_none()) return true;
    if (!isinstance<tuple>(src)) return false;
    auto t = reinterpret_borrow<tuple>(src);
    if (t.size() != 6) return false;
    auto shape = reinterpret_borrow<object>(t[2]);
    auto strides = reinterpret_borrow<object>(t[3]);
    if (!isinstance<tuple>(shape) || !isinstance<tuple>(strides)) return false;
    auto shape_t = reinterpret_borrow<tuple>(shape);
    auto strides_t = reinterpret_borrow<tuple>(strides);
    TL_CHECK(shape_t.size() == strides_t.size(), "tensor descriptor: shape and strides differ in length");
    TL_CHECK(shape_t.size() <= static_cast<size_t>(tl::kMaxDims), "tensor descriptor: rank ",
             shape_t.size(), " exceeds the supported maximum of ", tl::kMaxDims);
    value.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    const int dtype = t[1].cast<int>();
    value.dtype = (dtype >= 0 && dtype <= static_cast<int>(tl::DType::kOther))
                      ? static_cast<tl::DType>(dtype)
                      : tl::DType::kOther;
    value.ndim = static_cast<int32_t>(shape_t.size());
    for (int i = 0; i < value.ndim; ++i) {
      value.shape[i] = shape_t[i].cast<int64_t>();
      value.strides[i] = strides_t[i].cast<int64_t>();
      TL_CHECK(value.shape[i] >= 0, "tensor descriptor: negative size in shape");
    }
    const int device = t[4].cast<int>();
    value.device = device == 0 ? tl::DeviceType::kCPU
                               : (device == 1 ? tl::DeviceType::kCUDA : tl::DeviceType::kOther);
    value.device_index = t[5].cast<int32_t>();
    // Kernels index in int64: element counts and offsets must not overflow.
    tl::check_addressable(value);
    return true;
  }
};

}  // namespace detail
}  // namespace pybind11
