// IWYU pragma: private, include "kvevict/cpu.hpp"
// head_scorer<Impl>: the simple form of a CPU scorer implementation. The driver stages one
// (sequence, KV head) as fp32 row-major copies (cpu::head_inputs) and calls
//   Impl::score_head(const typename Scorer::params&, const cpu::head_inputs&, float* out /* L */);
// the row is saturated to the finite fp32 range and given to every query head of the GQA group.
// Memory: the copies take 2 L d floats per thread (the whole head), unless Impl declares
//   static constexpr bool per_token = true;
// (each token's score depends on that token's key and value only, as learned_mlp's and the
// value_norm example's do): score_head is then called on tiles of attention_key_tile tokens
// (head_inputs::length = the tile's tokens, keys/values the tile's rows, queries as usual) and
// the copies take 2 x attention_key_tile x d floats whatever L.
// A user's scorer specialises cpu::scorer_impl<Scorer> as `: cpu::head_scorer<its impl>` (see
// examples/custom_policy.cpp); a scorer with the legacy hook S::score_kv_head(params,
// cpu::head_inputs, float*) is served the same way without a specialisation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvevict/backends/cpu/scorers/common.hpp"

namespace kvevict {
namespace cpu {

namespace detail {
/// A temporal smoother with a linear row weighting weight(params, j, w) (every built-in but the
/// row-maximum ones; with those a head scorer sees temporal_weights = null).
template <class Tm, class = void>
struct is_linear_temporal : std::false_type {};
template <class Tm>
struct is_linear_temporal<Tm, std::void_t<decltype(Tm::weight(std::declval<const typename Tm::params&>(), 0, 1))>> : std::true_type {};

/// A scorer that checks its tables against a layer's shape declares
///   static status check_layer(const params&, int64 kv_heads, int64 head_dim, int layer_idx, int num_layers);
template <class S, class = void>
struct has_check_layer : std::false_type {};
template <class S>
struct has_check_layer<S, std::void_t<decltype(S::check_layer(std::declval<const typename S::params&>(), std::int64_t{},
                                                               std::int64_t{}, int{}, int{}))>> : std::true_type {};
}  // namespace detail

namespace detail {
/// Impl declares `static constexpr bool per_token = true` (head_scorer may call it on tiles).
template <class Impl, class = void>
struct is_per_token : std::false_type {};
template <class Impl>
struct is_per_token<Impl, std::enable_if_t<Impl::per_token>> : std::true_type {};
}  // namespace detail

/// See the file comment. Adds no drift (a head_scorer computes no window attention: a policy
/// that pairs it with spatial::adaptive_window fails to compile unless the scorer declares
/// window_attention, and then gets drift 0).
template <class Impl>
struct head_scorer : scorer_impl_base {
  /// The scratch holds fp32 copies of all L keys and values (head_scratch::carve full_kv),
  /// unless Impl scores tokens one by one (per_token).
  static constexpr bool full_kv() { return !detail::is_per_token<Impl>::value; }
  /// head_inputs::queries holds the whole window of the group.
  static constexpr bool all_queries() { return true; }
  /// No window attention: no logits block.
  static constexpr std::int64_t block_rows_max(std::int64_t) { return 0; }

  template <class Policy, class T>
  static void score(const detail::head_job<Policy, T>& job, detail::head_scratch& s, float* rows /* G x L */, double* drift /* G */,
                    float* /*rows2*/ = nullptr) {
    using namespace detail;
    const layer_inputs<T>& in = *job.in;
    const auto& P = *job.p;
    const std::int64_t L = job.L, d = in.head_dim(), b = job.b, h = job.h;
    const std::int64_t G = in.queries.data ? in.group_size() : 1;
    head_inputs hi;
    hi.batch_index = b;
    hi.kv_head = h;
    hi.length = L;
    hi.head_dim = d;
    hi.group_size = G;
    hi.window = in.queries.data ? job.w : 0;
    hi.layer_idx = in.layer_idx;
    if (in.queries.data) {
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < job.w; ++j) {
          const std::int64_t qrow = in.window() - job.w + j;
          for (std::int64_t c = 0; c < d; ++c)
            s.qbuf[(g * job.w + j) * d + c] = to_float(in.queries(b, h * G + g, qrow, c));
        }
      hi.queries = s.qbuf;
      if constexpr (detail::is_linear_temporal<typename Policy::temporal_smoother>::value) {
        temporal_impl<typename Policy::temporal_smoother>::weights(P.temporal, job.w, s.st_c);
        hi.temporal_weights = s.st_c;
      }
    }
    // Contiguous fp32 copies of the keys and values: all L tokens at once, or tile by tile for a
    // per_token Impl.
    const detail::row_source<T> ks = detail::head_rows(in, in.keys, b, h), vs = detail::head_rows(in, in.values, b, h);
    const std::int64_t tile = full_kv() ? std::max<std::int64_t>(L, 1) : attention_key_tile;
    std::int64_t n0 = 0;
    do {  // at least once: an empty head is scored too (length 0), as before
      const std::int64_t nt = std::min(tile, L - n0);
      ks.copy_rows(n0, nt, s.kbuf);
      hi.keys = s.kbuf;
      if (vs.base) {
        vs.copy_rows(n0, nt, s.vbuf);
        hi.values = s.vbuf;
      }
      hi.length = nt;
      Impl::score_head(P.scorer, hi, rows + n0);
      n0 += tile;
    } while (n0 < L);
    for (std::int64_t n = 0; n < L; ++n) rows[n] = saturate(rows[n]);
    for (std::int64_t g = 1; g < G; ++g) std::copy(rows, rows + L, rows + g * L);
    for (std::int64_t g = 0; g < G; ++g) drift[g] = 0.0;
  }
};

namespace detail {

/// Detects a user scorer's legacy CPU hook:
///   static void score_kv_head(const params&, const cpu::head_inputs&, float* out /* L */);
template <class S, class = void>
struct has_cpu_hook : std::false_type {};
template <class S>
struct has_cpu_hook<S, std::void_t<decltype(S::score_kv_head(std::declval<const typename S::params&>(),
                                                             std::declval<const head_inputs&>(),
                                                             std::declval<float*>()))>> : std::true_type {};

/// head_scorer's Impl for a scorer with the legacy hook.
template <class S>
struct legacy_hook {
  static void score_head(const typename S::params& p, const head_inputs& hi, float* out) { S::score_kv_head(p, hi, out); }
};

}  // namespace detail


/// A scorer with the legacy hook needs no specialisation (its policy-level check_layer, if any,
/// runs at plan time as every scorer's does).
template <class S>
struct scorer_impl<S, std::enable_if_t<detail::has_cpu_hook<S>::value>> : head_scorer<detail::legacy_hook<S>> {};

}  // namespace cpu
}  // namespace kvevict
