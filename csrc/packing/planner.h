// Micro-batch planner for dynamic sequence packing (torch-free).
//
// Given per-sequence token lengths, a per-micro-batch token budget and a number of
// data-parallel ranks, assign every sequence to exactly one (rank, micro-batch) so that
//   * every micro-batch holds <= max_tokens tokens and at least one sequence,
//   * every rank has the same number M of micro-batches (M % mbs_divisor == 0, M >= min_mbs),
//   * ranks are balanced by cost = len + attn_coef * len^2 (attn_coef = 0: tokens).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace areal {

struct PackingPlan {
  int64_t n_ranks = 0;
  int64_t mbs_per_rank = 0;      // M
  int64_t lower_bound = 0;       // smallest M any plan could have (valid w.r.t. min/divisor)
  std::vector<int64_t> order;    // sequence indices, rank-major then micro-batch-major
  std::vector<int64_t> mb_offsets;  // n_ranks * M + 1 offsets into `order`
  std::vector<int64_t> mb_tokens;   // n_ranks * M token sums
  std::vector<double> rank_cost;    // n_ranks cost sums
};

// Throws std::invalid_argument (a Python ValueError) with a message naming the bad input.
PackingPlan plan_microbatches(const int64_t* lengths, int64_t n, int64_t max_tokens,
                              int64_t n_ranks, int64_t min_mbs, int64_t mbs_divisor,
                              double attn_coef);

}  // namespace areal
