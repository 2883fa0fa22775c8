// Tests for the example inference engine (examples/engine).
// Build and run from the repository root:
//   g++ -std=c++17 -O2 -Wall -Wextra -I/usr/include/eigen3 -DKVEVICT_SOURCE_DIR="\"$PWD\"" tests/engine/test_engine.cpp -o test_engine && ./test_engine
// The model folder is resolved by kvevict_engine::resolve_model_dir() (env KVEVICT_MODEL_DIR overrides);
// model-dependent tests print a skip message when it is missing.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "../../examples/engine/forward.hpp"
#include "../../examples/engine/model_path.hpp"
#include "../../examples/engine/tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <unistd.h>

using namespace kvevict_engine;
namespace fs = std::filesystem;

namespace {

struct fixture {
    std::string dir = resolve_model_dir();
    bool available = false;
    std::string error;
    model m;
    tokenizer tok;
    fixture() {
        if (!model_dir_exists(dir)) return;
        if (auto r = load_model(model_file(dir), m); !r) { error = r.error; return; }
        if (auto r = tok.load(tokenizer_file(dir), m.cfg.vocab_size); !r) { error = r.error; return; }
        available = true;
    }
};
const fixture& fx() {
    static fixture f;
    return f;
}
#define REQUIRE_MODEL_OR_SKIP()                                                                          \
    if (!fx().available) {                                                                               \
        if (!fx().error.empty()) FAIL("model folder '" << fx().dir << "' present but failed: " << fx().error); \
        MESSAGE("skipping: model folder '" << fx().dir << "' not found (set KVEVICT_MODEL_DIR)");        \
        return;                                                                                          \
    }

std::string temp_path(const std::string& name) {
    return (fs::temp_directory_path() / ("kvevict_engine_test_" + std::to_string(::getpid()) + "_" + name)).string();
}
void write_bytes(const std::string& path, const std::vector<char>& b) {
    std::ofstream f(path, std::ios::binary);
    f.write(b.data(), std::streamsize(b.size()));
}
std::vector<char> read_bytes(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
}
/// A synthetic checkpoint: header h, followed by `n_floats` small deterministic values.
std::vector<char> synthetic_checkpoint(const std::int32_t (&h)[7], std::uint64_t n_floats) {
    std::vector<char> b(28 + 4 * n_floats);
    std::memcpy(b.data(), h, 28);
    for (std::uint64_t i = 0; i < n_floats; ++i) {
        float v = 0.05f * float(std::sin(0.37 * double(i) + 1.0));
        std::memcpy(b.data() + 28 + 4 * i, &v, 4);
    }
    return b;
}
std::uint64_t floats_for(const std::int32_t (&h)[7]) {
    config c{h[0], h[1], h[2], h[3], h[4], std::abs(h[5]), h[6], h[5] > 0};
    return expected_float_count(c);
}
float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    float d = 0;
    for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
    return d;
}
std::vector<int> prompt_tokens(const tokenizer& tok, size_t chars) {
    std::string path = resolve_model_dir() + "/../../data/text/sherlock.txt";
    std::vector<char> b = read_bytes(path);
    std::string text = b.empty() ? std::string("It was a dark and stormy night; the rain fell in torrents, except at occasional "
                                               "intervals, when it was checked by a violent gust of wind which swept up the streets.")
                                 : std::string(b.begin(), b.end());
    return tok.encode(text.substr(0, std::min(chars, text.size())));
}

}  // namespace

// ---------------------------------------------------------------------------------------------- (a) parity
TEST_CASE("tokenizer encodes the README example") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> want{1, 403, 407, 261, 378, 432, 261, 376, 400, 428, 395, 392, 412, 444};
    CHECK(fx().tok.encode("Once upon a time, a little dog named Max") == want);
    CHECK(fx().tok.decode(want) == "Once upon a time, a little dog named Max");
    CHECK(fx().tok.encode("") == std::vector<int>{1});
    // byte fallback round trip for characters without a piece
    const std::string odd = "caf\xc3\xa9 \xe2\x82\xac 42";
    CHECK(fx().tok.decode(fx().tok.encode(odd)) == odd);
}

TEST_CASE("logits at position 0 match the README golden values") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    CHECK(m.cfg.dim == 64);
    CHECK(m.cfg.n_kv_heads == 4);
    CHECK(m.cfg.shared_classifier);
    kv_cache cache(m.cfg, 8);
    std::vector<float> logits;
    REQUIRE(forward(m, cache, tokenizer::bos, logits));
    REQUIRE(logits.size() == 512);
    std::vector<int> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + 5, ids.end(), [&](int a, int b) { return logits[size_t(a)] > logits[size_t(b)]; });
    const int want_ids[5] = {403, 385, 410, 317, 407};
    const float want_vals[5] = {17.0235f, 15.4062f, 13.1083f, 12.7692f, 12.4181f};
    for (int i = 0; i < 5; ++i) {
        CHECK(ids[size_t(i)] == want_ids[i]);
        CHECK(std::abs(logits[size_t(want_ids[i])] - want_vals[i]) < 1e-3f);
    }
    CHECK(cache.next_position == 1);
    for (int h = 0; h < 4; ++h) CHECK(cache.length(0, h) == 1);
}

TEST_CASE("greedy continuation of [BOS] matches the README, and decodes to the story") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<int> want{403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338,
                                401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385};
    kv_cache cache(fx().m.cfg, 64);
    std::vector<float> logits;
    std::vector<int> got;
    int t = tokenizer::bos;
    for (int i = 0; i < 32; ++i) {
        REQUIRE(forward(fx().m, cache, t, logits));
        got.push_back(t = argmax(logits));
    }
    CHECK(got == want);
    const std::string text = fx().tok.decode(got, tokenizer::bos);
    CHECK(text.rfind("Once upon a time, there was a little girl named Lily.", 0) == 0);
    MESSAGE("greedy: " << text);

    // reset() gives the same run again
    cache.reset();
    CHECK(cache.next_position == 0);
    REQUIRE(forward(fx().m, cache, tokenizer::bos, logits));
    CHECK(argmax(logits) == 403);
}

TEST_CASE("sampling") {
    std::vector<float> l{1.0f, 3.0f, 3.0f, -2.0f};
    CHECK(argmax(l) == 1);  // ties to the lower id
    std::mt19937 a(7), b(7);
    std::vector<int> sa, sb;
    for (int i = 0; i < 50; ++i) { sa.push_back(sample(l, 0.8f, a)); sb.push_back(sample(l, 0.8f, b)); }
    CHECK(sa == sb);
    CHECK(std::count(sa.begin(), sa.end(), 3) <= 2);
    std::mt19937 c(1);
    CHECK(sample(l, 0.0f, c) == 1);
}

// ---------------------------------------------------------------------------------------------- (b) loader errors
TEST_CASE("loader: synthetic checkpoints, valid and broken") {
    const std::int32_t tied[7] = {8, 12, 2, 2, 1, 10, 4};
    const std::int32_t untied[7] = {8, 12, 2, 2, 1, -10, 4};
    model m;
    std::string p = temp_path("synthetic.bin");

    SUBCASE("valid tied and untied models load and run") {
        for (auto* h : {&tied, &untied}) {
            write_bytes(p, synthetic_checkpoint(*h, floats_for(*h)));
            load_result r = load_model(p, m);
            REQUIRE_MESSAGE(r.ok, r.error);
            CHECK(m.cfg.vocab_size == 10);
            CHECK(m.cfg.shared_classifier == ((*h)[5] > 0));
            CHECK(m.classifier().rows() == 10);
            kv_cache cache(m.cfg, 4);
            std::vector<float> logits;
            REQUIRE(forward(m, cache, 3, logits));
            CHECK(logits.size() == 10);
        }
        // cache full and bad token are reported, not crashed on
        kv_cache small(m.cfg, 1);
        std::vector<float> logits;
        CHECK(forward(m, small, 1, logits));
        result r = forward(m, small, 1, logits);
        CHECK_FALSE(r.ok);
        CHECK(r.error.find("full") != std::string::npos);
        r = forward(m, small, 99, logits);
        CHECK(r.error.find("token 99") != std::string::npos);
    }
    SUBCASE("missing file") {
        load_result r = load_model(temp_path("does_not_exist.bin"), m);
        CHECK_FALSE(r.ok);
        CHECK(r.error.find("cannot open") != std::string::npos);
    }
    SUBCASE("shorter than the header") {
        write_bytes(p, std::vector<char>(10, 0));
        load_result r = load_model(p, m);
        CHECK_FALSE(r.ok);
        CHECK(r.error.find("28-byte header") != std::string::npos);
    }
    SUBCASE("truncated body") {
        auto b = synthetic_checkpoint(tied, floats_for(tied));
        b.resize(b.size() - 100);
        write_bytes(p, b);
        load_result r = load_model(p, m);
        CHECK_FALSE(r.ok);
        CHECK(r.error.find("truncated file") != std::string::npos);
    }
    SUBCASE("trailing data") {
        auto b = synthetic_checkpoint(tied, floats_for(tied));
        b.resize(b.size() + 4);
        write_bytes(p, b);
        load_result r = load_model(p, m);
        CHECK_FALSE(r.ok);
        CHECK(r.error.find("size mismatch") != std::string::npos);
    }
    SUBCASE("bad headers") {
        struct bad_case { std::int32_t h[7]; const char* needle; };
        const bad_case cases[] = {
            {{8, 12, 2, 0, 1, 10, 4}, "n_heads = 0"},
            {{0, 12, 2, 2, 1, 10, 4}, "dim = 0"},
            {{8, -1, 2, 2, 1, 10, 4}, "hidden_dim = -1"},
            {{8, 12, 2, 2, 1, 0, 4}, "vocab_size"},
            {{8, 12, 2, 2, 1, 10, 0}, "seq_len = 0"},
            {{8, 12, 100000, 2, 1, 10, 4}, "n_layers = 100000"},
            {{1 << 30, 12, 2, 2, 1, 10, 4}, "dim = 1073741824"},
            {{12, 12, 2, 3, 2, 10, 4}, "not a multiple of n_kv_heads"},
            {{8, 12, 2, 3, 1, 10, 4}, "not a multiple of n_heads"},
            {{6, 12, 2, 2, 1, 10, 4}, "odd"},
        };
        for (const auto& c : cases) {
            write_bytes(p, synthetic_checkpoint(c.h, 1000));
            load_result r = load_model(p, m);
            CHECK_FALSE(r.ok);
            CHECK_MESSAGE(r.error.find(c.needle) != std::string::npos, r.error);
        }
    }
    std::remove(p.c_str());
}

TEST_CASE("loader: broken copies of the real checkpoint and tokenizer") {
    REQUIRE_MODEL_OR_SKIP();
    const std::vector<char> orig = read_bytes(model_file(fx().dir));
    REQUIRE(orig.size() == 1056540);
    model m;
    std::string p = temp_path("stories.bin");

    write_bytes(p, std::vector<char>(orig.begin(), orig.begin() + long(orig.size() / 2)));
    load_result r = load_model(p, m);
    CHECK_FALSE(r.ok);
    CHECK_MESSAGE(r.error.find("truncated file") != std::string::npos, r.error);
    CHECK(r.error.find("1056540") != std::string::npos);

    std::vector<char> b = orig;
    const std::int32_t zero = 0;
    std::memcpy(b.data() + 12, &zero, 4);  // n_heads = 0
    write_bytes(p, b);
    r = load_model(p, m);
    CHECK_FALSE(r.ok);
    CHECK_MESSAGE(r.error.find("n_heads = 0") != std::string::npos, r.error);

    b = orig;
    b.insert(b.end(), 8, '\0');
    write_bytes(p, b);
    r = load_model(p, m);
    CHECK_FALSE(r.ok);
    CHECK_MESSAGE(r.error.find("size mismatch") != std::string::npos, r.error);

    tokenizer t;
    r = t.load(temp_path("no_tok.bin"), 512);
    CHECK(r.error.find("cannot open") != std::string::npos);
    const std::vector<char> tb = read_bytes(tokenizer_file(fx().dir));
    write_bytes(p, std::vector<char>(tb.begin(), tb.end() - 3));
    r = t.load(p, 512);
    CHECK(r.error.find("truncated tokenizer") != std::string::npos);
    r = t.load(tokenizer_file(fx().dir), 500);
    CHECK(r.error.find("trailing bytes") != std::string::npos);
    std::remove(p.c_str());
}

// ---------------------------------------------------------------------------------------------- (c) compaction
namespace {
/// Hand compaction of one head: moves kept rows (keys, values, positions) down using raw pointers
/// and strides, exactly as an external eviction library would, then sets len.
void compact_by_hand(kv_cache& c, int l, int h, const std::vector<int>& keep) {
    float* K = c.keys(l) + h * c.head_stride();
    float* V = c.values(l) + h * c.head_stride();
    std::int32_t* P = c.positions(l) + h * c.position_head_stride();
    for (size_t i = 0; i < keep.size(); ++i) {
        const auto src = size_t(keep[i]);
        std::copy_n(K + src * size_t(c.slot_stride()), c.head_dim(), K + i * size_t(c.slot_stride()));
        std::copy_n(V + src * size_t(c.slot_stride()), c.head_dim(), V + i * size_t(c.slot_stride()));
        P[i] = P[src];
    }
    c.lengths(l)[h] = std::int32_t(keep.size());
}
}  // namespace

TEST_CASE("compaction: keeping everything changes nothing") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const std::vector<int> prompt = prompt_tokens(fx().tok, 200);
    kv_cache a(m.cfg, int(prompt.size()) + 4);
    std::vector<float> la, lb;
    REQUIRE(prefill(m, a, prompt, la));
    kv_cache b = a;
    for (int l = 0; l < m.cfg.n_layers; ++l)
        for (int h = 0; h < m.cfg.n_kv_heads; ++h) {
            std::vector<int> all(size_t(b.length(l, h)));
            std::iota(all.begin(), all.end(), 0);
            compact_by_hand(b, l, h, all);
        }
    const int t = argmax(la);
    REQUIRE(forward(m, a, t, la));
    REQUIRE(forward(m, b, t, lb));
    CHECK(la == lb);
}

TEST_CASE("compaction: decode after hand-compaction equals the masked full cache") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const std::vector<int> prompt = prompt_tokens(fx().tok, 300);
    const int n = int(prompt.size());
    MESSAGE("prompt tokens: " << n);
    REQUIRE(n > 40);
    const int steps = 6;

    kv_cache full(c, n + steps);
    std::vector<float> logits_full;
    REQUIRE(prefill(m, full, prompt, logits_full));
    kv_cache evicted = full;
    kv_cache plain = full;  // unmasked full cache, to show eviction actually matters

    // kept[l][h][s] for s < n: a different, irregular pattern per head; some heads keep everything.
    std::vector<std::vector<std::vector<char>>> kept(size_t(c.n_layers),
                                                     std::vector<std::vector<char>>(size_t(c.n_kv_heads), std::vector<char>(size_t(n), 1)));
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h) {
            if ((l + h) % 3 == 0) continue;  // untouched head
            std::vector<int> keep;
            for (int s = 0; s < n; ++s) {
                const bool k = s < 2 || s >= n - 6 || (s * 7 + l * 3 + h) % 5 < 1 + h % 2;
                kept[size_t(l)][size_t(h)][size_t(s)] = k;
                if (k) keep.push_back(s);
            }
            compact_by_hand(evicted, l, h, keep);
        }
    // heads now differ in length, positions are the original ones
    CHECK(evicted.length(0, 1) != evicted.length(0, 2));
    CHECK(evicted.length(0, 0) == n);
    for (int h = 0; h < c.n_kv_heads; ++h) {
        const int len = evicted.length(1, h);
        bool increasing = true, shifted = false;
        for (int s = 0; s < len; ++s) {
            increasing = increasing && (s == 0 || evicted.position(1, h, s) > evicted.position(1, h, s - 1));
            shifted = shifted || evicted.position(1, h, s) != s;
        }
        CHECK(increasing);
        CHECK(shifted == (len < n));  // compacted heads hold tokens away from their original slots
    }
    CHECK(evicted.next_position == n);

    forward_options masked;
    masked.slot_visible = [&](int l, int h, int s) { return s >= n || kept[size_t(l)][size_t(h)][size_t(s)] != 0; };
    std::vector<std::vector<float>> o_ref(size_t(c.n_layers)), o_ev(size_t(c.n_layers)), o_plain(size_t(c.n_layers));
    auto rec = [&c](std::vector<std::vector<float>>& dst) {
        return [&dst, &c](int l, const float* o) { dst[size_t(l)].assign(o, o + c.dim); };
    };
    masked.on_head_output = rec(o_ref);
    forward_options ev_opt, plain_opt;
    ev_opt.on_head_output = rec(o_ev);
    plain_opt.on_head_output = rec(o_plain);
    double prob_sum_err = 0;
    ev_opt.on_attention = [&](int, int, const float* p, int len) {
        prob_sum_err = std::max(prob_sum_err, std::abs(std::accumulate(p, p + len, 0.0) - 1.0));
    };

    std::vector<float> lr, le, lp;
    int t = argmax(logits_full);
    float worst = 0, evict_effect = 0;
    for (int i = 0; i < steps; ++i) {
        REQUIRE(forward(m, full, t, lr, masked));
        REQUIRE(forward(m, evicted, t, le, ev_opt));
        REQUIRE(forward(m, plain, t, lp, plain_opt));
        worst = std::max(worst, max_abs_diff(lr, le));
        evict_effect = std::max(evict_effect, max_abs_diff(lp, le));
        for (int l = 0; l < c.n_layers; ++l) CHECK(max_abs_diff(o_ref[size_t(l)], o_ev[size_t(l)]) < 1e-5f);
        t = argmax(le);
        // the new token went to slot len-1 of every head, at logical position n + i
        for (int h = 0; h < c.n_kv_heads; ++h) {
            const int len = evicted.length(2, h);
            CHECK(evicted.position(2, h, len - 1) == n + i);
        }
    }
    // relative attention-output error of the eviction in the last step, layer 4 (just reported)
    Eigen::Map<const vector> op(o_plain[4].data(), c.dim), oe(o_ev[4].data(), c.dim);
    MESSAGE("max |masked-full - compacted| logit diff: " << worst << "; eviction effect on logits: " << evict_effect
                                                         << "; layer-4 ||o-o_ev||/||o||: " << (op - oe).norm() / op.norm());
    CHECK(worst < 1e-4f);
    CHECK(evict_effect > 1e-3f);  // the test is not vacuous
    CHECK(prob_sum_err < 1e-5);
    CHECK(evicted.next_position == n + steps);
    CHECK(full.next_position == n + steps);
}

TEST_CASE("hooks: query window and wo access") {
    REQUIRE_MODEL_OR_SKIP();
    const model& m = fx().m;
    const config& c = m.cfg;
    const std::vector<int> prompt = prompt_tokens(fx().tok, 80);
    const int w = 8;
    query_window qw(c, w);
    std::vector<float> last_q;
    int calls = 0;
    forward_options opt;
    auto base = qw.hook();
    opt.on_query = [&](int l, std::int32_t pos, const float* q) {
        base(l, pos, q);
        ++calls;
        if (l == 3) last_q.assign(q, q + c.dim);
    };
    kv_cache cache(c, int(prompt.size()));
    std::vector<float> logits;
    REQUIRE(prefill(m, cache, prompt, logits, opt));
    CHECK(calls == int(prompt.size()) * c.n_layers);
    CHECK(qw.count(3) == w);
    const std::vector<float> q3 = qw.queries(3);  // (n_heads, w, head_dim)
    REQUIRE(q3.size() == size_t(c.n_heads * w * c.head_dim()));
    const int hd = c.head_dim();
    for (int h = 0; h < c.n_heads; ++h)
        for (int d = 0; d < hd; ++d) CHECK(q3[size_t((h * w + (w - 1)) * hd + d)] == last_q[size_t(h * hd + d)]);
    CHECK(m.wo(3).rows() == c.dim);
    CHECK(m.wo(3).cols() == c.dim);
}
