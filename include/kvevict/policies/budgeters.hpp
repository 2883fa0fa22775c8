// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Budgeter policies: how many tokens each head of a layer keeps.
// A budget counts every kept token of a head (protected ones included). Every budgeter keeps
// pass-through heads (L <= B) whole, keeps each head's protected tokens, and distributes the
// remaining per-layer total exactly (detail::apportion: largest remainder, ties to the lower
// head index), never above a head's length.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {
namespace budgeters {

/// Every head keeps its base budget B (keep_tokens, or floor(keep_fraction * L)).
struct uniform {
  struct params {};
  static constexpr const char* name = "uniform";
  static constexpr bool needs_scores = false;
  static status check(const params&) { return {}; }
  KVEVICT_HOST_DEVICE static std::int64_t head_budget(const params&, const detail::head_plan& h, int, int) {
    return h.pass_through ? h.length : h.base_budget;
  }
};

/// PyramidKV per-layer schedule (Cai et al. 2024, arXiv 2406.02069). With P = B - protected
/// and C = L - protected candidates: min = P // beta, max = 2P - min; if max >= C then
/// max = C, min = 2P - max; layer l keeps max - l * (max - min) / (n_layers - 1) candidates
/// plus its protected tokens. A head with no protected token keeps at least 1 candidate in every
/// layer (min is raised to 1 before max is derived, so with exact_total the layers still sum to
/// n_layers * P):
/// PyramidKV's min = P // beta is 0 for P < beta, which would empty the deepest layers' heads.
///  - exact_total (default): the real-valued schedule, rounded by largest remainder over the
///    layers so that the n_layers budgets sum to exactly n_layers * P (the average is B);
///  - exact_total = false: PyramidKV's integer code, step = (max - min) // (n_layers - 1).
/// Published beta = 20.
///
/// num_tokens (decode-time eviction): the pyramid is defined on the layers' common length, which
/// every layer has at prefill. Under a decode cap the layers' lengths diverge after the first
/// eviction (a deep layer keeps few tokens, the shallow ones many); a pyramid recomputed from each
/// layer's own length then keeps a short layer whole (L <= B) while the long ones keep their share,
/// and the model-wide average climbs above B (measured: +20% at B = 256). With num_tokens = t > 0
/// (decode_schedule::apply sets it to the tokens seen by the request) every layer's budget comes from
/// the pyramid of a head of max(t, L) tokens with the same protection (row_request): b_l =
/// protected + layer_candidates(P, max(t, L) - protected, l). A row is then planned with the token
/// budget b_l: it is kept whole only when L <= b_l, and otherwise keeps exactly b_l tokens (its
/// protected tokens counted at b_l). With exact_total the b_l sum to n_layers * B whenever t is the
/// common length the layers had before any eviction, so after every decode eviction the model-wide
/// average per head is at most B (a layer shorter than its b_l keeps its L), and at most B + the
/// tokens appended since between evictions; layer l stays within b_l <= 2B (+ those tokens).
/// With exact_total = false the integer schedule's floors add less than (n_layers - 1) / 2 tokens
/// to the average. num_tokens = 0 (default): each head's own length, the published prefill rule; at
/// t = L the two are the same selection for every protection without recent_share.
/// Errors: beta < 1 or not finite, num_tokens outside [0, 2^31 - 1].
struct pyramid {
  struct params {
    float beta = 20.0f;
    bool exact_total = true;
    /// t: the tokens every layer's pyramid is computed for (decode-time eviction); 0 = each head's own length.
    std::int64_t num_tokens = 0;
  };
  static constexpr const char* name = "pyramid";
  static constexpr bool needs_scores = false;
  static status check(const params& p) {
    if (!(p.beta >= 1.0f) || !std::isfinite(p.beta))
      return status::error(errc::invalid_argument, "budgeter.beta = %g must be finite and >= 1", static_cast<double>(p.beta));
    if (p.num_tokens < 0 || p.num_tokens > 0x7fffffff)
      return status::error(errc::invalid_argument, "budgeter.num_tokens = %lld must be in [0, 2^31 - 1] (tokens seen)",
                           static_cast<long long>(p.num_tokens));
    return {};
  }
  /// Candidates (non-protected kept tokens) of layer `layer` for P, C; min_candidates (0 or 1,
  /// <= P) is the least any layer gets. Host and device.
  KVEVICT_HOST_DEVICE static std::int64_t layer_candidates(const params& p, std::int64_t P, std::int64_t C, int layer,
                                                           int num_layers, std::int64_t min_candidates = 0) {
    if (num_layers <= 1) return P < C ? P : C;
    std::int64_t mn = static_cast<std::int64_t>(std::floor(static_cast<double>(P) / p.beta));
    if (mn < min_candidates) mn = min_candidates;
    std::int64_t mx = 2 * P - mn;
    if (mx >= C) {
      mx = C;
      mn = 2 * P - mx;
    }
    if (!p.exact_total) {
      const std::int64_t step = (mx - mn) / (num_layers - 1);
      std::int64_t v = mx - layer * step;
      return v < 0 ? 0 : (v > C ? C : v);
    }
    // Exact: largest remainder over the real schedule v_l = mx - l (mx - mn) / (n - 1), in
    // integer arithmetic (numerators over n - 1) so equal remainders tie exactly and go to the
    // lower layer. The n values sum to n * P because mx + mn = 2P.
    const std::int64_t den = num_layers - 1;
    const std::int64_t span = mx - mn;
    std::int64_t floor_sum = 0;
    for (int l = 0; l < num_layers; ++l) floor_sum += (mx * den - l * span) / den;
    std::int64_t deficit = P * num_layers - floor_sum;  // units handed out by largest remainder
    const std::int64_t my_num = mx * den - static_cast<std::int64_t>(layer) * span;
    std::int64_t v = my_num / den;
    const std::int64_t my_rem = my_num % den;
    // Rank of this layer among all layers by (remainder desc, layer asc).
    std::int64_t rank = 0;
    for (int l = 0; l < num_layers; ++l) {
      const std::int64_t rem = (mx * den - l * span) % den;
      if (rem > my_rem || (rem == my_rem && l < layer)) ++rank;
    }
    if (deficit > 0 && rank < deficit) v += 1;
    return v < 0 ? 0 : (v > C ? C : v);
  }
  /// The largest head_budget of any layer for base budget B (the shallowest layer keeps at most
  /// 2P - min <= 2B candidates plus its protected tokens): bounds a selection before the lengths
  /// are known (the CUDA backend's max_selected without host lengths).
  static std::int64_t max_head_budget(const params&, std::int64_t B) { return 2 * B + 1; }
  /// The budget of a row planned by plan_head: with num_tokens = 0 the pyramid over the row's own
  /// candidates; with num_tokens > 0 the row was planned with its layer's budget b_l (row_request),
  /// which it keeps.
  KVEVICT_HOST_DEVICE static std::int64_t head_budget(const params& p, const detail::head_plan& h, int layer,
                                                      int num_layers) {
    if (h.pass_through) return h.length;
    if (p.num_tokens > 0) return h.base_budget;
    return pyramid_budget(p, h, layer, num_layers);
  }
  /// The request a row of L tokens is planned with (the front-end and the CUDA plan kernel call it
  /// before plan_head_protected): `req` itself with num_tokens = 0; else the token budget b_l of a
  /// head of max(num_tokens, L) tokens with the same protection (see num_tokens above), or `req`
  /// when such a head would pass through (then so does this one: L <= its base budget).
  template <class Protection>
  KVEVICT_HOST_DEVICE static budget_request row_request(const params& p, const budget_request& req, const Protection& sp,
                                                        std::int64_t L, std::int64_t window, std::int64_t prefix, int layer,
                                                        int num_layers) {
    if (p.num_tokens <= 0) return req;
    const detail::head_plan r = detail::plan_head_protected(req, sp, reference_length(p, L), window, prefix);
    if (r.pass_through) return req;
    // A budget at or above L keeps the row whole, as L itself does (and L fits the int32 field).
    const std::int64_t b = pyramid_budget(p, r, layer, num_layers);
    budget_request out;
    out.keep_tokens = static_cast<decltype(out.keep_tokens)>(b < L ? b : L);
    out.keep_fraction = 0.0;
    return out;
  }
  /// The length a row of L tokens is planned for: max(num_tokens, L) (L with num_tokens = 0). The
  /// front-end sizes max_selected's bound with it (a fraction of the tokens seen can exceed one of
  /// the capacity).
  KVEVICT_HOST_DEVICE static std::int64_t reference_length(const params& p, std::int64_t L) {
    return p.num_tokens > L ? p.num_tokens : L;
  }

 private:
  KVEVICT_HOST_DEVICE static std::int64_t pyramid_budget(const params& p, const detail::head_plan& h, int layer, int num_layers) {
    const std::int64_t P = h.base_budget - h.protected_count();
    return h.protected_count() + layer_candidates(p, P, h.candidates(), layer, num_layers, h.protected_count() == 0 ? 1 : 0);
  }
};

/// AdaKV head-wise allocation (Feng et al. 2024, arXiv 2407.11550), per layer and sequence.
/// With T = sum over evicting heads of (B_h - protected_h): take the global top-T candidate
/// scores over the heads of the layer (ties: lower head, then lower index); c_h = winners of
/// head h; budget_h = protected_h + round((1 - alpha) c_h + alpha (B_h - protected_h)), the
/// rounding by largest remainder so the layer total is exactly T. alpha = 0 is pure
/// AdaKV; the published GQA setting is alpha = 0.2. Scores are the smoothed, GQA-reduced
/// scores of the scorer. A head with no protected token is never emptied: after the rounding,
/// each such head left with 0 takes 1 token from the head with the largest surplus (extra_h
/// minus its own floor; ties: lower head), in head order. The total stays T, and nothing
/// changes when no head was emptied. (Without the floor, 1 token per head over 2 heads with
/// nothing protected gave one head both tokens.)
/// `exact_total = false` is the authors' reference rule instead (AdaKV/adaptive_snapkv,
/// AdaptiveSnapKVCluster.update_kv): each head on its own gets
/// budget_h = protected_h + round((1 - alpha) c_h + floor(alpha (B_h - protected_h))), computed as
/// the reference does in float32 (c_h times float(1 - alpha), plus the floor, then rounded half to
/// even; alpha taken as the decimal it stands for, to 6 places, as the reference's Python double),
/// capped at the head's candidates; the layer total then differs from T by the rounding
/// (a few tokens; total_slack bounds it). A head with nothing protected that rounds to 0 keeps 1
/// token (no donor: there is no total to keep). `presets::adakv_published` uses it. Errors: alpha outside [0, 1].
struct adakv {
  struct params {
    float alpha = 0.2f;
    bool exact_total = true;  ///< false: the reference code's per-head rounding (above)
  };
  static constexpr const char* name = "adakv";
  static constexpr bool needs_scores = true;
  static status check(const params& p) {
    if (!(p.alpha >= 0.0f && p.alpha <= 1.0f))
      return status::error(errc::invalid_argument, "budgeter.alpha = %g must be in [0, 1]", static_cast<double>(p.alpha));
    return {};
  }
  /// The second half of the allocation, the same code on every backend: from the plans of the
  /// H heads of one sequence, winners[h] (c_h, the head's share of the global top-T candidate
  /// scores) and T (the layer's candidate total, <= the number of candidates), write budgets[h]
  /// (protected + apportioned, or L for a pass-through head). share, cap, extra: scratch of H
  /// entries each. Host and device; O(H^2) (detail::apportion).
  template <class Count>
  KVEVICT_HOST_DEVICE static void apportion_budgets(const params& p, const detail::head_plan* pl, const Count* winners,
                                                    std::int64_t H, std::int64_t T, double* share, std::int64_t* cap,
                                                    std::int64_t* extra, std::int64_t* budgets) {
    for (std::int64_t h = 0; h < H; ++h) {
      share[h] = 0.0;
      cap[h] = 0;
      if (pl[h].pass_through) continue;
      cap[h] = pl[h].candidates();
      share[h] = (1.0 - static_cast<double>(p.alpha)) * static_cast<double>(winners[h]) +
                 static_cast<double>(p.alpha) * static_cast<double>(pl[h].base_budget - pl[h].protected_count());
    }
    if (p.exact_total) {
      detail::apportion(share, cap, H, T, extra);
    } else {
      // The reference's floor_alpha is a Python double (0.2, not 0.2f): alpha rounded to 6 decimals stands
      // for it, so int((B - w) * floor_alpha) agrees for every alpha written with <= 6 decimals (0.7f
      // would give floor(6.99...) = 6 where Python's int(10 * 0.7) is 7).
      const double a = std::floor(static_cast<double>(p.alpha) * 1e6 + 0.5) / 1e6;
      const float keep = static_cast<float>(1.0 - a);  // torch: int tensor * python float -> float32
      for (std::int64_t h = 0; h < H; ++h) {
        extra[h] = 0;
        if (pl[h].pass_through) continue;
        const std::int64_t fl = static_cast<std::int64_t>(std::floor(a * static_cast<double>(pl[h].base_budget - pl[h].protected_count())));
#ifdef __CUDA_ARCH__
        const float t = __fmul_rn(static_cast<float>(winners[h]), keep);  // no FMA contraction: torch rounds the product first
#else
        const float t = static_cast<float>(winners[h]) * keep;
#endif
        const float x = t + static_cast<float>(fl);
        const float down = std::floor(x);
        std::int64_t r = static_cast<std::int64_t>(down);
        if (x - down > 0.5f || (x - down == 0.5f && (r & 1) != 0)) ++r;  // half to even, as torch.round
        extra[h] = r < 0 ? 0 : (r < cap[h] ? r : cap[h]);
      }
    }
    // Floor: an emptied head that must keep a token takes one from the head with the largest
    // surplus extra - m (ties: lower head). One exists: sum(extra - m) = T - sum(m) >= 0
    // (a floored head has B >= 1 and >= 1 candidate, so it adds >= 1 to T and 1 to sum(m)),
    // and the emptied head's own term is -1.
    for (std::int64_t h = 0; h < H; ++h) {
      if (floor_tokens(pl[h]) == 0 || extra[h] > 0) continue;
      if (!p.exact_total) {  // the reference rule has no total to keep: the head takes its token
        extra[h] = 1;
        continue;
      }
      std::int64_t donor = -1, best = 0;
      for (std::int64_t j = 0; j < H; ++j) {
        const std::int64_t surplus = extra[j] - floor_tokens(pl[j]);
        if (surplus > best) {
          best = surplus;
          donor = j;
        }
      }
      if (donor < 0) break;  // unreachable (see above); never take from a head that cannot spare
      --extra[donor];
      ++extra[h];
    }
    for (std::int64_t h = 0; h < H; ++h)
      budgets[h] = pl[h].pass_through ? pl[h].length : pl[h].protected_count() + extra[h];
  }
  /// Tokens a sequence of `heads` rows may keep beyond its total T + protected: 0 with exact_total;
  /// with the reference rounding each head rounds on its own, round(x_h) <= x_h + 1/2 with
  /// sum x_h <= T (sum c_h = T, sum F_h <= alpha T), and a head with nothing protected that rounds
  /// to 0 takes 1 token (the floor, without a donor here): at most T + heads. The plan's max_selected
  /// adds it (no longer exact).
  static std::int64_t total_slack(const params& p, std::int64_t heads) { return p.exact_total ? 0 : heads; }
  /// m_h: 1 for an evicting head with candidates and nothing protected, else 0.
  KVEVICT_HOST_DEVICE static std::int64_t floor_tokens(const detail::head_plan& h) {
    return (!h.pass_through && h.protected_count() == 0 && h.candidates() > 0) ? 1 : 0;
  }
};

/// Threshold allocation: each head keeps the candidates that pass a threshold, never more than its
/// budget. The budget request is a cap (B per head, protected tokens counted); how many tokens a head
/// keeps below it is a result of the scores (the selection's indptr reports it per head). Two rules:
///  - score: the candidates whose score is >= threshold (a log-score threshold with a window, KVzap;
///    NaN never passes);
///  - mass: the fewest highest-scoring candidates whose share of the head's candidate score sum
///    reaches threshold in [0, 1] (the cumulative attention mass of DefensiveKV's first stage;
///    negative scores count as 0; a head whose sum is 0 keeps none by the rule).
/// Then per head: at least min(min_candidates, candidates) (the floor: without it a threshold can
/// empty a head), at most B - protected; and per sequence, when max_tokens > 0, at most max_tokens
/// candidates over its heads: each head's floor first, the rest to the highest-scoring passing
/// candidates of all heads (ties: lower head, then lower index). If the floors alone exceed
/// max_tokens, the floors win. Heads kept whole (L <= B) are not counted. The selector then keeps
/// each head's best candidates by score (selectors::topk), so the kept set is the passing set.
/// max_selected is the cap's total (eviction_plan::max_selected_exact = false).
/// Errors: threshold not finite, or outside [0, 1] with the mass rule; rule not a rule;
/// min_candidates or max_tokens negative.
struct threshold {
  enum class rule : int { score = 0, mass = 1 };
  struct params {
    rule mode = rule::score;
    float threshold = 0.0f;
    std::int32_t min_candidates = 1;  ///< per-head floor of kept candidates
    std::int64_t max_tokens = 0;      ///< per-sequence cap on kept candidates over its heads; 0: none
  };
  static constexpr const char* name = "threshold";
  static constexpr bool needs_scores = true;
  /// Budgets are caps: a head keeps at most its base budget (the frontend's max_selected is a bound).
  static constexpr bool budget_is_cap = true;
  static status check(const params& p) {
    const int m = static_cast<int>(p.mode);
    if (m < 0 || m > 1) return status::error(errc::invalid_argument, "budgeter.mode = %d is not a threshold rule", m);
    if (!std::isfinite(p.threshold))
      return status::error(errc::invalid_argument, "budgeter.threshold = %g must be finite", static_cast<double>(p.threshold));
    if (p.mode == rule::mass && !(p.threshold >= 0.0f && p.threshold <= 1.0f))
      return status::error(errc::invalid_argument, "budgeter.threshold = %g must be in [0, 1] with the mass rule",
                           static_cast<double>(p.threshold));
    if (p.min_candidates < 0)
      return status::error(errc::invalid_argument, "budgeter.min_candidates = %d must be >= 0", p.min_candidates);
    if (p.max_tokens < 0)
      return status::error(errc::invalid_argument, "budgeter.max_tokens = %lld must be >= 0 (0: no cap)", static_cast<long long>(p.max_tokens));
    return {};
  }
};

}  // namespace budgeters
}  // namespace kvevict
