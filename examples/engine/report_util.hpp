// Shared by the engine's report programs (examples/fidelity: kvevict_fidelity, kvevict_decoding;
// examples/engine: kvevict_lkv_modes): the text folder, command-line helpers, the excerpt rule (starts
// spread evenly over the text, each moved to the next paragraph start; make_excerpts leaves out windows
// such as LKV's training contexts) and the fp64 log-softmax the KL
// figures are computed from.
#pragma once

#include "model.hpp"
#include "tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kvevict_engine {

/// Text folder: --data DIR, else $KVEVICT_DATA_DIR, else KVEVICT_SOURCE_DIR/../shared/data/text, else
/// ../shared/data/text.
inline std::string resolve_data_dir(const std::string& flag) {
    if (!flag.empty()) return flag;
    if (const char* e = std::getenv("KVEVICT_DATA_DIR"); e && *e) return e;
#ifdef KVEVICT_SOURCE_DIR
    return std::string(KVEVICT_SOURCE_DIR) + "/../shared/data/text";
#else
    return "../shared/data/text";
#endif
}

inline bool parse_int(const std::string& s, int lo, int hi, int& out) {
    char* end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (end == s.c_str() || *end != '\0' || v < lo || v > hi) return false;
    out = int(v);
    return true;
}

inline std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ','))
        if (!item.empty()) out.push_back(item);
    return out;
}

/// Byte offset of excerpt i of n reading `chars` bytes: (text - chars) * (2i + 1) / 2n, moved to the
/// next paragraph start ("\n\n") when one follows with room, then past blank lines and spaces.
inline size_t excerpt_start(const std::string& text, size_t chars, int i, int n) {
    size_t start = (text.size() - chars) * size_t(2 * i + 1) / size_t(2 * n);
    const size_t para = text.find("\n\n", start);
    if (para != std::string::npos && para + chars < text.size()) start = para;
    while (start < text.size() && (text[start] == '\n' || text[start] == ' ')) ++start;
    return start;
}

/// Tokenises the `chars` bytes at `start` (line breaks read as spaces: prose, not line breaks; a
/// 512-piece vocabulary has few '\n' merges) and appends excerpt `index`: its first `tokens` tokens (BOS
/// first) to `out`, the next `cont_tokens` to `cont` when given. Error: fewer tokens than that.
inline result add_excerpt(const tokenizer& tok, const std::string& text, size_t start, size_t chars, int index, int tokens, int cont_tokens,
                          std::vector<std::vector<int>>& out, std::vector<std::vector<int>>* cont) {
    std::string piece = text.substr(start, chars);
    for (char& ch : piece)
        if (ch == '\n') ch = ' ';
    std::vector<int> t = tok.encode(piece);
    if (int(t.size()) < tokens + cont_tokens)
        return result::failure("excerpt " + std::to_string(index) + " has only " + std::to_string(t.size()) + " tokens");
    if (cont) cont->emplace_back(t.begin() + tokens, t.begin() + tokens + cont_tokens);
    t.resize(size_t(tokens));
    out.push_back(std::move(t));
    return result::success();
}

/// `n` excerpts of `tokens` tokens (BOS first): starts spread evenly over the text, each moved to the
/// next paragraph start; with cont_tokens > 0 also the next cont_tokens tokens of each excerpt's
/// text (the real continuation) in *cont (the excerpt then comes from a longer piece of text).
inline result make_prompts(const tokenizer& tok, const std::string& text, int n, int tokens, std::vector<std::vector<int>>& out,
                           int cont_tokens = 0, std::vector<std::vector<int>>* cont = nullptr) {
    out.clear();
    if (cont) cont->clear();
    const size_t chars = size_t(tokens + cont_tokens) * 3 + 64;  // ~1.7 chars per token: 3 is ample
    if (text.size() < chars * 2) return result::failure("text too short for excerpts");
    for (int i = 0; i < n; ++i) {
        if (result r = add_excerpt(tok, text, excerpt_start(text, chars, i, n), chars, i, tokens, cont_tokens, out, cont); !r) return r;
    }
    return result::success();
}

/// FNV-1a (64 bits) of a byte string: the fingerprint an excluded-windows file gives its text
/// (tools/lkv/train_windows.py computes the same).
inline std::uint64_t fnv1a64(const std::string& s) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
    return h;
}

/// Byte windows [first, second) of one text that excerpts must not overlap: LKV's training contexts
/// (artifacts/lkv/train_windows.txt, written by tools/lkv/train_windows.py).
struct excluded_windows {
    std::vector<std::pair<size_t, size_t>> windows;  ///< empty when the file is about another text
    std::string text_name;                           ///< the text the file describes
};

/// Reads an excluded-windows file: '#' comments, one line "text NAME bytes N fnv1a64 HEX", then "start end"
/// lines. The windows apply only when `text` has exactly that size and fingerprint (another text, e.g. the
/// King James Bible, gets none). Errors: unreadable file, a malformed line, a window outside the text, and
/// a text whose file name (`text_file_name`) is the file's NAME but whose bytes differ (an edited or
/// re-encoded copy: its excerpts could overlap the windows unnoticed).
inline result read_excluded_windows(const std::string& path, const std::string& text, const std::string& text_file_name,
                                    excluded_windows& out) {
    out = excluded_windows{};
    std::ifstream f(path);
    if (!f) return result::failure("cannot read the excluded-windows file " + path);
    std::string line, name, w_bytes, w_hash;
    unsigned long long bytes = 0, hash = 0;
    bool header = false, same = false;
    int no = 0;
    while (std::getline(f, line)) {
        ++no;
        if (line.empty() || line[0] == '#') continue;
        std::istringstream is(line);
        if (!header) {
            std::string t;
            if (!(is >> t >> name >> w_bytes >> bytes >> w_hash >> std::hex >> hash) || t != "text" || w_bytes != "bytes" || w_hash != "fnv1a64")
                return result::failure(path + ":" + std::to_string(no) + ": expected 'text NAME bytes N fnv1a64 HEX'");
            header = true;
            out.text_name = name;
            same = bytes == text.size() && hash == fnv1a64(text);
            if (!same && name == text_file_name)
                return result::failure(path + " describes " + name + " of " + std::to_string(bytes) +
                                       " bytes with another fingerprint than this " + text_file_name + " (" + std::to_string(text.size()) +
                                       " bytes): regenerate it (tools/lkv/train_windows.py) or pass --exclude-windows none");
            continue;
        }
        unsigned long long a = 0, b = 0;
        if (!(is >> a >> b) || a >= b || b > bytes) return result::failure(path + ":" + std::to_string(no) + ": expected 'start end' with start < end <= " + std::to_string(bytes));
        if (same) out.windows.emplace_back(size_t(a), size_t(b));
    }
    if (!header) return result::failure(path + ": no 'text' line");
    return result::success();
}

/// The report's excerpts with windows left out: `n` non-overlapping excerpts of `tokens` tokens (BOS first;
/// plus `cont_tokens` of real continuation into `cont` when given). Candidates follow make_prompts' rule
/// (starts spread evenly over the text, each moved to the next paragraph start; each reads
/// 3 * (tokens + cont_tokens) + 64 bytes) for nc = n, n + 1, ... candidates; a candidate whose byte window
/// overlaps an excluded window or an earlier candidate is dropped. At the first nc that leaves at least n,
/// the n excerpts are taken evenly from what is left (index (2j + 1) * R / (2n) of R), so with nothing
/// excluded they are exactly make_prompts' excerpts. `left_out`: candidates of that nc dropped for an
/// excluded window; `starts`: the excerpts' byte offsets. Errors: too short a text, no nc up to 16 n.
inline result make_excerpts(const tokenizer& tok, const std::string& text, int n, int tokens, const std::vector<std::pair<size_t, size_t>>& excluded,
                            std::vector<std::vector<int>>& out, int cont_tokens, std::vector<std::vector<int>>* cont, int& left_out,
                            std::vector<size_t>& starts) {
    out.clear();
    if (cont) cont->clear();
    starts.clear();
    left_out = 0;
    const size_t chars = size_t(tokens + cont_tokens) * 3 + 64;  // as make_prompts
    if (text.size() < chars * 2) return result::failure("text too short for excerpts");
    std::vector<size_t> kept;
    for (int nc = n; nc <= 16 * n && int(kept.size()) < n; ++nc) {
        kept.clear();
        left_out = 0;
        for (int i = 0; i < nc; ++i) {
            const size_t start = excerpt_start(text, chars, i, nc), end = start + chars;
            bool excl = false;
            for (const auto& w : excluded) excl = excl || (w.first < end && start < w.second);
            if (excl) { ++left_out; continue; }
            if (!kept.empty() && kept.back() + chars > start) continue;  // overlaps the previous candidate
            kept.push_back(start);
        }
    }
    if (int(kept.size()) < n)
        return result::failure("only " + std::to_string(kept.size()) + " excerpts of " + std::to_string(chars) +
                               " bytes fit outside the excluded windows");
    const size_t R = kept.size();
    for (int j = 0; j < n; ++j) {
        const size_t start = kept[size_t(2 * j + 1) * R / size_t(2 * n)];
        if (result r = add_excerpt(tok, text, start, chars, j, tokens, cont_tokens, out, cont); !r) return r;
        starts.push_back(start);
    }
    return result::success();
}

// ---- statistics over excerpts (the report tables) ----
inline double mean(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / double(v.size());
}
/// Standard error of the mean of v (sample standard deviation / sqrt(n)); 0 for fewer than 2 values.
inline double std_error(const std::vector<double>& v) {
    if (v.size() < 2) return 0.0;
    const double mu = mean(v);
    double ss = 0;
    for (double x : v) ss += (x - mu) * (x - mu);
    return std::sqrt(ss / double(v.size() - 1) / double(v.size()));
}
/// Two-sided 95% critical value of Student's t with df degrees of freedom (df >= 1).
inline double t_critical_95(int df) {
    static const double t[30] = {12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                                 2.201,  2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                                 2.080,  2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042};
    if (df < 1) return 0.0;
    if (df <= 30) return t[df - 1];
    // Cornish-Fisher expansion around the normal quantile (2.0395 at 31 df, the tabulated value)
    const double z = 1.959963985, n = double(df);
    return z + (z * z * z + z) / (4 * n) + (5 * std::pow(z, 5) + 16 * z * z * z + 3 * z) / (96 * n * n);
}

/// Two-sided exact sign test: the probability, under a fair coin, of a split of wins + losses at least
/// as uneven as the one seen (ties dropped before). 1 when there is nothing to test.
inline double sign_test_p(int wins, int losses) {
    const int n = wins + losses, k = std::min(wins, losses);
    if (n == 0) return 1.0;
    double tail = 0;  // P(X <= k), X ~ Binomial(n, 1/2), from log-binomials
    for (int i = 0; i <= k; ++i) tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) - n * std::log(2.0));
    return std::min(1.0, 2.0 * tail);
}

/// Paired comparison of two rows measured on the same excerpts (x[i] and y[i] from excerpt i): d = mean of
/// x - y, se its standard error, t = d / se, `beyond` when |t| exceeds the two-sided 95% Student t with
/// n - 1 degrees of freedom (or d != 0 when se is 0); wins / losses = excerpts where x < y / x > y, and
/// p_sign the two-sided exact sign test of that split. `valid` is false for fewer than 2 excerpts.
struct paired_stats {
    bool valid = false, beyond = false;
    double d = 0, se = 0, t = 0, p_sign = 1;
    int wins = 0, losses = 0;
};
inline paired_stats paired_compare(const std::vector<double>& x, const std::vector<double>& y) {
    paired_stats r;
    if (x.size() != y.size() || x.size() < 2) return r;
    std::vector<double> diff;
    for (size_t i = 0; i < x.size(); ++i) {
        diff.push_back(x[i] - y[i]);
        r.wins += x[i] < y[i] ? 1 : 0;
        r.losses += x[i] > y[i] ? 1 : 0;
    }
    r.valid = true;
    r.d = mean(diff);
    r.se = std_error(diff);
    r.t = r.se > 0 ? r.d / r.se : 0.0;
    r.beyond = r.se > 0 ? std::fabs(r.t) > t_critical_95(int(x.size()) - 1) : r.d != 0;
    r.p_sign = sign_test_p(r.wins, r.losses);
    return r;
}

/// log-softmax in fp64.
inline std::vector<double> log_softmax(const std::vector<float>& x) {
    double mx = -std::numeric_limits<double>::infinity();
    for (float v : x) mx = std::max(mx, double(v));
    double s = 0;
    for (float v : x) s += std::exp(double(v) - mx);
    const double lse = mx + std::log(s);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = double(x[i]) - lse;
    return out;
}

/// KL(p || q) in nats of two log-probability vectors of the same length (fp64; clamped at 0 against
/// rounding).
inline double kl_divergence(const std::vector<double>& lp, const std::vector<double>& lq) {
    double kl = 0;
    for (size_t t = 0; t < lp.size(); ++t) kl += std::exp(lp[t]) * (lp[t] - lq[t]);
    return std::max(kl, 0.0);
}

/// A comma-separated list of numbers in (0, 1] (--fractions); false on an empty list or a bad item
/// (`bad` gets it).
inline bool parse_fraction_list(const std::string& s, std::vector<double>& out, std::string& bad) {
    out.clear();
    for (const std::string& f : split(s)) {
        char* end = nullptr;
        const double x = std::strtod(f.c_str(), &end);
        if (end == f.c_str() || *end != '\0' || !(x > 0.0 && x <= 1.0)) {
            bad = f;
            return false;
        }
        out.push_back(x);
    }
    bad.clear();
    return !out.empty();
}

/// A comma-separated list of integers in [lo, hi] (--intervals, --budgets); false as parse_fraction_list.
inline bool parse_int_list(const std::string& s, int lo, int hi, std::vector<int>& out, std::string& bad) {
    out.clear();
    for (const std::string& f : split(s)) {
        int v = 0;
        if (!parse_int(f, lo, hi, v)) {
            bad = f;
            return false;
        }
        out.push_back(v);
    }
    bad.clear();
    return !out.empty();
}

}  // namespace kvevict_engine
