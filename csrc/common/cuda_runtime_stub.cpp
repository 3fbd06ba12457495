// CPU-only build: the CUDA runtime queries answer "none". In a CUDA build the same symbols
// come from cuda_runtime.cu instead (this file is compiled out).
#include "common/cuda_runtime.h"

#ifndef AREAL_FAST_WITH_CUDA
namespace areal {
bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
}  // namespace areal
#endif
