// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Budget arithmetic shared by every budgeter, the selector and every backend: one documented
// rule for base budgets, protected tokens and pass-through (docs/semantics.md).
// `Protection` is any type with the protection fields of selectors::topk::params
// (int32 num_sink, int32 num_recent, float recent_share); core/ names no policy type.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/core/config.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace detail {

/// Protected recent tokens requested for base budget B and window W (before clamping to L).
template <class Protection>
KVEVICT_HOST_DEVICE inline std::int64_t requested_recent(const Protection& sp, std::int64_t base_budget,
                                                         std::int64_t window) {
  if (sp.recent_share >= 0.0f) {
    const std::int64_t free = base_budget - sp.num_sink;
    return free > 0 ? static_cast<std::int64_t>(std::floor(static_cast<double>(sp.recent_share) * static_cast<double>(free))) : 0;
  }
  return sp.num_recent >= 0 ? sp.num_recent : window;
}

/// The per-head plan every stage agrees on.
struct head_plan {
  std::int64_t length = 0;       ///< L: valid tokens of the head
  std::int64_t base_budget = 0;  ///< B: requested keep count before head-wise redistribution
  std::int64_t sinks = 0;        ///< protected first tokens, min(num_sink, L)
  std::int64_t recent = 0;       ///< protected last tokens
  bool pass_through = false;     ///< L <= B: keep everything, no scoring needed
  KVEVICT_HOST_DEVICE std::int64_t protected_count() const { return sinks + recent; }
  /// Smoothing region [0, evictable_end): everything before the protected recent tokens.
  KVEVICT_HOST_DEVICE std::int64_t evictable_end() const { return length - recent; }
  KVEVICT_HOST_DEVICE std::int64_t candidates() const { return length - sinks - recent; }
};

/// Plan for a head of length L. Assumes the request was validated (validate_budget()).
template <class Protection>
KVEVICT_HOST_DEVICE inline head_plan plan_head(const budget_request& req, const Protection& sp,
                                               std::int64_t length, std::int64_t window) {
  head_plan h;
  h.length = length;
  std::int64_t B;
  if (req.keep_tokens > 0) {
    B = req.keep_tokens;
  } else {
    B = static_cast<std::int64_t>(std::floor(req.keep_fraction * static_cast<double>(length)));
    // A fraction is a target: raise it to the protected tokens (and to 1), never below.
    const std::int64_t fixed_recent = sp.recent_share >= 0.0f ? 0 : (sp.num_recent >= 0 ? sp.num_recent : window);
    std::int64_t floor_b = sp.num_sink + fixed_recent;
    if (floor_b > length) floor_b = length;
    if (B < floor_b) B = floor_b;
    if (B < 1) B = 1;
  }
  h.base_budget = B;
  if (length <= B) {
    h.pass_through = true;
    h.sinks = 0;
    h.recent = 0;
    return h;
  }
  h.sinks = sp.num_sink < length ? sp.num_sink : length;
  std::int64_t r = requested_recent(sp, B, window);
  if (r > length - h.sinks) r = length - h.sinks;
  h.recent = r;
  return h;
}

/// plan_head for a head whose first `prefix` tokens are protected besides the selector's sinks (a
/// paged cache's pages.protected_prefix: a shared prefix is never evicted): the sinks become
/// max(num_sink, prefix) (at most L), and a budget below them plus the protected recent tokens is
/// raised to them (a token budget too; a fraction already is). prefix <= num_sink: plan_head itself.
template <class Protection>
KVEVICT_HOST_DEVICE inline head_plan plan_head_protected(const budget_request& req, const Protection& sp, std::int64_t length,
                                                         std::int64_t window, std::int64_t prefix) {
  if (prefix <= sp.num_sink) return plan_head(req, sp, length, window);
  Protection q = sp;
  q.num_sink = static_cast<decltype(q.num_sink)>(prefix < length ? prefix : length);
  head_plan h = plan_head(req, q, length, window);
  const std::int64_t fixed_recent = q.recent_share >= 0.0f ? 0 : (q.num_recent >= 0 ? q.num_recent : window);
  std::int64_t need = q.num_sink + fixed_recent;
  if (need > length) need = length;
  if (h.base_budget < need) {
    budget_request r = req;
    r.keep_tokens = static_cast<decltype(r.keep_tokens)>(need);
    r.keep_fraction = 0.0;
    h = plan_head(r, q, length, window);
  }
  return h;
}

}  // namespace detail
}  // namespace kvevict
