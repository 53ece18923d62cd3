#include <pybind11/pybind11.h>

#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/nvfp4.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_nvfp4(py::module_& m) {
  m.def("quantize_nvfp4", &tl::quantize_nvfp4, "input"_a, "amax"_a, "amax_t"_a, "output"_a,
        "scale"_a, "global_scale"_a, "output_t"_a, "scale_t"_a, "global_scale_t"_a,
        "scaling_2d"_a, "rht"_a, "stochastic_rounding"_a, "seed"_a, "offset"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "NVFP4 quantize (E2M1 + E4M3 1x16 / 16x16 block scales + float32 global scale); "
        "rowwise and/or columnwise copy");
  m.def("nvfp4_amax", &tl::nvfp4_amax, "input"_a, "amax"_a, "amax_rht"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "NVFP4 global amaxes: max |x| and/or max |H(x^T)| (the RHT columnwise copy's), one pass");
  m.def("nvfp4_gemm", &tl::nvfp4_gemm, "a"_a, "a_scale"_a, "a_global_scale"_a, "b"_a,
        "b_scale"_a, "b_global_scale"_a, "bias"_a, "d"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "d = NVFP4 block-scaled (a @ b.T) * a_global_scale * b_global_scale [+ bias]");
  m.def("nvfp4_grouped_gemm", &tl::nvfp4_grouped_gemm, "a"_a, "a_scale_inv"_a, "b"_a, "b_scale_inv"_a,
        "offs"_a, "bias"_a, "d"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "grouped NVFP4 GEMM: d[rows of g] = a[rows of g] @ b[g].T [+ bias[g]] (packed scales)");
  m.def("nvfp4_grouped_gemm_wgrad", &tl::nvfp4_grouped_gemm_wgrad, "grad_t"_a, "grad_t_scale_inv"_a, "x_t"_a,
        "x_t_scale_inv"_a, "offs"_a, "d"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "grouped NVFP4 wgrad: d[g] = grad_t[g] @ x_t[g].T over the token blocks of group g");
  m.def("quantize_nvfp4_grouped_columnwise", &tl::quantize_nvfp4_grouped_columnwise, "input"_a, "offs"_a,
        "seeds"_a, "output_t"_a, "scale_t"_a, "rht"_a, "stochastic_rounding"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "columnwise NVFP4 copies of the tokens masked to each group (packed scales)");
}

}  // namespace bindings
}  // namespace tl
