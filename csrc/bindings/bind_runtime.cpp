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
  m.def("cpu_isa", &tl::cpu_isa, "The CPU code path in use");
  m.def("set_cpu_isa", &tl::set_cpu_isa, "isa"_a,
        "Force a CPU code path: auto, generic, avx512 or avx512_bf16");
  m.def("built_with_cuda", &tl::built_with_cuda);
}

}  // namespace bindings
}  // namespace tl
