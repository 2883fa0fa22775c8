// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Selector policy: which tokens of a head are kept, given its budget and scores.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/core/config.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {
namespace selectors {

/// Top-k per head with protected tokens (the rule every paper of kvevict uses).
/// For a head with L tokens and budget b (b counts protected tokens):
///  - L <= b: pass-through, every token kept in order;
///  - else the first min(num_sink, L) tokens (sinks) and the last R tokens (recent) are kept BY
///    RULE, whatever their scores (NaN, +-inf, ties included), and the remaining
///    b - sinks - R slots go to the highest-scoring candidates in [sinks, L - R), ties to the
///    lower index, NaN scores ranked below every number. Output indices ascending.
/// R (protected recent tokens) is, in order of precedence:
///  - floor(recent_share * (B - num_sink)) when recent_share >= 0 (StreamingLLM: 1, H2O: 0.5),
///    B being the head's base budget before head-wise redistribution;
///  - num_recent when >= 0;
///  - the observation window W (the default: ReST-KV and SnapKV keep the window).
struct topk {
  struct params {
    std::int32_t num_sink = 0;
    std::int32_t num_recent = -1;  ///< -1: the observation window length
    float recent_share = -1.0f;    ///< >= 0: share of the non-sink budget kept as recent tokens
  };
  static constexpr const char* name = "topk";
  static status check(const params& p) {
    if (p.num_sink < 0) return status::error(errc::invalid_argument, "selector.num_sink = %d must be >= 0", p.num_sink);
    if (p.num_recent < -1)
      return status::error(errc::invalid_argument, "selector.num_recent = %d must be >= 0 (or -1 for the window)", p.num_recent);
    if (p.recent_share != p.recent_share || p.recent_share > 1.0f)
      return status::error(errc::invalid_argument, "selector.recent_share = %g must be in [0, 1] (or negative: unused)",
                           static_cast<double>(p.recent_share));
    return {};
  }
};

/// CriticalKV's two-stage selection (Feng et al. 2025, arXiv 2502.03805, "two-stage
/// perturbation-constrained selection"), for a scorer with a secondary row
/// (scorers::attention_value_norm: primary a = attention score, secondary u = ||v W_O^h||_1).
/// Protection, pass-through, budgets and the output order are exactly those of `topk` (its
/// params are inherited: num_sink, num_recent, recent_share). For a head with budget b, P
/// protected tokens and candidates [sinks, L - R), with k = min(b - P, candidates):
///  - stage 1 keeps k1 = floor(first_stage_ratio * k) candidates with the highest a;
///  - stage 2 keeps the k - k1 remaining candidates with the highest (a + eps) * u.
/// Both stages rank higher first, NaN below every number, ties to the lower index; output
/// ascending. a is the reduced, smoothed primary score (the one budgeters see); the product is
/// formed in fp64 and rounded to fp32 (saturating).
/// The ratio applies to the candidate budget k, not to b: protected tokens are kept by rule, so
/// they are not counted against stage 1 (the kvpress port instead pads the window with the
/// maximum score, so its window tokens use up part of stage 1; see docs/criticalkv.md).
/// Published defaults: first_stage_ratio 0.5, eps 1e-4. first_stage_ratio = 1 is plain top-k by
/// a; 0 ranks every candidate by (a + eps) * u.
/// Errors: first_stage_ratio outside [0, 1] or NaN; eps negative, NaN or infinite; the topk errors.
struct two_stage {
  struct params : topk::params {
    float first_stage_ratio = 0.5f;  ///< share of the candidate budget chosen by attention alone, in [0, 1]
    float eps = 1e-4f;               ///< added to a before the product, finite and >= 0
  };
  static constexpr const char* name = "two_stage";
  /// Ranks the scorer's secondary row (the front-end pairs it with a scorer that writes one).
  static constexpr bool reads_secondary_scores = true;
  static status check(const params& p) {
    KVEVICT_TRY(topk::check(p));
    if (!(p.first_stage_ratio >= 0.0f && p.first_stage_ratio <= 1.0f))
      return status::error(errc::invalid_argument, "selector.first_stage_ratio = %g must be in [0, 1]",
                           static_cast<double>(p.first_stage_ratio));
    if (!(p.eps >= 0.0f) || !std::isfinite(p.eps))
      return status::error(errc::invalid_argument, "selector.eps = %g must be finite and >= 0", static_cast<double>(p.eps));
    return {};
  }
  /// Stage-1 count k1 = floor(first_stage_ratio * k) for a candidate budget k >= 0 (fp64, exact
  /// for the float ratio), host and device.
  KVEVICT_HOST_DEVICE static std::int64_t first_stage_count(const params& p, std::int64_t k) {
    if (k <= 0) return 0;
    const std::int64_t k1 = static_cast<std::int64_t>(std::floor(static_cast<double>(p.first_stage_ratio) * static_cast<double>(k)));
    return k1 < 0 ? 0 : (k1 > k ? k : k1);
  }
};

}  // namespace selectors
}  // namespace kvevict
