// kvevict Python binding: what the CPU (evictor_impl.hpp) and CUDA (methods_cuda.cu) evictors of
// one method share: the kvevict::evictor with its fixed parameters, the name, what the
// parameters point into (LKV tables), the plan cache and the counters. Each driver adds its
// select(). Include after the backend's umbrella header (kvevict/cpu.hpp or kvevict/cuda.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <kvevict/kvevict.hpp>

#include "binding.hpp"
#include "inputs.hpp"
#include "params.hpp"

namespace kvevict_py {

template <class Policy, class Backend>
class evictor_base : public evictor_iface {
 public:
  using params_type = typename Policy::params;
  evictor_base(const char* name, const params_type& p, std::shared_ptr<const void> keep_alive)
      : ev_(p), name_(name), keep_alive_(std::move(keep_alive)) {}

  param_map params() const override { return to_map(ev_.params()); }
  const char* method() const override { return name_; }
  cache_stats stats() const override { return stats_; }
  status schedule_params(const kvevict::decode_schedule& s, const kvevict::decode_action& a, std::int64_t window, param_map* params,
                         kvevict::budget_request* budget) const override {
    if (!params || !budget) return status::error(errc::null_pointer, "schedule_params: null output");
    params_type p = ev_.params();
    kvevict::budget_request b;
    KVEVICT_TRY(s.apply(a, p, window, &b));
    *params = to_map(p);
    *budget = b;
    return {};
  }

 protected:
  /// Plans by cache key (cache_key(): one per layer, shape, budget, threads and lengths seen);
  /// at most max_plans, then the cache starts over (a bound, not an LRU: shapes rarely churn).
  static constexpr std::size_t max_plans = 256;
  using plan_map = std::map<std::vector<std::int64_t>, kvevict::eviction_plan>;

  /// The plan of `key`, made by make(&plan) on a miss (counted in stats_.plans).
  template <class Make>
  status find_plan(std::vector<std::int64_t>&& key, Make&& make, typename plan_map::iterator* out) {
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      kvevict::eviction_plan pl;
      KVEVICT_TRY(make(&pl));
      ++stats_.plans;
      if (plans_.size() >= max_plans) plans_.clear();
      it = plans_.emplace(std::move(key), pl).first;
    }
    *out = it;
    return {};
  }

  kvevict::evictor<Policy, Backend> ev_;
  const char* name_;
  std::shared_ptr<const void> keep_alive_;  // LKV: the artifact or device tables the params point into
  plan_map plans_;
  cache_stats stats_{};
};

/// The evictor Impl<Policy> with Policy's defaults (or `base`) overridden by `overrides`; the
/// first unknown name or bad value is an error naming it.
template <template <class> class Impl, class Policy, class... Extra>
status make_with(const char* name, const param_map& overrides, std::unique_ptr<evictor_iface>* out, typename Policy::params base,
                 std::shared_ptr<const void> keep_alive, Extra... extra) {
  KVEVICT_TRY(apply(&base, overrides, name));
  KVEVICT_TRY(Policy::check(base));
  out->reset(new Impl<Policy>(name, base, std::move(keep_alive), extra...));
  return {};
}

}  // namespace kvevict_py
