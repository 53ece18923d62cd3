// Each kernel family registers its own functions; module.cpp only calls these.
#pragma once

#include <pybind11/pybind11.h>

namespace tl {
namespace bindings {
void register_quantize(pybind11::module_& m);
void register_gemm(pybind11::module_& m);
void register_runtime(pybind11::module_& m);
void register_cuda(pybind11::module_& m);
void register_block(pybind11::module_& m);
void register_nvfp4(pybind11::module_& m);
void register_grouped(pybind11::module_& m);
}  // namespace bindings
}  // namespace tl
