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
#include "evictor_base.hpp"
#include "inputs.hpp"
#include "params.hpp"

namespace kvevict_py {

template <class Policy>
class evictor_impl final : public evictor_base<Policy, kvevict::cpu::backend> {
  using base = evictor_base<Policy, kvevict::cpu::backend>;
  using base::ev_;
  using base::plans_;
  using base::stats_;

 public:
  using base::base;

  status select(const select_args& a, select_result* out) override {
    if (!out) return status::error(errc::null_pointer, "out is null");
    if (!a.keys.given()) return status::error(errc::null_pointer, "keys is required");
    return dispatch_storage(a.keys.type, "keys", [&](auto tag) { return run<decltype(tag)>(a, out); });
  }

 private:
  template <class T>
  status run(const select_args& a, select_result* out) {
    kvevict::layer_inputs<T> in;
    KVEVICT_TRY(build_inputs(a, &in));
    kvevict::budget_request budget;
    budget.keep_tokens = a.keep_tokens;
    budget.keep_fraction = a.keep_fraction;
    typename base::plan_map::iterator it;
    KVEVICT_TRY(this->find_plan(cache_key(a, in), [&](kvevict::eviction_plan* pl) {
      kvevict::plan_options opt;
      opt.num_threads = a.num_threads;
      return ev_.plan(in, budget, pl, opt);
    }, &it));
    if (ws_.size() < it->second.workspace_bytes) {
      ws_.assign(it->second.workspace_bytes, 0);
      ++stats_.workspace_allocs;
      stats_.workspace_bytes = ws_.size();
    }
    const kvevict::eviction_plan& pl = it->second;
    select_result r;
    r.batch = in.batch();
    r.out_heads = pl.out_heads;
    r.seq = in.capacity();
    r.indptr.resize(static_cast<std::size_t>(pl.rows + 1));  // written in full by run() (uninit_allocator: no fill)
    r.indices.resize(static_cast<std::size_t>(std::max<std::int64_t>(pl.max_selected, 1)));  // [0, indptr[rows]) written
    r.positions.resize(r.indices.size());
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

  std::vector<unsigned char> ws_;  // one workspace for every cached plan; only grows
};

/// The CPU evictor of Policy with its defaults (or `base`) overridden by `overrides`.
template <class Policy>
status make_policy(const char* name, const param_map& overrides, std::unique_ptr<evictor_iface>* out,
                   typename Policy::params base = Policy::defaults(), std::shared_ptr<const void> keep_alive = nullptr) {
  return make_with<evictor_impl, Policy>(name, overrides, out, base, std::move(keep_alive));
}

}  // namespace kvevict_py
