// kvevict_fidelity: the registry of report rows (methods).
//
// A row is a kvevict_engine::method: a name, the number of window queries it reads, and a function that
// evicts one layer of the engine's cache given the engine state (kvevict_engine::layer_state).
// Built-in rows: ReST-KV, SnapKV, PyramidKV, AdaKV, H2O, TOVA, StreamingLLM, KeyNorm, the random floor and the
// oracle (orders 0..99). To add rows from a separate file, create examples/fidelity/methods_<name>.cpp
// (CMake picks up every methods_*.cpp) containing, for example:
//
//   #include "methods.hpp"
//   static kvevict_fidelity::register_method lkv_row(100, kvevict_engine::policy_method<my_policy>("LKV"));
//
// or any method whose `evict` function compacts the layer itself (see oracle.hpp for a hand-made one).
// Rows are reported in increasing `order`, then registration order. See docs/fidelity.md.
#pragma once

#include "evict.hpp"
#include "oracle.hpp"
#include "random_policy.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <vector>

namespace kvevict_fidelity {

struct registered_method {
    int order = 0;
    kvevict_engine::method m;
};

/// The global list of extra rows (function-local static: safe to use from static initialisers).
inline std::vector<registered_method>& method_registry() {
    static std::vector<registered_method> r;
    return r;
}

/// Registers a row at static-initialisation time: `static register_method r(order, method);`.
struct register_method {
    register_method(int order, kvevict_engine::method m) { method_registry().push_back({order, std::move(m)}); }
};

/// The built-in rows, papers' default parameters, window 32 (H2O: every prompt query).
inline std::vector<registered_method> builtin_methods() {
    using namespace kvevict;
    using kvevict_engine::policy_method;
    std::vector<registered_method> v;
    v.push_back({0, policy_method<presets::restkv>("ReST-KV")});
    v.push_back({10, policy_method<presets::snapkv>("SnapKV")});
    v.push_back({20, policy_method<presets::pyramidkv>("PyramidKV")});
    v.push_back({30, policy_method<presets::adakv>("AdaKV")});
    {  // AdaKV as its authors run it: window 32, max-pool kernel 7, alpha 0.2 (GQA-native here: mean over
       // the group; the per-query-head form on a cache repeated to q_heads needs issue 16 item 2)
        using adakv_mp7 = eviction_policy<scorers::attention_weight, temporal::sum, spatial::max_pool, budgeters::adakv>;
        auto p = adakv_mp7::defaults();
        p.spatial.kernel = 7;
        p.budgeter.alpha = 0.2f;
        v.push_back({31, policy_method<adakv_mp7>("AdaKV-mp7", p)});
    }
    v.push_back({40, policy_method<presets::h2o>("H2O", presets::h2o::defaults(), -1)});
    v.push_back({50, policy_method<presets::tova>("TOVA")});
    v.push_back({60, policy_method<presets::streaming_llm>("StreamingLLM", presets::streaming_llm::defaults(), 0)});
    v.push_back({65, policy_method<presets::key_norm>("KeyNorm", presets::key_norm::defaults(), 0)});  // query-free: no window
    v.push_back({70, random_method("Random")});
    v.push_back({90, window_oracle_method("Oracle-W")});  // the window's error after W_O, window kept
    v.push_back({91, oracle_method("Oracle-next")});     // the next query's error before W_O (look-ahead)
    return v;
}

/// ReST-KV ablation rows (kvevict_fidelity --ablations), one change each from the published defaults,
/// along the paper's ablation axes. Diagnostics only: the report's ReST-KV row keeps the defaults.
inline std::vector<registered_method> restkv_ablation_methods() {
    using namespace kvevict;
    using kvevict_engine::policy_method;
    using R = presets::restkv;
    using lor = scorers::output_reconstruction;
    std::vector<registered_method> v;
    auto p = R::defaults();
    p.scorer.include_window_in_output = true;
    v.push_back({1, policy_method<R>("ReST-KV+winz", p)});  // window tokens' share inside z_bar
    p = R::defaults();
    p.scorer.use_wo = false;
    v.push_back({2, policy_method<R>("ReST-KV-noWO", p)});  // value space: R = I
    p = R::defaults();
    p.scorer.aggregation = lor::mode::before;
    v.push_back({3, policy_method<R>("ReST-KV-before", p)});  // the paper's Eq. 7 per window row, then EMA
    using R_mean = eviction_policy<lor, temporal::mean, spatial::adaptive_window>;
    v.push_back({4, policy_method<R_mean>("ReST-KV-mean", R_mean::defaults())});  // mean over window rows, no EMA
    using R_pool = eviction_policy<lor, temporal::ema, spatial::avg_pool>;
    v.push_back({5, policy_method<R_pool>("ReST-KV-pool", R_pool::defaults())});  // SnapKV's pooling instead of AWS
    return v;
}

/// Built-in rows followed by the registered ones, sorted by order (stable).
/// `ablations`: also the ReST-KV ablation rows.
inline std::vector<kvevict_engine::method> report_methods(bool ablations = false) {
    std::vector<registered_method> all = builtin_methods();
    if (ablations) {
        const std::vector<registered_method> a = restkv_ablation_methods();
        all.insert(all.end(), a.begin(), a.end());
    }
    const auto& extra = method_registry();
    all.insert(all.end(), extra.begin(), extra.end());
    std::stable_sort(all.begin(), all.end(), [](const registered_method& a, const registered_method& b) { return a.order < b.order; });
    std::vector<kvevict_engine::method> out;
    for (auto& r : all) out.push_back(std::move(r.m));
    return out;
}

}  // namespace kvevict_fidelity
