/*!
 * \file tensor.h
 * \brief The tensor descriptor every kernel entry point takes.
 *
 * The extension does not link libtorch: Python describes each tensor with a
 * raw pointer, a dtype code, a shape and strides (transformer_linear/ops/descriptors.py
 * builds it), and the kernels validate what they are handed.
 */
#pragma once

#include <cstdint>
#include <string>

namespace tl {

/*! \brief Element types. The numeric values are part of the Python ABI (ops/descriptors.py). */
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  //!< float8_e4m3fn: finite max 448, no infinities
  kFloat8E5M2 = 4,  //!< float8_e5m2: finite max 57344
  kFloat64 = 5,
  kInt64 = 6,
  kInt32 = 7,
  kInt16 = 8,
  kInt8 = 9,
  kUInt8 = 10,
  kBool = 11,
  kOther = 12,  //!< any dtype the kernels never accept
};

/*! \brief Where a tensor lives. Values mirror torch's DeviceType codes for cpu and cuda. */
enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1, kOther = 2 };

/*! \brief Largest rank a descriptor carries; higher ranks are rejected when built. */
constexpr int kMaxDims = 8;

/*!
 * \brief A view of a tensor owned by the caller.
 *
 * Strides are in elements. An empty descriptor (`data == nullptr && ndim < 0`)
 * stands for an absent optional argument.
 */
struct TensorDesc {
  void* data = nullptr;
  DType dtype = DType::kOther;
  int32_t ndim = -1;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  DeviceType device = DeviceType::kOther;
  int32_t device_index = -1;

  /*! \brief True when this stands for a real tensor (an optional argument that was given). */
  bool defined() const { return ndim >= 0; }

  /*! \brief Number of elements (1 for a 0-dim tensor). */
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }

  /*! \brief Size of dimension `d`; negative `d` counts from the end. */
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }

  /*! \brief Row-major contiguity (size-1 dimensions may carry any stride; empty tensors,
   *         whose strides torch leaves arbitrary, count as contiguous as in torch). */
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

/*!
 * \brief Throw a ValueError unless `t` is addressable: its element count, and
 *        the byte offset of each of its elements from `data`, fit in int64, and
 *        no element's address wraps around the address space. The binding
 *        checks every descriptor it builds, so kernels may compute numel() and
 *        element offsets in int64 without overflow.
 */
void check_addressable(const TensorDesc& t);

/*! \brief Bytes per element of `dtype` (0 for kOther). */
int element_size(DType dtype);

/*! \brief torch-style dtype name, e.g. "bfloat16", "float8_e4m3fn". */
const char* dtype_name(DType dtype);

/*! \brief "cpu", "cuda" or "other". */
const char* device_name(DeviceType device);

/*! \brief "[2, 3]"-style rendering of a shape, for error messages. */
std::string shape_str(const TensorDesc& t);

/*! \brief "[3, 1]"-style rendering of strides, for error messages. */
std::string strides_str(const TensorDesc& t);

/*! \brief True for the two FP8 formats. */
inline bool is_fp8(DType d) { return d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2; }

/*! \brief True for the high-precision float types a kernel reads or writes (fp32, fp16, bf16). */
inline bool is_high_precision(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

/*!
 * \brief The launch argument of every entry point: for CUDA tensors the stream
 *        (cudaStream_t; 0 is the legacy default stream), for CPU tensors the
 *        thread count of the call (0: OpenMP's count of the calling thread).
 */
using Stream = std::uintptr_t;

}  // namespace tl
