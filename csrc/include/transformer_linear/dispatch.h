/*!
 * \file dispatch.h
 * \brief The one place where a runtime DType becomes a compile-time element type.
 *
 * Each dispatcher calls `fn(Tag{})` with the tag of element_types.h for the
 * dtype, or throws a TypeError that names the argument, what is accepted and
 * what was given.
 */
#pragma once

#include "transformer_linear/check.h"
#include "transformer_linear/element_types.h"

namespace tl {

/*! \brief Dispatch over float32, bfloat16, float16. `what` names the argument: "quantize: argument 'input'". */
template <typename Fn>
decltype(auto) dispatch_high_precision(DType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(Float32{});
    case DType::kBFloat16:
      return fn(BFloat16{});
    case DType::kFloat16:
      return fn(Float16{});
    default:
      TL_ERROR(TypeError, what, " must have dtype float32, bfloat16 or float16, got ", dtype_name(dtype));
  }
}

/*! \brief Dispatch over float8_e4m3fn, float8_e5m2. */
template <typename Fn>
decltype(auto) dispatch_fp8(DType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat8E4M3:
      return fn(Float8E4M3{});
    case DType::kFloat8E5M2:
      return fn(Float8E5M2{});
    default:
      TL_ERROR(TypeError, what, " must have dtype float8_e4m3fn or float8_e5m2, got ", dtype_name(dtype));
  }
}

}  // namespace tl
