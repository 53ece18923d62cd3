// What a CUDA build reports about itself (versions, architectures, GEMM
// paths). A CPU-only build has the same functions: cuda_build_info() is None
// there and the counters stay zero.
#include <pybind11/pybind11.h>

#include "bindings.h"

#ifdef TL_WITH_CUDA
#include "../cuda/cuda_info.h"
#endif

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_cuda(py::module_& m) {
  m.def(
      "cuda_build_info",
      []() -> py::object {
#ifdef TL_WITH_CUDA
        return py::dict("runtime_version"_a = cuda::runtime_version(),
                        "driver_version"_a = cuda::driver_version(), "archs"_a = cuda::built_archs());
#else
        return py::none();
#endif
      },
      "None for a CPU-only build, else {runtime_version, driver_version (0: no driver), archs}");
  m.def(
      "cuda_gemm_path_counts",
      []() {
#ifdef TL_WITH_CUDA
        const cuda::GemmPathCounts c = cuda::gemm_path_counts();
        return py::dict("cublaslt"_a = c.cublaslt, "fallback"_a = c.fallback, "padded"_a = c.padded,
                        "cached_algos"_a = c.cached_algos);
#else
        return py::dict("cublaslt"_a = 0, "fallback"_a = 0, "padded"_a = 0, "cached_algos"_a = 0);
#endif
      },
      "CUDA GEMMs run by cuBLASLt (padded: of those, on zero-padded operand copies) and by the tiled "
      "fallback kernel since the last reset, and the "
      "number of cached cuBLASLt algorithms");
  m.def("reset_cuda_gemm_path_counts", []() {
#ifdef TL_WITH_CUDA
    cuda::reset_gemm_path_counts();
#endif
  });
}

}  // namespace bindings
}  // namespace tl
