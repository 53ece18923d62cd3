#include <pybind11/pybind11.h>

#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/block.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_block(py::module_& m) {
  m.def("quantize_blockwise", &tl::quantize_blockwise, "input"_a, "output"_a, "scale_inv"_a,
        "output_t"_a, "scale_inv_t"_a, "block_rows"_a, "block_cols"_a, "block_rows_t"_a,
        "block_cols_t"_a, "power_2_scale"_a, "e8m0_floor"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "FP8 quantize with one scale per block; row-major and/or transposed output");
  m.def("fp8_gemm_blockwise", &tl::fp8_gemm_blockwise, "a"_a, "a_scale_inv"_a, "b"_a,
        "b_scale_inv"_a, "a_block_rows"_a, "a_block_cols"_a, "b_block_rows"_a, "b_block_cols"_a,
        "bias"_a, "d"_a, "accumulate"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
        "d = block-scaled (a @ b.T) [+ bias] [+ d], per-K-block fp32 promotion");
}

}  // namespace bindings
}  // namespace tl
