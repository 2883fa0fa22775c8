// CriticalKV rows of the fidelity report (registry: methods.hpp; method: docs/criticalkv.md).
//
//   CriticalKV      presets::criticalkv: SnapKV-style window attention (mean over the 32-query window,
//                   avg-pool 5, GQA mean), uniform per-head budgets, two-stage selection: half of each
//                   head's candidate budget by attention, the rest by (a + 1e-4) * ||v W_O^h||_1.
//                   Compare with the SnapKV row (same budgets, attention-only selection).
//   CriticalAdaKV   presets::critical_adakv: the same with AdaKV head-wise budgets (alpha 0.2).
//                   Compare with the AdaKV row.
// CriticalKV reads the layer's full output projection (layer_inputs::wo), which the engine's
// evict_layer() passes for scorers that need it (model::wo(layer), fp32 (dim, dim) [out][in]).
#include "methods.hpp"

namespace {

const kvevict_fidelity::register_method criticalkv_row(35, kvevict_engine::policy_method<kvevict::presets::criticalkv>("CriticalKV"));
const kvevict_fidelity::register_method critical_adakv_row(36, kvevict_engine::policy_method<kvevict::presets::critical_adakv>("CriticalAdaKV"));

}  // namespace
