// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Selector policy: which tokens of a head are kept, given its budget and scores.
#pragma once

#include <cstdint>

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

}  // namespace selectors
}  // namespace kvevict
