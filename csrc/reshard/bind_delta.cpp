// Python bindings of the delta codec: raw addresses as integers (areal_fast.weights.delta_codec
// wraps them with torch tensors and checks dtypes, devices and sizes first).
#include <pybind11/pybind11.h>

#include "reshard/delta.h"

namespace py = pybind11;

namespace areal {
namespace {

template <class T>
T* ptr(int64_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void bind_delta(py::module_& m) {
  m.def(
      "delta_count_cpu",
      [](int64_t old_w, int64_t new_w, int64_t n, int64_t n_threads) {
        py::gil_scoped_release nogil;
        return delta::count_changed_cpu(ptr<const uint16_t>(old_w), ptr<const uint16_t>(new_w), n, n_threads);
      },
      py::arg("old"), py::arg("new"), py::arg("n"), py::arg("n_threads") = 0,
      "Number of 16-bit words that differ between two buffers of n words.");
  m.def(
      "delta_encode_cpu",
      [](int64_t old_w, int64_t new_w, int64_t n, int64_t idx, int64_t val, int64_t cap, int64_t n_threads) {
        py::gil_scoped_release nogil;
        return delta::encode_cpu(ptr<const uint16_t>(old_w), ptr<const uint16_t>(new_w), n, ptr<int32_t>(idx),
                                 ptr<uint16_t>(val), cap, n_threads);
      },
      py::arg("old"), py::arg("new"), py::arg("n"), py::arg("idx"), py::arg("val"), py::arg("cap"),
      py::arg("n_threads") = 0, "Changed word positions (ascending int32) and new words; -1 if more than cap.");
  m.def(
      "delta_apply_cpu",
      [](int64_t dst, int64_t n_dst, int64_t idx, int64_t val, int64_t m_changes, int64_t n_threads) {
        py::gil_scoped_release nogil;
        delta::apply_cpu(ptr<uint16_t>(dst), n_dst, ptr<const int32_t>(idx), ptr<const uint16_t>(val), m_changes,
                         n_threads);
      },
      py::arg("dst"), py::arg("n_dst"), py::arg("idx"), py::arg("val"), py::arg("m"), py::arg("n_threads") = 0,
      "dst[idx[k]] = val[k]; an index outside the tensor raises before anything is written.");
}

}  // namespace areal
