// Delta weight encoding (torch-free): which 16-bit words of a tensor changed between two
// versions, as ascending int32 indices + the new words, and applying such a delta in place.
// Words are compared as bit patterns, so -0.0 vs 0.0 and NaN payloads count as changes and
// survive the round trip. The torch reference is areal_fast/weights/delta_codec.py.
#pragma once

#include <cstdint>

namespace areal {
namespace delta {

// Number of positions i < n with old_w[i] != new_w[i].
int64_t count_changed_cpu(const uint16_t* old_w, const uint16_t* new_w, int64_t n, int64_t n_threads);

// Writes the changed positions (ascending) into idx and the new words into val; both must hold
// `cap` entries. Returns the number of changes, or -1 (nothing written past cap) if more than cap.
int64_t encode_cpu(const uint16_t* old_w, const uint16_t* new_w, int64_t n, int32_t* idx, uint16_t* val,
                   int64_t cap, int64_t n_threads);

// dst[idx[k]] = val[k] for k < m. Throws std::invalid_argument naming the first index outside
// [0, n_dst) before writing anything.
void apply_cpu(uint16_t* dst, int64_t n_dst, const int32_t* idx, const uint16_t* val, int64_t m, int64_t n_threads);

}  // namespace delta
}  // namespace areal
