// CPU delta encode/apply. The encode is two passes over fixed chunks: count per chunk (in
// parallel), exclusive sum of the counts, then each chunk writes its changes at its offset,
// so the indices come out ascending with no sort, exactly like the Triton kernel's block scan.
#include "reshard/delta.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace areal {
namespace delta {
namespace {

constexpr int64_t kChunk = 1 << 18;           // words per chunk (512 KiB of bf16)
constexpr int64_t kThreadMinWords = 1 << 21;  // below ~4 MiB one thread is faster than spawning

int64_t threads_for(int64_t n, int64_t n_threads) {
  if (n < kThreadMinWords) return 1;
  int64_t hw = n_threads > 0 ? n_threads : static_cast<int64_t>(std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min<int64_t>(hw, (n + kChunk - 1) / kChunk));
}

// Calls fn(chunk) for every chunk, on up to `t` threads (chunks interleaved by thread).
template <class Fn>
void for_chunks(int64_t n_chunks, int64_t t, Fn fn) {
  if (t <= 1) {
    for (int64_t c = 0; c < n_chunks; ++c) fn(c);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t k = 0; k < t; ++k)
    pool.emplace_back([=] {
      for (int64_t c = k; c < n_chunks; c += t) fn(c);
    });
  for (auto& th : pool) th.join();
}

int64_t count_range(const uint16_t* a, const uint16_t* b, int64_t lo, int64_t hi) {
  int64_t c = 0;
  for (int64_t i = lo; i < hi; ++i) c += a[i] != b[i];  // branch-free: vectorised at -O3
  return c;
}

void check_n(int64_t n, const char* what) {
  if (n < 0) throw std::invalid_argument(std::string(what) + ": negative length " + std::to_string(n));
  if (n > INT32_MAX)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(n) +
                                " words do not fit int32 indices; send this tensor whole");
}

}  // namespace

int64_t count_changed_cpu(const uint16_t* old_w, const uint16_t* new_w, int64_t n, int64_t n_threads) {
  check_n(n, "delta count");
  const int64_t n_chunks = (n + kChunk - 1) / kChunk;
  std::vector<int64_t> counts(static_cast<size_t>(n_chunks), 0);
  for_chunks(n_chunks, threads_for(n, n_threads),
             [&](int64_t c) { counts[c] = count_range(old_w, new_w, c * kChunk, std::min(n, (c + 1) * kChunk)); });
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

int64_t encode_cpu(const uint16_t* old_w, const uint16_t* new_w, int64_t n, int32_t* idx, uint16_t* val,
                   int64_t cap, int64_t n_threads) {
  check_n(n, "delta encode");
  const int64_t n_chunks = (n + kChunk - 1) / kChunk;
  const int64_t t = threads_for(n, n_threads);
  std::vector<int64_t> start(static_cast<size_t>(n_chunks) + 1, 0);
  for_chunks(n_chunks, t,
             [&](int64_t c) { start[c + 1] = count_range(old_w, new_w, c * kChunk, std::min(n, (c + 1) * kChunk)); });
  for (int64_t c = 0; c < n_chunks; ++c) start[c + 1] += start[c];
  const int64_t total = start[n_chunks];
  if (total > cap) return -1;
  for_chunks(n_chunks, t, [&](int64_t c) {
    int64_t k = start[c];
    for (int64_t i = c * kChunk, hi = std::min(n, (c + 1) * kChunk); i < hi; ++i) {
      if (old_w[i] != new_w[i]) {
        idx[k] = static_cast<int32_t>(i);
        val[k] = new_w[i];
        ++k;
      }
    }
  });
  return total;
}

void apply_cpu(uint16_t* dst, int64_t n_dst, const int32_t* idx, const uint16_t* val, int64_t m, int64_t n_threads) {
  if (m < 0) throw std::invalid_argument("delta apply: negative number of changes " + std::to_string(m));
  for (int64_t k = 0; k < m; ++k) {
    if (idx[k] < 0 || idx[k] >= n_dst)
      throw std::invalid_argument("delta apply: change " + std::to_string(k) + " writes word " +
                                  std::to_string(idx[k]) + " of a tensor of " + std::to_string(n_dst) + " words");
  }
  const int64_t n_chunks = (m + kChunk - 1) / kChunk;
  for_chunks(n_chunks, threads_for(m, n_threads), [&](int64_t c) {
    for (int64_t k = c * kChunk, hi = std::min(m, (c + 1) * kChunk); k < hi; ++k) dst[idx[k]] = val[k];
  });
}

}  // namespace delta
}  // namespace areal
