// Just enough of CUDA for g++ to compile csrc/reshard/interval_copy_kernel.cuh as host code:
// qualifiers vanish, built-in indices are globals the emulator sets, vector types are plain
// structs, __ldg / __stcg are a load / a store, and the conversion intrinsics use the CPU
// routines' bit-exact rounding (round to nearest even; CUDA's canonical NaN for bf16).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "reshard/dtypes.h"

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct EmuDim {
  unsigned x = 0;
};
inline EmuDim threadIdx, blockIdx, blockDim, gridDim;

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

// The device faults on a vector access that is not aligned to its size: so does the emulation.
template <class T>
inline void emu_check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) {
    std::fprintf(stderr, "MISALIGNED %s of %zu bytes at %p\n", what, sizeof(T), p);
    std::abort();
  }
}
template <class T>
inline T __ldg(const T* p) {
  emu_check_aligned<T>(p, "load");
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void __stcg(T* p, T v) {
  emu_check_aligned<T>(p, "store");
  std::memcpy(p, &v, sizeof(T));
}
template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}

inline float __uint_as_float(uint32_t u) { return areal::reshard::bits_f32(u); }
inline uint32_t __float_as_uint(float f) { return areal::reshard::f32_bits(f); }

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;  // x in the low 16 bits, as on the device
};
struct __half2 {
  __half x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  return {(u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FFF) : areal::reshard::f32_to_bf16_bits(u)};
}
inline __half __float2half_rn(float f) { return {areal::reshard::f32_to_f16_bits(f)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(uint32_t(h.bits) << 16); }
inline float __half2float(__half h) { return __uint_as_float(areal::reshard::f16_bits_to_f32_bits(h.bits)); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
