// kvevict_engine: fp32 forward pass (one token at a time) over a compactable KV cache, plus sampling.
#pragma once

#include "kv_cache.hpp"
#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kvevict_engine {

/// Optional hooks and switches for forward(). All are empty by default (no overhead beyond a branch).
/// Pointers passed to hooks are valid only during the call.
struct forward_options {
    /// Called once per layer with the query of the current token after RoPE and before the 1/sqrt(head_dim)
    /// scaling: `q` is (n_heads, head_dim) contiguous, head-major; `position` is its logical position.
    std::function<void(int layer, std::int32_t position, const float* q)> on_query;
    /// Called once per layer with the attention output before wo: `o` is (n_heads, head_dim) contiguous,
    /// head h at o[h*head_dim ..] (the input of wo; the block's residual update is wo * o).
    std::function<void(int layer, const float* o)> on_head_output;
    /// Called per layer and query head with the fp32 softmax weights over slots 0..len-1 of its cache head
    /// (`len` = lengths(layer)[head / query_heads_per_cache_head()], the current token included; masked slots report 0).
    std::function<void(int layer, int head, const float* probs, int len)> on_attention;
    /// Reference masking (testing/measurement): if set, slot s of KV head h in `layer` takes part in
    /// attention only when slot_visible(layer, h, s) is true (h: the cache head). If every slot of a head is masked its output is 0.
    /// Normal operation leaves this empty: the mask then comes from lengths only.
    std::function<bool(int layer, int kv_head, int slot)> slot_visible;
};

namespace detail {
inline void rmsnorm(vector& out, const vector& x, const vector& w) {
    float ss = x.squaredNorm() / float(x.size()) + 1e-5f;
    out = w.cwiseProduct(x) * (1.0f / std::sqrt(ss));
}
/// Interleaved RoPE in place on n_heads blocks of head_dim: pairs (x[2i], x[2i+1]) rotated by
/// position * 10000^(-2i/head_dim).
inline void rope(float* x, int n_heads, int head_dim, std::int32_t position) {
    for (int i = 0; i < head_dim / 2; ++i) {
        const double freq = std::pow(10000.0, -2.0 * i / head_dim);
        const double a = double(position) * freq;
        const float c = float(std::cos(a)), s = float(std::sin(a));
        for (int h = 0; h < n_heads; ++h) {
            float* p = x + h * head_dim + 2 * i;
            const float x0 = p[0], x1 = p[1];
            p[0] = x0 * c - x1 * s;
            p[1] = x0 * s + x1 * c;
        }
    }
}
}  // namespace detail

/// Query heads that read one head of `cache`: c.kv_group() for a GQA-native cache, 1 for a cache repeated
/// to q_heads heads (kv_cache::kv_repeat() == kv_group()); query head h reads cache head h / this.
/// Precondition: cache.n_kv_heads() divides c.n_heads (forward() checks it).
inline int query_heads_per_cache_head(const config& c, const kv_cache& cache) { return c.n_heads / cache.n_kv_heads(); }

/// Runs one token through the model at logical position cache.next_position, appends its key/value
/// (key RoPE-rotated at that position) to every layer of `cache`, advances cache.next_position, and
/// writes the `vocab` logits to `logits` (resized).
/// Attention of query head h covers slots 0..len[j]-1 of its cache head j = h / query_heads_per_cache_head()
/// (h / kv_group for a GQA-native cache; h for one repeated to q_heads; the new token included); each cached
/// key keeps the rotation of its own stored position, so compaction needs no re-rotation.
/// Errors (checked first; cache and logits unchanged): token out of range, cache shape not matching the
/// model (layers, head_dim, or heads other than n_kv_heads * kv_repeat with kv_repeat dividing kv_group),
/// a full head in some layer.
inline result forward(const model& m, kv_cache& cache, int token, std::vector<float>& logits,
                      const forward_options& opt = {}) {
    const config& c = m.cfg;
    const int hd = c.head_dim();
    if (token < 0 || token >= c.vocab_size)
        return result::failure("forward: token " + std::to_string(token) + " outside 0.." + std::to_string(c.vocab_size - 1));
    const int rep = cache.kv_repeat();
    if (cache.n_layers() != c.n_layers || cache.head_dim() != hd || cache.n_kv_heads() != c.n_kv_heads * rep || c.kv_group() % rep != 0)
        return result::failure("forward: kv_cache shape (" + std::to_string(cache.n_layers()) + " layers, " + std::to_string(cache.n_kv_heads()) +
                               " heads = KV heads x kv_repeat " + std::to_string(rep) + ", head_dim " + std::to_string(cache.head_dim()) +
                               ") does not match the model (" + std::to_string(c.n_layers) + " layers, " + std::to_string(c.n_kv_heads) +
                               " KV heads, GQA group " + std::to_string(c.kv_group()) + ", head_dim " + std::to_string(hd) + ")");
    const int group = query_heads_per_cache_head(c, cache);
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < cache.n_kv_heads(); ++h)
            if (cache.length(l, h) >= cache.capacity())
                return result::failure("forward: kv_cache full (layer " + std::to_string(l) + ", head " +
                                       std::to_string(h) + ", capacity " + std::to_string(cache.capacity()) + ")");
    const std::int32_t pos = cache.next_position;
    const float scale = 1.0f / std::sqrt(float(hd));

    vector x = m.tok_emb.row(token).transpose(), xb(c.dim), q, k, v, o(c.dim), h1, h3;
    std::vector<float> scores, kbuf, vbuf;  // kbuf/vbuf: a head's rows gathered from a paged cache
    for (int l = 0; l < c.n_layers; ++l) {
        const layer_weights& w = m.layers[size_t(l)];
        detail::rmsnorm(xb, x, w.rms_att);
        q.noalias() = w.wq * xb;
        k.noalias() = w.wk * xb;
        v.noalias() = w.wv * xb;
        detail::rope(q.data(), c.n_heads, hd, pos);
        detail::rope(k.data(), c.n_kv_heads, hd, pos);
        if (result r = cache.append(l, k.data(), v.data(), pos); !r) return r;
        if (opt.on_query) opt.on_query(l, pos, q.data());

        for (int h = 0; h < c.n_heads; ++h) {
            const int kvh = h / group, len = cache.length(l, kvh);
            // rows are slots (slot_stride == hd); a paged cache gathers the head's pages into kbuf / vbuf
            Eigen::Map<const matrix> K(cache.head_keys(l, kvh, kbuf), len, hd);
            Eigen::Map<const matrix> V(cache.head_values(l, kvh, vbuf), len, hd);
            scores.resize(size_t(len));
            Eigen::Map<vector> s(scores.data(), len);
            s.noalias() = (K * q.segment(h * hd, hd)) * scale;
            float mx = -std::numeric_limits<float>::infinity();
            for (int t = 0; t < len; ++t) {
                if (opt.slot_visible && !opt.slot_visible(l, kvh, t)) s[t] = -std::numeric_limits<float>::infinity();
                mx = std::max(mx, s[t]);
            }
            if (mx == -std::numeric_limits<float>::infinity()) {  // everything masked
                s.setZero();
                o.segment(h * hd, hd).setZero();
            } else {
                float sum = 0.0f;
                for (int t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
                s *= 1.0f / sum;
                o.segment(h * hd, hd).noalias() = V.transpose() * s;
            }
            if (opt.on_attention) opt.on_attention(l, h, scores.data(), len);
        }
        if (opt.on_head_output) opt.on_head_output(l, o.data());
        x.noalias() += w.wo * o;

        detail::rmsnorm(xb, x, w.rms_ffn);
        h1.noalias() = w.w1 * xb;
        h3.noalias() = w.w3 * xb;
        h1 = (h1.array() / (1.0f + (-h1.array()).exp()) * h3.array()).matrix();  // silu(w1 x) * (w3 x)
        x.noalias() += w.w2 * h1;
    }
    detail::rmsnorm(xb, x, m.rms_final);
    logits.resize(size_t(c.vocab_size));
    Eigen::Map<vector>(logits.data(), c.vocab_size).noalias() = m.classifier() * xb;
    cache.next_position = pos + 1;
    return result::success();
}

/// Runs forward() over `tokens` in order (positions cache.next_position, +1, ...); `last_logits` receives
/// the logits after the last token. Hooks fire for every token. Error if `tokens` is empty or any step fails.
inline result prefill(const model& m, kv_cache& cache, const std::vector<int>& tokens, std::vector<float>& last_logits,
                      const forward_options& opt = {}) {
    if (tokens.empty()) return result::failure("prefill: empty token list");
    for (int t : tokens)
        if (result r = forward(m, cache, t, last_logits, opt); !r) return r;
    return result::success();
}

/// Keeps the RoPE-rotated queries of the last `w` tokens per layer (fed through forward_options::on_query).
/// Usage: `query_window qw(cfg, w); opts.on_query = qw.hook();` then `qw.queries(layer)`.
class query_window {
public:
    query_window(const config& c, int w) : n_heads_(c.n_heads), head_dim_(c.head_dim()), w_(w), q_(size_t(c.n_layers)) {}
    /// Hook to assign to forward_options::on_query. The window must outlive the options using it.
    std::function<void(int, std::int32_t, const float*)> hook() {
        return [this](int l, std::int32_t, const float* q) {
            auto& d = q_[size_t(l)];
            d.emplace_back(q, q + size_t(n_heads_) * size_t(head_dim_));
            while (int(d.size()) > w_) d.pop_front();
        };
    }
    /// Number of queries held for `layer` (min(w, tokens seen)).
    int count(int layer) const { return int(q_[size_t(layer)].size()); }
    /// Queries of `layer` as a contiguous (n_heads, count, head_dim) buffer, oldest token first.
    std::vector<float> queries(int layer) const {
        const auto& d = q_[size_t(layer)];
        const size_t n = d.size(), hd = size_t(head_dim_);
        std::vector<float> out(size_t(n_heads_) * n * hd);
        for (size_t t = 0; t < n; ++t)
            for (size_t h = 0; h < size_t(n_heads_); ++h)
                std::copy_n(d[t].data() + h * hd, hd, out.data() + (h * n + t) * hd);
        return out;
    }
    void clear() { for (auto& d : q_) d.clear(); }

private:
    int n_heads_, head_dim_, w_;
    std::vector<std::deque<std::vector<float>>> q_;
};

/// Greedy decoding: index of the largest logit (lowest id on ties). Precondition: non-empty logits.
inline int argmax(const std::vector<float>& logits) {
    return int(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// Samples from softmax(logits / temperature) using `rng` (one 32-bit draw per call, deterministic for a
/// given seed on every platform). temperature <= 0 falls back to argmax.
inline int sample(const std::vector<float>& logits, float temperature, std::mt19937& rng) {
    if (temperature <= 0.0f) return argmax(logits);
    const float mx = *std::max_element(logits.begin(), logits.end());
    std::vector<double> p(logits.size());
    double sum = 0.0;
    for (size_t i = 0; i < logits.size(); ++i) sum += (p[i] = std::exp(double(logits[i] - mx) / temperature));
    const double u = double(rng()) / 4294967296.0 * sum;  // in [0, sum)
    double acc = 0.0;
    for (size_t i = 0; i < p.size(); ++i)
        if ((acc += p[i]) > u) return int(i);
    return int(p.size()) - 1;
}

}  // namespace kvevict_engine
