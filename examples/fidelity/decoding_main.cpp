// kvevict_decoding: decode-time eviction on the real stories260K model (the decoding section of the
// fidelity report, docs/fidelity.md "Decoding").
//
// For every excerpt (the fidelity report's excerpts of sherlock.txt, 448 tokens each, of which the first
// --prompt-tokens are the prompt; LKV never trained on them):
//   full run     prefill the prompt, then a greedy continuation of the full cache up to the model's
//                context (512 positions: 512 - prompt generated tokens);
//   evicted run  for every row, cap and interval beta: an eviction_session (examples/engine/evict.hpp)
//                driven by kvevict::decode_schedule: evicted after the prefill and after every beta
//                generated tokens to the cap B = floor(keep * 512) tokens per head (the budget of every
//                preset; head-wise budgeters share B * heads), the observation window = the method's last
//                32 queries across evictions (H2O: every query so far); the full run's tokens fed back
//                (teacher forcing). LKV also runs in its own decoding modes (lkv_session): mode A (the
//                prompt evicted to LKV-H's budgets for B, generated tokens appended, never evicted) and
//                mode B (LKV-H's global budgets for min(B, t) per head recomputed every beta tokens), and
//                mode B with the 8 most recent tokens protected (decode_schedule's protect_recent); rows
//                "LKVd ..." do the same with the artifact trained for decoding (stories260K_decode.lkv);
//   metrics      KL(full || evicted) of the next-token distributions after each generated token (fp64,
//                nats), mean over the generated positions; top-1 agreement; peak KV tokens while decoding
//                (valid slots over every layer and KV head right after a token is appended, before an
//                eviction; the prefill's N * prompt is the same for every row and not counted), as tokens
//                per head (peak / (layers * kv_heads)) and as a share of the full cache at the end.
// Prints the table, writes decoding.csv (means over excerpts) and decoding_per_prompt.csv to --out.
// --smoke: 1 excerpt, 64-token prompt, 192 positions, keep 0.2, beta 1 and 16, rows SnapKV, StreamingLLM
// and the LKV modes; exit 0 with a message when the model or text is missing; exit 1 when a figure is
// not finite or the table is incomplete.
#include "evict.hpp"
#include "lkv_decode.hpp"
#include "methods.hpp"
#include "model_path.hpp"
#include "report_util.hpp"
#include "tokenizer.hpp"

#include <kvevict/backends/cpu/learned.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

using namespace kvevict_engine;
using namespace kvevict_fidelity;

namespace {

struct options {
    std::string model_flag, data_flag, text_flag, out_dir = ".", only, artifact_flag, decode_artifact_flag, dump;
    int prompts = 32, prompt_tokens = 96, context = 0, threads = 2;  // context 0: the model's seq_len
    std::vector<double> keeps{0.1, 0.2, 0.3};
    std::vector<int> intervals{16, 64};  // beta 1 (an eviction per token) costs 4x the rest: --intervals 1,16,64
    std::string exclude, reference = "SnapKV";
    bool smoke = false;
};

int usage(const char* argv0, const std::string& why) {
    if (!why.empty()) std::fprintf(stderr, "error: %s\n", why.c_str());
    std::fprintf(stderr,
                 "usage: %s [--smoke] [--model DIR] [--data DIR] [--text FILE] [--out DIR] [--prompts N] [--prompt-tokens N]\n"
                 "          [--context N] [--keeps F,F,..] [--intervals S,S,..] [--methods NAME,..] [--artifact FILE]\n"
                 "          [--decode-artifact FILE] [--threads N] [--dump FILE] [--exclude-windows FILE|none] [--reference NAME]\n"
                 "  --model DIR        model folder (default $KVEVICT_MODEL_DIR, else <repo>/../shared/models/stories260K)\n"
                 "  --data DIR         folder with sherlock.txt (default $KVEVICT_DATA_DIR, else <repo>/../shared/data/text)\n"
                 "  --text FILE        the prose the excerpts come from instead of <data>/sherlock.txt\n"
                 "  --out DIR          where decoding.csv and decoding_per_prompt.csv go (default .)\n"
                 "  --prompts N        excerpts (default 32: the fidelity report's, LKV's training contexts left out)\n"
                 "  --exclude-windows FILE  byte windows no excerpt may overlap (default <repo>/artifacts/lkv/train_windows.txt); none\n"
                 "  --reference NAME   the row others are compared with per excerpt, same cap and beta (default SnapKV)\n"
                 "  --prompt-tokens N  prompt tokens, BOS included, 2..448 (default 96)\n"
                 "  --context N        positions prompt + generated (default: the model's context, 512)\n"
                 "  --keeps LIST       caps as fractions of the context, per head (default 0.1,0.2,0.3)\n"
                 "  --intervals LIST   decode-time eviction every beta generated tokens (default 16,64; beta 1 costs 4x the rest)\n"
                 "  --methods LIST     only these rows (names as printed; 'LKV mode A' etc. for the LKV sessions)\n"
                 "  --artifact FILE    LKV tables (default $KVEVICT_LKV_ARTIFACT, else <repo>/artifacts/lkv/stories260K.lkv)\n"
                 "  --decode-artifact FILE  LKV tables trained for decoding, rows 'LKVd ...' (default $KVEVICT_LKV_DECODE_ARTIFACT,\n"
                 "                     else <repo>/artifacts/lkv/stories260K_decode.lkv; rows left out when missing)\n"
                 "  --threads N        runs in parallel (default 2; the figures do not depend on it)\n"
                 "  --dump FILE        tab-separated: each excerpt's prompt and fed tokens, and every run's KL (%%.17g), for\n"
                 "                     tests/python/test_press.py's decode-time check\n",
                 argv0);
    return 2;
}

/// One row of the table: an eviction method under the decode schedule, or an LKV decoding session.
struct row {
    std::string name;
    const method* meth = nullptr;  ///< null: an LKV session
    const kvevict::io::lkv_artifact* art = nullptr;  ///< the LKV session's tables
    lkv_decode_mode mode = lkv_decode_mode::b;
    int protect_recent = 0;
    bool has_interval = true;  ///< false: LKV mode A (never evicts while decoding): one column
};

struct figures {
    double kl = 0, top1 = 0;
    std::int64_t peak = 0;  ///< decode-phase peak KV tokens (all layers and heads)
    int evictions = 0;
    bool done = false;
};

struct reference {
    std::vector<int> fed;                       // generated tokens fed back, S of them
    std::vector<std::vector<double>> logp;      // S: log-softmax after each fed token
    std::vector<int> top1;                      // S: argmax after each fed token
    std::vector<float> prompt_logits;
};

result run_reference(const model& m, const std::vector<int>& prompt, int steps, reference& ref) {
    kv_cache cache(m.cfg, int(prompt.size()) + steps);
    std::vector<float> logits;
    if (result r = prefill(m, cache, prompt, logits); !r) return r;
    ref.prompt_logits = logits;
    int next = argmax(logits);
    for (int i = 0; i < steps; ++i) {
        ref.fed.push_back(next);
        if (result r = forward(m, cache, next, logits); !r) return r;
        ref.logp.push_back(log_softmax(logits));
        ref.top1.push_back(argmax(logits));
        next = ref.top1.back();
    }
    return result::success();
}

/// Feeds ref.fed through `decode` (a session's decode) and accumulates the figures.
template <class Decode>
result score(const reference& ref, Decode&& decode, figures& f) {
    std::vector<float> logits;
    const size_t S = ref.fed.size();
    for (size_t i = 0; i < S; ++i) {
        if (result r = decode(ref.fed[i], logits); !r) return result::failure("generated token " + std::to_string(i) + ": " + r.error);
        f.kl += kl_divergence(ref.logp[i], log_softmax(logits)) / double(S);
        f.top1 += (argmax(logits) == ref.top1[i] ? 1.0 : 0.0) / double(S);
    }
    return result::success();
}

result run_one(const model& m, const wo_factors& wo, const row& rw, const std::vector<int>& prompt,
               const reference& ref, int cap, int interval, figures& f) {
    const int capacity = int(prompt.size() + ref.fed.size()) + 1;
    std::vector<float> logits;
    if (rw.meth) {
        session_options o;
        o.prefill = prefill_mode::none;  // the schedule evicts after the prefill
        o.decode_interval = interval;
        o.budget = kvevict::budget_request::tokens(cap);
        o.window_across_evictions = true;
        eviction_session s(m, wo, *rw.meth, o, capacity);
        if (result r = s.prefill(prompt, logits); !r) return r;
        s.reset_peak();
        if (result r = score(ref, [&](int t, std::vector<float>& l) { return s.decode(t, l); }, f); !r) return r;
        f.peak = s.peak_kv_tokens();
        f.evictions = s.evictions();
    } else {
        lkv_decode_options o;
        o.mode = rw.mode;
        o.budget = kvevict::budget_request::tokens(cap);
        o.interval = interval;
        o.protect_recent = rw.protect_recent;
        lkv_session s(m, kvevict::io::scorer_params(*rw.art), kvevict::io::budgeter_params(*rw.art), o, capacity);
        if (result r = s.prefill(prompt, logits); !r) return r;
        s.reset_peak();
        if (result r = score(ref, [&](int t, std::vector<float>& l) { return s.decode(t, l); }, f); !r) return r;
        f.peak = s.peak_kv_tokens();
        f.evictions = s.evictions();
    }
    f.done = std::isfinite(f.kl) && std::isfinite(f.top1);
    return result::success();
}

}  // namespace

int main(int argc, char** argv) {
    options opt;
    std::string keeps_flag, intervals_flag, prompts_flag;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") return usage(argv[0], "");
        if (a == "--smoke") { opt.smoke = true; continue; }
        if (i + 1 >= argc) return usage(argv[0], "missing value for " + a);
        const std::string v = argv[++i];
        if (a == "--model") opt.model_flag = v;
        else if (a == "--data") opt.data_flag = v;
        else if (a == "--text") opt.text_flag = v;
        else if (a == "--out") opt.out_dir = v;
        else if (a == "--methods") opt.only = v;
        else if (a == "--artifact") opt.artifact_flag = v;
        else if (a == "--decode-artifact") opt.decode_artifact_flag = v;
        else if (a == "--dump") opt.dump = v;
        else if (a == "--exclude-windows") opt.exclude = v;
        else if (a == "--reference") opt.reference = v;
        else if (a == "--keeps") keeps_flag = v;
        else if (a == "--intervals") intervals_flag = v;
        else if (a == "--prompts") prompts_flag = v;
        else if (a == "--prompt-tokens") { if (!parse_int(v, 2, 448, opt.prompt_tokens)) return usage(argv[0], "--prompt-tokens needs 2..448, got '" + v + "'"); }
        else if (a == "--context") { if (!parse_int(v, 3, 1 << 20, opt.context)) return usage(argv[0], "--context needs an integer >= 3, got '" + v + "'"); }
        else if (a == "--threads") { if (!parse_int(v, 1, 64, opt.threads)) return usage(argv[0], "--threads needs 1..64, got '" + v + "'"); }
        else return usage(argv[0], "unknown option " + a);
    }
    if (opt.smoke) {
        opt.prompts = 1;
        opt.prompt_tokens = 64;
        opt.context = 192;  // cap 38 tokens: above the 32-query window SnapKV keeps
        opt.keeps = {0.2};
        opt.intervals = {1, 16};
        if (opt.only.empty()) opt.only = "SnapKV,StreamingLLM,LKV mode A,LKV mode B,LKV mode B+r8";
    }
    if (!prompts_flag.empty() && !parse_int(prompts_flag, 1, 64, opt.prompts)) return usage(argv[0], "--prompts needs 1..64, got '" + prompts_flag + "'");
    std::string bad;
    if (!keeps_flag.empty() && !parse_fraction_list(keeps_flag, opt.keeps, bad))
        return usage(argv[0], bad.empty() ? "--keeps is empty" : "--keeps: '" + bad + "' is not in (0, 1]");
    if (!intervals_flag.empty() && !parse_int_list(intervals_flag, 1, 1 << 20, opt.intervals, bad))
        return usage(argv[0], bad.empty() ? "--intervals is empty" : "--intervals: '" + bad + "' is not an integer >= 1");

    Eigen::setNbThreads(1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string mdir = resolve_model_dir(opt.model_flag), ddir = resolve_data_dir(opt.data_flag);
    const std::string text_path = opt.text_flag.empty() ? ddir + "/sherlock.txt" : opt.text_flag;
    if (!model_dir_exists(mdir) || !std::filesystem::is_regular_file(text_path)) {
        const std::string what = !model_dir_exists(mdir) ? "model folder '" + mdir + "'" : "text file '" + text_path + "'";
        if (opt.smoke) {
            std::printf("skipping decoding smoke test: %s not found (set KVEVICT_MODEL_DIR / KVEVICT_DATA_DIR)\n", what.c_str());
            return 0;
        }
        std::fprintf(stderr, "error: %s not found (use --model / --data, or KVEVICT_MODEL_DIR / KVEVICT_DATA_DIR)\n", what.c_str());
        return 1;
    }
    model m;
    if (result r = load_model(model_file(mdir), m); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }
    tokenizer tok;
    if (result r = tok.load(tokenizer_file(mdir), m.cfg.vocab_size); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }
    const config& c = m.cfg;
    if (opt.context == 0) opt.context = c.seq_len;
    if (opt.context > c.seq_len) {
        std::fprintf(stderr, "error: --context %d exceeds the model's trained context of %d tokens\n", opt.context, c.seq_len);
        return 2;
    }
    if (opt.prompt_tokens >= opt.context) return usage(argv[0], "--prompt-tokens must be below --context");
    const int S = opt.context - opt.prompt_tokens;
    // The fidelity report's excerpts (448 tokens: LKV's trainer excluded them), their first prompt_tokens.
    std::vector<std::vector<int>> prompts;
    {
        std::ifstream tf(text_path, std::ios::binary);
        const std::string text{std::istreambuf_iterator<char>(tf), std::istreambuf_iterator<char>()};
        // the fidelity report's excerpts (LKV's training contexts left out), their first prompt_tokens tokens
        excluded_windows ex;
        if (opt.exclude != "none") {
            const std::string path = opt.exclude.empty() ? std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/train_windows.txt" : opt.exclude;
            if (result r = read_excluded_windows(path, text, std::filesystem::path(text_path).filename().string(), ex); !r) {
                std::fprintf(stderr, "error: %s\n", r.error.c_str());
                return 2;
            }
        }
        std::vector<size_t> starts;
        int left = 0;
        if (result r = make_excerpts(tok, text, opt.prompts, 448, ex.windows, prompts, 0, nullptr, left, starts); !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 1;
        }
        for (auto& p : prompts) p.resize(size_t(opt.prompt_tokens));
    }
    wo_factors wo;
    if (result r = wo.compute(m); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }

    // Rows: every report row that runs without look-ahead on a GQA-native cache, then the LKV sessions. The
    // per-query-head rows (method::repeat_kv) are the fidelity report's: here every row's peak memory is
    // counted in the same GQA-native KV heads, which a cache repeated to q_heads would double.
    const std::vector<method> all = report_methods();
    std::vector<row> rows;
    for (const method& mm : all)
        if (!mm.needs_lookahead && !mm.repeat_kv) rows.push_back({mm.name, &mm, nullptr});
    // LKV sessions: the committed artifact (trained for mode A) and the one trained for decoding (mode B,
    // tools/lkv/train.py --decode-interval 4 --protect-recent 8)
    kvevict::io::lkv_artifact art, dart;
    auto load = [](const std::string& flag, const char* env_name, const char* file, kvevict::io::lkv_artifact& a) {
        const char* env = std::getenv(env_name);
        const std::string path = !flag.empty() ? flag : env && *env ? std::string(env) : std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/" + file;
        const kvevict::status s = kvevict::io::read_lkv_artifact(path.c_str(), &a);
        if (!s.ok()) std::fprintf(stderr, "note: LKV session rows of %s left out: %s\n", path.c_str(), s.message());
        return s.ok();
    };
    if (load(opt.artifact_flag, "KVEVICT_LKV_ARTIFACT", "stories260K.lkv", art)) {
        rows.push_back({"LKV mode A", nullptr, &art, lkv_decode_mode::a, 0, false});
        rows.push_back({"LKV mode B", nullptr, &art, lkv_decode_mode::b, 0, true});
        rows.push_back({"LKV mode B+r8", nullptr, &art, lkv_decode_mode::b, 8, true});
    }
    if (load(opt.decode_artifact_flag, "KVEVICT_LKV_DECODE_ARTIFACT", "stories260K_decode.lkv", dart)) {
        rows.push_back({"LKVd mode A", nullptr, &dart, lkv_decode_mode::a, 0, false});
        rows.push_back({"LKVd mode B", nullptr, &dart, lkv_decode_mode::b, 0, true});
        rows.push_back({"LKVd mode B+r8", nullptr, &dart, lkv_decode_mode::b, 8, true});
    }
    if (!opt.only.empty()) {
        std::vector<row> sel;
        for (const std::string& name : split(opt.only)) {
            bool found = false;
            for (const row& r : rows)
                if (r.name == name) { sel.push_back(r); found = true; }
            if (!found) {
                if (opt.smoke && name.rfind("LKV", 0) == 0) continue;  // no artifact: the smoke run goes on without
                for (const method& mm : all)
                    if (mm.name == name && mm.repeat_kv)
                        return usage(argv[0], "--methods: row '" + name + "' runs per query head on a cache repeated to q_heads; the decoding "
                                              "report compares GQA-native caches only (kvevict_fidelity has it)");
                return usage(argv[0], "--methods: no row named '" + name + "'");
            }
        }
        rows = sel;
    }
    const int N = c.n_layers * c.n_kv_heads;
    const double full_end = double(N) * double(opt.context);
    std::vector<int> caps;
    for (double k : opt.keeps) caps.push_back(std::max(1, int(std::floor(k * double(opt.context)))));

    std::printf("kvevict decoding: stories260K (%d layers x %d KV heads), %d excerpts of %s (the fidelity report's rule), %d-token prompts, "
                "greedy continuation of the full cache to %d positions (%d generated, teacher-forced); cap B = keep x %d tokens per head, "
                "evicted after the prefill and every beta generated tokens (kvevict::decode_schedule)\n",
                c.n_layers, c.n_kv_heads, opt.prompts, std::filesystem::path(text_path).filename().c_str(), opt.prompt_tokens, opt.context, S,
                opt.context);

    std::vector<reference> refs(prompts.size());
    for (size_t p = 0; p < prompts.size(); ++p)
        if (result r = run_reference(m, prompts[p], S, refs[p]); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }

    // jobs: (row, cap, interval, prompt); LKV mode A has one interval column (the first)
    struct job {
        size_t row, cap, interval, prompt;
    };
    std::vector<job> jobs;
    for (size_t r = 0; r < rows.size(); ++r)
        for (size_t k = 0; k < caps.size(); ++k)
            for (size_t b = 0; b < opt.intervals.size(); ++b)
                for (size_t p = 0; p < prompts.size(); ++p)
                    if (rows[r].has_interval || b == 0) jobs.push_back({r, k, b, p});
    const size_t per_row = caps.size() * opt.intervals.size() * prompts.size();
    std::vector<figures> fig(rows.size() * per_row);
    auto at = [&](size_t r, size_t k, size_t b, size_t p) -> figures& { return fig[((r * caps.size() + k) * opt.intervals.size() + b) * prompts.size() + p]; };
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::vector<std::string> errors(size_t(opt.threads));
    auto worker = [&](int id) {
        for (size_t j; !failed && (j = next++) < jobs.size();) {
            const job& jb = jobs[j];
            figures& f = at(jb.row, jb.cap, jb.interval, jb.prompt);
            if (result r = run_one(m, wo, rows[jb.row], prompts[jb.prompt], refs[jb.prompt], caps[jb.cap],
                                   opt.intervals[jb.interval], f);
                !r) {
                errors[size_t(id)] = rows[jb.row].name + " cap " + std::to_string(caps[jb.cap]) + " beta " + std::to_string(opt.intervals[jb.interval]) +
                                     " prompt " + std::to_string(jb.prompt) + ": " + r.error;
                failed = true;
            }
        }
    };
    {
        std::vector<std::thread> pool;
        for (int t = 1; t < opt.threads; ++t) pool.emplace_back(worker, t);
        worker(0);
        for (auto& t : pool) t.join();
    }
    for (const std::string& e : errors)
        if (!e.empty()) { std::fprintf(stderr, "error: %s\n", e.c_str()); return 1; }

    // means over prompts; table per cap
    std::filesystem::create_directories(opt.out_dir);
    const std::string stem = opt.smoke ? "decoding_smoke" : "decoding";
    std::ofstream csv(opt.out_dir + "/" + stem + ".csv"), pcsv(opt.out_dir + "/" + stem + "_per_prompt.csv");
    csv << "method,keep,cap_tokens,interval,kl,kl_se,top1,peak_kv_tokens,peak_tokens_per_head,peak_share_of_full,evictions,"
           "reference,kl_diff_ref,kl_diff_ref_se,wins_ref,losses_ref,sign_p_ref\n";
    // A run that never drops a token (LKV mode A when the cap holds the whole prompt: every excerpt's peak is
    // the full cache) is the full cache, not an eviction: the table says so and compares nothing with it.
    auto holds_all = [&](size_t r, size_t k, size_t b) {
        for (size_t p = 0; p < prompts.size(); ++p)
            if (at(r, k, b, p).peak < std::int64_t(N) * std::int64_t(opt.context)) return false;
        return true;
    };
    int iref = -1;
    for (size_t r = 0; r < rows.size(); ++r)
        if (rows[r].name == opt.reference) iref = int(r);
    if (iref < 0) std::printf("note: --reference row %s is not in the run; no paired comparisons\n", opt.reference.c_str());
    using paired = paired_stats;
    // row r against the reference at cap k and interval b (LKV mode A: its one column against the reference's first)
    auto compare = [&](size_t r, int ref, size_t k, size_t b) {
        if (ref < 0 || int(r) == ref) return paired{};
        const size_t rb = rows[size_t(ref)].has_interval ? b : 0;
        std::vector<double> x, y;
        for (size_t p = 0; p < prompts.size(); ++p) {
            x.push_back(at(r, k, b, p).kl);
            y.push_back(at(size_t(ref), k, rb, p).kl);
        }
        return paired_compare(x, y);
    };
    pcsv << "method,keep,cap_tokens,interval,prompt,kl,top1,peak_kv_tokens,evictions\n";
    bool complete = true;
    const double P = double(prompts.size());
    for (size_t k = 0; k < caps.size(); ++k) {
        std::printf("\nkeep %.0f%% of %d: cap %d tokens per head (%.0f KV tokens in all; the full cache ends at %.0f)\n", 100 * opt.keeps[k],
                    opt.context, caps[k], double(caps[k]) * N, full_end);
        std::printf("%-16s", "method");
        for (int b : opt.intervals) {
            const std::string h = "KL b=" + std::to_string(b);
            std::printf(" | %10s %6s %6s", h.c_str(), "top1", "peak");
        }
        std::printf("\n");
        for (size_t r = 0; r < rows.size(); ++r) {
            std::printf("%-16s", rows[r].name.c_str());
            for (size_t b = 0; b < opt.intervals.size(); ++b) {
                if (!rows[r].has_interval && b > 0) {
                    std::printf(" | %10s %6s %6s", "(no beta)", "", "");
                    continue;
                }
                double kl = 0, kl2 = 0, top1 = 0;
                std::int64_t peak = 0;
                double ev = 0;
                for (size_t p = 0; p < prompts.size(); ++p) {
                    const figures& f = at(r, k, b, p);
                    complete = complete && f.done;
                    kl += f.kl / P;
                    kl2 += f.kl * f.kl / P;
                    top1 += f.top1 / P;
                    peak = std::max(peak, f.peak);
                    ev += f.evictions / P;
                    pcsv << '"' << rows[r].name << "\"," << opt.keeps[k] << ',' << caps[k] << ',' << (rows[r].has_interval ? opt.intervals[b] : 0) << ','
                         << p << ',' << f.kl << ',' << f.top1 << ',' << f.peak << ',' << f.evictions << '\n';
                }
                const double se = P > 1 ? std::sqrt(std::max(0.0, kl2 - kl * kl) / (P - 1)) : 0.0;
                complete = complete && std::isfinite(kl) && std::isfinite(se);
                csv << '"' << rows[r].name << "\"," << opt.keeps[k] << ',' << caps[k] << ',' << (rows[r].has_interval ? opt.intervals[b] : 0) << ','
                    << kl << ',' << se << ',' << top1 << ',' << peak << ',' << double(peak) / N << ',' << double(peak) / full_end << ',' << ev;
                const paired d = holds_all(r, k, b) ? paired{} : compare(r, iref, k, b);  // the full cache is not compared
                if (d.valid) csv << ',' << opt.reference << ',' << d.d << ',' << d.se << ',' << d.wins << ',' << d.losses << ',' << d.p_sign;
                else csv << ",,,,,,";
                csv << '\n';
                if (holds_all(r, k, b)) std::printf(" | %10s %6s %6s", "(full)", "", "");  // the cap holds the whole run: nothing evicted
                else std::printf(" | %10.5f %6.3f %6.1f", kl, top1, double(peak) / N);
            }
            std::printf("\n");
        }
        // paired against the reference row at the same cap and beta, excerpt by excerpt
        if (iref >= 0) {
            std::printf("paired against %s (same cap and beta; d = mean KL(row) - KL(%s) +- its SE, * beyond the 95%% t with %d df; "
                        "wins of the row / excerpts that differ, two-sided sign-test p):\n",
                        opt.reference.c_str(), opt.reference.c_str(), int(P) - 1);
            for (size_t r = 0; r < rows.size(); ++r) {
                if (int(r) == iref) continue;
                std::string line;
                for (size_t b = 0; b < opt.intervals.size(); ++b) {
                    if ((!rows[r].has_interval && b > 0) || holds_all(r, k, b)) continue;
                    const paired d = compare(r, iref, k, b);
                    if (!d.valid) continue;
                    char buf[128];
                    std::snprintf(buf, sizeof buf, "  b=%d %+.5f+-%.5f%s (%d/%d, p %.3f)", opt.intervals[b], d.d, d.se, d.beyond ? "*" : "", d.wins,
                                  d.wins + d.losses, d.p_sign);
                    line += buf;
                }
                if (!line.empty()) std::printf("  %-16s%s\n", rows[r].name.c_str(), line.c_str());
            }
        }
    }
    if (!opt.dump.empty()) {  // lines: prompt <p> <tokens>; fed <p> <tokens>; kl <row> <keep> <cap> <interval> <p> <KL>
        std::FILE* d = std::fopen(opt.dump.c_str(), "w");
        if (!d) {
            std::fprintf(stderr, "error: cannot write --dump %s\n", opt.dump.c_str());
            return 1;
        }
        for (size_t p = 0; p < prompts.size(); ++p) {
            std::fprintf(d, "prompt\t%zu\t", p);
            for (size_t i = 0; i < prompts[p].size(); ++i) std::fprintf(d, i ? " %d" : "%d", prompts[p][i]);
            std::fprintf(d, "\nfed\t%zu\t", p);
            for (size_t i = 0; i < refs[p].fed.size(); ++i) std::fprintf(d, i ? " %d" : "%d", refs[p].fed[i]);
            std::fprintf(d, "\n");
        }
        for (size_t r = 0; r < rows.size(); ++r)
            for (size_t k = 0; k < caps.size(); ++k)
                for (size_t b = 0; b < opt.intervals.size(); ++b)
                    for (size_t p = 0; p < prompts.size(); ++p)
                        if (rows[r].has_interval || b == 0)
                            std::fprintf(d, "kl\t%s\t%g\t%d\t%d\t%zu\t%.17g\n", rows[r].name.c_str(), opt.keeps[k], caps[k],
                                         rows[r].has_interval ? opt.intervals[b] : 0, p, at(r, k, b, p).kl);
        std::fclose(d);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("\nKL: mean KL(full || evicted) over the %d generated positions, nats, mean over excerpts; top1: agreement with the full "
                "cache's next token; peak: KV tokens per head while decoding (max over excerpts of the peak over all %d heads, / %d), "
                "right after a token is appended; LKV mode A never evicts while decoding (%d tokens appended per head). %zu runs, %.0f s\n",
                S, N, N, S, jobs.size(), secs);
    if (!complete) {
        std::fprintf(stderr, "error: the decoding table is incomplete or has a non-finite figure\n");
        return 1;
    }
    return 0;
}
