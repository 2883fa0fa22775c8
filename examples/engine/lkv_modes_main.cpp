// kvevict_lkv_modes: LKV decoding mode A vs mode B on the real stories260K model (docs/lkv.md,
// "Decoding: mode A vs mode B").
//
// For every held-out sherlock.txt excerpt of prompt_tokens + steps tokens (the fidelity report's
// excerpt rule, examples/fidelity: starts spread evenly over the text, moved to the next paragraph;
// with the defaults 256 + 192 = 448 these are exactly the report's 6 prompts, which the LKV
// trainer excluded from training):
//   full run     prefill the first prompt_tokens tokens, then feed the TRUE next `steps` tokens of the
//                excerpt one by one (teacher forcing), full cache;
//   LKV runs     lkv_session (layer-wise prefill, evicted to floor(R * N * prompt) tokens), the same
//                tokens fed; mode A (budgets fixed at prefill, generated tokens appended) and mode B
//                with each interval s (budgets recomputed for the current t every s tokens);
//   metrics      KL(full || LKV) of the next-token distributions after each fed token (fp64, nats),
//                mean over the `steps` positions, and over its first and second half; top-1 agreement;
//                KV tokens (valid slots over all layers and heads): peak during the prefill, peak while
//                decoding (right after a token is appended, before a step) and at the end, and how many of
//                the end's come from the prompt (position < prompt_tokens).
// Prints a table; --out DIR writes lkv_modes.csv (means) and lkv_modes_per_prompt.csv.
// --smoke: 1 prompt, 64 + 16 tokens, keep 0.2, intervals 1 and 4; exit 0 with a message when the
// model, text or artifact is missing; exit 1 when a number is not finite.
#include "forward.hpp"
#include "lkv_decode.hpp"
#include "model_path.hpp"
#include "report_util.hpp"
#include "tokenizer.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

using namespace kvevict_engine;

namespace {

struct options {
    std::string model_flag, data_flag, artifact_flag, out_dir;
    int prompts = 6, prompt_tokens = 256, steps = 192;
    int protect_prefix = 0, protect_recent = 0;  // lkv_decode_options (both modes)
    std::vector<double> fractions{0.1, 0.2};
    std::vector<int> intervals{1, 16};
    bool smoke = false;
};

int usage(const char* argv0, const std::string& why) {
    if (!why.empty()) std::fprintf(stderr, "error: %s\n", why.c_str());
    std::fprintf(stderr,
                 "usage: %s [--smoke] [--model DIR] [--data DIR] [--artifact FILE] [--out DIR] [--prompts N]\n"
                 "          [--prompt-tokens N] [--steps N] [--fractions F,F,..] [--intervals S,S,..]\n"
                 "          [--protect-prefix N] [--protect-recent N]\n"
                 "  --model DIR        model folder (default $KVEVICT_MODEL_DIR, else <repo>/../shared/models/stories260K)\n"
                 "  --data DIR         folder with sherlock.txt (default $KVEVICT_DATA_DIR, else <repo>/../shared/data/text)\n"
                 "  --artifact FILE    LKV tables (default $KVEVICT_LKV_ARTIFACT, else <repo>/artifacts/lkv/stories260K.lkv)\n"
                 "  --out DIR          write lkv_modes.csv and lkv_modes_per_prompt.csv there\n"
                 "  --prompts N        excerpts (default 6)\n"
                 "  --prompt-tokens N  prefilled tokens per excerpt, BOS included (default 256)\n"
                 "  --steps N          teacher-forced continuation tokens (default 192)\n"
                 "  --fractions LIST   keep ratios R in (0, 1] (default 0.1,0.2)\n"
                 "  --intervals LIST   mode-B intervals s >= 1 (default 1,16)\n"
                 "  --protect-prefix N never evict the first N tokens (both modes; default 0)\n"
                 "  --protect-recent N never evict the N most recent tokens (both modes; default 0)\n"
                 "  --smoke            1 prompt, 64 + 16 tokens, keep 0.2, intervals 1,4\n",
                 argv0);
    return 2;
}

struct run_metrics {
    double kl = 0, kl_first = 0, kl_second = 0, top1 = 0;
    std::int64_t peak_prefill = 0, peak_decode = 0, final_tokens = 0;
    double prompt_kept = 0;  // tokens of the prompt still cached at the end (all heads)
};

struct row {
    std::string mode;  // "A" or "B"
    int interval = 0;
    double keep = 0;
    std::vector<run_metrics> per_prompt;
};

}  // namespace

int main(int argc, char** argv) {
    options opt;
    std::string fractions_flag, intervals_flag;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") return usage(argv[0], "");
        if (a == "--smoke") { opt.smoke = true; continue; }
        if (i + 1 >= argc) return usage(argv[0], "missing value for " + a);
        const std::string v = argv[++i];
        if (a == "--model") opt.model_flag = v;
        else if (a == "--data") opt.data_flag = v;
        else if (a == "--artifact") opt.artifact_flag = v;
        else if (a == "--out") opt.out_dir = v;
        else if (a == "--fractions") fractions_flag = v;
        else if (a == "--intervals") intervals_flag = v;
        else if (a == "--prompts") { if (!parse_int(v, 1, 64, opt.prompts)) return usage(argv[0], "--prompts needs 1..64, got '" + v + "'"); }
        else if (a == "--prompt-tokens") { if (!parse_int(v, 2, 4096, opt.prompt_tokens)) return usage(argv[0], "--prompt-tokens needs 2..4096, got '" + v + "'"); }
        else if (a == "--protect-prefix") { if (!parse_int(v, 0, 4096, opt.protect_prefix)) return usage(argv[0], "--protect-prefix needs 0..4096, got '" + v + "'"); }
        else if (a == "--protect-recent") { if (!parse_int(v, 0, 4096, opt.protect_recent)) return usage(argv[0], "--protect-recent needs 0..4096, got '" + v + "'"); }
        else if (a == "--steps") { if (!parse_int(v, 1, 4096, opt.steps)) return usage(argv[0], "--steps needs 1..4096, got '" + v + "'"); }
        else return usage(argv[0], "unknown option " + a);
    }
    if (opt.smoke) {
        opt.prompts = 1;
        opt.prompt_tokens = 64;
        opt.steps = 16;
        opt.fractions = {0.2};
        opt.intervals = {1, 4};
    }
    std::string bad;
    if (!fractions_flag.empty() && !parse_fraction_list(fractions_flag, opt.fractions, bad))
        return usage(argv[0], "--fractions: '" + bad + "' is not in (0, 1]");
    if (!intervals_flag.empty() && !parse_int_list(intervals_flag, 1, 1 << 20, opt.intervals, bad))
        return usage(argv[0], "--intervals: '" + bad + "' is not an integer >= 1");
    Eigen::setNbThreads(1);

    const std::string mdir = resolve_model_dir(opt.model_flag);
    const std::string ddir = resolve_data_dir(opt.data_flag);
    const char* env_art = std::getenv("KVEVICT_LKV_ARTIFACT");
    const std::string art_path = !opt.artifact_flag.empty() ? opt.artifact_flag
                                 : env_art && *env_art ? std::string(env_art) : std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
    const std::string text_path = ddir + "/sherlock.txt";
    std::error_code ec;
    if (!model_dir_exists(mdir) || !std::filesystem::is_regular_file(text_path, ec) || !std::filesystem::is_regular_file(art_path, ec)) {
        std::fprintf(stderr, "%s: model folder %s, text %s or artifact %s missing (use --model / --data / --artifact)\n",
                     opt.smoke ? "skipping" : "error", mdir.c_str(), text_path.c_str(), art_path.c_str());
        return opt.smoke ? 0 : 1;
    }
    model m;
    if (load_result r = load_model(model_file(mdir), m); !r) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
    }
    tokenizer tok;
    if (load_result r = tok.load(tokenizer_file(mdir), m.cfg.vocab_size); !r) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
    }
    kvevict::io::lkv_artifact art;
    kvevict::io::lkv_model_identity id;
    kvevict::status st = kvevict::io::read_lkv_artifact(art_path.c_str(), &art);
    if (st.ok()) st = kvevict::io::checkpoint_identity(model_file(mdir).c_str(), &id);
    if (st.ok()) st = kvevict::io::check_model(art, id);
    if (!st.ok()) {
        std::fprintf(stderr, "error: %s (artifact %s)\n", st.message(), art_path.c_str());
        return 1;
    }
    std::ifstream tf(text_path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(tf)), std::istreambuf_iterator<char>());
    std::vector<std::vector<int>> excerpts;
    if (result r = make_prompts(tok, text, opt.prompts, opt.prompt_tokens + opt.steps, excerpts); !r) {
        std::fprintf(stderr, "error: %s\n", r.error.c_str());
        return 1;
    }
    const config& c = m.cfg;
    const int N = c.n_layers * c.n_kv_heads, P = opt.prompt_tokens, S = opt.steps;
    const auto sp = kvevict::io::scorer_params(art);
    const auto bp = kvevict::io::budgeter_params(art);
    const auto t0 = std::chrono::steady_clock::now();

    std::vector<row> rows;
    for (double f : opt.fractions) {
        rows.push_back({"A", 0, f, {}});
        for (int s : opt.intervals) rows.push_back({"B", s, f, {}});
    }
    for (size_t p = 0; p < excerpts.size(); ++p) {
        const std::vector<int>& ex = excerpts[p];
        const std::vector<int> prompt(ex.begin(), ex.begin() + P);
        // full-cache reference
        kv_cache full(c, P + S);
        std::vector<float> logits;
        if (result r = prefill(m, full, prompt, logits); !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 1;
        }
        std::vector<std::vector<double>> ref(static_cast<size_t>(S));
        std::vector<int> ref_top(static_cast<size_t>(S));
        for (int i = 0; i < S; ++i) {
            if (result r = forward(m, full, ex[size_t(P + i)], logits); !r) {
                std::fprintf(stderr, "error: %s\n", r.error.c_str());
                return 1;
            }
            ref[size_t(i)] = log_softmax(logits);
            ref_top[size_t(i)] = argmax(logits);
        }
        for (row& rw : rows) {
            lkv_decode_options o;
            o.mode = rw.mode == "A" ? lkv_decode_mode::a : lkv_decode_mode::b;
            o.budget = kvevict::budget_request::fraction(rw.keep);
            o.interval = rw.mode == "A" ? 1 : rw.interval;
            o.protect_prefix = opt.protect_prefix;
            o.protect_recent = opt.protect_recent;
            lkv_session s(m, sp, bp, o, P + S);
            run_metrics x;
            if (result r = s.prefill(prompt, logits); !r) {
                std::fprintf(stderr, "error: mode %s keep %.2f prompt %zu: %s\n", rw.mode.c_str(), rw.keep, p, r.error.c_str());
                return 1;
            }
            x.peak_prefill = s.peak_kv_tokens();
            s.reset_peak();
            for (int i = 0; i < S; ++i) {
                if (result r = s.decode(ex[size_t(P + i)], logits); !r) {
                    std::fprintf(stderr, "error: mode %s keep %.2f prompt %zu step %d: %s\n", rw.mode.c_str(), rw.keep, p, i, r.error.c_str());
                    return 1;
                }
                const std::vector<double> lq = log_softmax(logits);
                const std::vector<double>& lp = ref[size_t(i)];
                double kl = 0;
                for (size_t t = 0; t < lp.size(); ++t) kl += std::exp(lp[t]) * (lp[t] - lq[t]);
                kl = std::max(kl, 0.0);
                x.kl += kl / S;
                (2 * i < S ? x.kl_first : x.kl_second) += kl;
                x.top1 += (argmax(logits) == ref_top[size_t(i)] ? 1.0 : 0.0) / S;
            }
            x.kl_first /= (S + 1) / 2;
            x.kl_second /= std::max(1, S / 2);
            x.peak_decode = s.peak_kv_tokens();
            x.final_tokens = s.kv_tokens();
            const kv_cache& kc = s.cache();
            for (int l = 0; l < c.n_layers; ++l)
                for (int h = 0; h < c.n_kv_heads; ++h)
                    for (int q = 0; q < kc.length(l, h); ++q) x.prompt_kept += kc.position(l, h, q) < P ? 1 : 0;
            rw.per_prompt.push_back(x);
        }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::printf("LKV decoding, stories260K, %zu held-out sherlock.txt excerpts: %d prefilled + %d teacher-forced tokens; "
                "N = %d KV heads; full cache at the end: %d tokens (%.1f s)\n",
                excerpts.size(), P, S, N, N * (P + S), secs);
    std::printf("%-4s %4s %5s %9s %9s %9s %6s %8s %8s %8s %8s %7s\n", "mode", "s", "keep", "KL", "KL 1st", "KL 2nd", "top1", "pk pre", "pk dec",
                "final", "prompt", "B<A");
    std::ofstream csv, pp;
    if (!opt.out_dir.empty()) {
        std::filesystem::create_directories(opt.out_dir, ec);
        csv.open(opt.out_dir + "/lkv_modes.csv");
        pp.open(opt.out_dir + "/lkv_modes_per_prompt.csv");
        csv << "mode,interval,keep,prompts,prompt_tokens,steps,kl_mean,kl_first_half,kl_second_half,top1,peak_prefill_tokens,"
               "peak_decode_tokens,final_tokens,prompt_tokens_kept,full_final_tokens\n";
        pp << "mode,interval,keep,prompt,kl_mean,top1,peak_decode_tokens,final_tokens\n";
    }
    bool finite = true;
    for (const row& rw : rows) {
        run_metrics a;
        int better = 0;
        const row* modeA = nullptr;
        for (const row& o : rows)
            if (o.mode == "A" && o.keep == rw.keep) modeA = &o;
        for (size_t p = 0; p < rw.per_prompt.size(); ++p) {
            const run_metrics& x = rw.per_prompt[p];
            const double n = double(rw.per_prompt.size());
            a.kl += x.kl / n;
            a.kl_first += x.kl_first / n;
            a.kl_second += x.kl_second / n;
            a.top1 += x.top1 / n;
            a.peak_prefill = std::max(a.peak_prefill, x.peak_prefill);
            a.peak_decode = std::max(a.peak_decode, x.peak_decode);
            a.final_tokens = std::max(a.final_tokens, x.final_tokens);
            a.prompt_kept += x.prompt_kept / n;
            if (modeA && x.kl < modeA->per_prompt[p].kl) ++better;
            finite = finite && std::isfinite(x.kl);
            if (pp.is_open())
                pp << rw.mode << ',' << rw.interval << ',' << rw.keep << ',' << p << ',' << x.kl << ',' << x.top1 << ',' << x.peak_decode << ','
                   << x.final_tokens << '\n';
        }
        std::printf("%-4s %4s %4.0f%% %9.5f %9.5f %9.5f %6.3f %8lld %8lld %8lld %8.1f %7s\n", rw.mode.c_str(),
                    rw.mode == "A" ? "-" : std::to_string(rw.interval).c_str(), 100 * rw.keep, a.kl, a.kl_first, a.kl_second, a.top1,
                    static_cast<long long>(a.peak_prefill), static_cast<long long>(a.peak_decode), static_cast<long long>(a.final_tokens), a.prompt_kept,
                    rw.mode == "A" ? "-" : (std::to_string(better) + "/" + std::to_string(rw.per_prompt.size())).c_str());
        if (csv.is_open())
            csv << rw.mode << ',' << rw.interval << ',' << rw.keep << ',' << rw.per_prompt.size() << ',' << P << ',' << S << ',' << a.kl << ','
                << a.kl_first << ',' << a.kl_second << ',' << a.top1 << ',' << a.peak_prefill << ',' << a.peak_decode << ',' << a.final_tokens
                << ',' << a.prompt_kept << ',' << N * (P + S) << '\n';
    }
    std::printf("KL: mean KL(full || LKV) per continuation position, nats (1st / 2nd: halves of the continuation); "
                "pk pre / pk dec / final: KV tokens over all heads (max over prompts) at the prefill peak, the decode peak, the end; "
                "prompt: of the end's, tokens from the prompt (mean over prompts); B<A: prompts where mode B's KL is below mode A's\n");
    if (!finite) {
        std::fprintf(stderr, "error: a KL is not finite\n");
        return 1;
    }
    return 0;
}
