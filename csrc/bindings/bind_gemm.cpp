#include <pybind11/pybind11.h>

#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/gemm.h"
#include "transformer_linear/quantize_gemm.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_gemm(py::module_& m) {
  m.def("fp8_gemm", &tl::fp8_gemm, "a"_a, "a_scale_inv"_a, "b"_a, "b_scale_inv"_a, "bias"_a,
        "d"_a, "accumulate"_a, "use_split_accumulator"_a, "workspace"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "d = (a @ b.T) * a_scale_inv * b_scale_inv [+ bias] [+ d]");
  m.def("quantize_fp8_gemm", &tl::quantize_fp8_gemm, "input"_a, "scale"_a, "output"_a, "scale_inv"_a, "amax"_a,
        "current_scaling"_a, "margin"_a, "b"_a, "b_scale_inv"_a, "bias"_a, "d"_a, "use_split_accumulator"_a,
        "workspace"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "output = quantize(input * scale); d = (output @ b.T) * scale_inv * b_scale_inv [+ bias]");
}

}  // namespace bindings
}  // namespace tl
