// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU budgeting and top-k selection with protected tokens.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/policies/budgeters.hpp"
#include "kvevict/policies/selectors.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// score order: higher first, NaN below everything, ties to the lower index.
inline bool score_before(float sa, std::int32_t a, float sb, std::int32_t b) {
  const bool na = !(sa == sa), nb = !(sb == sb);
  if (na != nb) return nb;  // a before b iff b is NaN and a is not
  if (!na && sa != sb) return sa > sb;
  return a < b;
}

/// The k best of the m scores s[c0 + i] (i < m) under score_before (higher first, NaN last, ties
/// to the lower slot), written as slots c0 + i in ascending order to out; returns k (0 < k < m).
/// The set is unique (score_before is a total order), so this is exactly what an nth_element
/// by score_before followed by a sort of the first k gives, without comparisons through the
/// slots: kth_largest_key (backend.hpp) finds the k-th best score_key t; one pass in slot order
/// then writes the slots above t and the lowest slots equal to t (about 5x faster than the
/// nth_element at m = 32k: issue 37's key-norm and TOVA rows spent 40 % of their time there).
/// scratch: m uint32.
inline std::int64_t topk_slots(const float* s, std::int64_t c0, std::int64_t m, std::int64_t k, std::int32_t* out,
                               std::uint32_t* scratch) {
  const kth_key kk = kth_largest_key(m, k, [s, c0](std::int64_t i) { return score_key(s[c0 + i]); }, scratch);
  std::int64_t n = 0, ties = k - kk.above;  // the slots above t, and the ties lowest first (out holds k: no write past it)
  for (std::int64_t i = 0; i < m; ++i) {
    const std::uint32_t key = score_key(s[c0 + i]);
    if (key > kk.t || (key == kk.t && ties-- > 0)) out[n++] = static_cast<std::int32_t>(c0 + i);
  }
  return n;
}

/// The part of a head's selection that does not depend on scores, shared by select_head and
/// select_head_two_stage: a head of length L = h.length keeping `budget` slots (protected ones
/// included) keeps all L slots when it is passed through or budget >= L; otherwise it keeps its
/// h.sinks first slots and h.recent last slots, and k of the candidates [c0, c1) in between.
struct candidate_range {
  std::int64_t c0 = 0, c1 = 0;  ///< candidate slots [c0, c1) = [h.sinks, L - h.recent)
  std::int64_t k = 0;           ///< candidates to keep: budget - h.protected_count(), clamped to [0, c1 - c0]
  std::int64_t n = 0;           ///< slots already written to out: L when whole, else c0 (the sinks)
  bool whole = false;           ///< pass-through or budget >= L: out[0, L) = 0..L-1, nothing left to select
};

/// Start a head's selection (plan h, `budget`): writes the whole head (0..L-1) when it is kept
/// whole, else the sinks 0..c0-1, to out (room for L int32), and returns the candidate range.
/// The caller then appends its k chosen candidates ascending and the recent slots [c1, L).
inline candidate_range begin_head_selection(const kvevict::detail::head_plan& h, std::int64_t budget,
                                            std::int32_t* out) {
  candidate_range r;
  const std::int64_t L = h.length;
  if (h.pass_through || budget >= L) {
    for (std::int64_t i = 0; i < L; ++i) out[i] = static_cast<std::int32_t>(i);
    r.n = L;
    r.whole = true;
    return r;
  }
  r.c0 = h.sinks;
  r.c1 = L - h.recent;
  r.k = std::min(std::max<std::int64_t>(budget - h.protected_count(), 0), r.c1 - r.c0);
  for (std::int64_t i = 0; i < r.c0; ++i) out[i] = static_cast<std::int32_t>(i);
  r.n = r.c0;
  return r;
}

/// Keep `budget` tokens of a head of length L (plan h) by the rule of selectors::topk; write the
/// kept slots ascending to out. Returns the count written. scores may be null (no scorer):
/// then only protected tokens can be kept (the budget equals them by construction).
inline std::int64_t select_head(const kvevict::detail::head_plan& h, std::int64_t budget, const float* scores,
                                std::int32_t* out, std::int32_t* idx_scratch) {
  const candidate_range r = begin_head_selection(h, budget, out);
  if (r.whole) return r.n;
  const std::int64_t L = h.length, c0 = r.c0, c1 = r.c1, k = r.k;
  std::int64_t n = r.n;
  if (k > 0) {
    if (!scores) {  // no scores: keep the most recent candidates
      for (std::int64_t i = c1 - k; i < c1; ++i) out[n++] = static_cast<std::int32_t>(i);
    } else {
      const std::int64_t m = c1 - c0;
      if (k < m) {  // the k best candidates, ascending (topk_slots: the set nth_element by score_before gives)
        n += topk_slots(scores, c0, m, k, out + n, reinterpret_cast<std::uint32_t*>(idx_scratch));
      } else {
        for (std::int64_t i = c0; i < c1; ++i) out[n++] = static_cast<std::int32_t>(i);
      }
    }
  }
  for (std::int64_t i = c1; i < L; ++i) out[n++] = static_cast<std::int32_t>(i);
  return n;
}

/// CriticalKV's two-stage selection (selectors::two_stage) of a head of length L (plan h) with
/// `budget`: the protected tokens and pass-through exactly as select_head; then of the k
/// candidates to keep, k1 = first_stage_count(p, k) by the primary score a (higher first, NaN
/// last, ties to the lower index) and the other k - k1, among the candidates not taken by stage
/// 1, by (a + eps) * u formed in fp64 (NaN stays NaN and ranks last, +-inf saturates to
/// +-FLT_MAX), same order rule. Kept slots ascending in out; returns the count.
/// a, u: rows of length >= L (primary and secondary scores); idx_scratch: L int32;
/// comb_scratch: L floats (the stage-2 scores, indexed by slot).
inline std::int64_t select_head_two_stage(const kvevict::detail::head_plan& h, std::int64_t budget, const float* a,
                                          const float* u, const selectors::two_stage::params& p, std::int32_t* out,
                                          std::int32_t* idx_scratch, float* comb_scratch) {
  const candidate_range r = begin_head_selection(h, budget, out);
  if (r.whole) return r.n;
  const std::int64_t L = h.length, c0 = r.c0, c1 = r.c1, k = r.k;
  std::int64_t n = r.n;
  if (k > 0) {
    const std::int64_t m = c1 - c0;
    for (std::int64_t i = 0; i < m; ++i) idx_scratch[i] = static_cast<std::int32_t>(c0 + i);
    const std::int64_t k1 = selectors::two_stage::first_stage_count(p, k);
    // Stage 1: the top k1 candidates by a move to idx_scratch[0, k1).
    if (k1 > 0 && k1 < m) {
      auto by_a = [a](std::int32_t x, std::int32_t y) { return score_before(a[x], x, a[y], y); };
      std::nth_element(idx_scratch, idx_scratch + (k1 - 1), idx_scratch + m, by_a);
    }
    // Stage 2: the top k - k1 of the rest by (a + eps) * u move to idx_scratch[k1, k).
    const std::int64_t k2 = k - k1;
    if (k2 > 0 && k < m) {
      const double eps = static_cast<double>(p.eps);
      const double fmax = 3.4028234663852886e38;
      for (std::int64_t i = k1; i < m; ++i) {
        const std::int32_t t = idx_scratch[i];
        double v = (static_cast<double>(a[t]) + eps) * static_cast<double>(u[t]);
        if (v > fmax) v = fmax;
        if (v < -fmax) v = -fmax;
        comb_scratch[t] = static_cast<float>(v);  // NaN stays NaN
      }
      auto by_c = [comb_scratch](std::int32_t x, std::int32_t y) {
        return score_before(comb_scratch[x], x, comb_scratch[y], y);
      };
      std::nth_element(idx_scratch + k1, idx_scratch + (k - 1), idx_scratch + m, by_c);
    }
    std::sort(idx_scratch, idx_scratch + k);
    for (std::int64_t i = 0; i < k; ++i) out[n++] = idx_scratch[i];
  }
  for (std::int64_t i = c1; i < L; ++i) out[n++] = static_cast<std::int32_t>(i);
  return n;
}

/// AdaKV budgets for the heads of one sequence (heads = out rows of the layer for sequence b).
/// plans[h], scores[h] (row of length >= plans[h].length), out budgets[h].
inline void adakv_budgets(const budgeters::adakv::params& p, const kvevict::detail::head_plan* plans,
                          const float* const* scores, std::int64_t heads, std::int64_t* budgets) {
  std::int64_t T = 0;
  std::vector<double> share(static_cast<std::size_t>(heads), 0.0);
  std::vector<std::int64_t> cap(static_cast<std::size_t>(heads), 0), extra(static_cast<std::size_t>(heads), 0);
  struct cand {
    float s;
    std::int32_t h, i;
  };
  std::vector<cand> all;
  for (std::int64_t h = 0; h < heads; ++h) {
    const auto& pl = plans[h];
    if (pl.pass_through) continue;
    T += pl.base_budget - pl.protected_count();
    for (std::int64_t i = pl.sinks; i < pl.length - pl.recent; ++i)
      all.push_back(cand{scores[h][i], static_cast<std::int32_t>(h), static_cast<std::int32_t>(i)});
  }
  if (T > static_cast<std::int64_t>(all.size())) T = static_cast<std::int64_t>(all.size());
  auto better = [](const cand& a, const cand& b) {
    const bool na = !(a.s == a.s), nb = !(b.s == b.s);
    if (na != nb) return nb;
    if (!na && a.s != b.s) return a.s > b.s;
    if (a.h != b.h) return a.h < b.h;
    return a.i < b.i;
  };
  std::vector<std::int64_t> winners(static_cast<std::size_t>(heads), 0);
  if (T > 0) {
    if (T < static_cast<std::int64_t>(all.size())) std::nth_element(all.begin(), all.begin() + (T - 1), all.end(), better);
    for (std::int64_t t = 0; t < T; ++t) ++winners[static_cast<std::size_t>(all[static_cast<std::size_t>(t)].h)];
  }
  budgeters::adakv::apportion_budgets(p, plans, winners.data(), heads, T, share.data(), cap.data(), extra.data(), budgets);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
