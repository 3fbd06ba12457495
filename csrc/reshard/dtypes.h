// Dtype codes shared by the reshard planner and the interval-copy kernels (torch-free).
// Conversions are bit-exact with PyTorch on CPU: fp32 -> bf16 rounds to nearest even and maps
// every NaN to 0xFFFF (what torch's vectorised CPU path produces; the scalar c10 path would give
// 0x7FC0); fp32 -> fp16 is c10's fp16_ieee_from_fp32_value (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AREAL_HD __host__ __device__ __forceinline__
#else
#define AREAL_HD inline
#endif

namespace areal {
namespace reshard {

enum DType : int64_t { kU8 = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kF64 = 4, kI32 = 5, kI64 = 6, kI16 = 7,
                       kNumDTypes = 8 };

AREAL_HD int64_t dtype_size(int64_t code) {
  switch (code) {
    case kU8: return 1;
    case kF32: case kI32: return 4;
    case kBF16: case kF16: case kI16: return 2;
    case kF64: case kI64: return 8;
    default: return -1;
  }
}

// Casts the copy routines implement besides same-dtype copies.
AREAL_HD bool cast_supported(int64_t s, int64_t d) {
  if (s == d) return true;
  return (s == kF32 && (d == kBF16 || d == kF16)) || ((s == kBF16 || s == kF16) && d == kF32);
}

AREAL_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
AREAL_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Round to nearest even; branch-free so that the CPU loop auto-vectorises (-O3).
AREAL_HD uint16_t f32_to_bf16_bits(uint32_t u) {
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? uint16_t(0xFFFFu) : uint16_t(r);
}

AREAL_HD uint32_t bf16_bits_to_f32_bits(uint16_t h) { return uint32_t(h) << 16; }

// c10::detail::fp16_ieee_from_fp32_value (from the FP16 library), bit for bit.
AREAL_HD uint16_t f32_to_f16_bits(float f) {
  const float scale_to_inf = bits_f32(UINT32_C(0x77800000));
  const float scale_to_zero = bits_f32(UINT32_C(0x08800000));
  float base = (f < 0 ? -f : f) * scale_to_inf;  // fabsf without <cmath> on device
  base *= scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = bits_f32((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

// c10::detail::fp16_ieee_to_fp32_value, bit for bit.
AREAL_HD uint32_t f16_bits_to_f32_bits(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = bits_f32(UINT32_C(0x7800000));
  const float normalized_value = bits_f32((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = bits_f32((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized_value) : f32_bits(normalized_value));
  return result;
}

}  // namespace reshard
}  // namespace areal
