// Python bindings of the reshard core: plain numpy int64 arrays in and out, raw pointers as
// integers (areal_fast.weights.plan / interval_copy wrap these with torch tensors).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "reshard/dtypes.h"
#include "reshard/interval_copy.h"
#include "reshard/planner.h"

namespace py = pybind11;

namespace areal {
namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> to_numpy(std::vector<int64_t>&& v, int64_t cols = 0) {
  auto* heap = new std::vector<int64_t>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  if (cols > 0)
    return py::array_t<int64_t>({static_cast<py::ssize_t>(heap->size() / cols), static_cast<py::ssize_t>(cols)},
                                heap->data(), owner);
  return py::array_t<int64_t>({static_cast<py::ssize_t>(heap->size())}, heap->data(), owner);
}

void check_1d(const I64Array& a, const char* name, py::ssize_t n) {
  if (a.ndim() != 1 || (n >= 0 && a.shape(0) != n))
    throw std::invalid_argument(std::string(name) + " must be a 1-D array" +
                                (n >= 0 ? " of length " + std::to_string(n) : std::string()));
}

void check_2d(const I64Array& a, const char* name, py::ssize_t cols) {
  if (a.ndim() != 2 || a.shape(1) != cols)
    throw std::invalid_argument(std::string(name) + " must be an int64 array of shape [n, " + std::to_string(cols) +
                                "]");
}

py::tuple assign_buckets_py(I64Array nbytes, I64Array align, int64_t bucket_bytes) {
  check_1d(nbytes, "nbytes", -1);
  check_1d(align, "align", nbytes.shape(0));
  auto a = reshard::assign_buckets(nbytes.data(), align.data(), nbytes.shape(0), bucket_bytes);
  return py::make_tuple(to_numpy(std::move(a.bucket)), to_numpy(std::move(a.offset)),
                        to_numpy(std::move(a.bucket_bytes)));
}

py::list plan_blocks_py(I64Array rows, I64Array cols, I64Array dtypes, int64_t n_ranks, I64Array blocks) {
  check_1d(rows, "src_rows", -1);
  check_1d(cols, "src_cols", rows.shape(0));
  check_1d(dtypes, "src_dtype", rows.shape(0));
  check_2d(blocks, "blocks", reshard::kBlockCols);
  reshard::RankIntervals out;
  {
    py::gil_scoped_release nogil;
    out = reshard::plan_blocks(rows.data(), cols.data(), dtypes.data(), rows.shape(0), n_ranks, blocks.data(),
                               blocks.shape(0));
  }
  py::list l;
  for (auto& v : out.per_rank) l.append(to_numpy(std::move(v), reshard::kIntervalCols));
  return l;
}

py::dict plan_fsdp_buckets_py(I64Array rows, I64Array cols, I64Array src_dtype, I64Array dst_dtype, int64_t n_ranks,
                              int64_t bucket_bytes) {
  const py::ssize_t n = rows.shape(0);
  check_1d(rows, "rows", -1);
  check_1d(cols, "cols", n);
  check_1d(src_dtype, "src_dtype", n);
  check_1d(dst_dtype, "dst_dtype", n);
  reshard::BucketPlan p;
  {
    py::gil_scoped_release nogil;
    p = reshard::plan_fsdp_buckets(rows.data(), cols.data(), src_dtype.data(), dst_dtype.data(), n, n_ranks,
                                   bucket_bytes);
  }
  py::dict d;
  d["bucket"] = to_numpy(std::move(p.assignment.bucket));
  d["offset"] = to_numpy(std::move(p.assignment.offset));
  d["bucket_bytes"] = to_numpy(std::move(p.assignment.bucket_bytes));
  d["seg_bytes"] = to_numpy(std::move(p.seg_bytes));
  py::list pack, bounds, unpack;
  for (auto& v : p.pack) pack.append(to_numpy(std::move(v), reshard::kIntervalCols));
  for (auto& v : p.pack_bounds) bounds.append(to_numpy(std::move(v)));
  for (auto& v : p.unpack) unpack.append(to_numpy(std::move(v), reshard::kIntervalCols));
  d["pack"] = pack;
  d["pack_bounds"] = bounds;
  d["unpack"] = unpack;
  return d;
}

void interval_copy_cpu_py(I64Array src_ptrs, I64Array dst_ptrs, I64Array intervals, int64_t n_threads) {
  check_1d(src_ptrs, "src_ptrs", -1);
  check_1d(dst_ptrs, "dst_ptrs", -1);
  check_2d(intervals, "intervals", reshard::kIntervalCols);
  py::gil_scoped_release nogil;
  reshard::interval_copy_cpu(src_ptrs.data(), src_ptrs.shape(0), dst_ptrs.data(), dst_ptrs.shape(0),
                             intervals.data(), intervals.shape(0), n_threads);
}

void interval_copy_cuda_py(I64Array src_ptrs, I64Array dst_ptrs, I64Array intervals, int64_t stream) {
  check_1d(src_ptrs, "src_ptrs", -1);
  check_1d(dst_ptrs, "dst_ptrs", -1);
  check_2d(intervals, "intervals", reshard::kIntervalCols);
  py::gil_scoped_release nogil;
  reshard::interval_copy_cuda(src_ptrs.data(), src_ptrs.shape(0), dst_ptrs.data(), dst_ptrs.shape(0),
                              intervals.data(), intervals.shape(0), stream);
}

}  // namespace

void bind_reshard(py::module_& m) {
  m.def("reshard_assign_buckets", &assign_buckets_py, py::arg("nbytes"), py::arg("align"), py::arg("bucket_bytes"),
        "Greedy order-preserving bucket packing -> (bucket, offset, bucket_bytes).");
  m.def("reshard_plan_blocks", &plan_blocks_py, py::arg("src_rows"), py::arg("src_cols"), py::arg("src_dtype"),
        py::arg("n_ranks"), py::arg("blocks"), "Per-source-rank copy intervals for a list of 2-D blocks.");
  m.def("reshard_plan_fsdp_buckets", &plan_fsdp_buckets_py, py::arg("rows"), py::arg("cols"), py::arg("src_dtype"),
        py::arg("dst_dtype"), py::arg("n_ranks"), py::arg("bucket_bytes"),
        "FSDP2 dim-0 shards -> flattened buckets (pack / gather / unpack plan).");
  m.def("interval_copy_cpu", &interval_copy_cpu_py, py::arg("src_ptrs"), py::arg("dst_ptrs"), py::arg("intervals"),
        py::arg("n_threads") = 0, "Execute copy intervals on the CPU (casts fp32<->bf16/fp16).");
  m.def("interval_copy_cuda", &interval_copy_cuda_py, py::arg("src_ptrs"), py::arg("dst_ptrs"), py::arg("intervals"),
        py::arg("stream") = 0, "Execute copy intervals on a CUDA stream in one kernel launch.");
  m.attr("RESHARD_INTERVAL_COLS") = static_cast<int>(reshard::kIntervalCols);
  m.attr("RESHARD_BLOCK_COLS") = static_cast<int>(reshard::kBlockCols);
}

}  // namespace areal
