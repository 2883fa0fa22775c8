// Shared by the engine's report programs (examples/fidelity: kvevict_fidelity, kvevict_decoding;
// examples/engine: kvevict_lkv_modes): the text folder, command-line helpers, the excerpt rule (starts
// spread evenly over the text, each moved to the next paragraph start) and the fp64 log-softmax the KL
// figures are computed from.
#pragma once

#include "model.hpp"
#include "tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
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
        size_t start = (text.size() - chars) * size_t(2 * i + 1) / size_t(2 * n);
        const size_t para = text.find("\n\n", start);
        if (para != std::string::npos && para + chars < text.size()) start = para;
        while (start < text.size() && (text[start] == '\n' || text[start] == ' ')) ++start;
        std::string piece = text.substr(start, chars);
        for (char& ch : piece)
            if (ch == '\n') ch = ' ';  // prose, not line breaks (a 512-piece vocabulary has few '\n' merges)
        std::vector<int> t = tok.encode(piece);
        if (int(t.size()) < tokens + cont_tokens)
            return result::failure("excerpt " + std::to_string(i) + " has only " + std::to_string(t.size()) + " tokens");
        if (cont) cont->emplace_back(t.begin() + tokens, t.begin() + tokens + cont_tokens);
        t.resize(size_t(tokens));
        out.push_back(std::move(t));
    }
    return result::success();
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
