// Reshard planner: see planner.h. Everything is O(tensors * ranks) (plus O(blocks * ranks)),
// so a 7B-shaped model (~290 tensors) plans in microseconds.
#include "reshard/planner.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "reshard/dtypes.h"

namespace areal {
namespace reshard {
namespace {

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

void check_dtype(int64_t code, const char* what, int64_t i) {
  if (dtype_size(code) <= 0)
    throw std::invalid_argument(std::string("reshard: ") + what + "[" + std::to_string(i) +
                                "] = " + std::to_string(code) + " is not a dtype code");
}

// Appends an interval, merging it into the previous one when both are single contiguous
// runs that continue each other on both sides (same buffers and dtypes).
void emit(std::vector<int64_t>& out, int64_t src_idx, int64_t src_off, int64_t src_ld, int64_t dst_idx,
          int64_t dst_off, int64_t dst_ld, int64_t len, int64_t rows, int64_t sdt, int64_t ddt) {
  if (len <= 0 || rows <= 0) return;
  if (rows == 1) {
    src_ld = len;
    dst_ld = len;
  }
  const size_t n = out.size();
  if (n >= kIntervalCols && rows == 1) {
    int64_t* p = &out[n - kIntervalCols];
    if (p[kRows] == 1 && p[kSrcIdx] == src_idx && p[kDstIdx] == dst_idx && p[kSrcDtype] == sdt &&
        p[kDstDtype] == ddt && p[kSrcOff] + p[kLen] == src_off && p[kDstOff] + p[kLen] == dst_off) {
      p[kLen] += len;
      p[kSrcLd] = p[kLen];
      p[kDstLd] = p[kLen];
      return;
    }
  }
  const int64_t row[kIntervalCols] = {src_idx, src_off, src_ld, dst_idx, dst_off, dst_ld, len, rows, sdt, ddt};
  out.insert(out.end(), row, row + kIntervalCols);
}

}  // namespace

BucketAssignment assign_buckets(const int64_t* nbytes, const int64_t* align, int64_t n, int64_t bucket_bytes) {
  if (bucket_bytes <= 0) throw std::invalid_argument("assign_buckets: bucket_bytes must be > 0");
  BucketAssignment a;
  a.bucket.resize(n);
  a.offset.resize(n);
  int64_t cur = 0;
  bool empty = true;
  for (int64_t t = 0; t < n; ++t) {
    if (nbytes[t] < 0) throw std::invalid_argument("assign_buckets: nbytes[" + std::to_string(t) + "] < 0");
    if (align[t] <= 0) throw std::invalid_argument("assign_buckets: align[" + std::to_string(t) + "] <= 0");
    int64_t off = align_up(cur, align[t]);
    if (!empty && off + nbytes[t] > bucket_bytes) {
      a.bucket_bytes.push_back(cur);
      cur = 0;
      off = 0;
      empty = true;
    }
    a.bucket[t] = static_cast<int64_t>(a.bucket_bytes.size());
    a.offset[t] = off;
    cur = off + nbytes[t];
    empty = false;
  }
  if (!empty) a.bucket_bytes.push_back(cur);
  return a;
}

RankIntervals plan_blocks(const int64_t* src_rows, const int64_t* src_cols, const int64_t* src_dtype,
                          int64_t n_src, int64_t n_ranks, const int64_t* blocks, int64_t n_blocks) {
  if (n_ranks < 1) throw std::invalid_argument("plan_blocks: n_ranks must be >= 1");
  for (int64_t t = 0; t < n_src; ++t) {
    if (src_rows[t] < 0 || src_cols[t] < 0)
      throw std::invalid_argument("plan_blocks: source " + std::to_string(t) + " has a negative shape");
    check_dtype(src_dtype[t], "src_dtype", t);
  }
  RankIntervals out;
  out.per_rank.resize(n_ranks);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t* k = blocks + b * kBlockCols;
    const int64_t t = k[kBSrc];
    const std::string where = "plan_blocks: block " + std::to_string(b);
    if (t < 0 || t >= n_src) throw std::invalid_argument(where + " names source " + std::to_string(t));
    const int64_t rows = src_rows[t], cols = src_cols[t];
    if (k[kBRow0] < 0 || k[kBRows] < 0 || k[kBRow0] + k[kBRows] > rows || k[kBCol0] < 0 || k[kBCols] < 0 ||
        k[kBCol0] + k[kBCols] > cols)
      throw std::invalid_argument(where + " is outside source " + std::to_string(t) + " [" +
                                  std::to_string(rows) + ", " + std::to_string(cols) + "]");
    if (k[kBDstOff] < 0 || k[kBDstLd] < k[kBCols])
      throw std::invalid_argument(where + ": dst_off < 0 or dst_ld < n_cols");
    check_dtype(k[kBDstDtype], "block dst_dtype", b);
    if (!cast_supported(src_dtype[t], k[kBDstDtype]))
      throw std::invalid_argument(where + ": cast from dtype " + std::to_string(src_dtype[t]) + " to " +
                                  std::to_string(k[kBDstDtype]) + " is not supported");
    const bool full_rows = k[kBCols] == cols && k[kBDstLd] == cols;  // rows are one contiguous run
    for (int64_t r = 0; r < n_ranks; ++r) {
      int64_t lo, hi;
      shard_rows(rows, n_ranks, r, &lo, &hi);
      const int64_t a = lo > k[kBRow0] ? lo : k[kBRow0];
      const int64_t e = hi < k[kBRow0] + k[kBRows] ? hi : k[kBRow0] + k[kBRows];
      if (a >= e) continue;
      const int64_t src_off = (a - lo) * cols + k[kBCol0];
      const int64_t dst_off = k[kBDstOff] + (a - k[kBRow0]) * k[kBDstLd];
      if (full_rows)
        emit(out.per_rank[r], t, src_off, cols, k[kBDstIdx], dst_off, cols, (e - a) * cols, 1, src_dtype[t],
             k[kBDstDtype]);
      else
        emit(out.per_rank[r], t, src_off, cols, k[kBDstIdx], dst_off, k[kBDstLd], k[kBCols], e - a, src_dtype[t],
             k[kBDstDtype]);
    }
  }
  return out;
}

BucketPlan plan_fsdp_buckets(const int64_t* rows, const int64_t* cols, const int64_t* src_dtype,
                             const int64_t* dst_dtype, int64_t n, int64_t n_ranks, int64_t bucket_bytes) {
  if (n_ranks < 1) throw std::invalid_argument("plan_fsdp_buckets: n_ranks must be >= 1");
  std::vector<int64_t> nbytes(n), align(n);
  for (int64_t t = 0; t < n; ++t) {
    if (rows[t] < 0 || cols[t] < 0)
      throw std::invalid_argument("plan_fsdp_buckets: tensor " + std::to_string(t) + " has a negative shape");
    check_dtype(src_dtype[t], "src_dtype", t);
    check_dtype(dst_dtype[t], "dst_dtype", t);
    if (!cast_supported(src_dtype[t], dst_dtype[t]))
      throw std::invalid_argument("plan_fsdp_buckets: tensor " + std::to_string(t) + ": cast from dtype " +
                                  std::to_string(src_dtype[t]) + " to " + std::to_string(dst_dtype[t]) +
                                  " is not supported");
    align[t] = dtype_size(dst_dtype[t]);
    nbytes[t] = rows[t] * cols[t] * align[t];
  }
  BucketPlan p;
  p.assignment = assign_buckets(nbytes.data(), align.data(), n, bucket_bytes);
  const int64_t nb = static_cast<int64_t>(p.assignment.bucket_bytes.size());
  p.seg_bytes.assign(nb, 0);
  p.pack.resize(n_ranks);
  p.pack_bounds.assign(n_ranks, std::vector<int64_t>(nb + 1, 0));
  p.unpack.resize(nb);
  // seg_off[t * n_ranks + r]: byte offset of rank r's rows of tensor t inside its segment.
  std::vector<int64_t> seg_off(n * n_ranks), seg_end(n_ranks);
  int64_t t0 = 0;
  for (int64_t b = 0; b < nb; ++b) {
    int64_t t1 = t0;
    while (t1 < n && p.assignment.bucket[t1] == b) ++t1;
    std::fill(seg_end.begin(), seg_end.end(), 0);
    for (int64_t r = 0; r < n_ranks; ++r) {
      p.pack_bounds[r][b] = static_cast<int64_t>(p.pack[r].size() / kIntervalCols);
      for (int64_t t = t0; t < t1; ++t) {
        int64_t lo, hi;
        shard_rows(rows[t], n_ranks, r, &lo, &hi);
        const int64_t es = align[t];
        const int64_t off = align_up(seg_end[r], es);
        const int64_t elems = (hi - lo) * cols[t];
        seg_off[t * n_ranks + r] = off;
        seg_end[r] = off + elems * es;
        emit(p.pack[r], t, 0, elems, 0, off / es, elems, elems, 1, src_dtype[t], dst_dtype[t]);
      }
    }
    int64_t seg = 0;
    for (int64_t r = 0; r < n_ranks; ++r) seg = seg_end[r] > seg ? seg_end[r] : seg;
    p.seg_bytes[b] = align_up(seg, 16);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < n_ranks; ++r) {
        int64_t lo, hi;
        shard_rows(rows[t], n_ranks, r, &lo, &hi);
        const int64_t row_bytes = cols[t] * align[t];
        emit(p.unpack[b], 0, r * p.seg_bytes[b] + seg_off[t * n_ranks + r], 0, 0,
             p.assignment.offset[t] + lo * row_bytes, 0, (hi - lo) * row_bytes, 1, kU8, kU8);
      }
    }
    t0 = t1;
  }
  for (int64_t r = 0; r < n_ranks; ++r) p.pack_bounds[r][nb] = static_cast<int64_t>(p.pack[r].size() / kIntervalCols);
  return p;
}

}  // namespace reshard
}  // namespace areal
