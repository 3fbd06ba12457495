// Interval copy (torch-free): execute a plan's intervals (see planner.h for the columns),
// reading from many source buffers and writing into many destination buffers, casting dtype
// per interval. Pointers are raw addresses; the caller guarantees they are valid and that
// no two intervals write the same bytes.
#pragma once

#include <cstdint>

namespace areal {
namespace reshard {

// Validates every interval (indices, dtypes, casts, non-negative offsets) and throws
// std::invalid_argument naming the first bad one. Returns the number of bytes written.
int64_t check_intervals(const int64_t* intervals, int64_t n, int64_t n_src, int64_t n_dst);

// CPU. Uses up to n_threads threads (0: hardware concurrency) when more than 4 MiB are written.
void interval_copy_cpu(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                       const int64_t* intervals, int64_t n, int64_t n_threads);

// CUDA: one kernel launch on `stream` (a cudaStream_t as an integer; 0 = legacy default).
// Asynchronous w.r.t. the host. Throws std::runtime_error in a CPU-only build.
void interval_copy_cuda(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                        const int64_t* intervals, int64_t n, int64_t stream);

}  // namespace reshard
}  // namespace areal
