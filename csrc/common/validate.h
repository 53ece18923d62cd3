// Argument checks shared by the entry points. Each takes the operation and
// argument names so that messages read "quantize: argument 'scale' must ...".
#pragma once

#include <initializer_list>
#include <utility>

#include "transformer_linear/check.h"
#include "transformer_linear/tensor.h"

namespace tl {

/*! \brief Throw unless the tensor was given. */
void check_defined(const char* op, const char* name, const TensorDesc& t);

/*! \brief Throw unless the tensor is on `device` (TypeError) and has data (a null data pointer with
 *         elements: ValueError). */
void check_device(const char* op, const char* name, const TensorDesc& t, DeviceType device,
                  int device_index);

/*! \brief Throw unless dtype is one of `allowed` (TypeError listing them). */
void check_dtype(const char* op, const char* name, const TensorDesc& t,
                 std::initializer_list<DType> allowed);

/*! \brief Throw on negative strides, or strides that are not row-major contiguous. */
void check_contiguous(const char* op, const char* name, const TensorDesc& t);

/*! \brief Throw unless `t` holds exactly one float32 element (shape () or (1,)). */
void check_scalar_fp32(const char* op, const char* name, const TensorDesc& t);

/*! \brief Throw unless `t` has rank `ndim`. */
void check_rank(const char* op, const char* name, const TensorDesc& t, int ndim);

/*! \brief Throw unless `t` has exactly this shape. */
void check_shape(const char* op, const char* name, const TensorDesc& t,
                 std::initializer_list<int64_t> shape);

/*! \brief Throw unless `a` and `b` have the same shape. */
void check_same_shape(const char* op, const char* name_a, const TensorDesc& a, const char* name_b,
                      const TensorDesc& b);

/*!
 * \brief Validate a 2-D GEMM operand as row-major or column-major and return
 *        its (row stride, column stride) in elements.
 */
void matrix_strides(const char* op, const char* name, const TensorDesc& t, int64_t* row_stride,
                    int64_t* col_stride);

/*! \brief Sizes and element strides of d = a @ b.T (a: (m, k), b: (n, k)). */
struct GemmShape {
  int64_t m, n, k;
  int64_t a_row, a_col, b_row, b_col;  // a[i, p] = a.data[i * a_row + p * a_col], b likewise
};

/*!
 * \brief Validate the FP8 operands of d = a @ b.T: float8_e4m3fn or float8_e5m2, each
 *        row- or column-major, b on a's device, inner dimensions equal. The caller has
 *        checked that `a` is given and on a device it supports.
 */
GemmShape check_gemm_operands(const char* op, const TensorDesc& a, const TensorDesc& b);

/*!
 * \brief Validate a GEMM's output d ((m, n) float32, bfloat16 or float16, contiguous, on
 *        `like`'s device) and, when given, its bias ((n,) of d's dtype, contiguous, same device).
 */
void check_gemm_output(const char* op, const TensorDesc& d, const TensorDesc& bias, int64_t m,
                       int64_t n, const TensorDesc& like);

/*! \brief An argument name and its descriptor, for check_disjoint. */
using NamedDesc = std::pair<const char*, const TensorDesc*>;

/*!
 * \brief Throw (ValueError) when an output's memory overlaps an input's or another output's.
 *
 * Compares the byte spans [first, last element] of each output with those of
 * every input and every later output; empty and absent tensors never overlap.
 * The spans are conservative: interleaved views of one buffer count as
 * overlapping. Call it after the layout checks (it assumes non-negative strides).
 */
void check_disjoint(const char* op, std::initializer_list<NamedDesc> outputs,
                    std::initializer_list<NamedDesc> inputs);

/*!
 * \brief Check group offsets read on the host (CPU kernels): a contiguous int32 1-D
 * tensor on `like`'s device whose entries are cumulative row ends, nondecreasing,
 * in [0, total]; `total` must be addressable by int32.
 * \return the number of groups (offs.shape[0]).
 */
int64_t check_host_offs(const char* op, const TensorDesc& offs, int64_t total, const TensorDesc& like);

/*! \brief Throw the TypeError for CUDA tensors reaching a build without CUDA kernels. */
[[noreturn]] void fail_no_cuda(const char* op);

}  // namespace tl
