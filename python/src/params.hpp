// kvevict Python binding: the runtime parameters of every built-in stage by name, so that Python
// keyword arguments (temporal_alpha=0.3) reach the policy's params struct and params() can list
// them. One `fields(params&, f)` per stage params type calls f(name, member) for each member;
// the dotted name is "<stage>.<member>" as kvevict's own error messages spell it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include <kvevict/kvevict.hpp>

#include "binding.hpp"

namespace kvevict_py {

/// An enum member with its names (index = the enum's value).
template <class E, int N>
struct enum_field {
  E* value;
  const char* const (&names)[N];
};

// --- the members of each stage's params ------------------------------------------------------
template <class F>
void fields(kvevict::scorers::output_reconstruction::params& p, F&& f) {
  static const char* const modes[2] = {"after", "before"};
  f("aggregation", enum_field<kvevict::scorers::output_reconstruction::mode, 2>{&p.aggregation, modes});
  f("use_wo", p.use_wo);
  f("tau", p.tau);
  f("include_window_in_output", p.include_window_in_output);
}
template <class F>
void fields(kvevict::scorers::defensive_attention::params& p, F&& f) {
  static const char* const rules[3] = {"preceding_keys", "window", "none"};
  f("kernel", p.kernel);
  f("clamp_at_mean", p.clamp_at_mean);
  f("mass_threshold", p.mass_threshold);
  f("share", enum_field<kvevict::scorers::defensive_attention::share_rule, 3>{&p.share, rules});
}
template <class F>
void fields(kvevict::scorers::accumulated_attention::params& p, F&& f) {
  f("normalize_by_visible", p.normalize_by_visible);
}
template <class F>
void fields(kvevict::temporal::ema::params& p, F&& f) { f("alpha", p.alpha); }
template <class F>
void fields(kvevict::temporal::reversed_ema::params& p, F&& f) { f("alpha", p.alpha); }
template <class F>
void fields(kvevict::spatial::avg_pool::params& p, F&& f) { f("kernel", p.kernel); }
template <class F>
void fields(kvevict::spatial::max_pool::params& p, F&& f) { f("kernel", p.kernel); }
template <class F>
void fields(kvevict::spatial::adaptive_window::params& p, F&& f) {
  f("beta", p.beta);
  f("k_min", p.k_min);
  f("reference_exact", p.reference_exact);
}
template <class F>
void fields(kvevict::budgeters::pyramid::params& p, F&& f) {
  f("beta", p.beta);
  f("exact_total", p.exact_total);
  f("num_tokens", p.num_tokens);
}
template <class F>
void fields(kvevict::budgeters::adakv::params& p, F&& f) {
  f("alpha", p.alpha);
  f("exact_total", p.exact_total);
}
template <class F>
void fields(kvevict::budgeters::headwise_learned::params& p, F&& f) {
  // The tables come from the artifact; these scalars may be overridden.
  f("temperature", p.temperature);
  f("min_budget", p.min_budget);
  f("num_tokens", p.num_tokens);
  f("ratios_temperature", p.ratios_temperature);
}
template <class F>
void fields(kvevict::selectors::topk::params& p, F&& f) {
  f("num_sink", p.num_sink);
  f("num_recent", p.num_recent);
  f("recent_share", p.recent_share);
}
template <class F>
void fields(kvevict::selectors::two_stage::params& p, F&& f) {
  fields(static_cast<kvevict::selectors::topk::params&>(p), f);
  f("first_stage_ratio", p.first_stage_ratio);
  f("eps", p.eps);
}
/// Stages without runtime parameters (attention_weight, last_query, key_norm, none, mean, sum,
/// last, spatial::none, uniform, learned_mlp: its tables come from the artifact).
template <class P, class F>
void fields(P&, F&&) {}

/// Every member of a policy's params, with its dotted name.
template <class Params, class F>
void policy_fields(Params& p, F&& f) {
  auto prefixed = [&f](const char* stage) {
    return [&f, stage](const char* name, auto&& member) { f((std::string(stage) + "." + name).c_str(), member); };
  };
  fields(p.scorer, prefixed("scorer"));
  fields(p.temporal, prefixed("temporal"));
  fields(p.spatial, prefixed("spatial"));
  fields(p.budgeter, prefixed("budgeter"));
  fields(p.selector, prefixed("selector"));
  static const char* const gqa_names[4] = {"mean", "max", "per_query_head", "layer_mean"};
  f("gqa", enum_field<kvevict::gqa_reduction, 4>{&p.gqa, gqa_names});
  f("check_finite", p.check_finite);
}

// --- reading and writing one member -----------------------------------------------------------
inline param_value to_value(bool v) { return v; }
inline param_value to_value(std::int32_t v) { return static_cast<std::int64_t>(v); }
inline param_value to_value(std::int64_t v) { return v; }
/// A float member as the shortest decimal that reads back as the same float (0.3f -> 0.3, not
/// 0.30000001192092896), so that params() shows the values as written.
inline param_value to_value(float v) {
  if (!std::isfinite(v)) return static_cast<double>(v);
  char buf[32];
  for (int prec = 6; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, static_cast<double>(v));
    if (std::strtof(buf, nullptr) == v) break;
  }
  return std::strtod(buf, nullptr);
}
template <class E, int N>
param_value to_value(const enum_field<E, N>& e) {
  const int i = static_cast<int>(*e.value);
  return std::string(i >= 0 && i < N ? e.names[i] : "?");
}

inline const char* value_kind(const param_value& v) {
  switch (v.index()) {
    case 0: return "bool";
    case 1: return "int";
    case 2: return "float";
    default: return "str";
  }
}

inline kvevict::status set_value(const char* name, bool* m, const param_value& v) {
  if (const bool* b = std::get_if<bool>(&v)) {
    *m = *b;
    return {};
  }
  return kvevict::status::error(kvevict::errc::invalid_argument, "%s must be a bool, got %s", name, value_kind(v));
}
template <class I>
kvevict::status set_int(const char* name, I* m, const param_value& v) {
  const std::int64_t* i = std::get_if<std::int64_t>(&v);
  if (!i) return kvevict::status::error(kvevict::errc::invalid_argument, "%s must be an int, got %s", name, value_kind(v));
  if (*i < static_cast<std::int64_t>(std::numeric_limits<I>::min()) || *i > static_cast<std::int64_t>(std::numeric_limits<I>::max()))
    return kvevict::status::error(kvevict::errc::invalid_argument, "%s = %lld is out of range", name, static_cast<long long>(*i));
  *m = static_cast<I>(*i);
  return {};
}
inline kvevict::status set_value(const char* name, std::int32_t* m, const param_value& v) { return set_int(name, m, v); }
inline kvevict::status set_value(const char* name, std::int64_t* m, const param_value& v) { return set_int(name, m, v); }
inline kvevict::status set_value(const char* name, float* m, const param_value& v) {
  double d;
  if (const double* x = std::get_if<double>(&v)) d = *x;
  else if (const std::int64_t* i = std::get_if<std::int64_t>(&v)) d = static_cast<double>(*i);
  else return kvevict::status::error(kvevict::errc::invalid_argument, "%s must be a float, got %s", name, value_kind(v));
  *m = static_cast<float>(d);  // range and finiteness: the stage's own check()
  return {};
}
template <class E, int N>
kvevict::status set_value(const char* name, const enum_field<E, N>& e, const param_value& v) {
  const std::string* s = std::get_if<std::string>(&v);
  if (s)
    for (int i = 0; i < N; ++i)
      if (*s == e.names[i]) {
        *e.value = static_cast<E>(i);
        return {};
      }
  std::string allowed;
  for (int i = 0; i < N; ++i) allowed += (i ? ", " : "") + std::string("'") + e.names[i] + "'";
  return kvevict::status::error(kvevict::errc::invalid_argument, "%s = %s is not one of %s", name,
                                s ? ("'" + *s + "'").c_str() : value_kind(v), allowed.c_str());
}

/// The parameters of p by dotted name.
template <class Params>
param_map to_map(Params p) {
  param_map m;
  policy_fields(p, [&m](const char* name, auto&& member) {
    using M = std::decay_t<decltype(member)>;
    if constexpr (std::is_arithmetic_v<M>) m[name] = to_value(member);
    else m[name] = to_value(member);
  });
  return m;
}

/// Applies `overrides` to p; the first unknown name or bad value is an error naming it (p is
/// then partly written: callers apply to a copy).
template <class Params>
kvevict::status apply(Params* p, const param_map& overrides, const char* method) {
  for (const auto& kv : overrides) {
    bool found = false;
    kvevict::status st;
    policy_fields(*p, [&](const char* name, auto&& member) {
      if (found || kv.first != name) return;
      found = true;
      using M = std::decay_t<decltype(member)>;
      if constexpr (std::is_arithmetic_v<M>) st = set_value(name, &member, kv.second);
      else st = set_value(name, member, kv.second);
    });
    if (!found) {
      std::string known;
      policy_fields(*p, [&known](const char* name, auto&&) { known += (known.empty() ? "" : ", ") + std::string(name); });
      return kvevict::status::error(kvevict::errc::invalid_argument, "%s is not a parameter of method '%s' (its parameters: %s)",
                                    kv.first.c_str(), method, known.c_str());
    }
    if (!st.ok()) return st;
  }
  return {};
}

}  // namespace kvevict_py
