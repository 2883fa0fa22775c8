// kvevict Python binding: evictor_impl<Policy>, one method on the CPU backend behind the
// evictor_iface of binding.hpp, with its plan cache. Included by the method units only.
//
// Plan cache: the plan of the last call is kept with everything it depends on (storage type,
// extents, strides and presence of every view, the lengths' values, budget, layer, threads);
// a call with the same key runs the kept plan in the kept workspace (no plan(), no allocation
// but the returned selection). A different key plans again; the workspace only grows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <kvevict/cpu.hpp>

#include "binding.hpp"
#include "params.hpp"

namespace kvevict_py {

using kvevict::errc;
using kvevict::status;

template <class T>
constexpr dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, kvevict::half_t>) return dtype::f16;
  else return dtype::bf16;
}

/// `name` must have rank `rank` and type `want`.
inline status check_arg(const tensor_arg& t, const char* name, int rank, dtype want, const char* want_desc) {
  if (t.ndim != rank)
    return status::error(errc::invalid_argument, "%s has %d dimensions; kvevict needs %d (%s)", name, t.ndim, rank, want_desc);
  if (t.type != want)
    return status::error(errc::invalid_argument, "%s.dtype = %s; kvevict needs %s here (%s)", name, to_string(t.type),
                         to_string(want), want_desc);
  for (int k = 0; k < rank; ++k)
    if (t.strides[k] < 0)
      return status::error(errc::invalid_argument, "%s.stride[%d] = %lld is negative; kvevict needs non-negative strides", name, k,
                           static_cast<long long>(t.strides[k]));
  return {};
}

template <class V>
V view_of(const tensor_arg& t) {
  V v;
  v.data = static_cast<decltype(v.data)>(t.data);
  for (int k = 0; k < V::rank; ++k) {
    v.extent[k] = t.shape[k];
    v.stride[k] = t.strides[k];
  }
  return v;
}

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
  status inputs(const select_args& a, kvevict::layer_inputs<T>* in) const {
    constexpr dtype t = dtype_of<T>();
    const char* kv = "(batch, kv_heads, seq, head_dim), the cache's storage type";
    KVEVICT_TRY(check_arg(a.keys, "keys", 4, t, kv));
    in->keys = view_of<kvevict::kv_view<const T>>(a.keys);
    if (a.values.given()) {
      KVEVICT_TRY(check_arg(a.values, "values", 4, t, "(batch, kv_heads, seq, head_dim), the keys' dtype"));
      in->values = view_of<kvevict::kv_view<const T>>(a.values);
    }
    if (a.queries.given()) {
      KVEVICT_TRY(check_arg(a.queries, "queries", 4, t, "(batch, q_heads, window, head_dim), the keys' dtype"));
      in->queries = view_of<kvevict::query_view<const T>>(a.queries);
    }
    if (a.lengths.given()) {
      KVEVICT_TRY(check_arg(a.lengths, "lengths", 2, dtype::i32, "(batch, kv_heads) int32"));
      in->lengths = view_of<kvevict::lengths_view>(a.lengths);
    }
    if (a.positions.given()) {
      KVEVICT_TRY(check_arg(a.positions, "positions", 3, dtype::i32, "(batch, kv_heads, seq) int32"));
      in->positions = view_of<kvevict::positions_view>(a.positions);
    }
    if (a.wo.given()) {
      KVEVICT_TRY(check_arg(a.wo, "wo", 2, t, "(hidden, q_heads * head_dim), the keys' dtype"));
      in->wo = view_of<kvevict::strided_view<const T, 2>>(a.wo);
    }
    if (a.wo_factor.given()) {
      KVEVICT_TRY(check_arg(a.wo_factor, "wo_factor", 3, dtype::f32, "(q_heads, head_dim, head_dim) float32"));
      in->wo_factor = view_of<kvevict::strided_view<const float, 3>>(a.wo_factor);
    }
    in->layer_idx = a.layer_idx;
    in->num_layers = a.num_layers;
    return {};
  }

  /// Everything a plan depends on, flattened (pointers excluded: the same shapes with other data
  /// reuse the plan; the lengths' values included: they fix the kept count).
  template <class T>
  std::vector<std::int64_t> cache_key(const select_args& a, const kvevict::layer_inputs<T>& in) const {
    std::vector<std::int64_t> k;
    k.reserve(64);
    k.push_back(static_cast<std::int64_t>(dtype_of<T>()));
    for (const tensor_arg* t : {&a.queries, &a.keys, &a.values, &a.lengths, &a.positions, &a.wo, &a.wo_factor}) {
      k.push_back(t->given() ? t->ndim : -1);
      for (int d = 0; d < t->ndim; ++d) {
        k.push_back(t->shape[d]);
        k.push_back(t->strides[d]);
      }
    }
    std::int64_t fbits;
    std::memcpy(&fbits, &a.keep_fraction, sizeof(fbits));
    k.insert(k.end(), {a.keep_tokens, fbits, a.layer_idx, a.num_layers, a.num_threads});
    if (in.lengths.data)
      for (std::int64_t b = 0; b < in.batch(); ++b)
        for (std::int64_t h = 0; h < in.kv_heads(); ++h) k.push_back(in.length(b, h));
    return k;
  }

  template <class T>
  status run(const select_args& a, select_result* out) {
    kvevict::layer_inputs<T> in;
    KVEVICT_TRY(inputs(a, &in));
    kvevict::budget_request budget;
    budget.keep_tokens = a.keep_tokens;
    budget.keep_fraction = a.keep_fraction;
    std::vector<std::int64_t> key = cache_key(a, in);
    if (!plan_.valid || key != key_) {
      // The lengths are read by plan(): check their shape first (plan reads them before the
      // shape check otherwise could fail on a short tensor).
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
      plan_ = pl;
      key_.swap(key);
    }
    select_result r;
    r.batch = in.batch();
    r.out_heads = plan_.out_heads;
    r.seq = in.capacity();
    r.indptr.assign(static_cast<std::size_t>(plan_.rows + 1), 0);
    r.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(plan_.max_selected, 1)), 0);
    r.positions.assign(r.indices.size(), 0);
    if (a.want_scores) r.scores.assign(static_cast<std::size_t>(r.batch * r.out_heads * r.seq), 0.0f);
    kvevict::selection_view sel{r.indptr.data(), r.indices.data(), r.positions.data(), static_cast<std::int64_t>(r.indices.size())};
    const status st = ev_.run(plan_, in, sel, ws_.data(), ws_.size(), a.want_scores ? r.scores.data() : nullptr);
    if (!st.ok()) {
      plan_.valid = false;  // a failed run (non-finite data, bad lengths) plans again next time
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
  kvevict::eviction_plan plan_{};
  std::vector<std::int64_t> key_;
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
