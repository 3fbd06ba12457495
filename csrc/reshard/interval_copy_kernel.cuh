// Device code of the CUDA interval copy (see interval_copy.cu for the design), in a header so
// that a CPU emulation can run the very same code: tests/cuda_emu/ compiles it with g++ behind a
// shim of the few CUDA names it uses and runs every "thread" of every "block" in turn (the kernel
// has no shared memory, barriers or inter-thread communication, so that order is as good as
// any), then compares with the C++ CPU routine.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "reshard/dtypes.h"
#include "reshard/planner.h"

namespace areal {
namespace reshard {
namespace ic {

constexpr int64_t kChunkElems = 16384;  // 32-64 KiB per block: long enough to hide latency
constexpr int kThreads = 256;
constexpr int kLoadBytesInFlight = 64;  // per thread and step: 4 x 16 B or 2 x 32 B loads before the stores
constexpr int64_t kMaxBlocks = 65536;

// ------------------------------------------------------------------------ vector loads / stores
// BYTES in {4, 8, 16, 32}; words are 32-bit, little-endian element order. Loads take the
// read-only path (ld.global.nc); stores are st.global.cg (L2 only: the buffer is written once
// here and next read by NCCL or another copy, never by this kernel).
template <int BYTES>
__device__ __forceinline__ void load_ro(const char* __restrict__ p, uint32_t* w) {
  if constexpr (BYTES >= 16) {
#pragma unroll
    for (int k = 0; k < BYTES / 16; ++k) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(p) + k);
      w[4 * k] = x.x, w[4 * k + 1] = x.y, w[4 * k + 2] = x.z, w[4 * k + 3] = x.w;
    }
  } else if constexpr (BYTES == 8) {
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = x.x, w[1] = x.y;
  } else {
    static_assert(BYTES == 4, "vector of 4, 8, 16 or 32 bytes");
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  }
}

template <int BYTES>
__device__ __forceinline__ void store(char* __restrict__ p, const uint32_t* w) {
  if constexpr (BYTES >= 16) {
#pragma unroll
    for (int k = 0; k < BYTES / 16; ++k)
      __stcg(reinterpret_cast<uint4*>(p) + k, make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]));
  } else if constexpr (BYTES == 8) {
    __stcg(reinterpret_cast<uint2*>(p), make_uint2(w[0], w[1]));
  } else {
    static_assert(BYTES == 4, "vector of 4, 8, 16 or 32 bytes");
    __stcg(reinterpret_cast<unsigned int*>(p), w[0]);
  }
}

// ---------------------------------------------------------------------------------- conversions
// Each Op converts N elements held in source words into destination words, and one element
// (the narrow head and tail). Rounding is that of torch on CUDA (the same intrinsics).
struct CopyOp {  // same dtype, treated as bytes (element size 1)
  static constexpr int kSrc = 1, kDst = 1;
  template <int N>
  __device__ __forceinline__ static void vec(const uint32_t* s, uint32_t* d) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) d[k] = s[k];
  }
  __device__ __forceinline__ static void one(const char* s, char* d) { *d = *s; }
};

template <bool BF16>
struct F32ToHalfOp {
  static constexpr int kSrc = 4, kDst = 2;
  template <int N>
  __device__ __forceinline__ static void vec(const uint32_t* s, uint32_t* d) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const float a = __uint_as_float(s[2 * k]), b = __uint_as_float(s[2 * k + 1]);
      if constexpr (BF16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        memcpy(&d[k], &h, 4);  // a register move; no type punning
      } else {
        const __half2 h = __floats2half2_rn(a, b);
        memcpy(&d[k], &h, 4);
      }
    }
  }
  __device__ __forceinline__ static void one(const char* s, char* d) {
    const float f = *reinterpret_cast<const float*>(s);
    if constexpr (BF16) *reinterpret_cast<__nv_bfloat16*>(d) = __float2bfloat16_rn(f);
    else *reinterpret_cast<__half*>(d) = __float2half_rn(f);
  }
};

template <bool BF16>
struct HalfToF32Op {
  static constexpr int kSrc = 2, kDst = 4;
  template <int N>
  __device__ __forceinline__ static void vec(const uint32_t* s, uint32_t* d) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      if constexpr (BF16) {  // bf16 -> fp32 is a shift: exact for every value, NaN payloads kept
        d[2 * k] = s[k] << 16;
        d[2 * k + 1] = s[k] & 0xFFFF0000u;
      } else {
        __half2 h;
        memcpy(&h, &s[k], 4);
        const float2 f = __half22float2(h);
        d[2 * k] = __float_as_uint(f.x);
        d[2 * k + 1] = __float_as_uint(f.y);
      }
    }
  }
  __device__ __forceinline__ static void one(const char* s, char* d) {
    if constexpr (BF16) *reinterpret_cast<float*>(d) = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(s));
    else *reinterpret_cast<float*>(d) = __half2float(*reinterpret_cast<const __half*>(s));
  }
};

// ------------------------------------------------------------------------------------ one chunk
// Elements [0, h) and [h + nv * N, cnt) one by one; the nv vectors in between, kUnroll per thread
// and step (64 bytes of loads), all loads of a step issued before its stores.
template <class Op, int N>
__device__ __forceinline__ void run_vectors(const char* __restrict__ s, char* __restrict__ d, int64_t cnt,
                                            int64_t h) {
  constexpr int SB = N * Op::kSrc, DB = N * Op::kDst;
  constexpr int kUnroll = SB >= kLoadBytesInFlight / 2 ? 2 : 4;  // 2 x 32 B or 4 x (<= 16 B)
  const int64_t nv = (cnt - h) / N;
  const char* __restrict__ sv = s + h * Op::kSrc;
  char* __restrict__ dv = d + h * Op::kDst;
  for (int64_t base = threadIdx.x; base < nv; base += int64_t(blockDim.x) * kUnroll) {
    uint32_t in[kUnroll][SB / 4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + int64_t(u) * blockDim.x;
      if (v < nv) load_ro<SB>(sv + v * SB, in[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + int64_t(u) * blockDim.x;
      if (v < nv) {
        uint32_t out[DB / 4];
        Op::template vec<N>(in[u], out);
        store<DB>(dv + v * DB, out);
      }
    }
  }
  const int64_t tail = h + nv * N;
  for (int64_t i = threadIdx.x; i < h + (cnt - tail); i += blockDim.x) {
    const int64_t e = i < h ? i : tail + (i - h);
    Op::one(s + e * Op::kSrc, d + e * Op::kDst);
  }
}

// First element index h < N at which both s + h * kSrc and d + h * kDst are aligned to their
// vector size (capped at 16 bytes); -1 if none. The same for every thread of the block.
template <class Op, int N>
__device__ __forceinline__ int64_t vector_head(const char* s, const char* d) {
  constexpr int SA = N * Op::kSrc < 16 ? N * Op::kSrc : 16, DA = N * Op::kDst < 16 ? N * Op::kDst : 16;
  const uintptr_t ps = reinterpret_cast<uintptr_t>(s), pd = reinterpret_cast<uintptr_t>(d);
#pragma unroll 1
  for (int h = 0; h < N; ++h)
    if (((ps + h * Op::kSrc) % SA) == 0 && ((pd + h * Op::kDst) % DA) == 0) return h;
  return -1;
}

// Widest vector first: N elements such that the narrow side moves 16, then 8, then 4 bytes.
template <class Op>
__device__ void run_chunk(const char* __restrict__ s, char* __restrict__ d, int64_t cnt) {
  constexpr int kNarrow = Op::kSrc < Op::kDst ? Op::kSrc : Op::kDst;
  constexpr int N16 = 16 / kNarrow, N8 = 8 / kNarrow, N4 = 4 / kNarrow;
  int64_t h;
  if ((h = vector_head<Op, N16>(s, d)) >= 0 && cnt >= h) return run_vectors<Op, N16>(s, d, cnt, h);
  if ((h = vector_head<Op, N8>(s, d)) >= 0 && cnt >= h) return run_vectors<Op, N8>(s, d, cnt, h);
  if constexpr (N4 >= 2) {
    if ((h = vector_head<Op, N4>(s, d)) >= 0 && cnt >= h) return run_vectors<Op, N4>(s, d, cnt, h);
  }
  for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) Op::one(s + i * Op::kSrc, d + i * Op::kDst);
}

__global__ void __launch_bounds__(kThreads) interval_copy_kernel(const int64_t* __restrict__ table, int64_t n_src,
                                                                 int64_t n_dst, int64_t n, int64_t total_chunks) {
  const int64_t* __restrict__ src_ptrs = table;
  const int64_t* __restrict__ dst_ptrs = table + n_src;
  const int64_t* __restrict__ iv = dst_ptrs + n_dst;
  const int64_t* __restrict__ prefix = iv + n * kIntervalCols;
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    int64_t lo = 0, hi = n;  // find i with prefix[i] <= chunk < prefix[i + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (__ldg(prefix + mid) <= chunk) lo = mid; else hi = mid;
    }
    const int64_t* __restrict__ p = iv + lo * kIntervalCols;
    const int64_t len = __ldg(p + kLen);
    const int64_t per_row = (len + kChunkElems - 1) / kChunkElems;
    const int64_t k = chunk - __ldg(prefix + lo);
    const int64_t row = k / per_row, start = (k % per_row) * kChunkElems;
    const int64_t cnt = min(kChunkElems, len - start);
    const int64_t sdt = __ldg(p + kSrcDtype), ddt = __ldg(p + kDstDtype);
    const int64_t ses = dtype_size(sdt), des = dtype_size(ddt);
    const char* s = reinterpret_cast<const char*>(__ldg(src_ptrs + __ldg(p + kSrcIdx))) +
                    (__ldg(p + kSrcOff) + row * __ldg(p + kSrcLd) + start) * ses;
    char* d = reinterpret_cast<char*>(__ldg(dst_ptrs + __ldg(p + kDstIdx))) +
              (__ldg(p + kDstOff) + row * __ldg(p + kDstLd) + start) * des;
    if (sdt == ddt) run_chunk<CopyOp>(s, d, cnt * ses);
    else if (sdt == kF32 && ddt == kBF16) run_chunk<F32ToHalfOp<true>>(s, d, cnt);
    else if (sdt == kF32 && ddt == kF16) run_chunk<F32ToHalfOp<false>>(s, d, cnt);
    else if (sdt == kBF16 && ddt == kF32) run_chunk<HalfToF32Op<true>>(s, d, cnt);
    else if (sdt == kF16 && ddt == kF32) run_chunk<HalfToF32Op<false>>(s, d, cnt);
  }
}

// ------------------------------------------------------------------------------------ the table
// What the kernel reads: source pointers, destination pointers, the intervals, then the
// per-interval chunk prefix sums (n + 1 of them). Returns the number of chunks.
inline int64_t build_table(const int64_t* src_ptrs, int64_t n_src, const int64_t* dst_ptrs, int64_t n_dst,
                           const int64_t* iv, int64_t n, std::vector<int64_t>& table) {
  table.clear();
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
  return total;
}

}  // namespace ic
}  // namespace reshard
}  // namespace areal
