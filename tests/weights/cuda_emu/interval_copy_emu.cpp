// CPU emulation of the CUDA interval-copy kernel against the C++ CPU routine (the reference).
// Every dtype pair, source and destination element offsets through a whole vector period, runs
// shorter than a vector, spanning several chunks, and strided rows; plus one plan of many
// intervals launched with fewer blocks than chunks (the grid-stride loop). Prints the number of
// cases and exits 0, or prints the first mismatch and exits 1.
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_shim.h"
#include "reshard/interval_copy.h"
#include "reshard/interval_copy_kernel.cuh"

using namespace areal::reshard;

namespace {

void launch(const std::vector<int64_t>& src_ptrs, const std::vector<int64_t>& dst_ptrs,
            const std::vector<int64_t>& iv, int64_t max_blocks) {
  std::vector<int64_t> table;
  const int64_t n = static_cast<int64_t>(iv.size()) / kIntervalCols;
  const int64_t total = ic::build_table(src_ptrs.data(), src_ptrs.size(), dst_ptrs.data(), dst_ptrs.size(),
                                        iv.data(), n, table);
  const int64_t blocks = total < max_blocks ? total : max_blocks;
  gridDim.x = static_cast<unsigned>(blocks);
  blockDim.x = ic::kThreads;
  for (int64_t b = 0; b < blocks; ++b) {
    blockIdx.x = static_cast<unsigned>(b);
    for (unsigned t = 0; t < blockDim.x; ++t) {
      threadIdx.x = t;
      ic::interval_copy_kernel(table.data(), src_ptrs.size(), dst_ptrs.size(), n, total);
    }
  }
}

bool is_nan_bits(const uint8_t* p, int64_t dt) {
  if (dt == kF32) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
  if (dt == kBF16 || dt == kF16) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dt == kBF16 ? (h & 0x7FFF) > 0x7F80 : (h & 0x7FFF) > 0x7C00;
  }
  return false;
}

// Bitwise, except that a NaN matches any NaN (payloads are no contract of the copy).
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t dt) {
  const int64_t es = dtype_size(dt);
  for (int64_t i = 0; i + es <= static_cast<int64_t>(a.size()); i += es) {
    if (std::memcmp(&a[i], &b[i], es) == 0) continue;
    if (is_nan_bits(&a[i], dt) && is_nan_bits(&b[i], dt)) continue;
    return i / es;
  }
  return -1;
}

std::vector<uint8_t> source(int64_t n, int64_t dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> buf(n * dtype_size(dt) + 64);
  for (auto& x : buf) x = static_cast<uint8_t>(rng());
  if (dt == kF32) {  // random bit patterns cover every class; plant the edge cases too
    const uint32_t special[] = {0x7FC00000u, 0xFF800000u, 0x7F800001u, 0x00000001u, 0x3F808000u, 0x477FF000u};
    for (int i = 0; i < 6 && (i + 1) * 4 <= static_cast<int>(buf.size()); ++i) std::memcpy(&buf[4 * i], &special[i], 4);
  }
  return buf;
}

struct Case {
  int64_t sdt, ddt, so, doff, len, rows, sld, dld;
};

bool run_case(const Case& c, uint32_t seed) {
  const int64_t des = dtype_size(c.ddt);
  const int64_t src_elems = c.so + (c.rows - 1) * c.sld + c.len, dst_elems = c.doff + (c.rows - 1) * c.dld + c.len;
  // 64-byte aligned bases, so that the element offsets alone set the alignment under test
  std::vector<uint8_t> src_raw = source(src_elems + 64, c.sdt, seed);
  std::vector<uint8_t> dst_a(dst_elems * des + 128, 0xAB), dst_b(dst_elems * des + 128, 0xAB);
  auto align64 = [](uint8_t* p) { return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); };
  const int64_t s_ptr = reinterpret_cast<int64_t>(align64(src_raw.data()));
  uint8_t* da = align64(dst_a.data());
  uint8_t* db = align64(dst_b.data());
  const std::vector<int64_t> iv = {0, c.so, c.sld, 0, c.doff, c.dld, c.len, c.rows, c.sdt, c.ddt};
  launch({s_ptr}, {reinterpret_cast<int64_t>(da)}, iv, ic::kMaxBlocks);
  const int64_t sp[] = {s_ptr}, dp[] = {reinterpret_cast<int64_t>(db)};
  interval_copy_cpu(sp, 1, dp, 1, iv.data(), 1, 1);
  const std::vector<uint8_t> a(da, da + dst_elems * des + 32), b(db, db + dst_elems * des + 32);
  const int64_t d = first_difference(a, b, c.ddt);
  if (d >= 0) {
    std::printf("MISMATCH %lld->%lld src offset %lld dst offset %lld len %lld rows %lld: element %lld\n",
                (long long)c.sdt, (long long)c.ddt, (long long)c.so, (long long)c.doff, (long long)c.len,
                (long long)c.rows, (long long)d);
    return false;
  }
  return true;
}

}  // namespace

int main() {
  const int64_t pairs[][2] = {{kF32, kBF16}, {kF32, kF16}, {kBF16, kF32}, {kF16, kF32},
                              {kF32, kF32},  {kBF16, kBF16}, {kU8, kU8}};
  const int64_t lengths[] = {1, 3, 9, 37, ic::kChunkElems + 5, 2 * ic::kChunkElems + 17};
  int64_t cases = 0;
  uint32_t seed = 1;
  for (const auto& pr : pairs)
    for (int64_t len : lengths)
      for (int64_t so = 0; so < 8; ++so)
        for (int64_t doff = 0; doff < 8; ++doff) {
          if (len > 64 && (so + doff) % 3 != 0) continue;  // long runs: a third of the offset grid is plenty
          if (!run_case({pr[0], pr[1], so, doff, len, 1, 0, 0}, seed++)) return 1;
          ++cases;
        }
  for (int i = 0; i < 4; ++i)  // strided rows
    if (!run_case({pairs[i][0], pairs[i][1], 3, 1, 257, 50, 301, 263}, seed++)) return 1;
  cases += 4;
  // many intervals, fewer blocks than chunks: the grid-stride loop and the prefix search
  {
    std::vector<float> src(200000);
    std::mt19937 rng(7);
    for (auto& x : src) x = std::uniform_real_distribution<float>(-1e3f, 1e3f)(rng);
    std::vector<uint16_t> a(220000, 0), b(220000, 0);
    std::vector<int64_t> iv;
    int64_t so = 0, doff = 0;
    for (int k = 0; k < 40; ++k) {
      const int64_t len = k % 5 == 0 ? 0 : 1 + (k * 7919) % 20000;  // empty intervals too
      if (so + len > 200000) break;
      iv.insert(iv.end(), {0, so, 0, 0, doff, 0, len, 1, kF32, kBF16});
      so += len + k % 3;
      doff += len + k % 2;
    }
    const int64_t sp[] = {reinterpret_cast<int64_t>(src.data())};
    launch({sp[0]}, {reinterpret_cast<int64_t>(a.data())}, iv, 3);
    const int64_t dp[] = {reinterpret_cast<int64_t>(b.data())};
    interval_copy_cpu(sp, 1, dp, 1, iv.data(), static_cast<int64_t>(iv.size()) / kIntervalCols, 1);
    if (std::memcmp(a.data(), b.data(), a.size() * 2) != 0) {
      std::printf("MISMATCH in the many-interval plan\n");
      return 1;
    }
    ++cases;
  }
  std::printf("OK %lld cases\n", (long long)cases);
  return 0;
}
