// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Compile-time composition of the eviction stages.
//
//   scorer -> (temporal smoothing inside the scorer) -> GQA reduction -> spatial smoothing
//          -> budgeter -> selector                                  [-> compaction, separate]
#pragma once

#include "kvevict/core/status.hpp"
#include "kvevict/policies/budgeters.hpp"
#include "kvevict/policies/scorers.hpp"
#include "kvevict/policies/selectors.hpp"
#include "kvevict/policies/spatial.hpp"
#include "kvevict/policies/temporal.hpp"

namespace kvevict {

/// How the G = q_heads / kv_heads query-head scores of a GQA group become one score row.
///  - mean (default): average, so the compacted cache keeps kv_heads heads;
///  - max: maximum over the group;
///  - per_query_head: no reduction; every query head selects its own tokens (the ReST-KV and
///    SnapKV reference codes, which repeat K/V to q_heads heads: G times the memory). The
///    selection then has q_heads rows per sequence;
///  - layer_mean: average over ALL query heads of the layer; every KV head keeps the same
///    tokens (TOVA). Requires equal lengths across the heads of a sequence.
enum class gqa_reduction : int { mean = 0, max = 1, per_query_head = 2, layer_mean = 3 };

inline const char* to_string(gqa_reduction g) noexcept {
  switch (g) {
    case gqa_reduction::mean: return "mean";
    case gqa_reduction::max: return "max";
    case gqa_reduction::per_query_head: return "per_query_head";
    case gqa_reduction::layer_mean: return "layer_mean";
  }
  return "unknown";
}

/// An eviction method = five stage policies chosen at compile time. Each stage is a type with a
/// nested `params` (plain data) and `static status check(const params&)`; the backend provides
/// the implementation (a stage without one for a backend fails to compile at the call site).
template <class Scorer, class Temporal = temporal::mean, class Spatial = spatial::none,
          class Budgeter = budgeters::uniform, class Selector = selectors::topk>
struct eviction_policy {
  using scorer = Scorer;
  using temporal_smoother = Temporal;
  using spatial_smoother = Spatial;
  using budgeter = Budgeter;
  using selector = Selector;

  /// All runtime parameters of the method; defaults are the papers' published settings.
  struct params {
    typename Scorer::params scorer{};
    typename Temporal::params temporal{};
    typename Spatial::params spatial{};
    typename Budgeter::params budgeter{};
    typename Selector::params selector{};
    gqa_reduction gqa = gqa_reduction::mean;
    /// Scan the valid region of the Q, K, V (and W_O) that the scorer reads for NaN/inf and fail
    /// with errc::non_finite_input (a position-only scorer, StreamingLLM, reads none of them).
    bool check_finite = true;
  };

  static params defaults() { return params{}; }

  /// Validate every stage's parameters; the first error names the parameter and value.
  static status check(const params& p) {
    KVEVICT_TRY(Scorer::check(p.scorer));
    KVEVICT_TRY(Temporal::check(p.temporal));
    KVEVICT_TRY(Spatial::check(p.spatial));
    KVEVICT_TRY(Budgeter::check(p.budgeter));
    KVEVICT_TRY(Selector::check(p.selector));
    const int g = static_cast<int>(p.gqa);
    if (g < 0 || g > 3) return status::error(errc::invalid_argument, "gqa = %d is not a gqa_reduction", g);
    return {};
  }
};

}  // namespace kvevict
