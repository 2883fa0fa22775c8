// Eviction inside the engine (examples/engine/evict.hpp) and the fidelity report's oracle and random
// floor (examples/fidelity). Model-dependent tests print a skip message when the model folder is missing.
#include <doctest/doctest.h>

#include "../../examples/engine/evict.hpp"
#include "../../examples/engine/model_path.hpp"
#include "../../examples/engine/tokenizer.hpp"
#include "../../examples/fidelity/oracle.hpp"
#include "../../examples/fidelity/random_policy.hpp"
#include "engine_fixture.hpp"

#include <kvevict/backends/cpu/learned.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <set>

using namespace kvevict_engine;

namespace {

using kvevict_engine_test::fx;

/// Tokens of `chars` characters of sherlock.txt starting at `offset` (fallback text when missing).
std::vector<int> text_tokens(size_t offset, size_t chars) {
    std::ifstream f(resolve_model_dir() + "/../../data/text/sherlock.txt", std::ios::binary);
    std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    if (text.size() < offset + chars) {
        text.clear();
        while (text.size() < offset + chars) text += "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals. ";
    }
    return fx().tok.encode(text.substr(offset, chars));
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    float d = 0;
    for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
    return d;
}

layer_state state_for(kv_cache& cache, int layer, const query_log* log, kvevict::budget_request b) {
    layer_state s;
    s.m = &fx().m;
    s.wo = &fx().wo;
    s.cache = &cache;
    s.layer = layer;
    s.queries = log;
    s.budget = b;
    return s;
}

/// Greedy decode of `steps` tokens through a session, returning the tokens and the last logits.
std::vector<int> run_request(eviction_session& s, const std::vector<int>& prompt, int steps, std::vector<float>& logits) {
    std::vector<int> out;
    REQUIRE_MESSAGE(s.prefill(prompt, logits), "prefill");
    for (int i = 0; i < steps; ++i) {
        const int t = argmax(logits);
        out.push_back(t);
        const result r = s.decode(t, logits);
        REQUIRE_MESSAGE(r, r.error);
    }
    return out;
}

}  // namespace

TEST_CASE("evict_layer: kept rows are original rows at their positions; window kept; next_position unchanged") {
    REQUIRE_MODEL_OR_SKIP();
    const config& c = fx().m.cfg;
    const std::vector<int> prompt = text_tokens(0, 220);
    const int n = int(prompt.size()), budget = 48, layer = 2;
    REQUIRE(n > budget + 32);
    kv_cache cache(c, n);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(fx().m, cache, prompt, logits, fo));
    const kv_cache before = cache;
    std::int64_t kept = 0;
    const result r = evict_layer<kvevict::presets::snapkv>(state_for(cache, layer, &log, kvevict::budget_request::tokens(budget)),
                                                          kvevict::presets::snapkv::defaults(), 32, &kept);
    REQUIRE_MESSAGE(r, r.error);
    CAPTURE(n);
    CHECK(kept == budget * c.n_kv_heads);
    CHECK(cache.next_position == n);
    for (int h = 0; h < c.n_kv_heads; ++h) {
        REQUIRE(cache.length(layer, h) == budget);
        std::set<int> pos;
        for (int s = 0; s < budget; ++s) {
            const int p = cache.position(layer, h, s);
            CHECK((s == 0 || p > cache.position(layer, h, s - 1)));
            pos.insert(p);
            // before eviction slot == position: the kept row must be that original row, bit for bit
            CHECK(std::equal(cache.key(layer, h, s), cache.key(layer, h, s) + c.head_dim(), before.key(layer, h, p)));
            CHECK(std::equal(cache.value(layer, h, s), cache.value(layer, h, s) + c.head_dim(), before.value(layer, h, p)));
        }
        for (int p = n - 32; p < n; ++p) CHECK(pos.count(p) == 1);  // the observation window is protected
    }
    for (int l = 0; l < c.n_layers; ++l)  // other layers untouched
        if (l != layer)
            for (int h = 0; h < c.n_kv_heads; ++h) CHECK(cache.length(l, h) == n);
}

TEST_CASE("evict_layer on every layer, then decoding, equals the full cache with the evicted slots masked") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const std::vector<int> prompt = text_tokens(5000, 300);
    const int n = int(prompt.size()), steps = 5;
    kv_cache full(c, n + steps);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(m, full, prompt, logits, fo));
    kv_cache ev = full, plain = full;
    for (int l = 0; l < c.n_layers; ++l) {
        const result r = evict_layer<kvevict::presets::restkv>(state_for(ev, l, &log, kvevict::budget_request::fraction(0.3)),
                                                              kvevict::presets::restkv::defaults());
        REQUIRE_MESSAGE(r, r.error);
    }
    std::vector<std::vector<std::vector<char>>> kept(size_t(c.n_layers), std::vector<std::vector<char>>(size_t(c.n_kv_heads), std::vector<char>(size_t(n), 0)));
    int evicted_total = 0;
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h) {
            for (int s = 0; s < ev.length(l, h); ++s) kept[size_t(l)][size_t(h)][size_t(ev.position(l, h, s))] = 1;
            evicted_total += n - ev.length(l, h);
        }
    CHECK(evicted_total > 0);
    forward_options masked;
    masked.slot_visible = [&](int l, int h, int s) { return s >= n || kept[size_t(l)][size_t(h)][size_t(s)] != 0; };
    std::vector<float> lf, le, lp;
    int t = argmax(logits);
    float worst = 0, effect = 0;
    for (int i = 0; i < steps; ++i) {
        REQUIRE(forward(m, full, t, lf, masked));
        REQUIRE(forward(m, ev, t, le));
        REQUIRE(forward(m, plain, t, lp));
        worst = std::max(worst, max_abs_diff(lf, le));
        effect = std::max(effect, max_abs_diff(lp, le));
        t = argmax(le);
    }
    INFO("evicted slots " << evicted_total << ", eviction effect on logits " << effect);
    CHECK(worst < 1e-4f);
    CHECK(effect > 1e-3f);  // not vacuous
}

TEST_CASE("errors: bad budget and bad selection leave the cache unchanged") {
    REQUIRE_MODEL_OR_SKIP();
    const config& c = fx().m.cfg;
    const std::vector<int> prompt = text_tokens(100, 150);
    const int n = int(prompt.size());
    kv_cache cache(c, n);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(fx().m, cache, prompt, logits, fo));
    const kv_cache before = cache;
    // 10 tokens cannot hold the 32-token window ReST-KV protects
    const result r = evict_layer<kvevict::presets::restkv>(state_for(cache, 0, &log, kvevict::budget_request::tokens(10)),
                                                          kvevict::presets::restkv::defaults());
    CHECK_FALSE(r.ok);
    INFO(r.error);
    CHECK(r.error.find("keep_tokens") != std::string::npos);
    CHECK(cache.length(0, 0) == n);
    // per-query-head selections cannot compact a KV-head cache in place
    auto p = kvevict::presets::snapkv::defaults();
    p.gqa = kvevict::gqa_reduction::per_query_head;
    CHECK_FALSE(evict_layer<kvevict::presets::snapkv>(state_for(cache, 0, &log, kvevict::budget_request::tokens(40)), p).ok);
    // a selection that is not ascending
    std::vector<std::int32_t> indptr{0, 2, 4, 6, 8}, indices{3, 1, 0, 1, 0, 1, 0, 1};
    const result r2 = apply_selection(cache, 1, indptr.data(), indices.data());
    CHECK_FALSE(r2.ok);
    CHECK(r2.error.find("ascending") != std::string::npos);
    for (int h = 0; h < c.n_kv_heads; ++h) CHECK(cache.length(1, h) == n);
    CHECK(std::equal(cache.keys(1), cache.keys(1) + c.n_kv_heads * cache.head_stride(), before.keys(1)));
    // the oracle refuses to run without the look-ahead
    const result r3 = kvevict_fidelity::oracle_method().evict(state_for(cache, 0, &log, kvevict::budget_request::tokens(40)));
    CHECK_FALSE(r3.ok);
}

TEST_CASE("session: chunked prefill scores each chunk against the compressed cache and never exceeds budget + chunk") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> prompt = text_tokens(20000, 400);
    const int n = int(prompt.size()), budget = 48, chunk = 40;
    session_options o;
    o.prefill = prefill_mode::chunked;
    o.chunk = chunk;
    o.budget = kvevict::budget_request::tokens(budget);
    // capacity budget + chunk: any larger peak would fail inside forward()
    eviction_session s(fx().m, fx().wo, policy_method<kvevict::presets::restkv>("ReST-KV"), o, budget + chunk);
    std::vector<float> logits;
    const result r = s.prefill(prompt, logits);
    REQUIRE_MESSAGE(r, r.error);
    CAPTURE(n);
    CHECK(s.evictions() == (n + chunk - 1) / chunk);
    CHECK(s.max_length_seen() <= budget + chunk);
    CHECK(s.max_length_seen() > budget);
    const kv_cache& c = s.cache();
    CHECK(c.next_position == n);
    for (int l = 0; l < c.n_layers(); ++l)
        for (int h = 0; h < c.n_kv_heads(); ++h) {
            CHECK(c.length(l, h) == budget);
            CHECK(c.position(l, h, budget - 1) == n - 1);  // the last chunk's window is kept
            for (int i = 1; i < budget; ++i) CHECK(c.position(l, h, i) > c.position(l, h, i - 1));
        }
    // non-vacuous: tokens from early chunks survived (scored against later chunks)
    int early = 0;
    for (int i = 0; i < budget; ++i) early += c.position(2, 0, i) < n - chunk ? 1 : 0;
    CHECK(early > 0);
    // a too-small capacity is reported, not crashed on
    eviction_session small(fx().m, fx().wo, policy_method<kvevict::presets::restkv>("ReST-KV"), o, budget + chunk - 1);
    CHECK_FALSE(small.prefill(prompt, logits).ok);
}

TEST_CASE("session: decode-time cap keeps every head within budget + interval while generating") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> prompt = text_tokens(30000, 200);
    const int n = int(prompt.size()), budget = 40, interval = 16, steps = 50;
    session_options o;
    o.prefill = prefill_mode::none;
    o.decode_interval = interval;
    o.budget = kvevict::budget_request::tokens(budget);
    eviction_session s(fx().m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV", kvevict::presets::snapkv::defaults(), 16), o, n + 1);
    std::vector<float> logits;
    REQUIRE(s.prefill(prompt, logits));
    CHECK(s.evictions() == 1);  // the cap applies from the first generated token
    s.reset_peak();
    int peak = 0;
    for (int i = 0; i < steps; ++i) {
        REQUIRE(s.decode(argmax(logits), logits));
        for (int l = 0; l < s.cache().n_layers(); ++l)
            for (int h = 0; h < s.cache().n_kv_heads(); ++h) peak = std::max(peak, s.cache().length(l, h));
    }
    CHECK(peak <= budget + interval - 1);  // after decode() returns; inside it the peak is budget + interval
    CHECK(s.max_length_seen() == budget + interval);  // right after the forward step that triggers an eviction
    CHECK(s.evictions() == 1 + steps / interval);
    CHECK(s.cache().next_position == n + steps);
    // a fraction budget is a fraction of the tokens seen at each eviction (kvevict::decode_schedule)
    o.budget = kvevict::budget_request::fraction(0.5);
    eviction_session half(fx().m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV", kvevict::presets::snapkv::defaults(), 16), o, n + 1);
    REQUIRE(half.prefill(prompt, logits));
    for (int l = 0; l < half.cache().n_layers(); ++l)
        for (int h = 0; h < half.cache().n_kv_heads(); ++h) CHECK(half.cache().length(l, h) == n / 2);
    for (int i = 0; i < interval; ++i) REQUIRE(half.decode(argmax(logits), logits));
    CHECK(half.evictions() == 2);
    for (int l = 0; l < half.cache().n_layers(); ++l)
        for (int h = 0; h < half.cache().n_kv_heads(); ++h) CHECK(half.cache().length(l, h) == (n + interval) / 2);
    // protection needs the decode-time schedule, and a cap that holds it
    session_options p = o;
    p.decode_interval = 0;
    p.protect_recent = 4;
    eviction_session bad(fx().m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV"), p, n + 1);
    const result rb = bad.prefill(prompt, logits);
    CHECK_FALSE(rb.ok);
    CHECK(rb.error.find("decode_interval") != std::string::npos);
    p.decode_interval = 4;
    p.budget = kvevict::budget_request::tokens(10);
    p.protect_prefix = 7;
    eviction_session bad2(fx().m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV"), p, n + 1);
    const result rb2 = bad2.prefill(prompt, logits);
    CHECK_FALSE(rb2.ok);
    CHECK(rb2.error.find("7 + 4") != std::string::npos);
    CHECK(bad2.cache().next_position == 0);  // refused before any token
}

TEST_CASE("session: decode-time schedule with a protected prefix and recent window, every preset") {
    REQUIRE_MODEL_OR_SKIP();
    using namespace kvevict::presets;
    const std::vector<int> prompt = text_tokens(33000, 90);
    const int n = int(prompt.size()), budget = 40, prefix = 5, recent = 6, steps = 40;  // budget >= prefix + the 32-query window
    const std::vector<method> methods = {
        policy_method<restkv>("ReST-KV"), policy_method<snapkv>("SnapKV"), policy_method<pyramidkv>("PyramidKV"),
        policy_method<adakv>("AdaKV"), policy_method<h2o>("H2O", h2o::defaults(), -1), policy_method<tova>("TOVA"),
        policy_method<streaming_llm>("StreamingLLM", streaming_llm::defaults(), 0), policy_method<key_norm>("KeyNorm", key_norm::defaults(), 0),
        policy_method<criticalkv>("CriticalKV"), policy_method<critical_adakv>("CriticalAdaKV")};
    // LKV (lkv::full through the evictor: LKV-H's budgets over the whole model, num_tokens = tokens seen)
    std::vector<method> all = methods;
    kvevict::io::lkv_artifact art;
    const std::string art_path = std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
    const bool have_lkv = kvevict::io::read_lkv_artifact(art_path.c_str(), &art).ok();
    if (have_lkv) all.push_back(policy_method<kvevict::lkv::full>("LKV", kvevict::lkv::full_params(art), 0));
    else MESSAGE("LKV row skipped: " << art_path << " unreadable");
    int heads_checked = 0;
    for (const method& meth : all)
        for (const int interval : {1, 7}) {
            CAPTURE(meth.name);
            CAPTURE(interval);
            session_options o;
            o.decode_interval = interval;
            o.budget = kvevict::budget_request::tokens(budget);
            o.protect_prefix = prefix;
            o.protect_recent = recent;
            o.window_across_evictions = true;
            eviction_session s(fx().m, fx().wo, meth, o, n + steps + 1);
            std::vector<float> logits;
            const result r = s.prefill(prompt, logits);
            REQUIRE_MESSAGE(r, r.error);
            int t = n;
            for (int i = 0; i <= steps; ++i) {
                const kv_cache& c = s.cache();
                const bool just_evicted = s.schedule().pending_tokens() == 0;
                // AdaKV's head-wise budgets share the cap within a layer; PyramidKV's layer i keeps up to
                // 2P - min candidates (P = budget - protected: prefix + the 32-query window) besides them
                const bool adaptive = meth.name.find("Ada") != std::string::npos, pyramid = meth.name == "PyramidKV";
                const bool learned = meth.name == "LKV";  // the cap holds over the whole model (N * budget)
                const int protected_tokens = prefix + 32;
                std::int64_t model_total = 0;
                for (int l = 0; l < c.n_layers(); ++l) {
                    std::int64_t layer_total = 0;
                    for (int h = 0; h < c.n_kv_heads(); ++h) {
                        const int len = c.length(l, h);
                        REQUIRE(len >= prefix + recent);
                        for (int j = 0; j < prefix; ++j) CHECK(c.position(l, h, j) == j);               // the prefix stays
                        for (int j = 0; j < recent; ++j) CHECK(c.position(l, h, len - 1 - j) == t - 1 - j);  // and the recent window
                        if (just_evicted && !adaptive && !learned) CHECK(len <= (pyramid ? protected_tokens + 2 * (budget - protected_tokens) : budget));
                        layer_total += len;
                        ++heads_checked;
                    }
                    if (just_evicted && !learned) CHECK(layer_total <= std::int64_t(c.n_kv_heads()) * (pyramid ? 2 * budget : budget));
                    model_total += layer_total;
                }
                if (just_evicted && learned) CHECK(model_total == std::int64_t(c.n_layers()) * c.n_kv_heads() * budget);
                if (i == steps) break;
                const result d = s.decode(argmax(logits), logits);
                REQUIRE_MESSAGE(d, d.error);
                ++t;
            }
            CHECK(s.evictions() == 1 + steps / interval);
            CHECK(s.peak_kv_tokens() <= std::int64_t(s.cache().n_layers()) * s.cache().n_kv_heads() * std::max(n, budget + interval));
        }
    CHECK(heads_checked == (have_lkv ? 11 : 10) * 2 * 41 * 5 * 4);
}

TEST_CASE("session: chunked prefill under the decode-time schedule protects the prefix at every chunk's eviction") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> prompt = text_tokens(31000, 200);
    for (const method& meth : {policy_method<kvevict::presets::snapkv>("SnapKV"), policy_method<kvevict::presets::tova>("TOVA")}) {
        CAPTURE(meth.name);
        session_options o;
        o.prefill = prefill_mode::chunked;
        o.chunk = 50;
        o.decode_interval = 4;
        o.budget = kvevict::budget_request::tokens(40);
        o.protect_prefix = 8;
        eviction_session s(fx().m, fx().wo, meth, o, 100);
        std::vector<float> logits;
        const result r = s.prefill(prompt, logits);
        REQUIRE_MESSAGE(r, r.error);
        CHECK(s.evictions() == int((prompt.size() + 49) / 50));
        for (int l = 0; l < s.cache().n_layers(); ++l)
            for (int h = 0; h < s.cache().n_kv_heads(); ++h)
                for (int j = 0; j < 8; ++j) CHECK(s.cache().position(l, h, j) == j);
        CHECK(s.schedule().protected_prefix() == 8);
    }
    // decode() before any prefill is refused before it touches the cache
    session_options o;
    o.decode_interval = 4;
    o.budget = kvevict::budget_request::tokens(40);
    eviction_session s(fx().m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV"), o, 100);
    std::vector<float> logits;
    CHECK_FALSE(s.decode(5, logits).ok);
    CHECK(s.cache().next_position == 0);
}

TEST_CASE("session: multi-turn appends the next prompt to the compressed cache and compresses again") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> turn1 = text_tokens(40000, 250);
    std::vector<int> turn2 = text_tokens(41000, 150);
    turn2.erase(turn2.begin());  // no BOS inside the conversation
    const int n1 = int(turn1.size()), n2 = int(turn2.size()), budget = 64, gen = 5;
    session_options o;
    o.budget = kvevict::budget_request::tokens(budget);
    eviction_session s(fx().m, fx().wo, policy_method<kvevict::presets::h2o>("H2O", kvevict::presets::h2o::defaults(), -1), o, std::max(n1, budget + gen + n2));
    std::vector<float> logits;
    REQUIRE(s.prefill(turn1, logits));
    for (int i = 0; i < gen; ++i) REQUIRE(s.decode(argmax(logits), logits));
    const result r = s.prefill(turn2, logits);
    REQUIRE_MESSAGE(r, r.error);
    CHECK(s.evictions() == 2);
    const kv_cache& c = s.cache();
    CHECK(c.next_position == n1 + gen + n2);
    int from_turn1 = 0;
    for (int l = 0; l < c.n_layers(); ++l)
        for (int h = 0; h < c.n_kv_heads(); ++h) {
            CHECK(c.length(l, h) == budget);
            CHECK(c.position(l, h, budget - 1) == n1 + gen + n2 - 1);
            for (int i = 0; i < budget; ++i) from_turn1 += c.position(l, h, i) < n1 ? 1 : 0;
        }
    CHECK(from_turn1 > 0);
}

TEST_CASE("session: same request, same output, whatever ran before (reset and fresh sessions)") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> a = text_tokens(50000, 180), b = text_tokens(60000, 260);
    session_options o;
    o.prefill = prefill_mode::chunked;
    o.chunk = 50;
    o.decode_interval = 8;
    o.budget = kvevict::budget_request::tokens(40);
    for (const method& meth : {policy_method<kvevict::presets::restkv>("ReST-KV"), policy_method<kvevict::presets::adakv>("AdaKV"),
                               kvevict_fidelity::random_method("Random")}) {
        CAPTURE(meth.name);
        eviction_session s(fx().m, fx().wo, meth, o, 120);
        std::vector<float> la1, lb, la2, la3;
        const std::vector<int> first = run_request(s, a, 20, la1);
        s.reset();
        CHECK(s.cache().next_position == 0);
        CHECK(s.evictions() == 0);
        const std::vector<int> other = run_request(s, b, 20, lb);
        s.reset();
        const std::vector<int> again = run_request(s, a, 20, la2);
        eviction_session fresh(fx().m, fx().wo, meth, o, 120);
        const std::vector<int> fresh_out = run_request(fresh, a, 20, la3);
        CHECK(first == again);
        CHECK(first == fresh_out);
        CHECK(la1 == la2);
        CHECK(la1 == la3);
        CHECK(first != other);  // not vacuous: the requests differ
    }
}

TEST_CASE("random floor: deterministic, keeps the window, differs across layers") {
    REQUIRE_MODEL_OR_SKIP();
    const config& c = fx().m.cfg;
    const std::vector<int> prompt = text_tokens(70000, 220);
    const int n = int(prompt.size()), budget = 50;
    kv_cache cache(c, n);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(fx().m, cache, prompt, logits, fo));
    kv_cache x = cache, y = cache;
    const method rm = kvevict_fidelity::random_method();
    for (int l = 0; l < c.n_layers; ++l) {
        REQUIRE(rm.evict(state_for(x, l, &log, kvevict::budget_request::tokens(budget))));
        REQUIRE(rm.evict(state_for(y, l, &log, kvevict::budget_request::tokens(budget))));
    }
    bool layers_differ = false;
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h)
            for (int s = 0; s < budget; ++s) {
                CHECK(x.position(l, h, s) == y.position(l, h, s));
                layers_differ = layers_differ || x.position(l, h, s) != x.position(0, h, s);
                if (s >= budget - 32) CHECK(x.position(l, h, s) == n - budget + s);
            }
    CHECK(layers_differ);
}

/// The naive greedy backward elimination both oracle tests compare with: while more than `budget` slots of
/// `keep` are kept, drop the candidate (a kept slot below `candidates`) whose removal gives the smallest
/// err(keep) recomputed from scratch (ties: the lower slot). Returns the kept slots, ascending.
template <class ErrF>
std::vector<std::int32_t> naive_greedy(std::vector<char>& keep, int candidates, int budget, ErrF&& err) {
    const int L = int(keep.size());
    for (int left = L; left > budget; --left) {
        int best = -1;
        double be = std::numeric_limits<double>::infinity();
        for (int n = 0; n < candidates; ++n) {
            if (!keep[size_t(n)]) continue;
            keep[size_t(n)] = 0;
            const double e = err(keep);
            keep[size_t(n)] = 1;
            if (e < be) { be = e; best = n; }
        }
        keep[size_t(best)] = 0;
    }
    std::vector<std::int32_t> out;
    for (int n = 0; n < L; ++n)
        if (keep[size_t(n)]) out.push_back(n);
    return out;
}

TEST_CASE("oracle-next: incremental greedy equals a naive greedy that recomputes the error from scratch") {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int trial = 0; trial < 5; ++trial) {
        const int L = 10 + 3 * trial, d = 4, G = 2, budget = 3 + trial;
        CAPTURE(trial);
        std::vector<float> K(size_t(L * d), 0.0f), V(size_t(L * d), 0.0f), q(size_t(G * d), 0.0f), kn(size_t(d), 0.0f), vn(size_t(d), 0.0f);
        for (auto* v : {&K, &V, &q, &kn, &vn})
            for (float& x : *v) x = 2.0f * nd(rng);
        std::vector<std::int32_t> fast;
        kvevict_fidelity::oracle_keep_head(K.data(), V.data(), L, d, q.data(), G, kn.data(), vn.data(), budget, fast);
        // naive: error of a keep mask, recomputed in fp64 from the definition
        auto out = [&](const std::vector<char>& keep, int g) {
            std::vector<double> w;
            std::vector<const float*> vs;
            for (int n = 0; n <= L; ++n) {
                if (n < L && !keep[size_t(n)]) continue;
                const float* k = n < L ? &K[size_t(n * d)] : kn.data();
                double s = 0;
                for (int c = 0; c < d; ++c) s += double(q[size_t(g * d + c)]) * k[c];
                w.push_back(s / std::sqrt(double(d)));
                vs.push_back(n < L ? &V[size_t(n * d)] : vn.data());
            }
            const double mx = *std::max_element(w.begin(), w.end());
            double sum = 0;
            for (double& x : w) sum += (x = std::exp(x - mx));
            std::vector<double> o(size_t(d), 0.0);
            for (size_t i = 0; i < w.size(); ++i)
                for (int c = 0; c < d; ++c) o[size_t(c)] += w[i] / sum * vs[i][c];
            return o;
        };
        std::vector<char> all(size_t(L), 1), keep = all;
        auto err = [&](const std::vector<char>& k) {
            double e = 0;
            for (int g = 0; g < G; ++g) {
                const auto a = out(all, g), b = out(k, g);
                for (int c = 0; c < d; ++c) e += (a[size_t(c)] - b[size_t(c)]) * (a[size_t(c)] - b[size_t(c)]);
            }
            return e;
        };
        const std::vector<std::int32_t> naive = naive_greedy(keep, L, budget, err);
        CHECK(fast == naive);
        CHECK(int(fast.size()) == budget);
    }
}

TEST_CASE("oracle-W: incremental greedy over the window after W_O equals a naive greedy that removes each token and recomputes") {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int removed = 0;
    for (int trial = 0; trial < 5; ++trial) {
        const int L = 14 + 3 * trial, d = 4, G = 1 + trial % 2, w = 2 + trial % 3, budget = w + 2 + trial;
        CAPTURE(trial);
        std::vector<float> K(size_t(L * d)), V(size_t(L * d)), Q(size_t(G * w * d)), R(size_t(G * d * d));
        for (auto* v : {&K, &V, &Q, &R})
            for (float& x : *v) x = 1.5f * nd(rng);
        std::vector<std::int32_t> fast;
        // queries laid out (g, j): head stride w * d, row stride d
        kvevict_fidelity::window_oracle_keep_head(K.data(), V.data(), L, d, Q.data(), std::int64_t(w) * d, d, R.data(), G, w, budget, fast);
        // naive: E(keep) = sum_g sum_j ||R_g (o_gj(all) - o_gj(keep))||^2, o_gj over the visible kept slots [0, L - w + j]
        auto out = [&](const std::vector<char>& keep, int g, int j) {
            std::vector<double> lg, o(size_t(d), 0.0);
            std::vector<int> idx;
            for (int n = 0; n <= L - w + j; ++n) {
                if (!keep[size_t(n)]) continue;
                double s = 0;
                for (int c = 0; c < d; ++c) s += double(Q[size_t((g * w + j) * d + c)]) * K[size_t(n * d + c)];
                lg.push_back(s / std::sqrt(double(d)));
                idx.push_back(n);
            }
            const double mx = *std::max_element(lg.begin(), lg.end());
            double sum = 0;
            for (double& x : lg) sum += (x = std::exp(x - mx));
            for (size_t i = 0; i < lg.size(); ++i)
                for (int c = 0; c < d; ++c) o[size_t(c)] += lg[i] / sum * V[size_t(idx[i] * d + c)];
            std::vector<double> y(size_t(d), 0.0);  // R_g o
            for (int a = 0; a < d; ++a)
                for (int c = 0; c < d; ++c) y[size_t(a)] += double(R[size_t((g * d + a) * d + c)]) * o[size_t(c)];
            return y;
        };
        std::vector<char> all(size_t(L), 1), keep = all;
        auto err = [&](const std::vector<char>& k) {
            double e = 0;
            for (int g = 0; g < G; ++g)
                for (int j = 0; j < w; ++j) {
                    const auto a = out(all, g, j), b = out(k, g, j);
                    for (int c = 0; c < d; ++c) e += (a[size_t(c)] - b[size_t(c)]) * (a[size_t(c)] - b[size_t(c)]);
                }
            return e;
        };
        const std::vector<std::int32_t> naive = naive_greedy(keep, L - w, budget, err);  // the window's slots are kept
        removed += L - budget;
        CHECK(fast == naive);
        CHECK(int(fast.size()) == budget);
        for (int n = L - w; n < L; ++n) CHECK(std::find(fast.begin(), fast.end(), n) != fast.end());
    }
    CHECK(removed > 40);
}

TEST_CASE("a cache repeated to q_heads: same logits; per-query-head presets select per query head as the library does on the GQA cache") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const int G = c.kv_group();
    REQUIRE(G > 1);  // stories260K: 8 query heads over 4 KV heads
    const std::vector<int> prompt = text_tokens(41000, 300);
    const int n = int(prompt.size()), steps = 4;
    kv_cache full(c, n + steps), rep(c, n + steps, 0, G);
    CHECK(rep.n_kv_heads() == c.n_heads);
    CHECK(rep.kv_repeat() == G);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> lf, lr;
    REQUIRE(prefill(m, full, prompt, lf, fo));
    REQUIRE(prefill(m, rep, prompt, lr));
    CHECK(max_abs_diff(lf, lr) == 0.0f);  // the same rows, read by the same query heads
    // repeated() of the GQA cache equals the cache built repeated; paged too
    const kv_cache copy = full.repeated(G);
    kv_cache paged(c, n + steps, 16);
    REQUIRE(prefill(m, paged, prompt, lr));
    const kv_cache paged_rep = paged.repeated(G);
    CHECK(paged_rep.paged());
    CHECK(paged_rep.kv_repeat() == G);
    for (int l = 0; l < c.n_layers; ++l) {
        CHECK(std::equal(copy.keys(l), copy.keys(l) + c.n_heads * copy.head_stride(), rep.keys(l)));
        CHECK(std::equal(copy.values(l), copy.values(l) + c.n_heads * copy.head_stride(), rep.values(l)));
        for (int h = 0; h < c.n_heads; ++h) {
            REQUIRE(copy.length(l, h) == n);
            REQUIRE(paged_rep.length(l, h) == n);
            int same = 0;
            for (int s = 0; s < n; ++s)
                same += std::equal(paged_rep.key(l, h, s), paged_rep.key(l, h, s) + c.head_dim(), full.key(l, h / G, s)) &&
                        std::equal(paged_rep.value(l, h, s), paged_rep.value(l, h, s) + c.head_dim(), full.value(l, h / G, s)) &&
                        paged_rep.position(l, h, s) == s && copy.position(l, h, s) == s;
            CHECK(same == n);
        }
    }

    // query head h reads cache head h: changing the values of one copy changes that query head's output only
    for (const int target : {1, c.n_heads - 2}) {
        CAPTURE(target);
        kv_cache a = copy, b = copy;
        for (int l = 0; l < c.n_layers; ++l)
            for (int s = 0; s < n; ++s)
                for (int i = 0; i < c.head_dim(); ++i) b.value(l, target, s)[i] += 1.0f;
        std::vector<std::vector<float>> oa(size_t(c.n_layers)), ob(size_t(c.n_layers));
        forward_options ha, hb;
        ha.on_head_output = [&](int l, const float* o) { oa[size_t(l)].assign(o, o + c.dim); };
        hb.on_head_output = [&](int l, const float* o) { ob[size_t(l)].assign(o, o + c.dim); };
        std::vector<float> x, y;
        REQUIRE(forward(m, a, prompt[0], x, ha));
        REQUIRE(forward(m, b, prompt[0], y, hb));
        // layer 0 sees the same input in both; its head outputs differ exactly in query head `target`
        for (int h = 0; h < c.n_heads; ++h) {
            float d = 0;
            for (int i = 0; i < c.head_dim(); ++i) d = std::max(d, std::abs(oa[0][size_t(h * c.head_dim() + i)] - ob[0][size_t(h * c.head_dim() + i)]));
            if (h == target) CHECK(d > 1e-3f);  // + (1 - the new slot's weight) in every dimension
            else CHECK(d == 0.0f);
        }
    }

    // per_query_head on the repeated cache (the engine's evict_layer) == the library's per_query_head on the
    // GQA-native cache (q_heads selection rows over kv_heads K/V): the same kept positions per query head
    auto check_preset = [&](auto tag, const char* name, bool& group_differs) {
        using P = decltype(tag);
        CAPTURE(name);
        auto p = P::defaults();
        p.gqa = kvevict::gqa_reduction::per_query_head;
        const kvevict::budget_request b = kvevict::budget_request::fraction(0.3);
        kv_cache ev = rep;
        for (int l = 0; l < c.n_layers; ++l) {
            const result r = evict_layer<P>(state_for(ev, l, &log, b), p);
            REQUIRE_MESSAGE(r, r.error);
            kvevict::layer_inputs<float> in;
            layer_page_table table;
            set_cache_inputs(in, full, l, table);
            in.queries = log.view(l, 32);
            in.wo_factor = fx().wo.view(l);
            in.layer_idx = l;
            in.num_layers = c.n_layers;
            kvevict::evictor<P, kvevict::cpu::backend> lib(p);
            std::vector<std::int32_t> indptr(size_t(c.n_heads) + 1), indices(size_t(c.n_heads) * size_t(n));
            kvevict::selection_view sel;
            sel.indptr = indptr.data();
            sel.indices = indices.data();
            sel.capacity = std::int64_t(indices.size());
            const kvevict::status st = lib.run(in, b, sel);
            REQUIRE_MESSAGE(st.ok(), st.message());
            REQUIRE(lib.out_heads(in) == c.n_heads);
            for (int h = 0; h < c.n_heads; ++h) {
                std::vector<int> got, want(indices.begin() + indptr[size_t(h)], indices.begin() + indptr[size_t(h) + 1]);
                for (int s = 0; s < ev.length(l, h); ++s) got.push_back(ev.position(l, h, s));
                CHECK(got == want);
                if (h % G != 0) {  // another query head of the same group
                    std::vector<int> first;
                    for (int s = 0; s < ev.length(l, h - h % G); ++s) first.push_back(ev.position(l, h - h % G, s));
                    group_differs = group_differs || first != got;
                }
            }
        }
        return ev;
    };
    bool differs = false;
    const kv_cache snap = check_preset(kvevict::presets::snapkv{}, "SnapKV", differs);
    check_preset(kvevict::presets::restkv{}, "ReST-KV", differs);
    check_preset(kvevict::presets::adakv_published{}, "AdaKV published", differs);
    CHECK(differs);  // not vacuous: query heads of one group keep different tokens

    // decoding on the evicted repeated cache == the full repeated cache with the evicted slots masked
    std::vector<std::vector<std::vector<char>>> kept(size_t(c.n_layers), std::vector<std::vector<char>>(size_t(c.n_heads), std::vector<char>(size_t(n), 0)));
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_heads; ++h)
            for (int s = 0; s < snap.length(l, h); ++s) kept[size_t(l)][size_t(h)][size_t(snap.position(l, h, s))] = 1;
    forward_options masked;
    masked.slot_visible = [&](int l, int h, int s) { return s >= n || kept[size_t(l)][size_t(h)][size_t(s)] != 0; };
    kv_cache ev = snap, whole = rep;
    std::vector<float> le, lw;
    int t = argmax(lf);
    float worst = 0;
    for (int i = 0; i < steps; ++i) {
        REQUIRE(forward(m, whole, t, lw, masked));
        REQUIRE(forward(m, ev, t, le));
        worst = std::max(worst, max_abs_diff(lw, le));
        t = argmax(le);
    }
    CHECK(worst < 1e-4f);

    // a session of a per-query-head method holds the repeated cache: G times the KV tokens of the GQA row
    session_options so;
    so.budget = kvevict::budget_request::fraction(0.3);
    auto pq = kvevict::presets::snapkv::defaults();
    pq.gqa = kvevict::gqa_reduction::per_query_head;
    const method pqh = policy_method<kvevict::presets::snapkv>("SnapKV-pqh", pq);
    CHECK(pqh.repeat_kv);
    eviction_session sg(m, fx().wo, policy_method<kvevict::presets::snapkv>("SnapKV"), so, n + steps), sq(m, fx().wo, pqh, so, n + steps);
    std::vector<float> a, bq;
    REQUIRE(sg.prefill(prompt, a));
    REQUIRE(sq.prefill(prompt, bq));
    CHECK(max_abs_diff(a, bq) == 0.0f);  // the logits before eviction
    CHECK(sq.cache().n_kv_heads() == c.n_heads);
    std::int64_t kg = 0, kq = 0;
    for (int l = 0; l < c.n_layers; ++l) {
        for (int h = 0; h < c.n_kv_heads; ++h) kg += sg.cache().length(l, h);
        for (int h = 0; h < c.n_heads; ++h) {
            kq += sq.cache().length(l, h);
            REQUIRE(sq.cache().length(l, h) == snap.length(l, h));
            int same = 0;
            for (int s = 0; s < snap.length(l, h); ++s) same += sq.cache().position(l, h, s) == snap.position(l, h, s);
            CHECK(same == snap.length(l, h));  // the session keeps what evict_layer kept, per query head
        }
    }
    CHECK(kq == G * kg);
    REQUIRE(sq.decode(argmax(bq), bq));

    // errors: per_query_head on a GQA-native cache, a cache of the wrong head count
    kv_cache gqa = full;
    const result r = evict_layer<kvevict::presets::snapkv>(state_for(gqa, 0, &log, kvevict::budget_request::fraction(0.3)), pq);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("repeat it to q_heads") != std::string::npos);
    CHECK(gqa.length(0, 0) == n);
    kv_cache odd(c.n_layers, 3, c.head_dim(), 8);
    const result rf = forward(m, odd, 1, le);
    CHECK_FALSE(rf.ok);
    CHECK(rf.error.find("does not match the model") != std::string::npos);
    kv_cache three(c, 8, 0, G + 1);  // kv_repeat must divide the GQA group
    const result r3 = forward(m, three, 1, le);
    CHECK_FALSE(r3.ok);
    CHECK(r3.error.find("kv_repeat " + std::to_string(G + 1)) != std::string::npos);
    CHECK(three.length(0, 0) == 0);
    CHECK(three.next_position == 0);

    // repeated() of an evicted, ragged, paged cache: every copy holds its source head's rows, positions and
    // pages; next_position and kv_repeat carry over
    kv_cache pev = paged;
    for (int l = 0; l < c.n_layers; ++l) {
        const result re = evict_layer<kvevict::presets::adakv>(state_for(pev, l, &log, kvevict::budget_request::fraction(0.3)),
                                                              kvevict::presets::adakv::defaults());
        REQUIRE_MESSAGE(re, re.error);
    }
    const kv_cache prep = pev.repeated(G);
    CHECK(prep.next_position == pev.next_position);
    CHECK(prep.kv_repeat() == G);
    CHECK(prep.repeated(1).kv_repeat() == G);
    bool ragged = false;
    for (int l = 0; l < c.n_layers; ++l) {
        int pages = 0;
        for (int h = 0; h < c.n_heads; ++h) {
            const int src = h / G, len = pev.length(l, src);
            REQUIRE(prep.length(l, h) == len);
            ragged = ragged || len != pev.length(l, 0);
            CHECK(prep.pages_in_use(l, h) == (len + 15) / 16);
            pages += prep.pages_in_use(l, h);
            int same = 0;
            for (int s = 0; s < len; ++s)
                same += std::equal(prep.key(l, h, s), prep.key(l, h, s) + c.head_dim(), pev.key(l, src, s)) &&
                        std::equal(prep.value(l, h, s), prep.value(l, h, s) + c.head_dim(), pev.value(l, src, s)) &&
                        prep.position(l, h, s) == pev.position(l, src, s);
            CHECK(same == len);
        }
        CHECK(prep.free_pages(l) == prep.num_pages() - pages);
    }
    CHECK(ragged);  // AdaKV's head-wise budgets
}
