// The transformer_linear._C module: exception translation plus one call per kernel family.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "transformer_linear/check.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "transformer_linear FP8 kernels (CPU, and CUDA when built with it). Internal: use\n"
      "transformer_linear.ops. Descriptors are checked for dtype, device, shape, layout and\n"
      "int64 overflow, but a raw data pointer cannot be checked: a forged one makes the\n"
      "kernels read or write wherever it points. The last argument of each kernel is the\n"
      "CUDA stream for CUDA tensors and the thread count (0: OpenMP's) for CPU tensors.";
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tl::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const tl::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const tl::RuntimeError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  tl::bindings::register_quantize(m);
  tl::bindings::register_gemm(m);
  tl::bindings::register_runtime(m);
  tl::bindings::register_cuda(m);
  tl::bindings::register_block(m);
  tl::bindings::register_nvfp4(m);
  tl::bindings::register_grouped(m);
}
