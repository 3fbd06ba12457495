// The one extension module, areal_fast._C. It exposes plain functions over pointers, sizes
// and numpy arrays: no torch headers, so the wheel builds under build isolation without
// torch. Each component registers its functions from its own bind_*.cpp.
#include <pybind11/pybind11.h>

#include "common/cuda_runtime.h"

namespace py = pybind11;

namespace areal {
void bind_packing(py::module_& m);
void bind_reshard(py::module_& m);
void bind_answer(py::module_& m);
void bind_delta(py::module_& m);
}  // namespace areal

PYBIND11_MODULE(_C, m) {
  m.doc() = "areal_fast native core (C++; CUDA kernels when built with a CUDA compiler)";
  m.def("has_cuda", &areal::built_with_cuda,
        "True when this build compiled the CUDA sources (csrc/**/*.cu).");
  m.def("cuda_device_count", &areal::cuda_device_count,
        "Number of CUDA devices visible to the native core (0 without a driver or in a CPU build).");
  areal::bind_packing(m);
  areal::bind_reshard(m);
  areal::bind_answer(m);
  areal::bind_delta(m);
}
