// CUDA interval copy: one launch for a whole plan. Every interval run is cut into chunks of
// kChunkElems elements; block b handles chunk b (grid-stride) after a binary search over the
// per-interval chunk prefix sums, so thousands of small tensors and a few huge ones are
// spread evenly over the SMs. The plan (pointer tables, intervals, prefix) goes to the device
// in one cudaMemcpyAsync on `stream` into stream-ordered scratch memory.
#ifdef AREAL_FAST_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "reshard/dtypes.h"
#include "reshard/interval_copy.h"
#include "reshard/planner.h"

namespace areal {
namespace reshard {
namespace {

constexpr int64_t kChunkElems = 16384;  // 32-64 KiB per block: long enough to hide latency
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

__device__ void copy_bytes(const char* s, char* d, int64_t nbytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) |
                      static_cast<uintptr_t>(nbytes);
  if ((a & 15) == 0) {
    const uint4* sp = reinterpret_cast<const uint4*>(s);
    uint4* dp = reinterpret_cast<uint4*>(d);
    for (int64_t i = threadIdx.x; i < nbytes / 16; i += blockDim.x) dp[i] = sp[i];
  } else if ((a & 3) == 0) {
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(s);
    uint32_t* dp = reinterpret_cast<uint32_t*>(d);
    for (int64_t i = threadIdx.x; i < nbytes / 4; i += blockDim.x) dp[i] = sp[i];
  } else {
    for (int64_t i = threadIdx.x; i < nbytes; i += blockDim.x) d[i] = s[i];
  }
}

__global__ void interval_copy_kernel(const int64_t* __restrict__ table, int64_t n_src, int64_t n_dst, int64_t n,
                                     int64_t total_chunks) {
  const int64_t* src_ptrs = table;
  const int64_t* dst_ptrs = table + n_src;
  const int64_t* iv = dst_ptrs + n_dst;
  const int64_t* prefix = iv + n * kIntervalCols;
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    int64_t lo = 0, hi = n;  // find i with prefix[i] <= chunk < prefix[i + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (prefix[mid] <= chunk) lo = mid; else hi = mid;
    }
    const int64_t* p = iv + lo * kIntervalCols;
    const int64_t per_row = (p[kLen] + kChunkElems - 1) / kChunkElems;
    const int64_t k = chunk - prefix[lo];
    const int64_t row = k / per_row, start = (k % per_row) * kChunkElems;
    const int64_t cnt = min(kChunkElems, p[kLen] - start);
    const int64_t sdt = p[kSrcDtype], ddt = p[kDstDtype];
    const int64_t ses = dtype_size(sdt), des = dtype_size(ddt);
    const char* s = reinterpret_cast<const char*>(src_ptrs[p[kSrcIdx]]) + (p[kSrcOff] + row * p[kSrcLd] + start) * ses;
    char* d = reinterpret_cast<char*>(dst_ptrs[p[kDstIdx]]) + (p[kDstOff] + row * p[kDstLd] + start) * des;
    if (sdt == ddt) {
      copy_bytes(s, d, cnt * ses);
    } else if (sdt == kF32 && ddt == kBF16) {
      const float* sp = reinterpret_cast<const float*>(s);
      __nv_bfloat16* dp = reinterpret_cast<__nv_bfloat16*>(d);
      int64_t done = 0;
      if (((reinterpret_cast<uintptr_t>(s) & 15) | (reinterpret_cast<uintptr_t>(d) & 7)) == 0) {
        // 16-byte loads, 8-byte stores: 4 elements per thread and step (the common, aligned case)
        const float4* sp4 = reinterpret_cast<const float4*>(s);
        uint2* dp4 = reinterpret_cast<uint2*>(d);
        for (int64_t i = threadIdx.x; i < cnt / 4; i += blockDim.x) {
          const float4 v = sp4[i];
          const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
          const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
          uint2 o;
          o.x = *reinterpret_cast<const uint32_t*>(&lo);
          o.y = *reinterpret_cast<const uint32_t*>(&hi);
          dp4[i] = o;
        }
        done = cnt / 4 * 4;
      }
      for (int64_t i = done + threadIdx.x; i < cnt; i += blockDim.x) dp[i] = __float2bfloat16_rn(sp[i]);
    } else if (sdt == kF32 && ddt == kF16) {
      const float* sp = reinterpret_cast<const float*>(s);
      __half* dp = reinterpret_cast<__half*>(d);
      for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) dp[i] = __float2half_rn(sp[i]);
    } else if (sdt == kBF16 && ddt == kF32) {
      const __nv_bfloat16* sp = reinterpret_cast<const __nv_bfloat16*>(s);
      float* dp = reinterpret_cast<float*>(d);
      for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) dp[i] = __bfloat162float(sp[i]);
    } else if (sdt == kF16 && ddt == kF32) {
      const __half* sp = reinterpret_cast<const __half*>(s);
      float* dp = reinterpret_cast<float*>(d);
      for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) dp[i] = __half2float(sp[i]);
    }
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("interval_copy_cuda: ") + what + ": " + cudaGetErrorString(e));
  }
}

}  // namespace

void interval_copy_cuda(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                        const int64_t* iv, int64_t n, int64_t stream_int) {
  check_intervals(iv, n, n_src, n_dst);
  std::vector<int64_t> table;
  table.reserve(n_src + n_dst + n * kIntervalCols + n + 1);
  table.insert(table.end(), src_ptrs, src_ptrs + n_src);
  table.insert(table.end(), dst_ptrs, dst_ptrs + n_dst);
  table.insert(table.end(), iv, iv + n * kIntervalCols);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    table.push_back(total);
    const int64_t* p = iv + i * kIntervalCols;
    total += p[kRows] * ((p[kLen] + kChunkElems - 1) / kChunkElems);
  }
  table.push_back(total);
  if (total == 0) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_int);
  void* dev = nullptr;
  const size_t bytes = table.size() * sizeof(int64_t);
  check(cudaMallocAsync(&dev, bytes, stream), "cudaMallocAsync");
  // Pageable source: the call returns once the host data is staged, so `table` may go away.
  check(cudaMemcpyAsync(dev, table.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  const int64_t blocks = total < kMaxBlocks ? total : kMaxBlocks;
  interval_copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const int64_t*>(dev),
                                                                               n_src, n_dst, n, total);
  check(cudaGetLastError(), "kernel launch");
  check(cudaFreeAsync(dev, stream), "cudaFreeAsync");
}

}  // namespace reshard
}  // namespace areal
#endif  // AREAL_FAST_WITH_CUDA
