// kvevict_engine example CLI: continue a prompt with the stories260K model, optionally evicting the KV cache.
// Usage: generate [--model DIR] [--prompt TEXT] [--steps N] [--temperature T] [--seed S]
//                 [--evict restkv|snapkv|pyramidkv|adakv|h2o|tova|streaming_llm --keep X [--chunk N] [--interval N]
//                  [--paged [--page-size N]]]
//                 [--evict lkv --keep R [--lkv-mode a|b] [--interval S] [--artifact FILE] [--paged [--page-size N]]]
// --paged: the KV cache is paged (one-head pages of --page-size slots, per-KV-head page tables; kv_cache.hpp),
// evictions free pages (the presets through kvevict::cpu::compact_paged, lkv_session by moving its kept rows
// through the page table), and the pages in use before and after every layer's eviction go to stderr.
// Build: g++ -std=c++17 -O2 -Iinclude -I/usr/include/eigen3 -DKVEVICT_SOURCE_DIR="\"$PWD\"" examples/engine/generate_main.cpp -o kvevict_generate
#include "evict.hpp"
#include "forward.hpp"
#include "lkv_decode.hpp"
#include "model_path.hpp"
#include "tokenizer.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

using namespace kvevict_engine;

namespace {
int usage(const char* argv0, const std::string& why) {
    if (!why.empty()) std::fprintf(stderr, "error: %s\n", why.c_str());
    std::fprintf(stderr,
                 "usage: %s [--model DIR] [--prompt TEXT] [--steps N] [--temperature T] [--seed S]\n"
                 "  --model DIR      model folder (default: $KVEVICT_MODEL_DIR, else <repo>/../shared/models/stories260K)\n"
                 "  --prompt TEXT    prompt (default: empty, i.e. start from BOS)\n"
                 "  --steps N        tokens to generate (default 64)\n"
                 "  --temperature T  0 = greedy (default 0)\n"
                 "  --seed S         RNG seed for sampling (default 42)\n"
                 "  --evict NAME     evict the KV cache with a kvevict preset: restkv, snapkv, pyramidkv, adakv, h2o, tova,\n"
                 "                   streaming_llm,\n"
                 "                   or lkv (learned budgets + scorer, artifacts/lkv; docs/lkv.md) (default: none)\n"
                 "  --keep X         per-head budget: a fraction in (0, 1), or a token count >= 1 (required with --evict);\n"
                 "                   lkv: the global keep ratio R (or tokens per head on average)\n"
                 "  --chunk N        chunked prefill: evict after every N prompt tokens (default: once, after the prompt)\n"
                 "  --interval N     decode-time cap: evict every N generated tokens (needs a token count for --keep);\n"
                 "                   lkv mode b: recompute budgets and evict every N generated tokens (default 1)\n"
                 "  --lkv-mode M     lkv decoding: a = budgets fixed at prefill, generated tokens appended;\n"
                 "                   b = budgets track the tokens seen, heads over budget drop (default a)\n"
                 "  --artifact FILE  lkv tables (default: $KVEVICT_LKV_ARTIFACT, else <repo>/artifacts/lkv/stories260K.lkv)\n"
                 "  --paged          paged KV cache: pages of one KV head, a page table per KV head; evictions free pages\n"
                 "                   and print the pages in use before -> after per layer and head to stderr\n"
                 "                   (presets and lkv: LKV's head-wise budgets free pages per head)\n"
                 "  --page-size N    slots per page with --paged (default 16)\n",
                 argv0);
    return 2;
}
bool parse_number(const char* s, double& out) {
    char* end = nullptr;
    out = std::strtod(s, &end);
    return end != s && *end == '\0';
}
}  // namespace

int main(int argc, char** argv) {
    std::string model_flag, prompt;
    int steps = 64;
    float temperature = 0.0f;
    unsigned seed = 42;
    std::string evict_name;
    double keep = 0;
    int chunk = 0, interval = 0;
    std::string lkv_mode, artifact_flag;  // lkv_mode empty: b
    bool paged = false;
    int page_size = 0;  // 0: not given (16 with --paged)
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") return usage(argv[0], "");
        if (a == "--paged") { paged = true; continue; }
        if (i + 1 >= argc) return usage(argv[0], "missing value for " + a);
        const char* v = argv[++i];
        double x = 0;
        if (a == "--model") model_flag = v;
        else if (a == "--prompt") prompt = v;
        else if (a == "--steps") {
            if (!parse_number(v, x) || x < 0 || x > 1e6) return usage(argv[0], "--steps needs a count in 0..1000000");
            steps = int(x);
        } else if (a == "--temperature") {
            if (!parse_number(v, x) || x < 0) return usage(argv[0], "--temperature needs a number >= 0");
            temperature = float(x);
        } else if (a == "--seed") {
            if (!parse_number(v, x) || x < 0) return usage(argv[0], "--seed needs a non-negative integer");
            seed = unsigned(x);
        } else if (a == "--evict") {
            evict_name = v;
        } else if (a == "--keep") {
            if (!parse_number(v, x) || !(x > 0) || x > 1e6 || (x >= 1 && x != double(long(x))))
                return usage(argv[0], "--keep needs a fraction in (0, 1) or a token count >= 1");
            keep = x;
        } else if (a == "--chunk") {
            if (!parse_number(v, x) || x < 1 || x > 1e6) return usage(argv[0], "--chunk needs a count in 1..1000000");
            chunk = int(x);
        } else if (a == "--interval") {
            if (!parse_number(v, x) || x < 1 || x > 1e6) return usage(argv[0], "--interval needs a count in 1..1000000");
            interval = int(x);
        } else if (a == "--lkv-mode") {
            if (std::string(v) != "a" && std::string(v) != "b") return usage(argv[0], "--lkv-mode needs a or b, got '" + std::string(v) + "'");
            lkv_mode = v;
        } else if (a == "--artifact") {
            artifact_flag = v;
        } else if (a == "--page-size") {
            if (!parse_number(v, x) || x < 1 || x > 1e6 || x != double(long(x))) return usage(argv[0], "--page-size needs a count in 1..1000000");
            page_size = int(x);
        } else return usage(argv[0], "unknown option " + a);
    }

    const std::string dir = resolve_model_dir(model_flag);
    model m;
    if (load_result r = load_model(model_file(dir), m); !r) {
        std::fprintf(stderr, "error: %s\n(model folder: %s; use --model DIR or KVEVICT_MODEL_DIR)\n", r.error.c_str(), dir.c_str());
        return 1;
    }
    tokenizer tok;
    if (load_result r = tok.load(tokenizer_file(dir), m.cfg.vocab_size); !r) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
    }

    const std::vector<int> tokens = tok.encode(prompt);
    if (page_size > 0 && !paged) return usage(argv[0], "--page-size needs --paged");
    if (paged && page_size == 0) page_size = 16;
    if (evict_name == "lkv") {
        if (!(keep > 0)) return usage(argv[0], "--evict lkv needs --keep");
        if (chunk > 0) return usage(argv[0], "--chunk does not apply to lkv (its prefill is layer-wise)");
        if (lkv_mode == "a" && interval > 0) return usage(argv[0], "--interval applies to --lkv-mode b only");
        const char* env = std::getenv("KVEVICT_LKV_ARTIFACT");
        const std::string art_path = !artifact_flag.empty() ? artifact_flag
                                     : env && *env ? std::string(env) : std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
        kvevict::io::lkv_artifact art;
        kvevict::io::lkv_model_identity id;
        kvevict::status st = kvevict::io::read_lkv_artifact(art_path.c_str(), &art);
        if (st.ok()) st = kvevict::io::checkpoint_identity(model_file(dir).c_str(), &id);
        if (st.ok()) st = kvevict::io::check_model(art, id);
        if (!st.ok()) {
            std::fprintf(stderr, "error: %s (artifact %s)\n", st.message(), art_path.c_str());
            return 1;
        }
        if (lkv_mode.empty()) lkv_mode = "a";  // what training optimises; mode B s = 1 is far worse with this artifact (docs/lkv.md)
        lkv_decode_options o;
        o.mode = lkv_mode == "a" ? lkv_decode_mode::a : lkv_decode_mode::b;
        o.budget = keep >= 1 ? kvevict::budget_request::tokens(std::int32_t(keep)) : kvevict::budget_request::fraction(keep);
        o.interval = interval > 0 ? interval : 1;
        o.page_size = paged ? page_size : 0;
        lkv_session session(m, kvevict::io::scorer_params(art), kvevict::io::budgeter_params(art), o, int(tokens.size()) + steps);
        if (paged) {  // every layer's pages in use before -> after its eviction (per KV head), as for the presets
            auto round = std::make_shared<int>(0);
            session.on_layer_evicted = [round](int layer, const std::vector<int>& before, const std::vector<int>& after) {
                if (layer == 0) ++*round;
                std::fprintf(stderr, "[eviction %d] pages in use: %s\n", *round, pages_line(layer, before, after).c_str());
            };
        }
        std::vector<float> logits;
        const auto t0 = std::chrono::steady_clock::now();
        if (result r = session.prefill(tokens, logits); !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 1;
        }
        std::mt19937 rng(seed);
        std::printf("%s", tok.decode(tokens).c_str());
        int prev = tokens.back(), generated = 0;
        while (generated < steps) {
            const int next = sample(logits, temperature, rng);
            if (next == tokenizer::bos || next == tokenizer::eos) break;
            std::printf("%s", tok.decode_piece(prev, next).c_str());
            std::fflush(stdout);
            prev = next;
            if (++generated == steps) break;
            if (result r = session.decode(next, logits); !r) {
                std::fprintf(stderr, "\nerror: %s\n", r.error.c_str());
                return 1;
            }
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("\n");
        std::fprintf(stderr, "[%zu prompt tokens, %d generated, %.1f tok/s]\n", tokens.size(), generated,
                     double(tokens.size() + size_t(generated)) / std::max(secs, 1e-9));
        std::fprintf(stderr, "[LKV mode %s%s: %d evictions, KV slots now %lld of %lld seen (all layers and heads), peak %lld]\n",
                     lkv_mode.c_str(), o.mode == lkv_decode_mode::b ? (" interval " + std::to_string(o.interval)).c_str() : "",
                     session.evictions(), static_cast<long long>(session.kv_tokens()),
                     static_cast<long long>(session.tokens_seen()) * m.cfg.n_layers * m.cfg.n_kv_heads,
                     static_cast<long long>(session.peak_kv_tokens()));
        return 0;
    }
    if (!lkv_mode.empty()) return usage(argv[0], "--lkv-mode needs --evict lkv");
    if (!artifact_flag.empty()) return usage(argv[0], "--artifact needs --evict lkv");

    method meth;
    meth.name = "none";
    if (evict_name == "restkv") meth = policy_method<kvevict::presets::restkv>("ReST-KV");
    else if (evict_name == "snapkv") meth = policy_method<kvevict::presets::snapkv>("SnapKV");
    else if (evict_name == "pyramidkv") meth = policy_method<kvevict::presets::pyramidkv>("PyramidKV");
    else if (evict_name == "adakv") meth = policy_method<kvevict::presets::adakv>("AdaKV");
    else if (evict_name == "tova") meth = policy_method<kvevict::presets::tova>("TOVA");
    else if (evict_name == "h2o") meth = policy_method<kvevict::presets::h2o>("H2O", kvevict::presets::h2o::defaults(), -1);
    else if (evict_name == "streaming_llm") meth = policy_method<kvevict::presets::streaming_llm>("StreamingLLM", kvevict::presets::streaming_llm::defaults(), 0);
    else if (!evict_name.empty() && evict_name != "none") return usage(argv[0], "--evict: unknown method '" + evict_name + "'");
    const bool evicting = bool(meth.evict);
    if (evicting && keep <= 0) return usage(argv[0], "--evict needs --keep");
    if (!evicting && (keep > 0 || chunk > 0 || interval > 0)) return usage(argv[0], "--keep, --chunk and --interval need --evict");
    session_options so;
    so.prefill = !evicting ? prefill_mode::none : chunk > 0 ? prefill_mode::chunked : prefill_mode::one_shot;
    so.chunk = chunk;
    so.decode_interval = interval;
    so.budget = keep >= 1 ? kvevict::budget_request::tokens(std::int32_t(keep)) : kvevict::budget_request::fraction(keep);
    so.page_size = paged ? page_size : 0;
    if (paged && evicting) {
        // Report every layer's pages in use before -> after its eviction (per KV head).
        auto inner = meth.evict;
        auto round = std::make_shared<int>(0);
        meth.evict = [inner, round](const layer_state& st) {
            const kv_cache& c = *st.cache;
            std::vector<int> before(size_t(c.n_kv_heads())), after(before.size());
            for (int h = 0; h < c.n_kv_heads(); ++h) before[size_t(h)] = c.pages_in_use(st.layer, h);
            const result r = inner(st);
            if (!r) return r;
            for (int h = 0; h < c.n_kv_heads(); ++h) after[size_t(h)] = c.pages_in_use(st.layer, h);
            if (st.layer == 0) ++*round;
            std::fprintf(stderr, "[eviction %d] pages in use: %s\n", *round, pages_line(st.layer, before, after).c_str());
            return r;
        };
    }
    wo_factors wo;
    if (evicting)
        if (result r = wo.compute(m); !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 1;
        }

    eviction_session session(m, wo, meth, so, int(tokens.size()) + steps);
    std::vector<float> logits;
    const auto t0 = std::chrono::steady_clock::now();
    if (result r = session.prefill(tokens, logits); !r) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
    }
    std::mt19937 rng(seed);
    std::printf("%s", tok.decode(tokens).c_str());
    int prev = tokens.back(), generated = 0;
    while (generated < steps) {
        const int next = sample(logits, temperature, rng);
        if (next == tokenizer::bos || next == tokenizer::eos) break;  // llama2.c: BOS delimits stories
        std::printf("%s", tok.decode_piece(prev, next).c_str());
        std::fflush(stdout);
        prev = next;
        if (++generated == steps) break;  // no need to run the last token
        if (result r = session.decode(next, logits); !r) {
            std::fprintf(stderr, "\nerror: %s\n", r.error.c_str());
            return 1;
        }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("\n");
    std::fprintf(stderr, "[%zu prompt tokens, %d generated, %.1f tok/s]\n", tokens.size(), generated,
                 double(tokens.size() + size_t(generated)) / std::max(s, 1e-9));
    if (evicting) {
        const kv_cache& c = session.cache();
        long kept = 0;
        for (int l = 0; l < c.n_layers(); ++l)
            for (int h = 0; h < c.n_kv_heads(); ++h) kept += c.length(l, h);
        std::fprintf(stderr, "[%s: %d evictions, KV slots now %ld of %ld (all layers and heads), peak %d per head]\n", meth.name.c_str(),
                     session.evictions(), kept, long(c.next_position) * c.n_layers() * c.n_kv_heads(), session.max_length_seen());
    }
    if (paged) {
        const kv_cache& c = session.cache();
        long used = 0;
        for (int l = 0; l < c.n_layers(); ++l) used += c.pages_in_use(l);
        std::fprintf(stderr, "[paged cache: page size %d, %d pages per layer pool, %ld pages in use now (all layers), %ld KiB of K+V pages]\n",
                     c.page_size(), c.num_pages(), used, used * c.page_size() * c.head_dim() * 2 * long(sizeof(float)) / 1024);
    }
    if (int(tokens.size()) + generated > m.cfg.seq_len)
        std::fprintf(stderr, "note: ran past the model's training context (%d tokens)\n", m.cfg.seq_len);
    return 0;
}
