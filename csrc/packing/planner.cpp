// Micro-batch planner: capacity-aware LPT over ranks, worst-fit over each rank's M bins,
// then move/swap refinement between the most and least loaded ranks.
//
// Why this shape: M is fixed first at the lower bound ceil(tokens / (ranks * budget)), so
// the plan never has more micro-batches than needed unless the items genuinely do not fit
// (then M grows by mbs_divisor and we retry; in practice at most once). Worst-fit
// (least-loaded bin first) keeps the bins of a rank level, which both leaves room for the
// tail of small sequences and gives micro-batches of similar size. Assigning in decreasing
// length order to the cheapest rank that still has room is LPT, whose imbalance is bounded
// by the cost of the last items placed; the refinement pass removes most of what is left.
// 65,536 sequences plan in a few ms (bench/bench_planner.py).
#include "packing/planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
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

// Min-heap of bin ids of one rank, keyed by load: the least-loaded bin is the only one
// that has to be tested, because if it cannot take an item no bin of the rank can.
struct BinHeap {
  const std::vector<int64_t>* load;
  std::vector<int32_t> ids;
  bool operator()(int32_t a, int32_t b) const {
    const int64_t la = (*load)[a], lb = (*load)[b];
    return la != lb ? la > lb : a > b;
  }
};

bool try_assign(const std::vector<int64_t>& len, const std::vector<double>& cost,
                const std::vector<int32_t>& sorted, int64_t budget, int64_t R, int64_t M,
                Assignment& out) {
  const int64_t n = static_cast<int64_t>(len.size());
  out.M = M;
  out.bin_of.assign(n, -1);
  out.bin_tokens.assign(R * M, 0);
  out.bin_count.assign(R * M, 0);
  out.rank_cost.assign(R, 0.0);

  std::vector<BinHeap> heaps(R);
  for (int64_t r = 0; r < R; ++r) {
    heaps[r].load = &out.bin_tokens;
    heaps[r].ids.resize(M);
    for (int64_t b = 0; b < M; ++b) heaps[r].ids[b] = static_cast<int32_t>(r * M + b);
    std::make_heap(heaps[r].ids.begin(), heaps[r].ids.end(), heaps[r]);
  }
  using RankKey = std::pair<double, int32_t>;
  std::priority_queue<RankKey, std::vector<RankKey>, std::greater<RankKey>> ranks;
  for (int64_t r = 0; r < R; ++r) ranks.emplace(0.0, static_cast<int32_t>(r));
  std::vector<RankKey> skipped;
  skipped.reserve(R);

  for (int32_t i : sorted) {
    skipped.clear();
    int32_t chosen = -1;
    while (!ranks.empty()) {
      RankKey top = ranks.top();
      ranks.pop();
      const int32_t least = heaps[top.second].ids.front();
      if (out.bin_tokens[least] + len[i] <= budget) {
        chosen = top.second;
        break;
      }
      skipped.push_back(top);
    }
    for (const RankKey& k : skipped) ranks.push(k);
    if (chosen < 0) return false;  // no rank has room: M is too small
    BinHeap& h = heaps[chosen];
    std::pop_heap(h.ids.begin(), h.ids.end(), h);
    const int32_t bin = h.ids.back();
    out.bin_tokens[bin] += len[i];
    out.bin_count[bin] += 1;
    out.bin_of[i] = bin;
    std::push_heap(h.ids.begin(), h.ids.end(), h);
    out.rank_cost[chosen] += cost[i];
    ranks.emplace(out.rank_cost[chosen], chosen);
  }
  return true;
}

// Every micro-batch must hold a sequence. Worst-fit fills empty bins first, so a bin is
// empty only when its rank received fewer than M sequences (e.g. one huge sequence under
// attention cost). Move the smallest sequence of a multi-sequence bin into it, preferring
// the same rank (no cost change), else the most expensive rank.
void fill_empty_bins(const std::vector<int64_t>& len, const std::vector<double>& cost,
                     int64_t R, Assignment& a) {
  const int64_t M = a.M, n = static_cast<int64_t>(len.size());
  for (int64_t bin = 0; bin < R * M; ++bin) {
    if (a.bin_count[bin] > 0) continue;
    const int64_t r = bin / M;
    int64_t best = -1;
    bool best_same = false;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t src = a.bin_of[i];
      if (a.bin_count[src] < 2) continue;
      const bool same = src / M == r;
      if (best < 0 || (same && !best_same) ||
          (same == best_same &&
           (same ? len[i] < len[best]
                 : a.rank_cost[src / M] > a.rank_cost[a.bin_of[best] / M] ||
                       (a.rank_cost[src / M] == a.rank_cost[a.bin_of[best] / M] &&
                        len[i] < len[best])))) {
        best = i;
        best_same = same;
      }
    }
    if (best < 0) fail("cannot give every micro-batch a sequence");  // guarded by caller
    const int32_t src = a.bin_of[best];
    a.bin_tokens[src] -= len[best];
    a.bin_count[src] -= 1;
    a.rank_cost[src / M] -= cost[best];
    a.bin_of[best] = static_cast<int32_t>(bin);
    a.bin_tokens[bin] += len[best];
    a.bin_count[bin] += 1;
    a.rank_cost[r] += cost[best];
  }
}

// Move or swap sequences between the most and the least expensive rank while that lowers
// the maximum. Members are kept sorted by cost so each candidate search is a binary search.
void refine(const std::vector<int64_t>& len, const std::vector<double>& cost, int64_t budget,
            int64_t R, Assignment& a) {
  if (R < 2) return;
  const int64_t M = a.M, n = static_cast<int64_t>(len.size());
  std::vector<std::vector<int32_t>> members(R);
  for (int64_t i = 0; i < n; ++i) members[a.bin_of[i] / M].push_back(static_cast<int32_t>(i));
  auto by_cost = [&](int32_t x, int32_t y) { return cost[x] < cost[y] || (cost[x] == cost[y] && x < y); };
  for (auto& m : members) std::sort(m.begin(), m.end(), by_cost);
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
  std::vector<int32_t> sorted(n);
  std::iota(sorted.begin(), sorted.end(), 0);
  std::sort(sorted.begin(), sorted.end(), [&](int32_t x, int32_t y) {
    return len[x] > len[y] || (len[x] == len[y] && x < y);
  });

  Assignment a;
  int64_t M = lb;
  while (!try_assign(len, cost, sorted, max_tokens, R, M, a)) {
    M += mbs_divisor;
    if (n < R * M) {
      std::ostringstream s;
      s << "plan_microbatches: cannot pack " << n << " sequences into " << R
        << " ranks with equal micro-batch counts under max_tokens_per_mb=" << max_tokens;
      fail(s.str());
    }
  }
  fill_empty_bins(len, cost, R, a);
  refine(len, cost, max_tokens, R, a);

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
