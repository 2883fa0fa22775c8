// Threshold-selection row of the fidelity report (registry: methods.hpp; budgeters::threshold).
//
//   Threshold-mass  SnapKV's scores (window 32, mean over the window, avg-pool 5, GQA mean) with
//                   budgeters::threshold, the mass rule: each head keeps its fewest best candidates
//                   holding 90% of its candidate score mass, at least 1, at most 2B - window (a budget
//                   request of 2B per head), and the sequence at most heads x (B - window) candidates
//                   in all (the floors first, then the best passing candidates of all heads). B is the
//                   row's label (floor(f x L)), so the row never keeps more than the others; it keeps
//                   less where the heads' mass is concentrated (the report prints the kept memory). The
//                   caps come from head 0's plan (the engine's heads have one length after a prefill);
//                   under a decode schedule the schedule's budget is the per-head cap.
#include <algorithm>

#include "methods.hpp"

namespace {

using threshold_snapkv = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::mean, kvevict::spatial::avg_pool,
                                                  kvevict::budgeters::threshold>;

kvevict_engine::result evict_threshold(const kvevict_engine::layer_state& s, int window) {
    if (!s.cache) return kvevict_engine::result::failure("Threshold-mass: no cache");
    auto p = threshold_snapkv::defaults();
    p.budgeter.mode = kvevict::budgeters::threshold::rule::mass;
    p.budgeter.threshold = 0.9f;
    p.budgeter.min_candidates = 1;
    const std::int64_t L = s.cache->length(s.layer, 0), H = s.cache->n_kv_heads();
    const auto hp = kvevict::detail::plan_head(s.budget, p.selector, L, std::min<std::int64_t>(window, L));
    if (hp.pass_through) return kvevict_engine::evict_layer<threshold_snapkv>(s, p, window);
    p.budgeter.max_tokens = H * (hp.base_budget - hp.protected_count());
    kvevict_engine::layer_state s2 = s;
    // a per-head cap of 2B, below L so that no head passes through whole (B < L here)
    s2.budget = kvevict::budget_request::tokens(static_cast<std::int32_t>(std::min<std::int64_t>(2 * hp.base_budget, L - 1)));
    return kvevict_engine::evict_layer<threshold_snapkv>(s2, p, window);
}

kvevict_engine::method threshold_method() {
    kvevict_engine::method m = kvevict_engine::policy_method<threshold_snapkv>("Threshold-mass");
    m.evict = [](const kvevict_engine::layer_state& s) { return evict_threshold(s, 32); };
    m.evict_with_window = [](const kvevict_engine::layer_state& s, int w) { return evict_threshold(s, w); };
    return m;
}

const kvevict_fidelity::register_method threshold_row(40, threshold_method());

}  // namespace
