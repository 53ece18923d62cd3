#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "transformer_linear/runtime.h"

namespace py = pybind11;
using namespace py::literals;

namespace tl {
namespace bindings {

void register_runtime(py::module_& m) {
  m.def("set_num_threads", &tl::set_num_threads, "n"_a);
  m.def("get_num_threads", &tl::get_num_threads);
  // The first call without a forced path times the paths (milliseconds): without the GIL.
  m.def("cpu_isa", &tl::cpu_isa, py::call_guard<py::gil_scoped_release>(),
        "The CPU code path in use");
  m.def("set_cpu_isa", &tl::set_cpu_isa, "isa"_a,
        "Force a CPU code path (generic, avx512 or avx512_bf16, any case), or 'auto' for the "
        "measured fastest");
  m.def("cpu_isa_supported", &tl::cpu_isa_supported, "isa"_a,
        "Whether this CPU can run the named code path");
  m.def(
      "cpu_isa_info",
      [] {
        CpuIsaInfo info;
        {
          py::gil_scoped_release no_gil;
          info = tl::cpu_isa_info();
        }
        py::dict seconds;
        for (const auto& [isa, s] : info.probe_seconds) seconds[py::str(isa)] = s;
        return py::dict("isa"_a = info.isa, "source"_a = info.source, "reason"_a = info.reason,
                        "gemm_kernel"_a = info.gemm_kernel, "supported"_a = info.supported,
                        "probe_seconds"_a = seconds, "probe_shape"_a = info.probe_shape);
      },
      "How the CPU code path was chosen: isa, source (forced / measured / only_supported), "
      "reason, gemm_kernel, supported, probe_seconds, probe_shape");
  m.def("built_with_cuda", &tl::built_with_cuda);
  // An unusable TL_CPU_ISA was ignored: say so once, when the module is imported.
  const std::string warning = tl::cpu_isa_env_warning();
  if (!warning.empty() && PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace bindings
}  // namespace tl
