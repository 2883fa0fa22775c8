// kvevict Python binding: evictor_impl<Policy>, one method on the CPU backend behind the
// evictor_iface of binding.hpp, with its plan cache. Included by the method units only.
//
// Plan cache: every plan made is kept under everything it depends on (storage type, extents,
// strides and presence of every view, the lengths' values, budget, layer, threads), up to
// max_plans; a call whose key was seen runs its plan in the shared workspace (no plan(), no
// allocation but the returned selection), so a loop over layers plans once per layer. The
// workspace only grows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <kvevict/cpu.hpp>

#include "binding.hpp"
#include "inputs.hpp"
#include "params.hpp"

namespace kvevict_py {


template <class Policy>
class evictor_impl final : public evictor_iface {
 public:
  using params_type = typename Policy::params;
  evictor_impl(const char* name, const params_type& p, std::shared_ptr<const void> keep_alive)
      : ev_(p), name_(name), keep_alive_(std::move(keep_alive)) {}

  status select(const select_args& a, select_result* out) override {
    if (!out) return status::error(errc::null_pointer, "out is null");
    if (!a.keys.given()) return status::error(errc::null_pointer, "keys is required");
    switch (a.keys.type) {
      case dtype::f32: return run<float>(a, out);
      case dtype::f16: return run<kvevict::half_t>(a, out);
      case dtype::bf16: return run<kvevict::bfloat16_t>(a, out);
      default:
        return status::error(errc::invalid_argument, "keys.dtype = %s; kvevict takes float32, float16 or bfloat16 caches",
                             to_string(a.keys.type));
    }
  }

  param_map params() const override { return to_map(ev_.params()); }
  const char* method() const override { return name_; }
  cache_stats stats() const override { return stats_; }

 private:
  template <class T>
  status run(const select_args& a, select_result* out) {
    kvevict::layer_inputs<T> in;
    KVEVICT_TRY(build_inputs(a, &in));
    kvevict::budget_request budget;
    budget.keep_tokens = a.keep_tokens;
    budget.keep_fraction = a.keep_fraction;
    std::vector<std::int64_t> key = cache_key(a, in);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      kvevict::eviction_plan pl;
      kvevict::plan_options opt;
      opt.num_threads = a.num_threads;
      KVEVICT_TRY(ev_.plan(in, budget, &pl, opt));
      ++stats_.plans;
      if (ws_.size() < pl.workspace_bytes) {
        ws_.assign(pl.workspace_bytes, 0);
        ++stats_.workspace_allocs;
        stats_.workspace_bytes = ws_.size();
      }
      if (plans_.size() >= max_plans) plans_.clear();  // a bound, not an LRU: shapes rarely churn
      it = plans_.emplace(std::move(key), pl).first;
    }
    const kvevict::eviction_plan& pl = it->second;
    select_result r;
    r.batch = in.batch();
    r.out_heads = pl.out_heads;
    r.seq = in.capacity();
    r.indptr.assign(static_cast<std::size_t>(pl.rows + 1), 0);
    r.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(pl.max_selected, 1)), 0);
    r.positions.assign(r.indices.size(), 0);
    if (a.want_scores) r.scores.assign(static_cast<std::size_t>(r.batch * r.out_heads * r.seq), 0.0f);
    kvevict::selection_view sel{r.indptr.data(), r.indices.data(), r.positions.data(), static_cast<std::int64_t>(r.indices.size())};
    const status st = ev_.run(pl, in, sel, ws_.data(), ws_.size(), a.want_scores ? r.scores.data() : nullptr);
    if (!st.ok()) {
      plans_.erase(it);  // a failed run (non-finite data, bad lengths) plans again next time
      return st;
    }
    ++stats_.runs;
    r.indices.resize(static_cast<std::size_t>(r.indptr.back()));
    r.positions.resize(r.indices.size());
    *out = std::move(r);
    return {};
  }

  kvevict::evictor<Policy, kvevict::cpu::backend> ev_;
  const char* name_;
  std::shared_ptr<const void> keep_alive_;  // LKV: the artifact the params point into
  /// Plans by cache key (one per layer, shape, budget and lengths seen; at most max_plans).
  static constexpr std::size_t max_plans = 256;
  std::map<std::vector<std::int64_t>, kvevict::eviction_plan> plans_;
  std::vector<unsigned char> ws_;
  cache_stats stats_{};
};

/// The evictor of Policy with its defaults (or `base`) overridden by `overrides`.
template <class Policy>
status make_policy(const char* name, const param_map& overrides, std::unique_ptr<evictor_iface>* out,
                   typename Policy::params base = Policy::defaults(), std::shared_ptr<const void> keep_alive = nullptr) {
  KVEVICT_TRY(apply(&base, overrides, name));
  KVEVICT_TRY(Policy::check(base));
  out->reset(new evictor_impl<Policy>(name, base, std::move(keep_alive)));
  return {};
}

}  // namespace kvevict_py
