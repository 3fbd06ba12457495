// CUDA interval copy: one launch for a whole plan. Every interval run is cut into chunks of
// kChunkElems elements; block b handles chunk b (grid-stride) after a binary search over the
// per-interval chunk prefix sums, so thousands of small tensors and a few huge ones are
// spread evenly over the SMs.
//
// Inside a chunk every thread issues 64 bytes of vector loads (4 x 16 B, or 2 x 32 B for the
// fp32 -> 16-bit casts) before its first store: one 16-byte load per thread cannot cover HBM
// latency. sm_90a: 80 registers, no spills, 3 blocks (24 warps) per SM, ~48 KiB of loads in
// flight per SM (the old one-load loop: 30 registers, 16 B per thread). Loads go
// through the read-only path (__ldg), and every supported cast is vectorised: N elements per
// step so that the narrow side moves 16 bytes. Where source and destination cannot both be
// vector-aligned at the same element, a narrower vector is tried; only the misaligned head
// (< N elements) and tail of the chunk go element by element.
//
// The plan (pointer tables, intervals, prefix sums) is kept in device memory across calls: a
// call whose table equals the previous one on that device launches at once; otherwise the
// table goes through a pinned staging buffer (truly asynchronous, never blocking on pageable
// memory) into a persistent device buffer that grows geometrically. All launches on a device
// form one chain (a call on another stream waits for the previous launch), so a table is never
// overwritten while a kernel reads it. Not usable inside CUDA graph capture (a host wait on the
// previous upload may occur).
#ifdef AREAL_FAST_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "reshard/interval_copy.h"
#include "reshard/interval_copy_kernel.cuh"

namespace areal {
namespace reshard {
namespace {

using ic::kMaxBlocks;
using ic::kThreads;
using ic::interval_copy_kernel;

// ------------------------------------------------------------------------------ host: plan cache
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("interval_copy_cuda: ") + what + ": " + cudaGetErrorString(e));
  }
}

// One per device, never freed: CUDA may already be torn down when static destructors run.
struct PlanCache {
  std::mutex mu;
  std::vector<int64_t> table;  // what the device buffer holds
  void* dev = nullptr;
  size_t dev_cap = 0;
  int64_t* pinned = nullptr;
  size_t pinned_cap = 0;
  cudaEvent_t uploaded = nullptr, done = nullptr;  // after the last upload / the last launch
  cudaStream_t last_stream = nullptr;
  bool launched = false;
};

PlanCache& cache_for(int device) {
  static std::mutex mu;
  static auto* caches = new std::map<int, PlanCache*>();
  std::lock_guard<std::mutex> lock(mu);
  PlanCache*& c = (*caches)[device];
  if (c == nullptr) {
    c = new PlanCache();
    check(cudaEventCreateWithFlags(&c->uploaded, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming), "cudaEventCreate");
  }
  return *c;
}

// The device the destination memory lives on (the stream handle alone does not say): that of
// the first non-null destination when the driver knows it, else the current device.
int target_device(const int64_t* dst_ptrs, int64_t n_dst) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  for (int64_t i = 0; i < n_dst; ++i) {
    if (dst_ptrs[i] == 0) continue;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(dst_ptrs[i])) != cudaSuccess) {
      cudaGetLastError();
      break;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) dev = a.device;
    break;
  }
  return dev;
}

struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

void upload(PlanCache& c, std::vector<int64_t>& table, cudaStream_t stream) {
  const size_t bytes = table.size() * sizeof(int64_t);
  // the staging buffer may still feed the previous upload (tiny and long done in practice)
  if (c.launched) check(cudaEventSynchronize(c.uploaded), "cudaEventSynchronize");
  if (c.pinned_cap < bytes) {
    const size_t cap = bytes > 2 * c.pinned_cap ? bytes : 2 * c.pinned_cap;
    if (c.pinned != nullptr) check(cudaFreeHost(c.pinned), "cudaFreeHost");
    c.pinned = nullptr;
    c.pinned_cap = 0;
    check(cudaHostAlloc(reinterpret_cast<void**>(&c.pinned), cap, cudaHostAllocDefault), "cudaHostAlloc");
    c.pinned_cap = cap;
  }
  if (c.dev_cap < bytes) {  // stream-ordered after every earlier launch (the chain), so no reader is left
    if (c.dev != nullptr) check(cudaFreeAsync(c.dev, stream), "cudaFreeAsync");
    c.dev = nullptr;
    const size_t cap = bytes > 2 * c.dev_cap ? bytes : 2 * c.dev_cap;
    c.dev_cap = 0;
    check(cudaMallocAsync(&c.dev, cap, stream), "cudaMallocAsync");
    c.dev_cap = cap;
  }
  std::memcpy(c.pinned, table.data(), bytes);
  check(cudaMemcpyAsync(c.dev, c.pinned, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  check(cudaEventRecord(c.uploaded, stream), "cudaEventRecord");
  c.table.swap(table);
}

}  // namespace

void interval_copy_cuda(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                        const int64_t* iv, int64_t n, int64_t stream_int) {
  check_intervals(iv, n, n_src, n_dst);
  std::vector<int64_t> table;
  const int64_t total = ic::build_table(src_ptrs, n_src, dst_ptrs, n_dst, iv, n, table);
  if (total == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_int);
  const int device = target_device(dst_ptrs, n_dst);
  DeviceGuard guard(device);
  PlanCache& c = cache_for(device);
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.launched && stream != c.last_stream) check(cudaStreamWaitEvent(stream, c.done, 0), "cudaStreamWaitEvent");
  if (!c.launched || table != c.table) upload(c, table, stream);
  const int64_t blocks = total < kMaxBlocks ? total : kMaxBlocks;
  interval_copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const int64_t*>(c.dev),
                                                                               n_src, n_dst, n, total);
  check(cudaGetLastError(), "kernel launch");
  check(cudaEventRecord(c.done, stream), "cudaEventRecord");
  c.last_stream = stream;
  c.launched = true;
}

}  // namespace reshard
}  // namespace areal
#endif  // AREAL_FAST_WITH_CUDA
