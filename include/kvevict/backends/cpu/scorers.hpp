// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU implementations of the built-in scorers, one file each under backends/cpu/scorers/
// (cpu::scorer_impl<Scorer>, backends/cpu/impl.hpp): this is the CPU scorer list (a new
// built-in adds its file here). score_kv_head below is a convenience for tests and benchmarks;
// the evictor calls the trait. Output of a scorer for one (sequence, KV head): G score rows (one per query
// head of the GQA group; query-free scorers write the same row G times) of length L, fp32,
// finite; plus, on request, the adaptive-window drift statistic of each query head.
#pragma once

#include <type_traits>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/scorers/accumulated_attention.hpp"
#include "kvevict/backends/cpu/scorers/attention_value_norm.hpp"
#include "kvevict/backends/cpu/scorers/attention_weight.hpp"
#include "kvevict/backends/cpu/scorers/common.hpp"
#include "kvevict/backends/cpu/scorers/defensive_attention.hpp"
#include "kvevict/backends/cpu/scorers/head_scorer.hpp"
#include "kvevict/backends/cpu/scorers/key_norm.hpp"
#include "kvevict/backends/cpu/scorers/last_query.hpp"
#include "kvevict/backends/cpu/scorers/learned_mlp.hpp"
#include "kvevict/backends/cpu/scorers/output_reconstruction.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// Scores of one (sequence, KV head) by cpu::scorer_impl<Scorer>: `rows` G x L primary scores,
/// `drift` G adaptive-window statistics, and for scorers with secondary_scores `rows2` G x L
/// secondary scores (else unused). Temporal must be the policy's temporal smoother.
/// Inputs are the caller's to check: a scorer with detects_nonfinite_keys (key norm, the window
/// scorers) that meets a NaN or inf key with the policy's check_finite sets s.nonfinite_keys
/// (and a window scorer returns zero rows); run() reads that flag and reports the element.
template <class Scorer, class Temporal, class Policy, class T>
void score_kv_head(const head_job<Policy, T>& job, head_scratch& s, float* rows /* G x L */, double* drift /* G */,
                   float* rows2 = nullptr /* G x L */) {
  static_assert(std::is_same<Scorer, typename Policy::scorer>::value &&
                    std::is_same<Temporal, typename Policy::temporal_smoother>::value,
                "kvevict: score_kv_head<Scorer, Temporal> takes the policy's own scorer and temporal smoother");
  scorer_impl<Scorer>::template score<Policy, T>(job, s, rows, drift, rows2);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
