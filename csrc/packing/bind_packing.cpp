#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "packing/planner.h"

namespace py = pybind11;

namespace areal {
namespace {

template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(heap->size())}, heap->data(), owner);
}

py::dict plan_microbatches_py(py::array_t<int64_t, py::array::c_style | py::array::forcecast> lengths,
                              int64_t max_tokens, int64_t n_ranks, int64_t min_mbs,
                              int64_t mbs_divisor, double attn_coef) {
  if (lengths.ndim() != 1) throw std::invalid_argument("plan_microbatches: lengths must be 1-D");
  PackingPlan plan;
  {
    py::gil_scoped_release nogil;
    plan = plan_microbatches(lengths.data(), lengths.shape(0), max_tokens, n_ranks, min_mbs,
                             mbs_divisor, attn_coef);
  }
  py::dict out;
  out["n_ranks"] = plan.n_ranks;
  out["mbs_per_rank"] = plan.mbs_per_rank;
  out["lower_bound"] = plan.lower_bound;
  out["order"] = to_numpy(std::move(plan.order));
  out["mb_offsets"] = to_numpy(std::move(plan.mb_offsets));
  out["mb_tokens"] = to_numpy(std::move(plan.mb_tokens));
  out["rank_cost"] = to_numpy(std::move(plan.rank_cost));
  return out;
}

}  // namespace

void bind_packing(py::module_& m) {
  m.def("plan_microbatches", &plan_microbatches_py, py::arg("lengths"), py::arg("max_tokens"),
        py::arg("n_ranks"), py::arg("min_mbs"), py::arg("mbs_divisor"), py::arg("attn_coef"),
        "Plan micro-batches; returns flat arrays (see areal_fast.packing.plan_microbatches).");
}

}  // namespace areal
