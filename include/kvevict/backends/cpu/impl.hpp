// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU backend's implementation traits: one per stage. evictor<Policy, cpu::backend> runs a
// policy's stages through them and names no policy type itself.
//
//   cpu::scorer_impl<Scorer>       scores of one (sequence, KV head), G rows (backends/cpu/scorers/)
//   cpu::temporal_impl<Temporal>   the window-row weights c_j (any linear smoother with weight(); the
//                                  row-maximum ones, temporal::maximum / defensive, need none)
//   cpu::spatial_impl<Spatial>     smoothing of one score row (backends/cpu/smoothers.hpp)
//   cpu::budgeter_impl<Budgeter>   score-driven budgets after scoring (AdaKV; backends/cpu/select.hpp)
//   cpu::selector_impl<Selector>   the kept slots of one row (backends/cpu/select.hpp)
//   GQA reduction                  a runtime choice, not a type: backends/cpu/gqa_reduce.hpp
//
// A built-in policy specialises its trait in a file of its own; a user's policy does the same
// (examples/custom_policy.cpp). A policy without a specialisation fails to compile at the call
// site with a message naming the stage and the backend; the compiler's "required from" note
// names the policy type.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/config.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/policies/temporal.hpp"

namespace kvevict {
namespace cpu {

namespace detail {
struct head_scratch;  // per-thread scratch of the scorers (backends/cpu/scorers/common.hpp)

/// Everything the scorer of one (sequence, KV head) needs: the layer's inputs, the policy's
/// parameters and which head.
template <class Policy, class T>
struct head_job {
  const layer_inputs<T>* in;
  const typename Policy::params* p;
  std::int64_t b, h;        ///< sequence, KV head
  std::int64_t L;           ///< valid tokens
  std::int64_t w;           ///< effective window rows min(W, L)
  std::int64_t drift_topk;  ///< K for the adaptive-window drift (<= 0: not needed)
  /// Window rows per block of the window loop (detail::block_rows of the backend's
  /// score_block_bytes; the evictor sets it, and carves head_scratch for the same bytes).
  /// The default, attention_row_block, goes with head_scratch::carve's default.
  std::int64_t rows_per_block = 32;
  /// Scorers that combine heads (scorers' combines_heads, defensive_attention): rows the scorer
  /// writes beside its G score rows for scorer_impl::combine_heads, aux_rows blocks of G rows of L
  /// floats each (block k, query head g at aux + (k G + g) L), and one statistic per query head.
  /// The evictor reduces each block over the group (mean) and the statistics too. Null otherwise.
  float* aux = nullptr;
  double* aux_stat = nullptr;
};
}  // namespace detail

/// CPU scorer implementation of Scorer. A specialisation provides
///   template <class Policy, class T>
///   static void score(const detail::head_job<Policy, T>& job, detail::head_scratch& s, float* rows /* G x L */,
///                     double* drift /* G */, float* rows2 /* G x L, secondary_scores only */);
/// writing G = group_size rows of L finite fp32 scores (query-free scorers: the same row G times),
/// the adaptive-window drift of each query head when job.drift_topk > 0 (else 0), and, for
/// scorers with secondary_scores, the secondary rows. It also provides the members below; deriving
/// from scorer_impl_base (or head_scorer / window_scorer, which do) gives their defaults:
///   static bool full_projection(const params&)   the scratch holds the value projections of
///                                                every token (head_scratch::carve full_y)
///   static constexpr bool hidden_projection      the scratch holds a W_O slice (carve_projection;
///                                                with secondary_row, the selection phase's does)
///   static constexpr bool full_kv()              the scratch holds fp32 copies of all L keys and
///                                                values (default true; the built-ins: tiles)
///   static constexpr bool all_queries()          ... and all w window rows of queries (default true)
///   static constexpr int64 block_rows_max(w)     the most window rows of one logits block
///                                                (default max(1, min(w, 32)); the built-ins
///                                                without window attention say 0)
///   template <class T> static status check_layer(const params&, const layer_inputs<T>&)
///                                                plan-time check against the layer's shapes
///   static constexpr bool detects_nonfinite_keys score() reads every valid key of a head it
///                                                scores and sets head_scratch::nonfinite_keys
///                                                on a NaN or inf one: run() skips its K scan
///                                                (default false)
/// head_scorer<Impl> (backends/cpu/scorers/head_scorer.hpp) turns a simple per-head function on
/// fp32 copies into this interface; the legacy hook S::score_kv_head(params, cpu::head_inputs,
/// float*) is served that way.
template <class Scorer, class Enable = void>
struct scorer_impl {
  static_assert(kvevict::detail::dependent_false<Scorer>,
                "kvevict: this Scorer has no CPU implementation (backend cpu::backend): specialise "
                "kvevict::cpu::scorer_impl<Scorer> (see examples/custom_policy.cpp), or give the scorer a static "
                "score_kv_head(params, cpu::head_inputs, float*) hook; a built-in scorer's file must be in the CPU "
                "scorer list, kvevict/backends/cpu/scorers.hpp");
};

namespace detail {
/// scorer_impl<Scorer> computes a secondary row on its own:
///   template <class T> static void secondary_row(const layer_inputs<T>&, int64 b, int64 hq, int64 L,
///                                                int64 t0, int64 t1, detail::head_scratch&,
///                                                float* u /* t1 - t0: tokens [t0, t1) of L */);
/// (a scorer with secondary_scores that has it gets rows2 = nullptr in score(); the evictor
/// calls it per selection row, or per token range for layer_mean).
template <class Scorer, class = void>
struct has_secondary_row : std::false_type {};
template <class Scorer>
struct has_secondary_row<Scorer, std::void_t<decltype(&scorer_impl<Scorer>::template secondary_row<float>)>> : std::true_type {};
/// has_secondary_row, asked only of scorers with secondary_scores (Has).
template <bool Has, class Scorer>
struct lazy_secondary : std::false_type {};
template <class Scorer>
struct lazy_secondary<true, Scorer> : has_secondary_row<Scorer> {};
}  // namespace detail

/// Defaults of the optional members of a scorer_impl.
struct scorer_impl_base {
  template <class P>
  static bool full_projection(const P&) {
    return false;
  }
  static constexpr bool hidden_projection = false;
  /// The scratch holds fp32 copies of all L keys and values (head_scratch::options::full_kv) and
  /// all w window rows of the group's queries (all_queries), as a scorer written before the
  /// tiles may expect. The built-in scorers read K and V by tiles and say false (window_scorer,
  /// key_norm; head_scorer over a per_token Impl); a user's scorer_impl that does the same can too.
  static constexpr bool full_kv() { return true; }
  static constexpr bool all_queries() { return true; }
  /// The most window rows one block of this scorer's window loop holds (the logits block of
  /// head_scratch): every row of the window, up to attention_row_block; 0 for a scorer that
  /// computes no window attention (head_scorer, key_norm), 1 for TOVA's last row.
  static constexpr std::int64_t block_rows_max(std::int64_t w) { return w < 32 ? (w > 1 ? w : 1) : 32; }
  template <class P, class T>
  static status check_layer(const P&, const layer_inputs<T>&) {
    return {};
  }
  /// True when score() reads every valid key of each (sequence, KV head) it scores and sets
  /// head_scratch::nonfinite_keys when one is NaN or inf (with the policy's check_finite): run()
  /// then skips the K scan before scoring, rescans K only when a flag is set (to name the element:
  /// the same error) and scans the heads it did not score. The built-in key norm and
  /// window-attention scorers (window_scorer) say true; a user's scorer_impl keeps the scan.
  static constexpr bool detects_nonfinite_keys = false;
};

namespace detail {
/// scorer_impl Impl's detects_nonfinite_keys (false when Impl does not declare it).
template <class Impl, class = void>
struct impl_detects_nonfinite_keys : std::false_type {};
template <class Impl>
struct impl_detects_nonfinite_keys<Impl, std::void_t<decltype(Impl::detects_nonfinite_keys)>>
    : std::integral_constant<bool, Impl::detects_nonfinite_keys> {};
}  // namespace detail

/// CPU implementation of a temporal smoother: weights(p, w, c) writes the w row weights c_j.
/// Served for every smoother with KVEVICT_HOST_DEVICE static double weight(params, j, w)
/// (every built-in but the row-maximum temporal::maximum / defensive, below; docs/architecture.md);
/// others need a specialisation.
template <class Temporal, class Enable = void>
struct temporal_impl {
  static_assert(kvevict::detail::dependent_false<Temporal>,
                "kvevict: this temporal smoother has no CPU implementation (backend cpu::backend): give it a static "
                "double weight(const params&, int j, int w) (a linear row weighting) or specialise "
                "kvevict::cpu::temporal_impl<Temporal>");
};
template <class Temporal>
struct temporal_impl<Temporal, std::void_t<decltype(Temporal::weight(std::declval<const typename Temporal::params&>(), 0, 1))>> {
  /// c[j] = weight(p, j, w) for j < w, as fp32.
  static void weights(const typename Temporal::params& p, std::int64_t w, float* c) {
    for (std::int64_t j = 0; j < w; ++j) c[j] = static_cast<float>(Temporal::weight(p, static_cast<int>(j), static_cast<int>(w)));
  }
};
/// Row-maximum smoothers (temporal::maximum, temporal::defensive): the window loop takes the maximum
/// over the rows itself (window_scorer) and reads no weights; they are NaN, so that a hook that reads
/// them by mistake makes its scores NaN (caught by the tests) rather than silently summing.
template <class Temporal>
struct temporal_impl<Temporal, std::enable_if_t<kvevict::detail::temporal_row_max<Temporal>::value>> {
  static void weights(const typename Temporal::params&, std::int64_t w, float* c) {
    for (std::int64_t j = 0; j < w; ++j) c[j] = std::numeric_limits<float>::quiet_NaN();
  }
};

/// CPU implementation of a spatial smoother:
///   static void smooth(const params&, float* x, std::int64_t n, double drift, float* tmp,
///                      double* pre, std::int64_t* dq);
/// smooths x[0, n) in place (drift: the adaptive-window statistic; scratch tmp n floats, pre
/// n + 1 doubles, dq n int64). The legacy hook S::smooth(params, const float* in, float* out,
/// int64 n) is served by backends/cpu/smoothers.hpp.
template <class Spatial, class Enable = void>
struct spatial_impl {
  static_assert(kvevict::detail::dependent_false<Spatial>,
                "kvevict: this spatial smoother has no CPU implementation (backend cpu::backend): specialise "
                "kvevict::cpu::spatial_impl<Spatial>, or give it a static smooth(params, const float* in, float* out, "
                "int64_t n) hook");
};

/// CPU implementation of a score-driven budgeter (needs_scores = true):
///   static void score_budgets(const params&, const head_plan* plans, const float* const* rows,
///                             std::int64_t H, std::int64_t* budgets);
/// moves budget between the H rows of one sequence from their smoothed scores (the total stays).
/// Per-head and whole-layer budgeters need none: the front-end runs them (frontend/frontend.hpp).
template <class Budgeter, class Enable = void>
struct budgeter_impl {
  static_assert(kvevict::detail::dependent_false<Budgeter>,
                "kvevict: this score-driven budgeter has no CPU implementation (backend cpu::backend): specialise "
                "kvevict::cpu::budgeter_impl<Budgeter>");
};

/// CPU implementation of a selector:
///   static std::int64_t select(const params&, const head_plan&, std::int64_t budget,
///                              const float* scores /* null: nothing scored */,
///                              const float* scores2 /* secondary row or null */,
///                              std::int32_t* out, std::int32_t* idx /* L */, float* tmp /* L */);
/// writes the kept slots of one row ascending and returns their count (min(budget, L)).
template <class Selector, class Enable = void>
struct selector_impl {
  static_assert(kvevict::detail::dependent_false<Selector>,
                "kvevict: this selector has no CPU implementation (backend cpu::backend): specialise "
                "kvevict::cpu::selector_impl<Selector>");
};

}  // namespace cpu
}  // namespace kvevict
