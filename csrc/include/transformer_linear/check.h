/*!
 * \file check.h
 * \brief The one error-checking header: exception types and check macros.
 *
 * Kernels stay framework-free: they throw tl::TypeError / tl::ValueError /
 * tl::RuntimeError, and the binding layer turns them into the Python
 * exceptions of the same names. Every message starts with the operation and
 * the argument, e.g. "fp8_gemm: argument 'b' must be ...", and carries the
 * C++ file:line.
 */
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "transformer_linear/tensor.h"

namespace tl {

/*! \brief Wrong dtype or device (Python TypeError). */
struct TypeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/*! \brief Wrong shape, layout or value (Python ValueError). */
struct ValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/*! \brief A failed library or runtime call (Python RuntimeError). */
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream ss;
  (ss << ... << args);
  return ss.str();
}
}  // namespace detail

}  // namespace tl

#define TL_STRINGIFY_(x) #x
#define TL_STRINGIFY(x) TL_STRINGIFY_(x)
#define TL_WHERE " [" __FILE__ ":" TL_STRINGIFY(__LINE__) "]"

/*! \brief Throw `kind` (TypeError, ValueError, RuntimeError) with a streamed message unless `cond`. */
#define TL_CHECK_AS(kind, cond, ...)                                        \
  do {                                                                      \
    if (!(cond)) throw ::tl::kind(::tl::detail::concat(__VA_ARGS__) + TL_WHERE); \
  } while (0)

#define TL_CHECK(cond, ...) TL_CHECK_AS(ValueError, cond, __VA_ARGS__)
#define TL_CHECK_TYPE(cond, ...) TL_CHECK_AS(TypeError, cond, __VA_ARGS__)
#define TL_ERROR(kind, ...) throw ::tl::kind(::tl::detail::concat(__VA_ARGS__) + TL_WHERE)
