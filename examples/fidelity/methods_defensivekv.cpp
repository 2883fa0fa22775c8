// DefensiveKV rows of the fidelity report (registry: methods.hpp; method: docs/defensivekv.md).
//
//   DefensiveKV   presets::defensivekv (Feng et al., ICLR 2026, arXiv 2510.13334): window 32, avg-pool 5
//                 per window row, the maximum over the window and the GQA group clamped at its mean,
//                 value norms ||v W_O^h||_1 normalised over the heads, the tokens holding 0.9 minus the
//                 window share of the attention forced in, one flattened top-k over the layer's heads.
//                 GQA-native (one kept set per KV head). Compare with AdaKV-pub and CriticalAdaKV.
//   SnapKV-def    SnapKV with DefensiveKV's aggregation alone (temporal::defensive, gqa max): the maximum
//                 over the window and the group floored at its mean, then avg-pool 5, uniform budgets.
//   Layer-DefensiveKV the same scores with one flattened top-k over every layer and head of the sequence
//                 (kvevict::layer_wide_topk; kvevict_engine::layer_wide_method): T = layers x heads x
//                 (B - window) candidates in all, so per-head budgets differ between layers.
// It reads the layer's full output projection (layer_inputs::wo), which the engine passes for scorers
// that need it.
#include "methods.hpp"

namespace {

const kvevict_fidelity::register_method defensivekv_row(38, kvevict_engine::policy_method<kvevict::presets::defensivekv>("DefensiveKV"));
const kvevict_fidelity::register_method layer_defensivekv_row(39, kvevict_engine::layer_wide_method<kvevict::presets::defensivekv>("Layer-DefensiveKV"));

}  // namespace

namespace {

/// SnapKV with DefensiveKV's aggregation alone (temporal::defensive: the maximum over the window rows,
/// the group's maximum, floored at the mean; then SnapKV's avg-pool 5 and uniform budgets): what the
/// defensive aggregation buys without the value norms, the mass stage and the head-wise budgets.
struct snapkv_defensive : kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::defensive,
                                                   kvevict::spatial::avg_pool> {
  static params defaults() {
    params p;
    p.gqa = kvevict::gqa_reduction::max;
    return p;
  }
};

const kvevict_fidelity::register_method snapkv_def_row(37, kvevict_engine::policy_method<snapkv_defensive>("SnapKV-def"));

}  // namespace
