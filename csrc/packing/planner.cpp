// Micro-batch planner: capacity-aware LPT over ranks, best fit over each rank's M bins,
// then move/swap refinement between the most and the least expensive rank.
//
// Why this shape: M starts at the lower bound max(ceil(tokens / (ranks * budget)),
// ceil(#long / ranks), min_mbs), so the plan has more micro-batches only when the items
// genuinely do not fit; then every rank gets mbs_divisor more bins and assignment goes on
// (no restart). Sequences are taken in decreasing length; each goes to the cheapest rank
// that has room (LPT: the imbalance left is about the cost of the last, smallest items),
// into that rank's fullest bin with room (best fit: near-FFD bin counts). The refinement
// pass then moves or swaps sequences between the extreme ranks.
// 65,536 sequences plan in about 10 ms (bench/bench_planner.py).
#include "packing/planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace areal {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Assignment {
  int64_t M = 0;
  std::vector<int32_t> bin_of;       // per sequence: global bin id = rank * M + b
  std::vector<int64_t> bin_tokens;   // per bin
  std::vector<int32_t> bin_count;    // sequences per bin
  std::vector<double> rank_cost;
};

// Indices by decreasing length, ties by increasing index. Lengths are bounded by the token
// budget, so a counting sort is O(n + max_len): 65,536 sequences take ~0.3 ms against ~5 ms
// for std::sort. Very large budgets fall back to a comparison sort.
std::vector<int32_t> sort_by_length_desc(const std::vector<int64_t>& len) {
  const int64_t n = static_cast<int64_t>(len.size());
  std::vector<int32_t> out(n);
  const int64_t max_len = *std::max_element(len.begin(), len.end());
  if (max_len > (int64_t{1} << 22) || max_len > 64 * n + 4096) {
    std::iota(out.begin(), out.end(), 0);
    std::sort(out.begin(), out.end(), [&](int32_t x, int32_t y) {
      return len[x] > len[y] || (len[x] == len[y] && x < y);
    });
    return out;
  }
  std::vector<int32_t> start(max_len + 2, 0);
  for (int64_t i = 0; i < n; ++i) start[max_len - len[i] + 1] += 1;  // bucket 0 = longest
  for (int64_t k = 0; k <= max_len; ++k) start[k + 1] += start[k];
  for (int64_t i = 0; i < n; ++i) out[start[max_len - len[i]]++] = static_cast<int32_t>(i);
  return out;
}

// One rank's bins, ordered by load. Best fit (the fullest bin that still has room) packs
// almost as tightly as first-fit-decreasing, so M stays at the lower bound or one above it;
// worst fit, tried first, needed up to 6 extra micro-batches at 65,536 x lognormal lengths
// with a 32k budget. Node-based, but 65,536 inserts cost ~3 ms.
using LoadSet = std::set<std::pair<int64_t, int32_t>>;  // (load, bin id)

// Bins are numbered in creation order while assigning, because M can still grow; they get
// global ids rank * M + slot at the end.
struct LocalBin {
  int32_t rank;
  int32_t slot;
};

// Returns false when a sequence cannot be placed even after growing M up to `max_M`.
bool assign(const std::vector<int64_t>& len, const std::vector<double>& cost,
            const std::vector<int32_t>& sorted, int64_t budget, int64_t R, int64_t M,
            int64_t step, int64_t max_M, Assignment& out) {
  const int64_t n = static_cast<int64_t>(len.size());
  std::vector<int64_t> load;
  std::vector<LocalBin> owner;
  std::vector<int32_t> bin_of(n, -1);
  std::vector<int32_t> slots(R, 0);
  std::vector<LoadSet> bins(R);
  out.rank_cost.assign(R, 0.0);
  auto add_bins = [&](int64_t count) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t k = 0; k < count; ++k) {
        const int32_t id = static_cast<int32_t>(load.size());
        owner.push_back({static_cast<int32_t>(r), slots[r]++});
        load.push_back(0);
        bins[r].emplace(0, id);
      }
    }
  };
  add_bins(M);

  using RankKey = std::pair<double, int32_t>;
  std::priority_queue<RankKey, std::vector<RankKey>, std::greater<RankKey>> ranks;
  for (int64_t r = 0; r < R; ++r) ranks.emplace(0.0, static_cast<int32_t>(r));
  std::vector<RankKey> skipped;
  skipped.reserve(R);

  for (int32_t i : sorted) {
    const int64_t room = budget - len[i];  // a bin fits i iff its load <= room
    skipped.clear();
    int32_t chosen = -1;
    while (!ranks.empty()) {
      const RankKey top = ranks.top();
      ranks.pop();
      if (bins[top.second].begin()->first <= room) {  // its least-loaded bin has room
        chosen = top.second;
        break;
      }
      skipped.push_back(top);
    }
    for (const RankKey& k : skipped) ranks.push(k);
    if (chosen < 0) {
      // No rank has room: every rank gets `step` more (empty) micro-batches and we go on
      // from this sequence instead of starting over (a restart costs a whole pass).
      if (M + step > max_M) return false;
      M += step;
      add_bins(step);
      chosen = ranks.top().second;  // the cheapest rank; its new bins are empty
      ranks.pop();
    }
    LoadSet& set = bins[chosen];
    auto it = std::prev(set.upper_bound({room, INT32_MAX}));  // fullest bin with load <= room
    const int32_t bin = it->second;
    set.erase(it);
    load[bin] += len[i];
    set.emplace(load[bin], bin);
    bin_of[i] = bin;
    out.rank_cost[chosen] += cost[i];
    ranks.emplace(out.rank_cost[chosen], chosen);
  }
  out.M = M;
  out.bin_tokens.assign(R * M, 0);
  out.bin_count.assign(R * M, 0);
  out.bin_of.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const LocalBin& b = owner[bin_of[i]];
    const int32_t g = static_cast<int32_t>(b.rank * M + b.slot);
    out.bin_of[i] = g;
    out.bin_tokens[g] += len[i];
    out.bin_count[g] += 1;
  }
  return true;
}

// Every micro-batch must hold a sequence. Best fit leaves a bin empty when its rank needed
// fewer than M bins (fewer tokens, e.g. it holds the long sequences under attention cost).
// Fill each empty bin with the shortest sequence of a multi-sequence bin: of the same rank
// when there is one (cost unchanged), else of the most expensive rank. Candidates are
// visited in increasing length (`sorted` backwards), so this is O(n) for all empty bins.
void fill_empty_bins(const std::vector<int64_t>& len, const std::vector<double>& cost,
                     const std::vector<int32_t>& sorted, int64_t R, Assignment& a) {
  const int64_t M = a.M;
  std::vector<int64_t> empty;
  for (int64_t bin = 0; bin < R * M; ++bin)
    if (a.bin_count[bin] == 0) empty.push_back(bin);
  if (empty.empty()) return;
  auto move = [&](int32_t i, int64_t dst) {
    const int32_t src = a.bin_of[i];
    a.bin_tokens[src] -= len[i];
    a.bin_count[src] -= 1;
    a.rank_cost[src / M] -= cost[i];
    a.bin_of[i] = static_cast<int32_t>(dst);
    a.bin_tokens[dst] += len[i];
    a.bin_count[dst] += 1;
    a.rank_cost[dst / M] += cost[i];
  };
  // Pass 1: within the rank.
  std::vector<std::vector<int64_t>> empty_of(R);
  for (int64_t bin : empty) empty_of[bin / M].push_back(bin);
  for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) {
    const int32_t i = *it;
    const int64_t r = a.bin_of[i] / M;
    if (!empty_of[r].empty() && a.bin_count[a.bin_of[i]] > 1) {
      move(i, empty_of[r].back());
      empty_of[r].pop_back();
    }
  }
  // Pass 2: from other ranks, the most expensive donor first.
  for (int64_t r = 0; r < R; ++r) {
    while (!empty_of[r].empty()) {
      int32_t best = -1;
      for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) {
        const int32_t i = *it;
        if (a.bin_count[a.bin_of[i]] < 2) continue;
        if (best < 0 || a.rank_cost[a.bin_of[i] / M] > a.rank_cost[a.bin_of[best] / M]) best = i;
      }
      if (best < 0) fail("plan_microbatches: cannot give every micro-batch a sequence");
      move(best, empty_of[r].back());
      empty_of[r].pop_back();
    }
  }
}

// Move or swap sequences between the most and the least expensive rank while that lowers
// the maximum. Members are kept sorted by cost so each candidate search is a binary search.
void refine(const std::vector<int64_t>& len, const std::vector<double>& cost,
            const std::vector<int32_t>& sorted, int64_t budget, int64_t R, Assignment& a) {
  if (R < 2) return;
  const int64_t M = a.M;
  // Walking `sorted` backwards yields increasing cost with ties by decreasing index, so the
  // member lists come out already ordered by `by_cost` (no sort needed).
  std::vector<std::vector<int32_t>> members(R);
  for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) members[a.bin_of[*it] / M].push_back(*it);
  auto by_cost = [&](int32_t x, int32_t y) { return cost[x] < cost[y] || (cost[x] == cost[y] && x > y); };
  // Least-loaded bin of a rank (bins per rank are few: a linear scan is cheapest).
  auto least_bin = [&](int64_t r, int32_t exclude) {
    int32_t best = -1;
    for (int64_t b = r * M; b < (r + 1) * M; ++b) {
      if (b == exclude) continue;
      if (best < 0 || a.bin_tokens[b] < a.bin_tokens[best]) best = static_cast<int32_t>(b);
    }
    return best;
  };
  auto erase = [&](int64_t r, int32_t i) {
    auto& m = members[r];
    m.erase(std::lower_bound(m.begin(), m.end(), i, by_cost));
  };
  auto insert = [&](int64_t r, int32_t i) {
    auto& m = members[r];
    m.insert(std::lower_bound(m.begin(), m.end(), i, by_cost), i);
  };
  auto place = [&](int32_t i, int32_t bin) {
    const int32_t src = a.bin_of[i];
    a.bin_tokens[src] -= len[i];
    a.bin_count[src] -= 1;
    a.rank_cost[src / M] -= cost[i];
    a.bin_of[i] = bin;
    a.bin_tokens[bin] += len[i];
    a.bin_count[bin] += 1;
    a.rank_cost[bin / M] += cost[i];
  };

  const int64_t max_iters = 64 * R;
  for (int64_t it = 0; it < max_iters; ++it) {
    int64_t hi = 0, lo = 0;
    for (int64_t r = 1; r < R; ++r) {
      if (a.rank_cost[r] > a.rank_cost[hi]) hi = r;
      if (a.rank_cost[r] < a.rank_cost[lo]) lo = r;
    }
    const double diff = a.rank_cost[hi] - a.rank_cost[lo];
    if (diff <= 1e-9 * std::max(1.0, a.rank_cost[hi])) return;
    const double target = diff / 2;  // moving exactly diff/2 equalises the pair
    bool improved = false;

    // (1) Move one sequence hi -> lo with 0 < cost < diff, closest to diff/2.
    {
      const int32_t dst = least_bin(lo, -1);
      const auto& m = members[hi];
      auto it2 = std::lower_bound(m.begin(), m.end(), target,
                                  [&](int32_t x, double v) { return cost[x] < v; });
      int32_t best = -1;
      double best_gap = diff;
      for (int k = 0; k < 2; ++k) {
        // scan a few neighbours on each side of the ideal cost
        auto p = it2;
        for (int s = 0; s < 8; ++s) {
          if (k == 0 ? p == m.end() : p == m.begin()) break;
          if (k == 1) --p;
          const int32_t i = *p;
          if (cost[i] > 0 && cost[i] < diff && a.bin_count[a.bin_of[i]] > 1 &&
              a.bin_tokens[dst] + len[i] <= budget) {
            const double gap = std::fabs(cost[i] - target);
            if (gap < best_gap) { best_gap = gap; best = i; }
          }
          if (k == 0) ++p;
        }
      }
      if (best >= 0) {
        erase(hi, best);
        place(best, dst);
        insert(lo, best);
        improved = true;
      }
    }
    // (2) Otherwise swap x in hi with y in lo, 0 < cost[x] - cost[y] < diff, closest to diff/2.
    if (!improved) {
      const auto& mh = members[hi];
      const auto& ml = members[lo];
      int32_t bx = -1, by = -1;
      double best_gap = diff / 2;
      const size_t stride = std::max<size_t>(1, mh.size() / 256);  // bound the work per step
      for (size_t k = 0; k < mh.size(); k += stride) {
        const int32_t x = mh[k];
        const double want = cost[x] - target;  // ideal cost of y
        auto p = std::lower_bound(ml.begin(), ml.end(), want,
                                  [&](int32_t y, double v) { return cost[y] < v; });
        for (int s = -2; s < 2; ++s) {
          auto q = p + s;
          if (q < ml.begin() || q >= ml.end()) continue;
          const int32_t y = *q;
          const double d = cost[x] - cost[y];
          if (d <= 0 || d >= diff) continue;
          const int32_t bx_bin = a.bin_of[x], by_bin = a.bin_of[y];
          if (a.bin_tokens[by_bin] - len[y] + len[x] > budget) continue;
          if (a.bin_tokens[bx_bin] - len[x] + len[y] > budget) continue;
          const double gap = std::fabs(d - target);
          if (gap < best_gap) { best_gap = gap; bx = x; by = y; }
        }
      }
      if (bx >= 0) {
        const int32_t bin_x = a.bin_of[bx], bin_y = a.bin_of[by];
        erase(hi, bx);
        erase(lo, by);
        place(bx, bin_y);
        place(by, bin_x);
        insert(lo, bx);
        insert(hi, by);
        improved = true;
      }
    }
    if (!improved) return;
  }
}

}  // namespace

PackingPlan plan_microbatches(const int64_t* lengths, int64_t n, int64_t max_tokens,
                              int64_t n_ranks, int64_t min_mbs, int64_t mbs_divisor,
                              double attn_coef) {
  if (n <= 0) fail("plan_microbatches: `lengths` is empty; there is nothing to pack");
  if (max_tokens <= 0) {
    std::ostringstream s;
    s << "plan_microbatches: max_tokens_per_mb must be > 0, got " << max_tokens;
    fail(s.str());
  }
  if (n_ranks < 1) fail("plan_microbatches: n_ranks must be >= 1, got " + std::to_string(n_ranks));
  if (min_mbs < 1) fail("plan_microbatches: min_mbs must be >= 1, got " + std::to_string(min_mbs));
  if (mbs_divisor < 1)
    fail("plan_microbatches: mbs_divisor must be >= 1, got " + std::to_string(mbs_divisor));
  if (!(attn_coef >= 0) || !std::isfinite(attn_coef))
    fail("plan_microbatches: attn_coef must be a finite number >= 0");
  if (n > INT32_MAX) fail("plan_microbatches: more than 2^31 sequences");

  std::vector<int64_t> len(lengths, lengths + n);
  std::vector<double> cost(n);
  int64_t total = 0, n_big = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = len[i];
    if (l <= 0) {
      std::ostringstream s;
      s << "plan_microbatches: sequence " << i << " has length " << l << "; lengths must be > 0";
      fail(s.str());
    }
    if (l > max_tokens) {
      std::ostringstream s;
      s << "plan_microbatches: sequence " << i << " has length " << l
        << ", longer than max_tokens_per_mb=" << max_tokens;
      fail(s.str());
    }
    total += l;
    n_big += (2 * l > max_tokens);  // two of these never share a micro-batch
    cost[i] = static_cast<double>(l) + attn_coef * static_cast<double>(l) * static_cast<double>(l);
  }

  const int64_t R = n_ranks;
  int64_t lb = std::max<int64_t>({(total + R * max_tokens - 1) / (R * max_tokens),
                                  (n_big + R - 1) / R, min_mbs});
  lb = round_up(lb, mbs_divisor);
  if (n < R * lb) {
    std::ostringstream s;
    s << "plan_microbatches: " << n << " sequences cannot fill " << R << " ranks x " << lb
      << " micro-batches (every micro-batch needs at least one sequence); lower min_mbs, "
      << "mbs_divisor or n_ranks";
    fail(s.str());
  }

  // Decreasing length (= decreasing cost, cost is monotone in length); ties by index so the
  // plan is deterministic.
  std::vector<int32_t> sorted = sort_by_length_desc(len);

  Assignment a;
  if (!assign(len, cost, sorted, max_tokens, R, lb, mbs_divisor, n / R, a)) {
    std::ostringstream s;
    s << "plan_microbatches: cannot pack " << n << " sequences into " << R
      << " ranks with equal micro-batch counts under max_tokens_per_mb=" << max_tokens
      << " with at least one sequence per micro-batch";
    fail(s.str());
  }
  const int64_t M = a.M;
  fill_empty_bins(len, cost, sorted, R, a);
  refine(len, cost, sorted, max_tokens, R, a);

  PackingPlan plan;
  plan.n_ranks = R;
  plan.mbs_per_rank = M;
  plan.lower_bound = lb;
  plan.rank_cost = a.rank_cost;
  plan.mb_tokens = a.bin_tokens;
  // Counting sort by bin; within a bin indices stay ascending (original order).
  plan.mb_offsets.assign(R * M + 1, 0);
  for (int64_t i = 0; i < n; ++i) plan.mb_offsets[a.bin_of[i] + 1] += 1;
  for (int64_t b = 0; b < R * M; ++b) plan.mb_offsets[b + 1] += plan.mb_offsets[b];
  plan.order.resize(n);
  std::vector<int64_t> cursor(plan.mb_offsets.begin(), plan.mb_offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) plan.order[cursor[a.bin_of[i]]++] = i;
  return plan;
}

}  // namespace areal
