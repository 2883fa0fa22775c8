// IWYU pragma: private, include "kvevict/distributed.hpp"
// What the ranks of a sharded layer must agree on before their budgets can be combined
// (layer_terms, exchange.hpp): the layer's GQA group, head_dim, window and storage dtype, the budget
// request, the GQA reduction, the selector's protection, the policy's stages and the budgeter's
// parameters (for LKV-H the content of its logit table, so ranks that loaded different artifacts are
// refused), compared field by field in round 1 of the exchange so that a mismatch names the field.
// Tables that are legitimately sliced per rank (LKV-T's scorer weights) are not part of it.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "kvevict/core/config.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/numeric.hpp"
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
  static std::uint64_t of(const budgeters::adakv::params& p, std::uint64_t h) {
    const unsigned char e = p.exact_total ? 1 : 0;
    return fnv1a(fnv1a(h, &p.alpha, sizeof p.alpha), &e, 1);
  }
};
template <>
struct budgeter_fingerprint<budgeters::pyramid> {
  static std::uint64_t of(const budgeters::pyramid::params& p, std::uint64_t h) {
    const unsigned char e = p.exact_total ? 1 : 0;
    return fnv1a(fnv1a(fnv1a(h, &p.beta, sizeof p.beta), &e, 1), &p.num_tokens, sizeof p.num_tokens);
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

/// A stage's name, or "" for a user's stage that declares none.
template <class X, class = void>
struct stage_name {
  static constexpr const char* value = "";
};
template <class X>
struct stage_name<X, std::void_t<decltype(X::name)>> {
  static constexpr const char* value = X::name;
};

/// What round 1 compares (exchange.hpp, layer_terms): the layer's GQA group, head_dim, window and
/// storage dtype, the budget request, the GQA reduction, the selector's protection, a hash of the
/// policy's stage names and one of the budgeter's parameters. Tables that are legitimately sliced
/// per rank (LKV-T's scorer weights) are not part of it.
template <class Policy, class T>
layer_terms layer_terms_of(const typename Policy::params& p, const budget_request& req, const layer_inputs<T>& in) {
  using Budgeter = typename Policy::budgeter;
  layer_terms t;
  t.group = in.group_size();
  t.head_dim = in.head_dim();
  t.window = in.window();
  t.dtype = std::is_same<T, float>::value ? 0 : (std::is_same<T, half_t>::value ? 1 : 2);
  t.keep_tokens = req.keep_tokens;
  t.keep_fraction = req.keep_fraction;
  t.gqa = static_cast<std::int64_t>(p.gqa);
  if constexpr (std::is_base_of<selectors::topk::params, typename Policy::selector::params>::value) {
    t.num_sink = p.selector.num_sink;
    t.num_recent = p.selector.num_recent;
    t.recent_share = p.selector.recent_share;
  }
  std::uint64_t h = 1469598103934665603ull;
  for (const char* n : {stage_name<typename Policy::scorer>::value, stage_name<typename Policy::temporal_smoother>::value,
                        stage_name<typename Policy::spatial_smoother>::value, stage_name<Budgeter>::value,
                        stage_name<typename Policy::selector>::value}) {
    h = fnv1a(h, n, std::char_traits<char>::length(n));
    h = fnv1a(h, "/", 1);
  }
  t.policy = h;
  t.budgeter = budgeter_fingerprint<Budgeter>::of(p.budgeter, 1469598103934665603ull);
  return t;
}

}  // namespace detail
}  // namespace distributed
}  // namespace kvevict
