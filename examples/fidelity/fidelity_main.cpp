// kvevict_fidelity: full KV cache vs evicted KV cache on the real stories260K model (the main job).
//
// For every excerpt of sherlock.txt (~prompt_tokens tokens each), every registered method
// (methods.hpp) and every keep fraction f:
//   1. full run: prefill the prompt (all queries captured), greedy continuation of `steps` tokens;
//   2. evicted run: the prefilled cache, each layer evicted once by the method (one-shot, end of prefill,
//      per-head budget floor(f * L)), then the full run's tokens fed back (teacher forcing);
//   3. metrics: mean KL(full || evicted) of the next-token distributions over the `steps` positions, top-1
//      agreement, greedy match length (steps before the first top-1 disagreement = tokens a free-running
//      greedy decode from the evicted cache reproduces), per-layer relative attention-output error
//      ||o - o_ev|| / ||o|| at the first decoding step (o: concatenated head outputs, the input of W_O,
//      from forward_options::on_head_output; "isolated": layer l's full-cache query attends the evicted
//      layer-l cache, so the error is that layer's eviction alone; also after W_O and "propagated"),
//      bytes of fp32 K+V kept.
// Per-query-head rows (method::repeat_kv: ReST-KV-pqh, SnapKV-pqh, SnapKV-mp7-pqh, AdaKV-pub, Greedy-W-pqh) evict a copy of
// the prefilled cache repeated to q_heads heads, as the methods' reference code does: one selection per
// query head, and G times the KV bytes of a GQA-native row at the same keep fraction (the kept column can
// exceed 100%: it is against the GQA-native full cache).
// Prints a table, writes fidelity.csv (means over prompts) and fidelity_per_prompt.csv to --out.
// --smoke: 1 prompt, fractions 0.2 and 0.5, 8 steps; its files are fidelity_smoke.csv and
// fidelity_smoke_per_prompt.csv, so a smoke run never overwrites a full report in the same folder.
// --paged [--page-size N]: the same report over a paged kv_cache (one-head pages, a page table per KV
// head; evictions through kvevict::cpu::compact_paged free pages): the table must equal the contiguous
// one figure for figure (only the header line says "paged"); the pages in use before -> after every
// eviction round (all layers) go to stderr, one line per (row, fraction, excerpt).
// Exit status 1 when the table is incomplete, a figure is not finite or the measurement self-check
// fails; 0 with a message when the model or text folder is missing under --smoke.
#include "evict.hpp"
#include "methods.hpp"
#include "model_path.hpp"
#include "report_util.hpp"
#include "tokenizer.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace kvevict_engine;

namespace {

/// One budget of the report: a keep fraction of each head's tokens, or a number of tokens per head.
struct budget_spec {
    double fraction = 0;  ///< > 0: keep fraction (budget_request::fraction)
    int tokens = 0;       ///< > 0: tokens per head (budget_request::tokens)
    kvevict::budget_request request() const {
        return tokens > 0 ? kvevict::budget_request::tokens(tokens) : kvevict::budget_request::fraction(fraction);
    }
    /// Tokens per head for chunked prefill: the tokens, or floor(fraction * prompt length), at least 1.
    int chunk_budget(size_t prompt) const { return tokens > 0 ? tokens : std::max(1, int(std::floor(fraction * double(prompt)))); }
    /// "10%" or "64t".
    std::string label() const {
        char b[32];
        if (tokens > 0) std::snprintf(b, sizeof b, "%dt", tokens);
        else std::snprintf(b, sizeof b, "%.0f%%", 100 * fraction);
        return b;
    }
    /// The CSV's keep_fraction: the fraction, or tokens / prompt tokens.
    double nominal_fraction(int prompt_tokens) const { return tokens > 0 ? double(tokens) / double(prompt_tokens) : fraction; }
};

struct options {
    std::string model_flag, data_flag, text_flag, out_dir = ".", only, dump, prompt_file, write_prompts, exclude;
    int prompts = 32, prompt_tokens = 448, steps = 64, chunk = 0, page_size = 0;  // page_size > 0: --paged
    int threads = std::max(1, int(std::thread::hardware_concurrency()));          // excerpts in parallel
    std::vector<budget_spec> budgets{{0.1, 0}, {0.2, 0}, {0.3, 0}, {0.5, 0}};
    bool smoke = false, ablations = false, full = false;
    std::string reference = "SnapKV";  ///< --reference: the row every other row is compared with, excerpt by excerpt
    bool text_continuation = false;  ///< --continuation text: teacher-force the real text after each excerpt
};

int usage(const char* argv0, const std::string& why) {
    if (!why.empty()) std::fprintf(stderr, "error: %s\n", why.c_str());
    std::fprintf(stderr,
                 "usage: %s [--smoke] [--model DIR] [--data DIR] [--text FILE] [--out DIR] [--prompts N] [--prompt-tokens N]\n"
                 "          [--steps N] [--fractions F,F,.. | --budgets N,N,..] [--continuation greedy|text]\n"
                 "          [--prompt-file FILE] [--write-prompts FILE] [--methods NAME,NAME,..] [--ablations] [--chunk N]\n"
                 "          [--dump FILE] [--paged [--page-size N]] [--threads N] [--exclude-windows FILE|none]\n"
                 "          [--full] [--reference NAME]\n"
                 "  --smoke            1 prompt, fractions 0.2,0.5, 8 steps; checks the table (exit 1 if incomplete\n"
                 "                     or not finite; exit 0 with a message if the model/text folder is missing);\n"
                 "                     writes fidelity_smoke.csv and fidelity_smoke_per_prompt.csv, never the full report's files\n"
                 "  --model DIR        model folder (default $KVEVICT_MODEL_DIR, else <repo>/../shared/models/stories260K)\n"
                 "  --data DIR         text folder with sherlock.txt (default $KVEVICT_DATA_DIR, else <repo>/../shared/data/text)\n"
                 "  --text FILE        the prose the excerpts come from, instead of <data>/sherlock.txt (e.g. the King\n"
                 "                     James Bible, scripts/kjv_text.sh: a text the model and LKV never saw in training)\n"
                 "  --out DIR          where fidelity.csv and fidelity_per_prompt.csv go (default .)\n"
                 "  --prompts N        excerpts (default 32)\n"
                 "  --exclude-windows FILE  byte windows of the text no excerpt may overlap (default: LKV's training\n"
                 "                     contexts, <repo>/artifacts/lkv/train_windows.txt; they apply to sherlock.txt only); none: no windows\n"
                 "  --threads N        excerpts evaluated in parallel (default: the machine's hardware threads); the\n"
                 "                     figures do not depend on it\n"
                 "  --prompt-tokens N  tokens per excerpt, BOS included (default 448)\n"
                 "  --steps N          continuation tokens (default 64)\n"
                 "  --fractions LIST   keep fractions in (0, 1] (default 0.1,0.2,0.3,0.5)\n"
                 "  --budgets LIST     budgets in tokens per head instead of fractions (e.g. 32,64,128)\n"
                 "  --continuation M   greedy (default): the full cache's greedy continuation, teacher-forced; text: the\n"
                 "                     excerpt's real next tokens, teacher-forced (match is then a separate free-running decode)\n"
                 "  --prompt-file FILE prompts as token ids, one per line: 'ids... [| continuation ids...]' (with a\n"
                 "                     continuation on every line it is teacher-forced; else greedy); replaces the text\n"
                 "  --write-prompts FILE  write the run's prompts and continuations in --prompt-file's format: rerun\n"
                 "                     with --prompt-file FILE reproduces the run's figures bit for bit\n"
                 "  --methods LIST     only these rows (names as printed)\n"
                 "  --ablations        add ReST-KV ablation rows (diagnostics; one change each from the defaults)\n"
                 "  --full             also the costly rows the default leaves out (Greedy-W-pqh)\n"
                 "  --reference NAME   the row every other row is compared with per excerpt (default SnapKV): paired KL\n"
                 "                     difference, its standard error, sign-test wins\n"
                 "  --chunk N          chunked-prefill eviction every N prompt tokens (budget floor(f * prompt) tokens per\n"
                 "                     head) instead of one-shot; rows that need the look-ahead (Greedy-next) are left out\n"
                 "  --dump FILE        also write the prompts, the continuation, every kept position per (row, fraction,\n"
                 "                     prompt, layer, KV head) and every KL in full precision (the Python press test reads it)\n"
                 "  --paged            paged KV cache (one-head pages, a page table per KV head; evictions free pages):\n"
                 "                     the same table; pages in use before -> after each eviction round go to stderr\n"
                 "  --page-size N      slots per page with --paged (default 16)\n",
                 argv0);
    return 2;
}

/// Prompts from a token-id file: one per line, "id id ... [| id id ...]" (the part after '|' is the
/// continuation to teacher-force); blank lines and lines starting with '#' are skipped. Every line has a
/// continuation or none does, and every prompt has the same length (the table's kept share and the
/// CSV's keep_fraction are per prompt length). Errors name the line: an id outside [0, vocab), a prompt
/// shorter than 2 tokens or of another length than the first, a mix of lines with and without a continuation.
result read_prompt_file(const std::string& path, int vocab, std::vector<std::vector<int>>& prompts, std::vector<std::vector<int>>& conts) {
    std::ifstream f(path);
    if (!f) return result::failure("cannot read --prompt-file " + path);
    prompts.clear();
    conts.clear();
    std::string line;
    int no = 0, with = 0;
    while (std::getline(f, line)) {
        ++no;
        if (line.find_first_not_of(" \t\r") == std::string::npos || line[line.find_first_not_of(" \t")] == '#') continue;
        const size_t bar = line.find('|');
        std::vector<int> parts[2];
        for (int k = 0; k < 2; ++k) {
            if (k == 1 && bar == std::string::npos) break;
            std::istringstream is(k == 0 ? line.substr(0, bar) : line.substr(bar + 1));
            std::string w;
            while (is >> w) {
                char* end = nullptr;
                const long id = std::strtol(w.c_str(), &end, 10);
                if (end == w.c_str() || *end != '\0' || id < 0 || id >= vocab)
                    return result::failure(path + ":" + std::to_string(no) + ": token id '" + w + "' is not in [0, " + std::to_string(vocab) + ")");
                parts[k].push_back(int(id));
            }
        }
        if (parts[0].size() < 2) return result::failure(path + ":" + std::to_string(no) + ": a prompt needs at least 2 token ids");
        if (!prompts.empty() && parts[0].size() != prompts[0].size())
            return result::failure(path + ":" + std::to_string(no) + ": a prompt of " + std::to_string(parts[0].size()) +
                                   " tokens; the first has " + std::to_string(prompts[0].size()) + " (every prompt has the same length)");
        if (bar != std::string::npos && parts[1].empty()) return result::failure(path + ":" + std::to_string(no) + ": empty continuation after '|'");
        with += bar != std::string::npos ? 1 : 0;
        prompts.push_back(std::move(parts[0]));
        conts.push_back(std::move(parts[1]));
    }
    if (prompts.empty()) return result::failure("--prompt-file " + path + " holds no prompt");
    if (with != 0 && with != int(prompts.size()))
        return result::failure("--prompt-file " + path + ": " + std::to_string(with) + " of " + std::to_string(prompts.size()) +
                               " lines have a continuation; give one on every line or on none");
    if (with == 0) conts.clear();
    return result::success();
}

/// Attention output of one layer for query `q` (n_heads, hd) over the layer's cached slots plus one extra
/// token (k_new, v_new: kv_dim), fp64, written to `o` (dim). Independent of forward()'s code path.
/// A cache repeated to q_heads heads (kv_cache::kv_repeat() > 1): query head h reads cache head h / (n_heads /
/// cache heads), whose new token is model KV head (that) / kv_repeat.
void attend(const config& c, const kv_cache& cache, int l, const float* q, const float* k_new, const float* v_new, std::vector<double>& o) {
    const int hd = c.head_dim(), G = query_heads_per_cache_head(c, cache);
    o.assign(size_t(c.dim), 0.0);
    const double scale = 1.0 / std::sqrt(double(hd));
    std::vector<double> s;
    for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / G, len = cache.length(l, kvh), src = kvh / cache.kv_repeat();
        s.assign(size_t(len) + 1, 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (int t = 0; t <= len; ++t) {
            const float* k = t < len ? cache.key(l, kvh, t) : k_new + size_t(src) * size_t(hd);
            double acc = 0;
            for (int d = 0; d < hd; ++d) acc += double(q[h * hd + d]) * k[d];
            s[size_t(t)] = acc * scale;
            mx = std::max(mx, s[size_t(t)]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int t = 0; t <= len; ++t) {
            const float* v = t < len ? cache.value(l, kvh, t) : v_new + size_t(src) * size_t(hd);
            for (int d = 0; d < hd; ++d) o[size_t(h * hd + d)] += s[size_t(t)] / sum * v[d];
        }
    }
}

double rel_err(const std::vector<double>& ref, const std::vector<double>& x) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) { num += (ref[i] - x[i]) * (ref[i] - x[i]); den += ref[i] * ref[i]; }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<double> apply_wo(const model& m, int l, const std::vector<double>& o) {
    Eigen::VectorXd x = Eigen::Map<const Eigen::VectorXd>(o.data(), Eigen::Index(o.size()));
    Eigen::VectorXd y = m.wo(l).cast<double>() * x;
    return std::vector<double>(y.data(), y.data() + y.size());
}

/// Everything the full-cache run produces for one prompt.
struct reference {
    kv_cache prefilled;                     // cache right after the prompt
    query_log queries;                      // every prompt query (H2O reads all)
    int first = 0;                          // c0 = argmax of the prompt's last logits (identical for all)
    std::vector<int> inputs;                // c0, t1, ..., t_{steps-1} (greedy), or the given continuation (text)
    bool teacher_text = false;              // inputs are a given continuation, not the greedy one
    std::vector<int> greedy_top1;           // steps: the full cache's free-running greedy tokens after c0 = first
    std::vector<std::vector<double>> logp;  // steps x vocab: full-cache next-token log-probs
    std::vector<int> top1;                  // steps: full-cache argmax (t1 .. t_steps)
    std::vector<std::vector<float>> q, k, v;      // per layer: c0's query (dim), key and value (kv_dim)
    std::vector<std::vector<double>> o, y;        // per layer: c0's attention output (dim) and W_O o
};

/// The full run of one prompt: prefill, then `steps` tokens teacher-forced: the greedy continuation
/// (continuation empty), or the given one (its first `steps` tokens; then also a free-running greedy
/// decode for the match metric).
result run_reference(const model& m, const std::vector<int>& prompt, int steps, int page_size, const std::vector<int>& continuation,
                     reference& ref) {
    const config& c = m.cfg;
    ref.prefilled = kv_cache(c, int(prompt.size()) + steps + 1, page_size);  // page_size 0: contiguous
    ref.queries = query_log(c, -1);
    forward_options fo;
    fo.on_query = ref.queries.hook();
    std::vector<float> logits;
    if (result r = prefill(m, ref.prefilled, prompt, logits, fo); !r) return r;
    ref.first = argmax(logits);
    kv_cache cache = ref.prefilled;
    ref.q.assign(size_t(c.n_layers), {});
    ref.o.assign(size_t(c.n_layers), {});
    ref.y.assign(size_t(c.n_layers), {});
    ref.k.assign(size_t(c.n_layers), std::vector<float>(size_t(c.kv_dim())));
    ref.v.assign(size_t(c.n_layers), std::vector<float>(size_t(c.kv_dim())));
    forward_options first;
    first.on_query = [&](int l, std::int32_t, const float* q) { ref.q[size_t(l)].assign(q, q + c.dim); };
    first.on_head_output = [&](int l, const float* o) { ref.o[size_t(l)].assign(o, o + c.dim); };
    ref.inputs.clear();
    ref.logp.clear();
    ref.top1.clear();
    ref.teacher_text = !continuation.empty();
    if (ref.teacher_text && int(continuation.size()) < steps)
        return result::failure("the given continuation has " + std::to_string(continuation.size()) + " tokens < steps " + std::to_string(steps));
    int tok = ref.teacher_text ? continuation[0] : ref.first;
    for (int i = 0; i < steps; ++i) {
        ref.inputs.push_back(tok);
        if (result r = forward(m, cache, tok, logits, i == 0 ? first : forward_options{}); !r) return r;
        ref.logp.push_back(log_softmax(logits));
        const int a = argmax(logits);
        ref.top1.push_back(a);
        tok = ref.teacher_text ? (i + 1 < steps ? continuation[size_t(i) + 1] : a) : a;
    }
    ref.greedy_top1 = ref.top1;
    if (ref.teacher_text) {  // the full cache's own greedy decode from c0 = first
        kv_cache g = ref.prefilled;
        ref.greedy_top1.clear();
        int t = ref.first;
        for (int i = 0; i < steps; ++i) {
            if (result r = forward(m, g, t, logits); !r) return r;
            t = argmax(logits);
            ref.greedy_top1.push_back(t);
        }
    }
    const int hd = c.head_dim();
    for (int l = 0; l < c.n_layers; ++l) {
        for (int h = 0; h < c.n_kv_heads; ++h) {
            const int s = int(prompt.size());  // c0's slot in the unevicted cache
            std::copy_n(cache.key(l, h, s), hd, ref.k[size_t(l)].begin() + h * hd);
            std::copy_n(cache.value(l, h, s), hd, ref.v[size_t(l)].begin() + h * hd);
        }
        ref.y[size_t(l)] = apply_wo(m, l, ref.o[size_t(l)]);
    }
    return result::success();
}

struct metrics {
    double kl = 0, top1 = 0, match = 0, kv_bytes = 0, oerr_prop = 0;
    double scored = 0;                  // kept tokens chosen by score, mean over (layer, cache head)
    std::vector<double> oerr, oerr_wo;  // per layer (isolated)
    std::vector<double> oerr_wo_prop;   // per layer, after W_O, measured in the evicted run (propagated)
};
/// The evicted cache of one (excerpt, method, fraction): one-shot eviction of the prefilled cache
/// (chunk == 0), or chunked prefill through eviction_session (chunk > 0: every `chunk` prompt tokens,
/// budget floor(fraction * prompt length) tokens per head).
result evicted_cache(const model& m, const wo_factors& wo, const reference& ref, const std::vector<int>& prompt, const method& meth,
                     const budget_spec& budget, int chunk, kv_cache& cache) {
    const config& c = m.cfg;
    if (chunk > 0) {
        session_options so;
        so.prefill = prefill_mode::chunked;
        so.chunk = chunk;
        so.budget = kvevict::budget_request::tokens(budget.chunk_budget(prompt.size()));
        so.page_size = ref.prefilled.page_size();
        eviction_session s(m, wo, meth, so, ref.prefilled.capacity());
        std::vector<float> logits;
        if (result r = s.prefill(prompt, logits); !r) return r;
        cache = s.cache();
        return result::success();
    }
    // per-query-head rows: the prefilled cache repeated to q_heads heads (G times the memory)
    cache = meth.repeat_kv ? ref.prefilled.repeated(c.kv_group()) : ref.prefilled;
    for (int l = 0; l < c.n_layers; ++l) {
        layer_state s;
        s.m = &m;
        s.wo = &wo;
        s.cache = &cache;
        s.layer = l;
        s.queries = &ref.queries;
        s.budget = budget.request();
        s.next_query = ref.q[size_t(l)].data();
        s.next_key = ref.k[size_t(l)].data();
        s.next_value = ref.v[size_t(l)].data();
        if (result r = meth.evict(s); !r) return r;
    }
    return result::success();
}

/// kept[l][h]: the logical positions a layer-l KV head keeps after eviction, ascending.
using kept_positions = std::vector<std::vector<std::vector<int>>>;

/// Pages in use (all layers) before and after each eviction round of a paged cache.
using page_rounds = std::vector<std::pair<long, long>>;

result evaluate(const model& m, const wo_factors& wo, const reference& ref, const std::vector<int>& prompt, const method& meth,
                const budget_spec& budget, int chunk, metrics& out, kept_positions* kept = nullptr, page_rounds* pages = nullptr) {
    const config& c = m.cfg;
    kv_cache cache;
    method counted = meth;
    if (pages) {  // count the pages around every layer's eviction (a round starts at layer 0)
        pages->clear();
        counted.evict = [inner = meth.evict, pages](const layer_state& s) {
            const long before = s.cache->pages_in_use(s.layer);
            const result r = inner(s);
            if (!r) return r;
            if (s.layer == 0 || pages->empty()) pages->emplace_back(0, 0);
            pages->back().first += before;
            pages->back().second += s.cache->pages_in_use(s.layer);
            return r;
        };
    }
    if (result r = evicted_cache(m, wo, ref, prompt, counted, budget, chunk, cache); !r) return r;
    if (kept) {
        kept->assign(size_t(c.n_layers), std::vector<std::vector<int>>(size_t(cache.n_kv_heads())));
        for (int l = 0; l < c.n_layers; ++l)
            for (int h = 0; h < cache.n_kv_heads(); ++h) {
                const std::int32_t* pos = cache.positions(l) + size_t(h) * size_t(cache.capacity());
                (*kept)[size_t(l)][size_t(h)].assign(pos, pos + cache.length(l, h));
            }
    }
    out = metrics{};
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < cache.n_kv_heads(); ++h) out.kv_bytes += double(cache.length(l, h)) * c.head_dim() * 2 * sizeof(float);
    // tokens chosen by score: kept minus the tokens the method keeps by rule (its plan's sinks and
    // protected recent tokens for the head's length before eviction; `window` of them without a plan)
    if (chunk == 0) {
        int cells = 0;
        for (int l = 0; l < c.n_layers; ++l)
            for (int h = 0; h < cache.n_kv_heads(); ++h) {
                const int L = ref.prefilled.length(l, h / std::max(1, cache.kv_repeat()));
                const std::int64_t prot = meth.plan ? meth.plan(budget.request(), L, meth.window).protected_count()
                                                    : std::min<std::int64_t>(std::max(meth.window, 0), L);
                out.scored += double(std::max<std::int64_t>(0, cache.length(l, h) - prot));
                ++cells;
            }
        out.scored /= std::max(1, cells);
    }
    std::vector<double> o;
    for (int l = 0; l < c.n_layers; ++l) {
        attend(c, cache, l, ref.q[size_t(l)].data(), ref.k[size_t(l)].data(), ref.v[size_t(l)].data(), o);
        out.oerr.push_back(rel_err(ref.o[size_t(l)], o));
        out.oerr_wo.push_back(rel_err(ref.y[size_t(l)], apply_wo(m, l, o)));
    }
    std::vector<std::vector<double>> o_prop(size_t(c.n_layers));
    forward_options first;
    first.on_head_output = [&](int l, const float* x) { o_prop[size_t(l)].assign(x, x + c.dim); };
    std::vector<float> logits;
    const int steps = int(ref.inputs.size());
    if (ref.teacher_text) {  // free-running greedy match: the evicted cache's own decode from c0 = first
        kv_cache g = cache;
        int t = ref.first;
        for (int i = 0; i < steps; ++i) {
            if (result r = forward(m, g, t, logits); !r) return r;
            t = argmax(logits);
            if (t != ref.greedy_top1[size_t(i)]) break;
            out.match += 1;
        }
    }
    bool diverged = ref.teacher_text;  // teacher-forced greedy continuation: match = steps before the first disagreement
    for (int i = 0; i < steps; ++i) {
        if (result r = forward(m, cache, ref.inputs[size_t(i)], logits, i == 0 ? first : forward_options{}); !r) return r;
        const std::vector<double> lq = log_softmax(logits);
        const std::vector<double>& lp = ref.logp[size_t(i)];
        double kl = 0;
        for (size_t t = 0; t < lp.size(); ++t) kl += std::exp(lp[t]) * (lp[t] - lq[t]);
        out.kl += std::max(kl, 0.0);
        const bool same = argmax(logits) == ref.top1[size_t(i)];
        out.top1 += same ? 1 : 0;
        if (!same) diverged = true;
        if (!diverged) out.match += 1;
    }
    out.kl /= steps;
    out.top1 /= steps;
    for (int l = 0; l < c.n_layers; ++l) {
        out.oerr_prop += rel_err(ref.o[size_t(l)], o_prop[size_t(l)]) / c.n_layers;
        out.oerr_wo_prop.push_back(rel_err(ref.y[size_t(l)], apply_wo(m, l, o_prop[size_t(l)])));
    }
    return result::success();
}

bool is_finite(double x) { return std::isfinite(x); }

}  // namespace

int main(int argc, char** argv) {
    options opt;
    std::string fractions_flag, budgets_flag, steps_flag, prompts_flag;
    bool paged = false, page_size_given = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") return usage(argv[0], "");
        if (a == "--smoke") { opt.smoke = true; continue; }
        if (a == "--ablations") { opt.ablations = true; continue; }
        if (a == "--full") { opt.full = true; continue; }
        if (a == "--paged") { paged = true; continue; }
        if (i + 1 >= argc) return usage(argv[0], "missing value for " + a);
        const std::string v = argv[++i];
        if (a == "--model") opt.model_flag = v;
        else if (a == "--data") opt.data_flag = v;
        else if (a == "--text") opt.text_flag = v;
        else if (a == "--out") opt.out_dir = v;
        else if (a == "--methods") opt.only = v;
        else if (a == "--dump") opt.dump = v;
        else if (a == "--prompts") prompts_flag = v;
        else if (a == "--steps") steps_flag = v;
        else if (a == "--fractions") fractions_flag = v;
        else if (a == "--budgets") budgets_flag = v;
        else if (a == "--prompt-file") opt.prompt_file = v;
        else if (a == "--write-prompts") opt.write_prompts = v;
        else if (a == "--exclude-windows") opt.exclude = v;
        else if (a == "--reference") opt.reference = v;
        else if (a == "--threads") {
            if (!parse_int(v, 1, 256, opt.threads)) return usage(argv[0], "--threads needs an integer in 1..256");
        }
        else if (a == "--continuation") {
            if (v != "greedy" && v != "text") return usage(argv[0], "--continuation must be greedy or text, not '" + v + "'");
            opt.text_continuation = v == "text";
        }
        else if (a == "--page-size") {
            if (!parse_int(v, 1, 1 << 20, opt.page_size)) return usage(argv[0], "--page-size needs an integer in 1..1048576");
            page_size_given = true;
        }
        else if (a == "--chunk") {
            if (!parse_int(v, 1, 1 << 20, opt.chunk)) return usage(argv[0], "--chunk needs an integer in 1..1048576");
        } else if (a == "--prompt-tokens") {
            if (!parse_int(v, 40, 1 << 20, opt.prompt_tokens)) return usage(argv[0], "--prompt-tokens needs an integer in 40..1048576");
        } else return usage(argv[0], "unknown option " + a);
    }
    if (page_size_given && !paged) return usage(argv[0], "--page-size needs --paged");
    if (paged && !page_size_given) opt.page_size = 16;
    if (opt.smoke) {
        opt.prompts = 1;
        opt.steps = 8;
        opt.budgets = {{0.2, 0}, {0.5, 0}};
    }
    if (!prompts_flag.empty() && !parse_int(prompts_flag, 1, 1000, opt.prompts)) return usage(argv[0], "--prompts needs an integer in 1..1000");
    if (!steps_flag.empty() && !parse_int(steps_flag, 1, 1 << 20, opt.steps)) return usage(argv[0], "--steps needs an integer in 1..1048576");
    if (!fractions_flag.empty() && !budgets_flag.empty()) return usage(argv[0], "give --fractions or --budgets, not both");
    if (!fractions_flag.empty()) {
        opt.budgets.clear();
        std::vector<double> fr;
        std::string bad;
        if (!parse_fraction_list(fractions_flag, fr, bad))
            return usage(argv[0], bad.empty() ? "--fractions is empty" : "--fractions: '" + bad + "' is not in (0, 1]");
        for (double x : fr) opt.budgets.push_back({x, 0});
    }
    if (!budgets_flag.empty()) {
        opt.budgets.clear();
        std::vector<int> bt;
        std::string bad;
        if (!parse_int_list(budgets_flag, 1, 1 << 20, bt, bad))
            return usage(argv[0], bad.empty() ? "--budgets is empty" : "--budgets: '" + bad + "' is not a token count in 1..1048576");
        for (int n : bt) opt.budgets.push_back({0.0, n});
    }
    if (!opt.prompt_file.empty() && (opt.text_continuation || !opt.text_flag.empty() || !prompts_flag.empty()))
        return usage(argv[0], "--prompt-file gives the prompts (and continuations): no --text, --prompts or --continuation with it");

    // One thread for Eigen's own products: the matrices here are tiny, and OpenMP threads spinning on a
    // shared 2-core machine cost more than they give (kvevict's evictor also runs with num_threads = 1).
    Eigen::setNbThreads(1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string mdir = resolve_model_dir(opt.model_flag), ddir = resolve_data_dir(opt.data_flag);
    const std::string text_path = opt.text_flag.empty() ? ddir + "/sherlock.txt" : opt.text_flag;
    const std::string text_name = std::filesystem::path(text_path).filename().string();
    if (!model_dir_exists(mdir) || (opt.prompt_file.empty() && !std::filesystem::is_regular_file(text_path))) {
        const std::string what = !model_dir_exists(mdir) ? "model folder '" + mdir + "'" : "text file '" + text_path + "'";
        if (opt.smoke) {
            std::printf("skipping fidelity smoke test: %s not found (set KVEVICT_MODEL_DIR / KVEVICT_DATA_DIR)\n", what.c_str());
            return 0;
        }
        std::fprintf(stderr, "error: %s not found (use --model / --data, or KVEVICT_MODEL_DIR / KVEVICT_DATA_DIR)\n", what.c_str());
        return 1;
    }
    model m;
    if (result r = load_model(model_file(mdir), m); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }
    tokenizer tok;
    if (result r = tok.load(tokenizer_file(mdir), m.cfg.vocab_size); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }
    std::vector<std::vector<int>> prompts, continuations;  // continuations: empty = greedy protocol
    int excerpts_left_out = 0;
    std::string excluded_note = "prompts from a file";
    std::string source = text_name;
    if (!opt.prompt_file.empty()) {
        if (result r = read_prompt_file(opt.prompt_file, m.cfg.vocab_size, prompts, continuations); !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 2;
        }
        size_t shortest = size_t(-1), longest = 0;
        for (const auto& pr : prompts) longest = std::max(longest, pr.size());
        for (const auto& ct : continuations) shortest = std::min(shortest, ct.size());
        if (!continuations.empty()) {
            if (steps_flag.empty()) opt.steps = int(shortest);
            else if (size_t(opt.steps) > shortest) {
                std::fprintf(stderr, "error: --steps %d > the shortest continuation in %s (%zu tokens)\n", opt.steps, opt.prompt_file.c_str(), shortest);
                return 2;
            }
        }
        opt.prompts = int(prompts.size());
        opt.prompt_tokens = int(longest);
        source = std::filesystem::path(opt.prompt_file).filename().string() + " (token ids)";
    }
    // Every position the report runs (prompt, then the continuation) must lie inside the context
    // the model was trained on: past it RoPE positions are untrained and the figures meaningless.
    if (opt.prompt_tokens + opt.steps > m.cfg.seq_len) {
        std::fprintf(stderr,
                     "error: --prompt-tokens %d + --steps %d = %d positions exceed the model's trained context of %d tokens "
                     "(%s); use at most %d prompt tokens with %d steps\n",
                     opt.prompt_tokens, opt.steps, opt.prompt_tokens + opt.steps, m.cfg.seq_len, model_file(mdir).c_str(),
                     std::max(0, m.cfg.seq_len - opt.steps), opt.steps);
        return 2;
    }
    if (opt.prompt_file.empty()) {
        std::ifstream tf(text_path, std::ios::binary);
        const std::string text{std::istreambuf_iterator<char>(tf), std::istreambuf_iterator<char>()};
        // LKV's training contexts (byte windows of sherlock.txt) are left out of the excerpts
        excluded_windows ex;
        if (opt.exclude != "none") {
            const std::string path = opt.exclude.empty() ? std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/train_windows.txt" : opt.exclude;
            if (result r = read_excluded_windows(path, text, text_name, ex); !r) {
                std::fprintf(stderr, "error: %s\n", r.error.c_str());
                return 2;
            }
        }
        std::vector<size_t> starts;
        if (result r = make_excerpts(tok, text, opt.prompts, opt.prompt_tokens, ex.windows, prompts, opt.text_continuation ? opt.steps : 0,
                                     opt.text_continuation ? &continuations : nullptr, excerpts_left_out, starts);
            !r) {
            std::fprintf(stderr, "error: %s\n", r.error.c_str());
            return 1;
        }
        excluded_note = ex.windows.empty() ? (opt.exclude == "none" ? "no windows excluded" : "no excerpt can overlap LKV's training contexts (another text)")
                                           : std::to_string(excerpts_left_out) + " candidate excerpts overlapping LKV's " + std::to_string(ex.windows.size()) +
                                                 " training contexts left out";
    }
    wo_factors wo;
    if (result r = wo.compute(m); !r) { std::fprintf(stderr, "error: %s\n", r.error.c_str()); return 1; }

    std::vector<method> methods = kvevict_fidelity::report_methods(opt.ablations, opt.full);
    if (!opt.only.empty()) {
        const std::vector<std::string> keep = split(opt.only);
        std::vector<method> sel;
        for (const std::string& name : keep) {
            bool found = false;
            for (const method& mm : methods)
                if (mm.name == name) { sel.push_back(mm); found = true; }
            if (!found) return usage(argv[0], "--methods: no row named '" + name + "'");
        }
        methods = sel;
    }
    if (opt.chunk > 0) {
        std::vector<method> sel;
        for (const method& mm : methods)
            if (!mm.needs_lookahead) sel.push_back(mm);
            else std::printf("note: row %s left out (needs the look-ahead; chunked prefill has none)\n", mm.name.c_str());
        methods = sel;
    }
    const config& c = m.cfg;
    std::printf("kvevict fidelity: stories260K (dim %d, %d layers, %d heads / %d KV heads, head_dim %d), %d excerpts of %d tokens "
                "from %s (%s), %d continuation tokens%s, %s%s\n",
                c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), opt.prompts, opt.prompt_tokens, source.c_str(), excluded_note.c_str(), opt.steps,
                continuations.empty() ? "" : " (the given text, teacher-forced; match: free-running greedy)",
                opt.chunk > 0 ? ("chunked-prefill eviction every " + std::to_string(opt.chunk) + " tokens").c_str()
                              : "one-shot eviction at the end of prefill",
                opt.page_size > 0 ? (", paged KV cache (page size " + std::to_string(opt.page_size) + ")").c_str() : "");

    // Honest budgets: a row keeps the budget it is labelled with. Where a budget cannot hold the tokens the
    // method keeps by rule (its window or sinks), a row whose window is its protected recent part runs with
    // a window of half the budget (the other half chosen by score); any other such row is left out, with
    // the reason printed. One-shot eviction only (chunked budgets are per chunk).
    std::vector<std::vector<method>> eff(methods.size());
    std::vector<std::vector<std::string>> left_out(methods.size(), std::vector<std::string>(opt.budgets.size()));
    for (size_t i = 0; i < methods.size(); ++i)
        for (size_t f = 0; f < opt.budgets.size(); ++f) {
            method mm = methods[i];
            const int L = opt.prompt_tokens;
            const budget_spec& b = opt.budgets[f];
            const std::int64_t want = b.tokens > 0 ? b.tokens : std::int64_t(std::floor(b.fraction * double(L)));
            if (opt.chunk == 0 && mm.plan && want < L) {
                const kvevict::detail::head_plan pl = mm.plan(b.request(), L, mm.window);
                if (pl.base_budget > want || pl.protected_count() > want) {
                    const int w = int(want / 2);
                    if (mm.evict_with_window && w >= 1) {
                        std::printf("note: %s at keep %s: the budget of %lld tokens per head cannot hold its window of %d; "
                                    "window %d instead (the rest chosen by score)\n",
                                    mm.name.c_str(), b.label().c_str(), (long long)want, mm.window, w);
                        mm.evict = [ew = mm.evict_with_window, w](const layer_state& st) { return ew(st, w); };
                        mm.window = w;
                    } else {
                        left_out[i][f] = "its " + std::to_string(pl.protected_count()) + " tokens kept by rule exceed the budget of " +
                                         std::to_string(want) + " tokens per head";
                        std::printf("note: %s at keep %s left out: %s\n", mm.name.c_str(), b.label().c_str(), left_out[i][f].c_str());
                    }
                }
            }
            eff[i].push_back(std::move(mm));
        }

    // results[method][fraction] = per-prompt metrics
    std::vector<std::vector<std::vector<metrics>>> res(methods.size(), std::vector<std::vector<metrics>>(opt.budgets.size()));
    std::FILE* wp = nullptr;
    if (!opt.write_prompts.empty() && !(wp = std::fopen(opt.write_prompts.c_str(), "w"))) {
        std::fprintf(stderr, "error: cannot write --write-prompts file %s\n", opt.write_prompts.c_str());
        return 1;
    }
    bool ok = true;
    std::FILE* dump = nullptr;
    if (!opt.dump.empty() && !(dump = std::fopen(opt.dump.c_str(), "w"))) {
        std::fprintf(stderr, "error: cannot write --dump file %s\n", opt.dump.c_str());
        return 1;
    }
    // Excerpts run in parallel (--threads), one excerpt per task, everything of an excerpt on one thread:
    // each figure is computed exactly as serially (kvevict's evictor runs with num_threads = 1), and the
    // outputs are written in excerpt order afterwards, so the report is the same for any thread count.
    struct excerpt_out {
        std::vector<std::vector<metrics>> m;         // [method][budget]
        std::vector<std::vector<char>> done;         // [method][budget]: evaluated without error
        std::string dump, pages, prompts_line, errors;
        double self_check = 0, full_bytes = 0;
        bool failed = false;                          // the full run failed
    };
    std::vector<excerpt_out> outs(prompts.size());
    auto run_excerpt = [&](size_t p) {
        excerpt_out& eo = outs[p];
        eo.m.assign(methods.size(), std::vector<metrics>(opt.budgets.size()));
        eo.done.assign(methods.size(), std::vector<char>(opt.budgets.size(), 0));
        char buf[512];
        auto ints = [](const std::vector<int>& v) {
            std::string t;
            for (int x : v) t += " " + std::to_string(x);
            return t + "\n";
        };
        reference ref;
        if (result r = run_reference(m, prompts[p], opt.steps, opt.page_size, continuations.empty() ? std::vector<int>{} : continuations[p], ref);
            !r) {
            eo.errors += "error: " + r.error + "\n";
            eo.failed = true;
            return;
        }
        if (wp) {  // prompt | the continuation as teacher-forced: a rerun with --prompt-file reproduces this run
            for (int x : prompts[p]) eo.prompts_line += std::to_string(x) + " ";
            eo.prompts_line += "|" + ints(ref.inputs);
        }
        // self-check of the isolated measurement: the unevicted cache must reproduce forward()'s output
        std::vector<double> o;
        for (int l = 0; l < c.n_layers; ++l) {
            attend(c, ref.prefilled, l, ref.q[size_t(l)].data(), ref.k[size_t(l)].data(), ref.v[size_t(l)].data(), o);
            eo.self_check = std::max(eo.self_check, rel_err(ref.o[size_t(l)], o));
        }
        eo.full_bytes = double(prompts[p].size()) * c.n_layers * c.n_kv_heads * c.head_dim() * 2 * sizeof(float);
        if (dump) eo.dump += "prompt\t" + std::to_string(p) + "\t" + ints(prompts[p]) + "inputs\t" + std::to_string(p) + "\t" + ints(ref.inputs);
        for (size_t i = 0; i < methods.size(); ++i)
            for (size_t f = 0; f < opt.budgets.size(); ++f) {
                if (!left_out[i][f].empty()) continue;
                metrics& mt = eo.m[i][f];
                kept_positions kept;
                page_rounds pages;
                if (result r = evaluate(m, wo, ref, prompts[p], eff[i][f], opt.budgets[f], opt.chunk, mt, dump ? &kept : nullptr,
                                        opt.page_size > 0 ? &pages : nullptr);
                    !r) {
                    eo.errors += "error: " + methods[i].name + " at keep " + opt.budgets[f].label() + ", prompt " + std::to_string(p) + ": " + r.error + "\n";
                    continue;
                }
                eo.done[i][f] = 1;
                if (opt.page_size > 0) {
                    std::string line;
                    for (const auto& pr : pages) line += (line.empty() ? "" : ", ") + std::to_string(pr.first) + " -> " + std::to_string(pr.second);
                    std::snprintf(buf, sizeof buf, "pages in use (all layers, pool %d per layer): %s keep %s excerpt %zu: ",
                                  ref.prefilled.num_pages() * (methods[i].repeat_kv ? c.kv_group() : 1), methods[i].name.c_str(),
                                  opt.budgets[f].label().c_str(), p);
                    eo.pages += buf + line + "\n";
                }
                if (dump) {
                    std::snprintf(buf, sizeof buf, "kl\t%s\t%.17g\t%zu\t%.17g\n", methods[i].name.c_str(), opt.budgets[f].nominal_fraction(opt.prompt_tokens), p, mt.kl);
                    eo.dump += buf;
                    for (int l = 0; l < c.n_layers; ++l)
                        for (int h = 0; h < int(kept[size_t(l)].size()); ++h) {  // cache heads (q_heads for a -pqh row)
                            std::snprintf(buf, sizeof buf, "kept\t%s\t%.17g\t%zu\t%d\t%d\t", methods[i].name.c_str(),
                                          opt.budgets[f].nominal_fraction(opt.prompt_tokens), p, l, h);
                            eo.dump += buf + ints(kept[size_t(l)][size_t(h)]);
                        }
                }
            }
    };
    {
        std::atomic<size_t> next{0};
        auto worker = [&] {
            for (size_t p; (p = next.fetch_add(1)) < prompts.size();) run_excerpt(p);
        };
        std::vector<std::thread> pool;
        const int nt = std::max(1, std::min(opt.threads, int(prompts.size())));
        for (int t = 1; t < nt; ++t) pool.emplace_back(worker);
        worker();
        for (std::thread& t : pool) t.join();
    }
    double self_check = 0, full_bytes = 0;
    for (size_t p = 0; p < prompts.size(); ++p) {
        const excerpt_out& eo = outs[p];
        std::fputs(eo.errors.c_str(), stderr);
        std::fputs(eo.pages.c_str(), stderr);
        if (eo.failed) return 1;
        if (wp) std::fputs(eo.prompts_line.c_str(), wp);
        if (dump) std::fputs(eo.dump.c_str(), dump);
        self_check = std::max(self_check, eo.self_check);
        full_bytes = eo.full_bytes;
        for (size_t i = 0; i < methods.size(); ++i)
            for (size_t f = 0; f < opt.budgets.size(); ++f) {
                if (eo.done[i][f]) res[i][f].push_back(eo.m[i][f]);
                else if (left_out[i][f].empty()) ok = false;
            }
    }
    if (dump) std::fclose(dump);
    if (wp) std::fclose(wp);

    // aggregate, print, write
    std::filesystem::create_directories(opt.out_dir);
    // A smoke run has file names of its own: it must not replace a full report in the same folder.
    const std::string stem = opt.out_dir + (opt.smoke ? "/fidelity_smoke" : "/fidelity");
    const std::string csv_path = stem + ".csv", pp_path = stem + "_per_prompt.csv";
    std::ofstream csv(csv_path), pp(pp_path);
    if (!csv || !pp) { std::fprintf(stderr, "error: cannot write %s\n", csv_path.c_str()); return 1; }
    auto row_of = [&](const std::string& name) -> int {
        for (size_t i = 0; i < methods.size(); ++i)
            if (methods[i].name == name) return int(i);
        return -1;
    };
    auto complete = [&](int i, size_t f) { return i >= 0 && res[size_t(i)][f].size() == prompts.size(); };
    const size_t n_ex = prompts.size();
    const double tc = t_critical_95(int(n_ex) - 1);
    // Paired comparison of KL(row a at budget fa) with KL(row b at budget fb) over the same excerpts.
    using paired_kl = paired_stats;
    auto compare = [&](int a, size_t fa, int b, size_t fb) {
        std::vector<double> x, y;
        for (size_t p = 0; p < n_ex; ++p) {
            x.push_back(res[size_t(a)][fa][p].kl);
            y.push_back(res[size_t(b)][fb][p].kl);
        }
        return paired_compare(x, y);
    };
    const int iref = row_of(opt.reference);
    if (iref < 0) std::printf("note: --reference row %s is not in the run; no paired columns\n", opt.reference.c_str());
    csv << "method,keep_fraction,prompts,kl_mean,top1_agreement,greedy_match,oerr_mean,oerr_wo_mean,oerr_prop_mean";
    for (int l = 0; l < c.n_layers; ++l) csv << ",oerr_l" << l;
    for (int l = 0; l < c.n_layers; ++l) csv << ",oerr_wo_l" << l;
    csv << ",kv_bytes,kv_bytes_full,kl_se,top1_se,match_se,oerr_wo_se,budget_tokens,oerr_wo_prop_mean";
    for (int l = 0; l < c.n_layers; ++l) csv << ",oerr_wo_prop_l" << l;
    csv << ",scored_tokens,reference,kl_diff_ref,kl_diff_ref_se,wins_ref,losses_ref,sign_p_ref\n";
    pp << "method,keep_fraction,prompt,kl_mean,top1_agreement,greedy_match,oerr_mean,oerr_wo_mean,oerr_prop_mean,kv_bytes,scored_tokens\n";
    pp << std::setprecision(17);  // every paired statistic can be recomputed from this file exactly
    std::printf("\nKL of each row, and paired against %s on the same excerpts: d = mean of KL(row) - KL(%s), its standard error, "
                "t = d / se (* beyond %.3f, the two-sided 95%% t with %zu df), wins = excerpts where the row's KL is lower, "
                "p = two-sided sign test\n",
                opt.reference.c_str(), opt.reference.c_str(), tc, n_ex > 0 ? n_ex - 1 : 0);
    std::printf("\n%-14s %5s %6s %9s %8s %9s %8s %7s %7s %6s %6s %5s %8s %8s %6s\n", "method", "keep", "scored", "KL", "+-se", "d", "+-se",
                "t", "wins", "p", "top1", "match", "oerr_WO", "KV KiB", "kept");
    std::printf("%-14s %5s %6s %9s %8s %9s %8s %7s %7s %6s %6s %5s %8s %8s %6s\n", "", "", "(tok)", "(nats)", "", "(nats)", "", "", "", "(sign)",
                "", "(tok)", "(iso)", "", "");
    int rows = 0, skipped = 0;
    std::string memory_off;  // rows whose kept bytes differ from their label's floor(f x L) tokens per head
    for (size_t i = 0; i < methods.size(); ++i) {
        for (size_t f = 0; f < opt.budgets.size(); ++f) {
            const double kf = opt.budgets[f].nominal_fraction(opt.prompt_tokens);
            if (!left_out[i][f].empty()) {
                std::printf("%-14s %5s left out: %s\n", methods[i].name.c_str(), opt.budgets[f].label().c_str(), left_out[i][f].c_str());
                ++skipped;
                continue;
            }
            const auto& v = res[i][f];
            if (v.size() != n_ex) { ok = false; continue; }
            metrics a;
            std::vector<double> kl_p, top1_p, match_p, oerr_wo_p;  // per prompt, for the standard errors
            for (const metrics& x : v) {
                kl_p.push_back(x.kl);
                top1_p.push_back(x.top1);
                match_p.push_back(x.match);
                oerr_wo_p.push_back(mean(x.oerr_wo));
            }
            const double kl_se = std_error(kl_p), top1_se = std_error(top1_p), match_se = std_error(match_p), oerr_wo_se = std_error(oerr_wo_p);
            a.oerr.assign(size_t(c.n_layers), 0.0);
            a.oerr_wo.assign(size_t(c.n_layers), 0.0);
            a.oerr_wo_prop.assign(size_t(c.n_layers), 0.0);
            const double n = double(v.size());
            for (size_t p = 0; p < v.size(); ++p) {
                const metrics& x = v[p];
                a.kl += x.kl / n; a.top1 += x.top1 / n; a.match += x.match / n; a.kv_bytes += x.kv_bytes / n; a.oerr_prop += x.oerr_prop / n;
                a.scored += x.scored / n;
                for (int l = 0; l < c.n_layers; ++l) {
                    a.oerr[size_t(l)] += x.oerr[size_t(l)] / n;
                    a.oerr_wo[size_t(l)] += x.oerr_wo[size_t(l)] / n;
                    a.oerr_wo_prop[size_t(l)] += x.oerr_wo_prop[size_t(l)] / n;
                }
                pp << methods[i].name << ',' << kf << ',' << p << ',' << x.kl << ',' << x.top1 << ',' << x.match << ','
                   << mean(x.oerr) << ',' << mean(x.oerr_wo) << ',' << x.oerr_prop << ',' << x.kv_bytes << ',' << x.scored << '\n';
            }
            const bool paired = iref >= 0 && int(i) != iref && complete(iref, f) && n_ex >= 2;
            const paired_kl pr = paired ? compare(int(i), f, iref, f) : paired_kl{};
            std::vector<double> all{a.kl, a.top1, a.match, a.kv_bytes, a.oerr_prop, a.scored, pr.d, pr.se};
            all.insert(all.end(), a.oerr.begin(), a.oerr.end());
            all.insert(all.end(), a.oerr_wo.begin(), a.oerr_wo.end());
            all.insert(all.end(), {kl_se, top1_se, match_se, oerr_wo_se});
            all.insert(all.end(), a.oerr_wo_prop.begin(), a.oerr_wo_prop.end());
            for (double x : all)
                if (!is_finite(x)) ok = false;
            csv << methods[i].name << ',' << kf << ',' << v.size() << ',' << a.kl << ',' << a.top1 << ',' << a.match << ','
                << mean(a.oerr) << ',' << mean(a.oerr_wo) << ',' << a.oerr_prop;
            for (double x : a.oerr) csv << ',' << x;
            for (double x : a.oerr_wo) csv << ',' << x;
            csv << ',' << a.kv_bytes << ',' << full_bytes << ',' << kl_se << ',' << top1_se << ',' << match_se << ',' << oerr_wo_se << ','
                << opt.budgets[f].tokens << ',' << mean(a.oerr_wo_prop);
            for (double x : a.oerr_wo_prop) csv << ',' << x;
            csv << ',' << a.scored << ',' << (paired ? opt.reference : std::string()) << ',';
            if (paired) csv << pr.d << ',' << pr.se << ',' << pr.wins << ',' << pr.losses << ',' << pr.p_sign;
            else csv << ",,,,";
            csv << '\n';
            char cmp[96];
            if (paired) {
                char wins[16], tt[16];
                std::snprintf(wins, sizeof wins, "%d/%d", pr.wins, pr.wins + pr.losses);
                std::snprintf(tt, sizeof tt, "%+.1f%s", pr.t, pr.beyond ? "*" : " ");
                std::snprintf(cmp, sizeof cmp, "%+9.5f %8.5f %7s %7s %6.3f", pr.d, pr.se, tt, wins, pr.p_sign);
            } else {
                std::snprintf(cmp, sizeof cmp, "%9s %8s %7s %7s %6s", int(i) == iref ? "(ref)" : "-", "", "", "", "");
            }
            char sc[16];
            if (opt.chunk > 0) std::snprintf(sc, sizeof sc, "%6s", "-");  // chunked budgets are per chunk: not counted
            else std::snprintf(sc, sizeof sc, "%6.1f", a.scored);
            std::printf("%-14s %5s %s %9.5f %8.5f %s %6.3f %5.1f %8.4f %8.1f %5.1f%%\n", methods[i].name.c_str(), opt.budgets[f].label().c_str(),
                        sc, a.kl, kl_se, cmp, a.top1, a.match, mean(a.oerr_wo), a.kv_bytes / 1024.0, 100.0 * a.kv_bytes / full_bytes);
            // the memory the label promises: floor(f x L) tokens per cache head (G cache heads per KV head when repeated)
            const double label_bytes = double(opt.budgets[f].tokens > 0 ? opt.budgets[f].tokens
                                                                         : int(std::floor(opt.budgets[f].fraction * opt.prompt_tokens))) *
                                       c.n_layers * c.n_kv_heads * (methods[i].repeat_kv ? c.kv_group() : 1) * c.head_dim() * 2 * sizeof(float);
            if (opt.chunk == 0 && label_bytes > 0 && label_bytes < full_bytes * (methods[i].repeat_kv ? c.kv_group() : 1) &&
                std::fabs(a.kv_bytes / label_bytes - 1.0) > 0.005) {
                char b[96];
                std::snprintf(b, sizeof b, " %s %s %+.1f%%", methods[i].name.c_str(), opt.budgets[f].label().c_str(), 100.0 * (a.kv_bytes / label_bytes - 1.0));
                memory_off += b;
            }
            ++rows;
        }
    }
    csv.close();
    pp.close();
    if (!memory_off.empty())
        std::printf("\nkept memory off the label's floor(f x L) tokens per head by more than 0.5%% (measured):%s\n", memory_off.c_str());
    std::printf("\nfull cache: %.1f KiB of fp32 K+V per prompt. scored = kept tokens per head chosen by score (the rest are kept by "
                "rule: window, sinks, recent); KL, top1 and match over %d teacher-forced steps; oerr_WO = mean over layers of "
                "||W_O (o - o_ev)|| / ||W_O o|| at the first decoding step; kept = KV bytes against the GQA-native full cache.\n",
                full_bytes / 1024.0, opt.steps);

    // ReST-KV vs SnapKV per layer, with Greedy-W beside them (the diagnostic docs/fidelity.md discusses)
    const int ir = row_of("ReST-KV"), is = row_of("SnapKV"), io = row_of("Greedy-W");
    if (ir >= 0 && is >= 0) {
        std::printf("\nper-layer oerr (isolated), ReST-KV / SnapKV%s; wins = (prompt, layer) pairs where ReST-KV's error is lower:\n",
                    io >= 0 ? " / Greedy-W" : "");
        for (size_t f = 0; f < opt.budgets.size(); ++f) {
            if (!complete(ir, f) || !complete(is, f)) continue;
            const auto& R = res[size_t(ir)][f];
            const auto& S = res[size_t(is)][f];
            std::printf("keep %4s:", opt.budgets[f].label().c_str());
            int wins = 0, pairs = 0;
            for (int l = 0; l < c.n_layers; ++l) {
                double r = 0, sv = 0, o = 0;
                for (size_t p = 0; p < n_ex; ++p) {
                    r += R[p].oerr[size_t(l)] / double(n_ex);
                    sv += S[p].oerr[size_t(l)] / double(n_ex);
                    if (complete(io, f)) o += res[size_t(io)][f][p].oerr[size_t(l)] / double(n_ex);
                    wins += R[p].oerr[size_t(l)] < S[p].oerr[size_t(l)] ? 1 : 0;
                    pairs += R[p].oerr[size_t(l)] != S[p].oerr[size_t(l)] ? 1 : 0;
                }
                std::printf(" L%d %.4f/%.4f", l, r, sv);
                if (complete(io, f)) std::printf("/%.4f", o);
            }
            std::printf("  wins %d of %d\n", wins, pairs);
        }
    }
    if (n_ex >= 2) {
        auto show = [&](const paired_kl& r) {
            std::printf("%+.5f+-%.5f%s (%d/%d, p %.3f)", r.d, r.se, r.beyond ? "*" : "", r.wins, r.wins + r.losses, r.p_sign);
        };
        // Against the reference: which rows are beyond noise (both tests), per budget.
        if (iref >= 0) {
            std::printf("\nagainst %s, beyond noise by the paired t test (|t| > %.3f) and by the sign test (p < 0.05):\n", opt.reference.c_str(), tc);
            for (size_t f = 0; f < opt.budgets.size(); ++f) {
                if (!complete(iref, f)) continue;
                std::string lower, higher;
                int within = 0;
                for (size_t i = 0; i < methods.size(); ++i) {
                    if (int(i) == iref || !complete(int(i), f)) continue;
                    const paired_kl r = compare(int(i), f, iref, f);
                    if (r.beyond && r.p_sign < 0.05) (r.d < 0 ? lower : higher) += " " + methods[i].name;
                    else ++within;
                }
                std::printf("keep %4s: lower KL:%s; higher KL:%s; %d rows not shown different\n", opt.budgets[f].label().c_str(),
                            lower.empty() ? " none" : lower.c_str(), higher.empty() ? " none" : higher.c_str(), within);
            }
        }
        // Greedy-W is a search, not a bound: the rows and excerpts that beat it.
        if (io >= 0) {
            std::printf("\nGreedy-W is not a bound; rows with a lower mean KL, and excerpts where some other row has a lower KL:\n");
            for (size_t f = 0; f < opt.budgets.size(); ++f) {
                if (!complete(io, f)) continue;
                std::string below;
                int beaten = 0;
                double g = 0;
                for (size_t p = 0; p < n_ex; ++p) g += res[size_t(io)][f][p].kl / double(n_ex);
                for (size_t i = 0; i < methods.size(); ++i) {
                    if (int(i) == io || !complete(int(i), f)) continue;
                    double k = 0;
                    for (size_t p = 0; p < n_ex; ++p) k += res[i][f][p].kl / double(n_ex);
                    if (k < g) below += " " + methods[i].name;
                }
                for (size_t p = 0; p < n_ex; ++p) {
                    bool any = false;
                    for (size_t i = 0; i < methods.size() && !any; ++i)
                        any = int(i) != io && complete(int(i), f) && res[i][f][p].kl < res[size_t(io)][f][p].kl;
                    beaten += any ? 1 : 0;
                }
                std::printf("keep %4s: lower mean KL:%s; beaten on %d of %zu excerpts\n", opt.budgets[f].label().c_str(),
                            below.empty() ? " none" : below.c_str(), beaten, n_ex);
            }
        }
        // The pairs docs/fidelity.md states, with the same statistics.
        const std::pair<const char*, const char*> claims[] = {
            {"ReST-KV", "SnapKV"},          {"AdaKV", "SnapKV"},         {"CriticalAdaKV", "AdaKV-pub"}, {"DefensiveKV", "AdaKV-pub"},
            {"DefensiveKV", "CriticalAdaKV"}, {"Layer-DefensiveKV", "AdaKV-pub"}, {"Layer-DefensiveKV", "DefensiveKV"}, {"LKV", "AdaKV-pub"},
            {"LKV", "ReST-KV"},             {"LKV", "AdaKV"},            {"Greedy-W", "ReST-KV"},        {"Greedy-W", "LKV"},
            {"ReST-KV-pqh", "ReST-KV"},     {"SnapKV-pqh", "SnapKV"},    {"SnapKV-mp7-pqh", "SnapKV-pqh"}, {"AdaKV-pub", "AdaKV-mp7"},
            {"Greedy-W-pqh", "Greedy-W"}};
        std::printf("\npairs (d = first - second, +-se, * = beyond the t test; wins of the first / excerpts that differ, sign-test p):\n");
        for (const auto& cl : claims) {
            const int a = row_of(cl.first), b = row_of(cl.second);
            if (a < 0 || b < 0) continue;
            std::printf("%s - %s:", cl.first, cl.second);
            for (size_t f = 0; f < opt.budgets.size(); ++f) {
                if (!complete(a, f) || !complete(b, f)) continue;
                std::printf("  %s ", opt.budgets[f].label().c_str());
                show(compare(a, f, b, f));
            }
            std::printf("\n");
        }
        // Per-query-head rows hold G times the KV bytes at the same keep fraction: compare them at equal memory
        // too, a per-query-head row at fraction f against a GQA-native row at G * f (where the run has both),
        // whichever of the pair is the per-query-head one (d is always first - second).
        const int G = c.kv_group();
        for (const auto& cl : claims) {
            const int a = row_of(cl.first), b = row_of(cl.second);
            if (a < 0 || b < 0 || methods[size_t(a)].repeat_kv == methods[size_t(b)].repeat_kv) continue;
            const bool a_pqh = methods[size_t(a)].repeat_kv;
            bool any = false;
            for (size_t f = 0; f < opt.budgets.size(); ++f)
                for (size_t g = 0; g < opt.budgets.size(); ++g) {
                    // x: the per-query-head row's budget, y: the GQA-native row's (G times x)
                    const budget_spec &x = opt.budgets[a_pqh ? f : g], &y = opt.budgets[a_pqh ? g : f];
                    const bool equal = x.tokens > 0 ? y.tokens == G * x.tokens : y.tokens == 0 && std::fabs(y.fraction - G * x.fraction) < 1e-9;
                    if (!equal || !complete(a, f) || !complete(b, g)) continue;
                    if (!any)
                        std::printf("%s - %s at equal KV bytes (the per-query-head row at keep f, the other at %d f):", cl.first, cl.second, G);
                    any = true;
                    std::printf("  %s vs %s ", opt.budgets[f].label().c_str(), opt.budgets[g].label().c_str());
                    show(compare(a, f, b, g));
                }
            if (any) std::printf("\n");
        }
    }
    const int expected = int(methods.size() * opt.budgets.size()) - skipped;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("self-check (unevicted cache, isolated attention vs forward()): max rel err %.2e\n", self_check);
    // File names only: the table is copied into docs/ (scripts/fidelity.sh --update-docs), where the
    // machine's absolute --out folder would mean nothing to a reader.
    auto base = [](const std::string& p) { const auto i = p.find_last_of('/'); return i == std::string::npos ? p : p.substr(i + 1); };
    std::printf("rows %d / %d; wrote %s and %s in the --out folder; %.1f s\n", rows, expected, base(csv_path).c_str(),
                base(pp_path).c_str(), secs);
    if (self_check > 1e-4) { std::fprintf(stderr, "error: measurement self-check failed (%.3e > 1e-4)\n", self_check); ok = false; }
    if (rows != expected) ok = false;
    if (!ok) {
        std::fprintf(stderr, "error: the table is incomplete or has non-finite figures\n");
        return 1;
    }
    return 0;
}
