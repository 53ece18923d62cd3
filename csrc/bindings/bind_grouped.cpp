#include <pybind11/pybind11.h>

#include "../common/validate.h"
#include "bindings.h"
#include "tensor_caster.h"
#include "transformer_linear/grouped.h"

#ifdef TL_WITH_CUDA
#include "../cuda/gemm_grouped_cuda.h"
#endif

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
  m.def("quantize_grouped_columnwise", &tl::quantize_grouped_columnwise, "input"_a, "offs"_a, "token_block"_a,
        "power_2_scale"_a, "e8m0_floor"_a, "output_t"_a, "scale_inv_t"_a, "stream"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "output_t (C, total) FP8, scale_inv_t = the grouped columnwise copy of input (total, C) (CPU; offs read "
        "on the host)");
  m.def(
      "fp8_grouped_gemm_cublaslt",
      [](const TensorDesc& a, const TensorDesc& a_scale_inv, const TensorDesc& b, const TensorDesc& b_scale_inv,
         const TensorDesc& offs, const TensorDesc& d, const TensorDesc& workspace, Stream stream) -> bool {
#ifdef TL_WITH_CUDA
        return cuda::fp8_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, d, workspace, stream);
#else
        (void)a, (void)a_scale_inv, (void)b, (void)b_scale_inv, (void)offs, (void)d, (void)workspace, (void)stream;
        fail_no_cuda("fp8_grouped_gemm");
#endif
      },
      "a"_a, "a_scale_inv"_a, "b"_a, "b_scale_inv"_a, "offs"_a, "d"_a, "workspace"_a, "stream"_a = 0,
      py::call_guard<py::gil_scoped_release>(),
      "d[rows of group g] = (a[rows of g] @ b[g].T) * a_scale_inv * b_scale_inv[g] (tensorwise) through "
      "cuBLASLt's grouped matmul (csrc/cuda/gemm_grouped_cuda.h), offs read on the device; rows past offs[-1] "
      "untouched, no bias; False (d untouched) when cuBLASLt cannot run it here");
  m.def(
      "cublaslt_grouped_runs",
      []() -> uint64_t {
#ifdef TL_WITH_CUDA
        return cuda::cublaslt_grouped_runs();
#else
        return 0;
#endif
      },
      "How many grouped GEMMs cuBLASLt ran in this process (0 in a CPU-only build)");
}

}  // namespace bindings
}  // namespace tl
