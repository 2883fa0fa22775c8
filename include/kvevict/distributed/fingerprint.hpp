// IWYU pragma: private, include "kvevict/distributed.hpp"
// What the ranks of a sharded layer must agree on before their budgets can be combined: the
// budget request, the GQA reduction and the budgeter's parameters (for LKV-H the content of its
// logit table, so ranks that loaded different artifacts are refused). Hashed to one int64 and
// compared in round 1 of the exchange (exchange.hpp). Tables that are legitimately sliced per
// rank (LKV-T's scorer weights) are not part of it.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "kvevict/core/config.hpp"
#include "kvevict/distributed/exchange.hpp"
#include "kvevict/policies/budgeters.hpp"
#include "kvevict/policies/learned.hpp"
#include "kvevict/policies/selectors.hpp"

namespace kvevict {
namespace distributed {
namespace detail {

/// The budgeter's part of the fingerprint: its parameters, field by field (no padding bytes).
/// Budgeters without a specialisation contribute their name only.
template <class Budgeter>
struct budgeter_fingerprint {
  static std::uint64_t of(const typename Budgeter::params&, std::uint64_t h) { return h; }
};
template <>
struct budgeter_fingerprint<budgeters::adakv> {
  static std::uint64_t of(const budgeters::adakv::params& p, std::uint64_t h) { return fnv1a(h, &p.alpha, sizeof p.alpha); }
};
template <>
struct budgeter_fingerprint<budgeters::pyramid> {
  static std::uint64_t of(const budgeters::pyramid::params& p, std::uint64_t h) {
    const unsigned char e = p.exact_total ? 1 : 0;
    return fnv1a(fnv1a(h, &p.beta, sizeof p.beta), &e, 1);
  }
};
template <>
struct budgeter_fingerprint<budgeters::headwise_learned> {
  static std::uint64_t of(const budgeters::headwise_learned::params& p, std::uint64_t h) {
    h = fnv1a(h, &p.num_layers, sizeof p.num_layers);
    h = fnv1a(h, &p.kv_heads, sizeof p.kv_heads);
    h = fnv1a(h, &p.temperature, sizeof p.temperature);
    h = fnv1a(h, &p.min_budget, sizeof p.min_budget);
    h = fnv1a(h, &p.num_tokens, sizeof p.num_tokens);
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    if (p.logits && !p.on_device && n > 0) h = fnv1a(h, p.logits, static_cast<std::size_t>(n) * sizeof(float));
    return h;
  }
};

/// Fingerprint of a policy's parameters and a budget request, as round 1 compares it.
template <class Policy>
std::uint64_t policy_fingerprint(const typename Policy::params& p, const budget_request& req) {
  using Budgeter = typename Policy::budgeter;
  std::uint64_t h = 1469598103934665603ull;
  h = fnv1a(h, Budgeter::name, std::char_traits<char>::length(Budgeter::name));
  h = fnv1a(h, &req.keep_tokens, sizeof req.keep_tokens);
  h = fnv1a(h, &req.keep_fraction, sizeof req.keep_fraction);
  const int g = static_cast<int>(p.gqa);
  h = fnv1a(h, &g, sizeof g);
  if constexpr (std::is_base_of<selectors::topk::params, typename Policy::selector::params>::value) {
    const std::int32_t sel[2] = {p.selector.num_sink, p.selector.num_recent};  // the protected tokens
    h = fnv1a(h, sel, sizeof sel);
    h = fnv1a(h, &p.selector.recent_share, sizeof p.selector.recent_share);
  }
  return budgeter_fingerprint<Budgeter>::of(p.budgeter, h);
}

}  // namespace detail
}  // namespace distributed
}  // namespace kvevict
