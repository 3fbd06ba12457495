// Reshard planner (torch-free): turns "which rows of which tensor live on which rank" and
// "where every tensor (or block of one) must land" into copy intervals.
//
// Source tensors are viewed as 2-D [rows, cols] (rows = dim 0, cols = numel / dim 0) and are
// either full (n_ranks = 1) or sharded on dim 0 over n_ranks exactly like FSDP2
// (torch.chunk): chunk = ceil(rows / n), rank r holds rows [min(r*chunk, rows),
// min((r+1)*chunk, rows)) as a contiguous local tensor (possibly empty).
//
// An interval (one row of the int64 [n, kIntervalCols] arrays) copies `rows` runs of `len`
// elements: run k reads src[src_idx] at element src_off + k*src_ld (src dtype) and writes
// dst[dst_idx] at element dst_off + k*dst_ld (dst dtype), casting on the way.
#pragma once

#include <cstdint>
#include <vector>

namespace areal {
namespace reshard {

enum IntervalCol : int { kSrcIdx = 0, kSrcOff, kSrcLd, kDstIdx, kDstOff, kDstLd, kLen, kRows, kSrcDtype,
                         kDstDtype, kIntervalCols };

// [lo, hi) rows of a dim-0 sharded tensor held by `rank` (FSDP2 / torch.chunk semantics).
inline void shard_rows(int64_t rows, int64_t n_ranks, int64_t rank, int64_t* lo, int64_t* hi) {
  const int64_t chunk = (rows + n_ranks - 1) / n_ranks;
  *lo = rank * chunk < rows ? rank * chunk : rows;
  *hi = (rank + 1) * chunk < rows ? (rank + 1) * chunk : rows;
}

struct BucketAssignment {
  std::vector<int64_t> bucket;        // [T] bucket of each tensor
  std::vector<int64_t> offset;        // [T] byte offset inside its bucket (multiple of align)
  std::vector<int64_t> bucket_bytes;  // [n_buckets] used bytes of each bucket
};

// Greedy, order-preserving packing: a tensor starts a new bucket when it would overflow
// `bucket_bytes`; a tensor larger than the limit gets a bucket of its own (never split: the
// server needs whole tensors).
BucketAssignment assign_buckets(const int64_t* nbytes, const int64_t* align, int64_t n, int64_t bucket_bytes);

// One block: rows [row0, row0+n_rows) x cols [col0, col0+n_cols) of source tensor src_t,
// written to dst buffer dst_idx at element dst_off with leading dimension dst_ld.
enum BlockCol : int { kBSrc = 0, kBRow0, kBCol0, kBRows, kBCols, kBDstIdx, kBDstOff, kBDstLd, kBDstDtype,
                      kBlockCols };

struct RankIntervals {
  std::vector<std::vector<int64_t>> per_rank;  // per source rank: flat [n, kIntervalCols]
};

// Intervals per source rank for a list of blocks; adjacent contiguous runs are coalesced.
RankIntervals plan_blocks(const int64_t* src_rows, const int64_t* src_cols, const int64_t* src_dtype,
                          int64_t n_src, int64_t n_ranks, const int64_t* blocks, int64_t n_blocks);

// The FSDP2 -> flattened-bucket plan. Per bucket b each rank packs its local rows of the
// bucket's tensors (cast to dst dtype) into a send segment of seg_bytes[b] bytes; a gather
// to rank 0 lays the segments out rank-major; rank 0 then runs `unpack[b]` (byte intervals,
// gather buffer -> bucket buffer) to get every tensor contiguous at its bucket offset.
struct BucketPlan {
  BucketAssignment assignment;
  std::vector<int64_t> seg_bytes;                 // [n_buckets], multiple of 16
  std::vector<std::vector<int64_t>> pack;         // [n_ranks] flat intervals, ordered by bucket
  std::vector<std::vector<int64_t>> pack_bounds;  // [n_ranks][n_buckets + 1] interval index bounds
  std::vector<std::vector<int64_t>> unpack;       // [n_buckets] flat byte intervals
};

BucketPlan plan_fsdp_buckets(const int64_t* rows, const int64_t* cols, const int64_t* src_dtype,
                             const int64_t* dst_dtype, int64_t n, int64_t n_ranks, int64_t bucket_bytes);

}  // namespace reshard
}  // namespace areal
