// CPU interval copy. Same-dtype runs are memcpy; casts are branch-free scalar loops that GCC
// vectorises at -O3. Large copies are split into ~1 MiB chunks handed to std::threads, since
// one core reaches only about a third of the memory bandwidth of a socket.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "reshard/dtypes.h"
#include "reshard/interval_copy.h"
#include "reshard/planner.h"

namespace areal {
namespace reshard {
namespace {

constexpr int64_t kChunkBytes = 1 << 20;
constexpr int64_t kThreadMinBytes = 4 << 20;

void copy_run(const char* s, char* d, int64_t n, int64_t sdt, int64_t ddt) {
  if (sdt == ddt) {
    std::memcpy(d, s, static_cast<size_t>(n * dtype_size(sdt)));
    return;
  }
  if (sdt == kF32 && ddt == kBF16) {
    const float* sp = reinterpret_cast<const float*>(s);
    uint16_t* dp = reinterpret_cast<uint16_t*>(d);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, sp + i, 4);
      dp[i] = f32_to_bf16_bits(u);
    }
  } else if (sdt == kBF16 && ddt == kF32) {
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(s);
    uint32_t* dp = reinterpret_cast<uint32_t*>(d);
    for (int64_t i = 0; i < n; ++i) dp[i] = bf16_bits_to_f32_bits(sp[i]);
  } else if (sdt == kF32 && ddt == kF16) {
    const float* sp = reinterpret_cast<const float*>(s);
    uint16_t* dp = reinterpret_cast<uint16_t*>(d);
    for (int64_t i = 0; i < n; ++i) dp[i] = f32_to_f16_bits(sp[i]);
  } else if (sdt == kF16 && ddt == kF32) {
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(s);
    uint32_t* dp = reinterpret_cast<uint32_t*>(d);
    for (int64_t i = 0; i < n; ++i) dp[i] = f16_bits_to_f32_bits(sp[i]);
  }
}

struct Chunk {
  int64_t interval, row, start, count;  // elements [start, start+count) of run `row`
};

void run_chunk(const int64_t* src_ptrs, const int64_t* dst_ptrs, const int64_t* iv, const Chunk& c) {
  const int64_t* p = iv + c.interval * kIntervalCols;
  const int64_t ses = dtype_size(p[kSrcDtype]), des = dtype_size(p[kDstDtype]);
  const char* s = reinterpret_cast<const char*>(src_ptrs[p[kSrcIdx]]) +
                  (p[kSrcOff] + c.row * p[kSrcLd] + c.start) * ses;
  char* d = reinterpret_cast<char*>(dst_ptrs[p[kDstIdx]]) + (p[kDstOff] + c.row * p[kDstLd] + c.start) * des;
  copy_run(s, d, c.count, p[kSrcDtype], p[kDstDtype]);
}

}  // namespace

int64_t check_intervals(const int64_t* iv, int64_t n, int64_t n_src, int64_t n_dst) {
  int64_t bytes = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* p = iv + i * kIntervalCols;
    const std::string where = "interval_copy: interval " + std::to_string(i);
    if (p[kSrcIdx] < 0 || p[kSrcIdx] >= n_src)
      throw std::invalid_argument(where + " reads source " + std::to_string(p[kSrcIdx]) + " of " +
                                  std::to_string(n_src));
    if (p[kDstIdx] < 0 || p[kDstIdx] >= n_dst)
      throw std::invalid_argument(where + " writes destination " + std::to_string(p[kDstIdx]) + " of " +
                                  std::to_string(n_dst));
    if (dtype_size(p[kSrcDtype]) <= 0 || dtype_size(p[kDstDtype]) <= 0 ||
        !cast_supported(p[kSrcDtype], p[kDstDtype]))
      throw std::invalid_argument(where + ": unsupported dtypes " + std::to_string(p[kSrcDtype]) + " -> " +
                                  std::to_string(p[kDstDtype]));
    if (p[kSrcOff] < 0 || p[kDstOff] < 0 || p[kLen] < 0 || p[kRows] < 0 ||
        (p[kRows] > 1 && (p[kSrcLd] < p[kLen] || p[kDstLd] < p[kLen])))
      throw std::invalid_argument(where + ": negative offset/length or leading dimension < length");
    bytes += p[kLen] * p[kRows] * dtype_size(p[kDstDtype]);
  }
  return bytes;
}

void interval_copy_cpu(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                       const int64_t* iv, int64_t n, int64_t n_threads) {
  const int64_t bytes = check_intervals(iv, n, n_src, n_dst);
  if (n_threads <= 0) n_threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  n_threads = std::min<int64_t>(n_threads, bytes / kThreadMinBytes + 1);
  if (n_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* p = iv + i * kIntervalCols;
      for (int64_t r = 0; r < p[kRows]; ++r) run_chunk(src_ptrs, dst_ptrs, iv, Chunk{i, r, 0, p[kLen]});
    }
    return;
  }
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* p = iv + i * kIntervalCols;
    const int64_t per = std::max<int64_t>(1, kChunkBytes / dtype_size(p[kDstDtype]));
    for (int64_t r = 0; r < p[kRows]; ++r)
      for (int64_t s = 0; s < p[kLen]; s += per) chunks.push_back(Chunk{i, r, s, std::min(per, p[kLen] - s)});
  }
  std::atomic<size_t> next{0};
  auto work = [&]() {
    for (size_t c; (c = next.fetch_add(1)) < chunks.size();) run_chunk(src_ptrs, dst_ptrs, iv, chunks[c]);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < n_threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

}  // namespace reshard
}  // namespace areal
