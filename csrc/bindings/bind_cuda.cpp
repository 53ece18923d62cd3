// What a CUDA build reports about itself (versions, architectures, GEMM
// paths), and cuBLASLt's block-scaled matmul with the table of the scaling
// pairs it runs. A CPU-only build has the same functions: cuda_build_info() is
// None there, the counters stay zero, the table answers and the block-scaled
// matmul raises.
#include <pybind11/pybind11.h>

#include "../common/cublaslt_block_pairs.h"
#include "../common/validate.h"
#include "bindings.h"
#include "tensor_caster.h"

#ifdef TL_WITH_CUDA
#include "../cuda/cuda_info.h"
#include "../cuda/gemm_block_cuda.h"
#include "../cuda/gemm_nvfp4_cuda.h"
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
                        "driver_version"_a = cuda::driver_version(), "archs"_a = cuda::built_archs(),
                        "cublas_header_version"_a = cuda::cublas_header_version(),
                        "cublaslt_version"_a = cuda::cublaslt_version());
#else
        return py::none();
#endif
      },
      "None for a CPU-only build, else {runtime_version, driver_version (0: no driver), archs, "
      "cublas_header_version (CUBLAS_VERSION compiled against), cublaslt_version (the loaded library's)}");
  m.def(
      "cuda_gemm_path_counts",
      []() {
#ifdef TL_WITH_CUDA
        const cuda::GemmPathCounts c = cuda::gemm_path_counts();
        return py::dict("cublaslt"_a = c.cublaslt, "fallback"_a = c.fallback, "padded"_a = c.padded,
                        "cached_algos"_a = c.cached_algos, "cublaslt_block"_a = c.cublaslt_block);
#else
        return py::dict("cublaslt"_a = 0, "fallback"_a = 0, "padded"_a = 0, "cached_algos"_a = 0,
                        "cublaslt_block"_a = 0);
#endif
      },
      "CUDA GEMMs run by cuBLASLt (padded: of those, on zero-padded operand copies) and by the tiled "
      "fallback kernel since the last reset, the number of cached cuBLASLt algorithms, and the "
      "block-scaled GEMMs cuBLASLt ran");
  m.def("reset_cuda_gemm_path_counts", []() {
#ifdef TL_WITH_CUDA
    cuda::reset_gemm_path_counts();
#endif
  });
  m.def("cublaslt_block_pair_runs", &cublaslt_block_pair_runs, "a_scaling"_a, "b_scaling"_a, "major"_a, "minor"_a,
        "cublas_version"_a,
        "Whether cuBLASLt of cublas_version (CUBLAS_VERSION encoding) has a block-scaled matmul for the "
        "ScalingType pair (a_scaling, b_scaling) on a GPU of compute capability (major, minor); the table "
        "of csrc/common/cublaslt_block_pairs.cpp, in every build");
  m.def(
      "fp8_gemm_blockwise_cublaslt",
      [](const TensorDesc& a, const TensorDesc& a_scale_inv, const std::string& a_scaling, const TensorDesc& b,
         const TensorDesc& b_scale_inv, const std::string& b_scaling, const TensorDesc& bias, const TensorDesc& d,
         const TensorDesc& workspace, Stream stream) -> bool {
#ifdef TL_WITH_CUDA
        return cuda::fp8_gemm_blockwise(a, a_scale_inv, a_scaling, b, b_scale_inv, b_scaling, bias, d, workspace,
                                        stream);
#else
        (void)a, (void)a_scale_inv, (void)a_scaling, (void)b, (void)b_scale_inv, (void)b_scaling, (void)bias,
            (void)d, (void)workspace, (void)stream;
        fail_no_cuda("fp8_gemm");
#endif
      },
      "a"_a, "a_scale_inv"_a, "a_scaling"_a, "b"_a, "b_scale_inv"_a, "b_scaling"_a, "bias"_a, "d"_a,
      "workspace"_a, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
      "d = block-scaled (a @ b.T) [+ bias] through cuBLASLt, scales in cuBLASLt's layouts "
      "(csrc/cuda/gemm_block_cuda.h); False (d untouched) when cuBLASLt cannot run it here");
  m.def(
      "nvfp4_gemm_cublaslt",
      [](const TensorDesc& a, const TensorDesc& a_scale, const TensorDesc& b, const TensorDesc& b_scale,
         const TensorDesc& d, const TensorDesc& workspace, Stream stream) -> bool {
#ifdef TL_WITH_CUDA
        return cuda::nvfp4_gemm(a, a_scale, b, b_scale, d, workspace, stream);
#else
        (void)a, (void)a_scale, (void)b, (void)b_scale, (void)d, (void)workspace, (void)stream;
        fail_no_cuda("nvfp4_gemm");
#endif
      },
      "a"_a, "a_scale"_a, "b"_a, "b_scale"_a, "d"_a, "workspace"_a, "stream"_a = 0,
      py::call_guard<py::gil_scoped_release>(),
      "float32 d = NVFP4 a @ b.T (block scales only; the caller applies the global scales and bias) through "
      "cuBLASLt, scales as uint8 E4M3 bits in its 128x4 tiles (csrc/cuda/gemm_nvfp4_cuda.h); False (d "
      "untouched) when cuBLASLt cannot run it here");
}

}  // namespace bindings
}  // namespace tl
