#include <pybind11/pybind11.h>

#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/quantize.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_quantize(py::module_& m) {
  m.def("amax", &tl::amax, "input"_a, "amax"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(), "amax[0] = max |input| (NaN-propagating)");
  m.def("quantize", &tl::quantize, "input"_a, "scale"_a, "output"_a, "output_t"_a, "scale_inv"_a,
        "amax"_a, "dbias"_a, "current_scaling"_a, "margin"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "FP8 quantize with optional transposed output, amax and bias gradient");
  m.def("dequantize", &tl::dequantize, "input"_a, "scale_inv"_a, "output"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(), "output = float(input) * scale_inv");
  m.def("transpose", &tl::transpose, "input"_a, "output"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(), "output = input with its last two dimensions swapped (FP8)");
  m.def("bias_grad", &tl::bias_grad, "input"_a, "dbias"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "dbias = column sums of input (float32 accumulation, 256-row blocks added in order)");
}

}  // namespace bindings
}  // namespace tl
