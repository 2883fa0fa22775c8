// Named presets, all in this one file under one scheme (presets::<method>): the published
// configurations of ReST-KV, the baselines and LKV, as eviction_policy types whose defaults()
// return the papers' settings.
//
//   using P = kvevict::presets::restkv;
//   auto params = P::defaults();            // alpha 0.3, beta 2000, k_min 5, "after" LOR
//   params.spatial.k_min = 21;              // the RULER setting
#pragma once

#include "kvevict/policies/policy.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace presets {

/// ReST-KV (An et al., ICLR 2026): output-reconstruction score ("after" aggregation, W_O
/// factor), EMA alpha 0.3 over a 32-query window, adaptive-window smoothing (beta 2000,
/// k_min 5, reference-exact shift), uniform per-head budget, window kept. GQA: mean over the
/// group (use gqa_reduction::per_query_head for the reference code's per-query-head caches).
struct restkv : eviction_policy<scorers::output_reconstruction, temporal::ema, spatial::adaptive_window> {};

/// SnapKV (Li et al. 2024): window-attention sum, avg-pool width 5, uniform budget, window kept.
struct snapkv : eviction_policy<scorers::attention_weight, temporal::sum, spatial::avg_pool> {};

/// PyramidKV (Cai et al. 2024): SnapKV scores with the pyramid per-layer schedule, beta 20.
struct pyramidkv : eviction_policy<scorers::attention_weight, temporal::sum, spatial::avg_pool, budgeters::pyramid> {};

/// AdaKV (Feng et al. 2024): SnapKV scores with head-wise adaptive budgets, alpha 0.2 (GQA).
struct adakv : eviction_policy<scorers::attention_weight, temporal::sum, spatial::avg_pool, budgeters::adakv> {};

/// AdaKV as its authors publish and run it (Feng et al. 2024, reference code AdaKV/adaptive_snapkv):
/// window 32, max-pool kernel 7 (not SnapKV's avg-pool 5), alpha 0.2, the reference's per-head budget
/// rounding (budgeters::adakv::params::exact_total = false: the layer keeps T tokens give or take the
/// rounding, not exactly T), one selection per query head
/// (gqa_reduction::per_query_head: the reference repeats K/V to q_heads heads before eviction, so the
/// compacted cache has q_heads heads, G times a GQA-native cache). The selection has q_heads rows per
/// sequence; an engine compacts it into a cache that holds a copy of each KV head per query head. On such
/// a repeated cache (G = 1) the preset equals the same policy with any GQA reduction. `adakv` is the
/// GQA-native form (mean over the group, avg-pool 5).
struct adakv_published : eviction_policy<scorers::attention_weight, temporal::sum, spatial::max_pool, budgeters::adakv> {
  static params defaults() {
    params p;
    p.spatial.kernel = 7;
    p.budgeter.alpha = 0.2f;
    p.budgeter.exact_total = false;  // the reference's per-head rounding (budgeters::adakv)
    p.gqa = gqa_reduction::per_query_head;
    return p;
  }
};

/// CriticalKV (Feng et al. 2025, arXiv 2502.03805) on SnapKV scores, uniform per-head budgets (the
/// reference's CriticalKVPress wrapping SnapKV): window attention averaged over the window
/// (temporal::mean, as the reference's SnapKV scorer, so eps is independent of the window length),
/// avg-pool width 5, GQA mean; selection in two stages: half of each head's candidate budget by
/// attention, the rest by (a + 1e-4) * ||v W_O^h||_1. Needs layer_inputs::wo (the layer's output
/// projection, hidden x q_heads * head_dim). Window kept. Uniform budgets make it the
/// like-for-like counterpart of `snapkv`: the two differ only in the value-norm stage.
struct criticalkv : eviction_policy<scorers::attention_value_norm, temporal::mean, spatial::avg_pool, budgeters::uniform,
                                    selectors::two_stage> {};

/// CriticalAdaKV (Feng et al. 2025): `criticalkv` with AdaKV head-wise budgets (alpha 0.2, the
/// reference's alpha_safeguard), allocated on the pooled attention score as in the reference; each
/// head's budget then goes through the two stages. The counterpart of `adakv`.
struct critical_adakv : eviction_policy<scorers::attention_value_norm, temporal::mean, spatial::avg_pool, budgeters::adakv,
                                        selectors::two_stage> {};

/// DefensiveKV (Feng et al., "Taming the Fragility of KV Cache Eviction in LLM Inference", ICLR 2026,
/// arXiv 2510.13334; the authors' EfficientDefensiveKVPress): window 32, avg-pool 5 per window row,
/// defensive aggregation (the maximum over the window rows and the GQA group, clamped below at its
/// mean), CriticalKV's projected value norms normalised over the KV heads, the highest-mass tokens up
/// to 0.9 minus the window share forced in, and one flattened top-k over the heads of the layer
/// (AdaKV with alpha 0: no per-head safeguard). Window kept. Needs layer_inputs::wo.
/// scorers::defensive_attention documents each step. CPU backend.
struct defensivekv : eviction_policy<scorers::defensive_attention, temporal::mean, spatial::none, budgeters::adakv> {
  static params defaults() {
    params p;
    p.budgeter.alpha = 0.0f;
    return p;
  }
};

/// H2O (Zhang et al. 2023): accumulated attention of all prompt queries (pass W = L), half of
/// the budget heavy hitters and half recent tokens.
struct h2o : eviction_policy<scorers::accumulated_attention, temporal::sum, spatial::none> {
  static params defaults() {
    params p;
    p.selector.recent_share = 0.5f;
    return p;
  }
};

/// TOVA (Oren et al. 2024): attention of the last query averaged over all heads of the layer;
/// one token set per layer; nothing protected by rule.
struct tova : eviction_policy<scorers::last_query, temporal::last, spatial::none> {
  static params defaults() {
    params p;
    p.gqa = gqa_reduction::layer_mean;
    p.selector.num_recent = 0;
    return p;
  }
};

/// StreamingLLM (Xiao et al. 2023): 4 sink tokens + the most recent tokens, no scoring.
struct streaming_llm : eviction_policy<scorers::none, temporal::last, spatial::none> {
  static params defaults() {
    params p;
    p.selector.num_sink = 4;
    p.selector.recent_share = 1.0f;
    return p;
  }
};

/// Key norm (Devoto et al. 2024): keep low-norm keys, query-free; window kept by rule when
/// window queries are given (none are needed).
struct key_norm : eviction_policy<scorers::key_norm, temporal::last, spatial::none> {};

}  // namespace presets

/// LKV compositions (spec lkv.md; paper arXiv 2605.06676; docs/lkv.md). Backend-neutral: their
/// parameters come from a trained artifact, through kvevict/backends/cpu/learned.hpp
/// (lkv::full_params(io::lkv_artifact)) or kvevict/backends/cuda/learned.cuh
/// (lkv::full_params(cuda::lkv_device_tables)).
namespace lkv {

/// Full LKV: learned budgets + learned scorer, no forced sinks or window (num_recent = 0).
struct full : eviction_policy<scorers::learned_mlp, temporal::last, spatial::none, budgeters::headwise_learned> {
  static params defaults() {
    params p;
    p.selector.num_recent = 0;
    p.check_finite = true;
    return p;
  }
};

/// Uniform budgets + learned scorer (ablation of LKV-H), no window.
struct uniform_budgets : eviction_policy<scorers::learned_mlp, temporal::last, spatial::none, budgeters::uniform> {
  static params defaults() {
    params p;
    p.selector.num_recent = 0;
    return p;
  }
};

/// Learned budgets + the ReST-KV scorer and smoothers (published ReST-KV settings; the window
/// stays protected as in ReST-KV: each head first gets its window, the rest is water-filled).
struct budgets_restkv
    : eviction_policy<scorers::output_reconstruction, temporal::ema, spatial::adaptive_window, budgeters::headwise_learned> {};

/// Learned budgets + SnapKV's attention-weight scores (sum over the window, avg-pool 5, window kept).
struct budgets_attention : eviction_policy<scorers::attention_weight, temporal::sum, spatial::avg_pool, budgeters::headwise_learned> {};

}  // namespace lkv

namespace presets {
/// The LKV compositions under the presets' naming scheme (the same types as lkv::*): every
/// published method and every LKV variant is presets::<name>. Their parameters come from an
/// artifact (lkv::full_params(...), backends/cpu/learned.hpp or backends/cuda/learned.cuh).
using lkv = kvevict::lkv::full;
using lkv_uniform_budgets = kvevict::lkv::uniform_budgets;
using lkv_budgets_restkv = kvevict::lkv::budgets_restkv;
using lkv_budgets_attention = kvevict::lkv::budgets_attention;
}  // namespace presets
}  // namespace kvevict
