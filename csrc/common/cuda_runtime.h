// CUDA runtime queries that work in both builds: without CUDA they report "no device".
#pragma once

namespace areal {
bool built_with_cuda();
int cuda_device_count();  // 0 without a driver/device or in a CPU-only build
}  // namespace areal
