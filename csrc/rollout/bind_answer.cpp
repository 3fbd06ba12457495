// areal_fast._C.scan_generate_answer: the native half of areal_fast.rollout.answer.parse_generate.
#include <pybind11/pybind11.h>

#include "rollout/answer_scan.h"

namespace py = pybind11;

namespace areal {
namespace {

py::object scan_generate_answer_py(const py::object& raw, int64_t vocab) {
  // PyBUF_SIMPLE: bytes, bytearray, a contiguous memoryview; read in place, never copied. The
  // view is held until this returns, so a bytearray cannot be resized while the GIL is released.
  Py_buffer view;
  if (PyObject_GetBuffer(raw.ptr(), &view, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();  // e.g. a strided memoryview: the reference copes with it
    return py::str("not a contiguous buffer");
  }
  AnswerScan scan;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = scan_generate_answer(static_cast<const char*>(view.buf), static_cast<std::size_t>(view.len), scan,
                              vocab);
  }
  PyBuffer_Release(&view);
  if (!ok) return py::str(scan.reason);
  return py::make_tuple(
      py::bytes(reinterpret_cast<const char*>(scan.ids.data()), scan.ids.size() * sizeof(int32_t)),
      py::bytes(reinterpret_cast<const char*>(scan.logprobs.data()), scan.logprobs.size() * sizeof(float)),
      py::bytes(scan.rest));
}

}  // namespace

void bind_answer(py::module_& m) {
  // The rules the scanner enforces (areal_fast.rollout.answer uses a scanner only with these):
  // 2 = ids in [0, vocab), log-probs <= 0, entry ids == output_ids, no duplicate key anywhere.
  m.attr("ANSWER_SCAN_RULES") = 2;
  m.def("scan_generate_answer", &scan_generate_answer_py, py::arg("raw"), py::arg("vocab") = 0,
        "Scan one /generate answer (any contiguous buffer, read in place, GIL released): "
        "(ids int32 bytes, log-probs float32 bytes, the answer with both arrays emptied) when "
        "handled, else a str saying why not (see areal_fast.rollout.answer.parse_generate). vocab > 0: "
        "ids must be below it.");
}

}  // namespace areal
