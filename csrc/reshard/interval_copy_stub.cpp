// CPU-only build: the CUDA interval copy is not available (interval_copy.cu is compiled instead
// when nvcc is found and AREAL_FAST_WITH_CUDA is defined).
#include <stdexcept>

#include "reshard/interval_copy.h"

#ifndef AREAL_FAST_WITH_CUDA
namespace areal {
namespace reshard {
void interval_copy_cuda(const int64_t*, int64_t, const int64_t*, int64_t, const int64_t*, int64_t, int64_t) {
  throw std::runtime_error("interval_copy_cuda: areal_fast._C was built without CUDA (no nvcc at build time)");
}
}  // namespace reshard
}  // namespace areal
#endif
