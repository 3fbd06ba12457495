// CUDA build: runtime queries through the statically linked cudart. On a machine without a
// driver cudaGetDeviceCount fails; we report 0 devices instead of raising, so that
// `import areal_fast` works everywhere.
#include <cuda_runtime_api.h>

#include "common/cuda_runtime.h"

namespace areal {
bool built_with_cuda() { return true; }
int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  return n;
}
}  // namespace areal
