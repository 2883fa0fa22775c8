// kvevict_fidelity: the random-selection floor, written as a custom kvevict policy.
//
// random_scorer is a user-defined scorer (kvevict/backends/cpu/scorers.hpp, "user scorer CPU hook"):
// it gives every token of a head a pseudo-random score, so the top-k selector keeps a uniformly random
// subset of the evictable tokens (protected tokens - the window - are kept by the selector's rule, as
// for SnapKV). Scores depend only on (seed, KV head, head length, slot): the same request gives the
// same selection whatever ran before, and different layers differ when the caller mixes the layer
// into the seed (random_method() does).
#pragma once

#include "evict.hpp"

#include <kvevict/cpu.hpp>

#include <cstdint>
#include <string>

namespace kvevict_fidelity {

/// Seeded random scorer: s[n] = uniform [0, 1) from splitmix64(seed, kv_head, length, n).
/// No queries, values or W_O are read.
struct random_scorer {
    struct params {
        std::uint64_t seed = 0x5eed;
    };
    static constexpr const char* name = "random";
    static constexpr bool needs_queries = false;
    static constexpr bool needs_values = false;
    static constexpr bool window_attention = false;
    static constexpr bool has_scores = true;
    static bool needs_wo_factor(const params&) { return false; }
    static kvevict::status check(const params&) { return {}; }

    static std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
        x += 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        return x ^ (x >> 31);
    }
    /// CPU hook: out[n] for n < in.length.
    static void score_kv_head(const params& p, const kvevict::cpu::head_inputs& in, float* out) {
        const std::uint64_t base = mix(p.seed ^ mix(std::uint64_t(in.batch_index) * 1315423911ull + std::uint64_t(in.kv_head)) ^
                                       mix(std::uint64_t(in.length) << 20));
        for (std::int64_t n = 0; n < in.length; ++n) out[n] = float(mix(base + std::uint64_t(n)) >> 40) * (1.0f / 16777216.0f);
    }
};

/// The random floor: random scores, uniform budget, window kept (selector default).
struct random_policy : kvevict::eviction_policy<random_scorer, kvevict::temporal::last, kvevict::spatial::none> {};

/// Registry row for the random floor; layer l uses seed `seed` mixed with l.
inline kvevict_engine::method random_method(std::string name = "Random", std::uint64_t seed = 0x5eed, int window = 32) {
    kvevict_engine::method m;
    m.name = std::move(name);
    m.window = window;
    auto run = [seed](const kvevict_engine::layer_state& s, int w) {
        random_policy::params p = random_policy::defaults();
        p.scorer.seed = random_scorer::mix(seed + std::uint64_t(s.layer) * 0x632be59bd9b4e019ull);
        return kvevict_engine::evict_layer<random_policy>(s, p, w);
    };
    m.evict = [run, window](const kvevict_engine::layer_state& s) { return run(s, window); };
    m.evict_with_window = run;
    m.plan = [](const kvevict::budget_request& req, std::int64_t length, int w) {
        return kvevict::detail::plan_head(req, random_policy::defaults().selector, length, std::min<std::int64_t>(w, length));
    };
    return m;
}

}  // namespace kvevict_fidelity
