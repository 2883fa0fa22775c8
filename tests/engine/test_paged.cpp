// The example engine's paged KV cache (kv_cache paged mode, paged_layer.hpp): prefill, eviction through
// kvevict's paged inputs and cpu::compact_paged, and decoding give the same numbers as the contiguous
// cache, bit for bit, while head-wise budgets free real pages; so does LKV's decoding session
// (lkv_session, modes A and B) over the paged cache. Part of test_engine_evict. Model-dependent
// tests print a skip message when the model folder is missing.
#include <doctest/doctest.h>

#include "../../examples/engine/evict.hpp"
#include "../../examples/engine/layerwise_prefill.hpp"
#include "../../examples/engine/lkv_decode.hpp"
#include "../../examples/engine/model_path.hpp"
#include "../../examples/engine/tokenizer.hpp"
#include "engine_fixture.hpp"

#include <kvevict/backends/cpu/learned.hpp>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>
#include <vector>

using namespace kvevict_engine;

namespace {

using kvevict_engine_test::fx;

/// Tokens of `chars` characters of sherlock.txt from `offset`, newlines as spaces (FAILs if the text is missing).
std::vector<int> sherlock_tokens(size_t offset, size_t chars) {
    std::ifstream f(resolve_model_dir() + "/../../data/text/sherlock.txt", std::ios::binary);
    std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    REQUIRE_MESSAGE(text.size() >= offset + chars, "sherlock.txt not found next to the model folder");
    text = text.substr(offset, chars);
    for (char& c : text)
        if (c == '\n') c = ' ';
    return fx().tok.encode(text);
}

layer_state layer_of(kv_cache& cache, int layer, const query_log* log, kvevict::budget_request b) {
    layer_state s;
    s.m = &fx().m;
    s.wo = &fx().wo;
    s.cache = &cache;
    s.layer = layer;
    s.queries = log;
    s.budget = b;
    return s;
}

/// Kept positions of every (layer, KV head), and the key/value rows, must be equal in both caches.
void check_same_contents(const kv_cache& a, const kv_cache& b) {
    const int hd = a.head_dim();
    for (int l = 0; l < a.n_layers(); ++l)
        for (int h = 0; h < a.n_kv_heads(); ++h) {
            CAPTURE(l);
            CAPTURE(h);
            REQUIRE(a.length(l, h) == b.length(l, h));
            bool same_pos = true, same_rows = true;
            for (int s = 0; s < a.length(l, h); ++s) {
                same_pos = same_pos && a.position(l, h, s) == b.position(l, h, s);
                same_rows = same_rows && std::equal(a.key(l, h, s), a.key(l, h, s) + hd, b.key(l, h, s)) &&
                            std::equal(a.value(l, h, s), a.value(l, h, s) + hd, b.value(l, h, s));
            }
            CHECK(same_pos);
            CHECK(same_rows);
        }
}

/// Allocator invariants of a paged cache: every head holds ceil(len / page_size) pages; held + free = pool.
void check_pages(const kv_cache& c) {
    REQUIRE(c.paged());
    for (int l = 0; l < c.n_layers(); ++l) {
        for (int h = 0; h < c.n_kv_heads(); ++h) CHECK(c.pages_in_use(l, h) == (c.length(l, h) + c.page_size() - 1) / c.page_size());
        CHECK(c.pages_in_use(l) + c.free_pages(l) == c.num_pages());
    }
}

using evict_fn = std::function<result(const layer_state&)>;
struct named_method {
    std::string name;
    int window;
    evict_fn evict;
};
template <class Policy>
named_method named(std::string name, typename Policy::params p, int window = 32) {
    return {std::move(name), window, [p, window](const layer_state& s) { return evict_layer<Policy>(s, p, window); }};
}

}  // namespace

TEST_CASE("paged cache: prefill, eviction (snapkv, adakv, pyramidkv, LKV) and decoding equal the contiguous cache bit for bit; "
          "head-wise budgets free pages") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const std::vector<int> prompt = sherlock_tokens(12000, 760);
    const int n = int(prompt.size()), steps = 6;
    REQUIRE(n > 300);
    REQUIRE(n + steps <= c.seq_len);
    namespace P = kvevict::presets;
    std::vector<named_method> methods{named<P::snapkv>("SnapKV", P::snapkv::defaults()), named<P::adakv>("AdaKV", P::adakv::defaults()),
                                      named<P::pyramidkv>("PyramidKV", P::pyramidkv::defaults())};
    if (fx().have_lkv) methods.push_back(named<kvevict::lkv::full>("LKV", kvevict::lkv::full_params(fx().art), 0));
    else MESSAGE("LKV rows skipped: artifacts/lkv/stories260K.lkv missing or for another model");
    const kvevict::budget_request budget = kvevict::budget_request::fraction(0.3);

    kv_cache contiguous(c, n + steps);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(m, contiguous, prompt, logits, fo));

    for (const int ps : {1, 16, 64}) {
        CAPTURE(ps);
        kv_cache paged(c, n + steps, ps);
        REQUIRE(paged.paged());
        query_log plog(c, 32);
        forward_options pfo;
        pfo.on_query = plog.hook();
        std::vector<float> plogits;
        REQUIRE(prefill(m, paged, prompt, plogits, pfo));
        CHECK(plogits == logits);
        check_same_contents(contiguous, paged);
        check_pages(paged);
        for (int l = 0; l < c.n_layers; ++l)
            for (int h = 0; h < c.n_kv_heads; ++h) CHECK(paged.pages_in_use(l, h) == (n + ps - 1) / ps);

        for (const named_method& meth : methods) {
            CAPTURE(meth.name);
            kv_cache a = contiguous, b = paged;
            const page_counts before = count_pages(b);
            for (int l = 0; l < c.n_layers; ++l) {
                const result ra = meth.evict(layer_of(a, l, &log, budget));
                REQUIRE_MESSAGE(ra, ra.error);
                const result rb = meth.evict(layer_of(b, l, &plog, budget));
                REQUIRE_MESSAGE(rb, rb.error);
            }
            // same selections (kept positions per head) and rows
            check_same_contents(a, b);
            check_pages(b);
            // the pages freed per head follow the head's kept count: before - ceil(kept / page_size)
            const page_counts after = count_pages(b);
            int evicted = 0;
            bool kept_differs = false;
            for (int l = 0; l < c.n_layers; ++l)
                for (int h = 0; h < c.n_kv_heads; ++h) {
                    const int kept = b.length(l, h);
                    evicted += n - kept;
                    kept_differs = kept_differs || kept != b.length(0, 0);
                    CHECK(before[size_t(l)][size_t(h)] - after[size_t(l)][size_t(h)] ==
                          (n + ps - 1) / ps - (kept + ps - 1) / ps);
                }
            CHECK(evicted > 0);
            if (meth.name != "SnapKV") CHECK(kept_differs);  // head-wise or layer-wise budgets: not vacuous
            // next-token logits after eviction and a few greedy decode steps: bit for bit
            std::vector<float> la, lb;
            int t = argmax(logits);
            for (int i = 0; i < steps; ++i) {
                REQUIRE(forward(m, a, t, la));
                REQUIRE(forward(m, b, t, lb));
                CAPTURE(i);
                CHECK(la == lb);
                t = argmax(la);
            }
            check_pages(b);
            check_same_contents(a, b);
        }
    }
}

TEST_CASE("paged cache: AdaKV frees pages per head by its head-wise budgets; freed pages are reused by later appends") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const std::vector<int> prompt = sherlock_tokens(30000, 700);
    const int n = int(prompt.size()), ps = 16;
    kv_cache cache(c, n + 40, ps);
    query_log log(c, 32);
    forward_options fo;
    fo.on_query = log.hook();
    std::vector<float> logits;
    REQUIRE(prefill(m, cache, prompt, logits, fo));
    const int pool = cache.num_pages();
    for (int l = 0; l < c.n_layers; ++l) {
        const result r = evict_layer<kvevict::presets::adakv>(layer_of(cache, l, &log, kvevict::budget_request::fraction(0.3)),
                                                             kvevict::presets::adakv::defaults());
        REQUIRE_MESSAGE(r, r.error);
    }
    std::set<int> page_counts_seen;
    for (int h = 0; h < c.n_kv_heads; ++h) page_counts_seen.insert(cache.pages_in_use(2, h));
    CHECK(page_counts_seen.size() > 1);  // the heads of a layer hold different numbers of pages
    check_pages(cache);
    // decode 40 tokens: heads whose last page fills take pages from the free list; nothing leaks
    int t = argmax(logits);
    for (int i = 0; i < 40; ++i) {
        REQUIRE(forward(m, cache, t, logits));
        t = argmax(logits);
    }
    check_pages(cache);
    CHECK(cache.num_pages() == pool);
    // reset returns every page
    cache.reset();
    for (int l = 0; l < c.n_layers; ++l) CHECK(cache.free_pages(l) == pool);
}

TEST_CASE("paged cache: sessions (chunked prefill + decode-time cap) and layer-wise LKV prefill equal the contiguous cache") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const std::vector<int> prompt = sherlock_tokens(50000, 600);
    session_options o;
    o.prefill = prefill_mode::chunked;
    o.chunk = 48;
    o.decode_interval = 8;
    o.budget = kvevict::budget_request::tokens(40);
    for (const int ps : {1, 16, 64}) {
        CAPTURE(ps);
        session_options po = o;
        po.page_size = ps;
        const method meth = policy_method<kvevict::presets::adakv>("AdaKV");
        eviction_session a(m, fx().wo, meth, o, 100), b(m, fx().wo, meth, po, 100);
        REQUIRE(b.cache().paged());
        std::vector<float> la, lb;
        REQUIRE(a.prefill(prompt, la));
        const result r = b.prefill(prompt, lb);
        REQUIRE_MESSAGE(r, r.error);
        CHECK(la == lb);
        for (int i = 0; i < 20; ++i) {
            const int t = argmax(la);
            REQUIRE(a.decode(t, la));
            REQUIRE(b.decode(t, lb));
            CHECK(la == lb);
        }
        CHECK(a.evictions() == b.evictions());
        check_same_contents(a.cache(), b.cache());
        check_pages(b.cache());
    }
    if (!fx().have_lkv) {
        MESSAGE("LKV layer-wise part skipped: artifacts/lkv/stories260K.lkv missing or for another model");
        return;
    }
    const kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(kvevict::lkv::full_params(fx().art));
    const kvevict::budget_request budget = kvevict::budget_request::fraction(0.2);
    kv_cache a(m.cfg, int(prompt.size()) + 4);
    std::vector<float> la, lb;
    REQUIRE(layerwise_prefill(m, a, prompt, la, [&](int l, kv_cache& c) { return evict_layer_kv(ev, c, l, budget); }));
    for (const int ps : {1, 16, 64}) {
        CAPTURE(ps);
        kv_cache b(m.cfg, int(prompt.size()) + 4, ps);
        const result r = layerwise_prefill(m, b, prompt, lb, [&](int l, kv_cache& c) { return evict_layer_kv(ev, c, l, budget); });
        REQUIRE_MESSAGE(r, r.error);
        CHECK(la == lb);
        check_same_contents(a, b);
        check_pages(b);
        kv_cache a2 = a;
        std::vector<float> x, y;
        REQUIRE(forward(m, a2, argmax(la), x));
        REQUIRE(forward(m, b, argmax(lb), y));
        CHECK(x == y);
    }
}

TEST_CASE("paged cache: the LKV decoding session (modes A and B) equals the contiguous one and frees pages by LKV's head-wise budgets") {
    REQUIRE_MODEL_OR_SKIP();
    if (!fx().have_lkv) {
        MESSAGE("skipped: artifacts/lkv/stories260K.lkv missing or for another model");
        return;
    }
    const model& m = fx().m;
    const std::vector<int> prompt = sherlock_tokens(90000, 700);
    const int steps = 24;
    for (const lkv_decode_mode mode : {lkv_decode_mode::a, lkv_decode_mode::b}) {
        lkv_decode_options o;
        o.mode = mode;
        o.budget = kvevict::budget_request::fraction(0.2);
        o.interval = 4;
        lkv_session a(m, kvevict::io::scorer_params(fx().art), kvevict::io::budgeter_params(fx().art), o, int(prompt.size()) + steps);
        std::vector<float> la;
        REQUIRE(a.prefill(prompt, la));
        std::vector<std::vector<float>> ref_logits{la};
        std::vector<int> next;
        for (int i = 0; i < steps; ++i) {
            next.push_back(int(std::max_element(la.begin(), la.end()) - la.begin()));
            REQUIRE(a.decode(next.back(), la));
            ref_logits.push_back(la);
        }
        for (const int ps : {1, 16, 64}) {
            CAPTURE(ps);
            CAPTURE(int(mode));
            lkv_decode_options po = o;
            po.page_size = ps;
            lkv_session b(m, kvevict::io::scorer_params(fx().art), kvevict::io::budgeter_params(fx().art), po, int(prompt.size()) + steps);
            REQUIRE(b.cache().paged());
            // every eviction's report: the pages before and after each layer's eviction, per head
            int reports = 0, freed = 0;
            std::set<int> pages_after;  // distinct page counts of the heads of layer 1 after the prefill's eviction
            b.on_layer_evicted = [&](int l, const std::vector<int>& before, const std::vector<int>& after) {
                ++reports;
                REQUIRE(int(before.size()) == m.cfg.n_kv_heads);
                for (int h = 0; h < m.cfg.n_kv_heads; ++h) {
                    CHECK(after[size_t(h)] == (b.cache().length(l, h) + ps - 1) / ps);
                    CHECK(after[size_t(h)] <= before[size_t(h)]);
                    freed += before[size_t(h)] - after[size_t(h)];
                    if (l == 1 && b.evictions() == 0) pages_after.insert(after[size_t(h)]);
                }
            };
            std::vector<float> lb;
            const result r = b.prefill(prompt, lb);
            REQUIRE_MESSAGE(r, r.error);
            CHECK(reports == m.cfg.n_layers);
            CHECK(lb == ref_logits[0]);
            for (int i = 0; i < steps; ++i) {
                REQUIRE(b.decode(next[size_t(i)], lb));
                CHECK(lb == ref_logits[size_t(i) + 1]);
            }
            CHECK(b.evictions() == a.evictions());
            CHECK(reports == m.cfg.n_layers * b.evictions());
            CHECK(freed > 0);
            if (ps <= 16) CHECK(pages_after.size() > 1);  // LKV's head-wise budgets: the heads keep different page counts
            check_same_contents(a.cache(), b.cache());
            check_pages(b.cache());
            // the utilities of the kept slots (mode A scores only the prompt's; its generated slots hold no score)
            for (int l = 0; l < m.cfg.n_layers; ++l)
                for (int h = 0; h < m.cfg.n_kv_heads; ++h) {
                    const int scored = a.cache().length(l, h) - (mode == lkv_decode_mode::a ? steps : 0);  // mode A: prompt slots first
                    for (int s = 0; s < scored; ++s) REQUIRE(a.utility(l, h, s) == b.utility(l, h, s));
                }
        }
    }
}
