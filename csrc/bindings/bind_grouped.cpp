#include <pybind11/pybind11.h>

#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/grouped.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_grouped(py::module_& m) {
  m.def("fp8_grouped_gemm", &tl::fp8_grouped_gemm, "a"_a, "a_scale_inv"_a, "b"_a, "b_scale_inv"_a,
        "offs"_a, "a_block_rows"_a, "a_block_cols"_a, "b_block_rows"_a, "b_block_cols"_a, "bias"_a,
        "d"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "d[rows of group g] = block-scaled (a[rows of g] @ b[g].T) [+ bias[g]]; rows past offs[-1] = 0");
  m.def("fp8_grouped_gemm_wgrad", &tl::fp8_grouped_gemm_wgrad, "grad"_a, "grad_scale_inv"_a, "x"_a,
        "x_scale_inv"_a, "offs"_a, "d"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "d[g] = (grad[rows of g].T @ x[rows of g]) * grad_scale_inv * x_scale_inv (tensorwise)");
  m.def("fp8_grouped_gemm_wgrad_blockwise", &tl::fp8_grouped_gemm_wgrad_blockwise, "grad_t"_a,
        "grad_t_scale_inv"_a, "x_t"_a, "x_t_scale_inv"_a, "offs"_a, "token_block"_a, "d"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "d[g] = block-scaled grad_t[:, tokens of g] @ x_t[:, tokens of g].T (grouped columnwise copies)");
}

}  // namespace bindings
}  // namespace tl
