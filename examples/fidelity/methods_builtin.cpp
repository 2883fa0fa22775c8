// kvevict_fidelity / kvevict_decoding: the built-in report rows (declared in methods.hpp). One
// translation unit instantiates the evictor of every preset for both report programs.
#include "methods.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <vector>

namespace kvevict_fidelity {

/// SnapKV's scores with max pooling (the kernel is set by the row).
using snapkv_mp7 = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::sum, kvevict::spatial::max_pool>;

std::vector<registered_method> builtin_methods(bool full) {
    using namespace kvevict;
    using kvevict_engine::policy_method;
    std::vector<registered_method> v;
    // Per-query-head rows ("-pqh", and AdaKV-pub): the published configurations as their reference code runs
    // them, on a cache repeated to q_heads heads (method::repeat_kv: G times the KV bytes), one selection per
    // query head. Each sits right after its GQA-native row.
    auto pqh = [](auto p) {
        p.gqa = gqa_reduction::per_query_head;
        return p;
    };
    v.push_back({0, policy_method<presets::restkv>("ReST-KV")});
    v.push_back({0, policy_method<presets::restkv>("ReST-KV-pqh", pqh(presets::restkv::defaults()))});
    v.push_back({10, policy_method<presets::snapkv>("SnapKV")});
    v.push_back({10, policy_method<presets::snapkv>("SnapKV-pqh", pqh(presets::snapkv::defaults()))});
    {  // SnapKV as its reference code is run in the AdaKV authors' comparisons: window 32, max-pool 7, per query head
        auto p = snapkv_mp7::defaults();
        p.spatial.kernel = 7;
        p.gqa = gqa_reduction::per_query_head;
        v.push_back({10, policy_method<snapkv_mp7>("SnapKV-mp7-pqh", p)});
    }
    v.push_back({20, policy_method<presets::pyramidkv>("PyramidKV")});
    v.push_back({30, policy_method<presets::adakv>("AdaKV")});
    {  // AdaKV's published configuration (window 32, max-pool 7, alpha 0.2): GQA-native (mean over the group)
       // as "AdaKV-mp7", and as published, per query head on a repeated cache, as "AdaKV-pub"
        auto p = presets::adakv_published::defaults();
        p.gqa = gqa_reduction::mean;
        v.push_back({31, policy_method<presets::adakv_published>("AdaKV-mp7", p)});
        v.push_back({31, policy_method<presets::adakv_published>("AdaKV-pub")});
    }
    v.push_back({40, policy_method<presets::h2o>("H2O", presets::h2o::defaults(), -1)});
    v.push_back({50, policy_method<presets::tova>("TOVA")});
    v.push_back({60, policy_method<presets::streaming_llm>("StreamingLLM", presets::streaming_llm::defaults(), 0)});
    v.push_back({65, policy_method<presets::key_norm>("KeyNorm", presets::key_norm::defaults(), 0)});  // query-free: no window
    v.push_back({70, random_method("Random")});
    v.push_back({90, window_oracle_method("Greedy-W")});  // the window's error after W_O, window kept
    if (full)  // the same per query head (repeated cache): a quarter of the report's time, in --full only
        v.push_back({90, window_oracle_method("Greedy-W-pqh", 32, true)});
    v.push_back({91, oracle_method("Greedy-next")});     // the next query's error before W_O (look-ahead)
    return v;
}

std::vector<registered_method> restkv_ablation_methods() {
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

std::vector<kvevict_engine::method> report_methods(bool ablations, bool full) {
    std::vector<registered_method> all = builtin_methods(full);
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
