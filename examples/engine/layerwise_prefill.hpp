// kvevict_engine: layer-wise prefill with eviction (LKV, arXiv 2605.06676, "evict each layer's
// cache as soon as that layer is done"), example code.
//
//   layerwise_prefill(m, cache, prompt, logits, evict, &stats)
//       runs the whole prompt through layer 0, calls evict(0, cache), then layer 1 over the whole
//       prompt, evict(1, cache), ... The numbers are the same as prefill() (forward.hpp) token by
//       token: each token of layer l attends over the same keys in both orders, and layer l's
//       eviction happens after every prompt token has used layer l, so for a query-agnostic
//       scorer (scorers::learned_mlp, key_norm) the final caches are IDENTICAL to "prefill(),
//       then evict every layer". (A query-based scorer would need the window queries, which
//       layer-wise order also has once the layer is done; the equality test uses LKV.)
//   evict_layer_kv<Policy>(ev, cache, layer, budget)
//       one layer of a kv_cache through kvevict::evictor<Policy, cpu::backend> without window
//       queries, then in-place compaction (kv_cache::compact_head; a paged cache: compact_layer_paged,
//       which frees the pages a head no longer needs).
//   live_kv_bytes(cache)
//       bytes of the VALID slots (sum of lengths * 2 * head_dim * 4): the memory a cache that
//       grows and shrinks with its contents (paged/block caches) would hold. kv_cache itself
//       preallocates `capacity` slots for every layer, so its allocation does not show it (a paged
//       kv_cache holds pages of page_size slots instead: kv_cache::pages_in_use).
//
// Peak KV bytes: prefill() then evict peaks at n_layers * T * kv_heads * head_dim * 8 bytes;
// layerwise_prefill peaks at (one full layer) + (the already evicted layers), reported in
// layerwise_stats.
#pragma once

#include "forward.hpp"
#include "kv_cache.hpp"
#include "model.hpp"
#include "paged_layer.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace kvevict_engine {

/// Bytes held by the valid slots of every layer (keys + values, fp32).
inline std::int64_t live_kv_bytes(const kv_cache& c) {
    std::int64_t n = 0;
    for (int l = 0; l < c.n_layers(); ++l)
        for (int h = 0; h < c.n_kv_heads(); ++h) n += c.length(l, h);
    return n * 2 * c.head_dim() * std::int64_t(sizeof(float));
}

/// Peak and final live KV bytes of a prefill (see live_kv_bytes).
struct layerwise_stats {
    std::int64_t peak_kv_bytes = 0;
    std::int64_t final_kv_bytes = 0;
};

/// Called when layer `layer` has processed every prompt token; must evict that layer only.
using layer_evict_fn = std::function<result(int layer, kv_cache& cache)>;

/// Layer-wise prefill of `tokens` at positions cache.next_position, +1, ... (the cache may already
/// hold earlier tokens). `evict` may be empty (no eviction: then the result equals prefill()).
/// last_logits receives the logits after the last token. Errors (cache unchanged): empty tokens, a
/// token out of range, cache shape not matching the model (a cache repeated to q_heads included), not enough free slots in some head for
/// the whole prompt; an error of `evict` is returned as is (the cache is then partly filled).
inline result layerwise_prefill(const model& m, kv_cache& cache, const std::vector<int>& tokens, std::vector<float>& last_logits,
                                const layer_evict_fn& evict = {}, layerwise_stats* stats = nullptr) {
    const config& c = m.cfg;
    const int hd = c.head_dim(), group = c.kv_group(), T = int(tokens.size());
    if (tokens.empty()) return result::failure("layerwise_prefill: empty token list");
    for (int t : tokens)
        if (t < 0 || t >= c.vocab_size)
            return result::failure("layerwise_prefill: token " + std::to_string(t) + " outside 0.." + std::to_string(c.vocab_size - 1));
    if (cache.n_layers() != c.n_layers || cache.n_kv_heads() != c.n_kv_heads || cache.head_dim() != hd)
        return result::failure("layerwise_prefill: kv_cache shape (" + std::to_string(cache.n_layers()) + " layers, " +
                               std::to_string(cache.n_kv_heads()) + " heads, kv_repeat " + std::to_string(cache.kv_repeat()) + ", head_dim " +
                               std::to_string(cache.head_dim()) + ") does not match the model (" + std::to_string(c.n_layers) + " layers, " +
                               std::to_string(c.n_kv_heads) + " KV heads, head_dim " + std::to_string(hd) +
                               "); a cache repeated to q_heads (kv_repeat > 1) is not supported here: use forward()");
    for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h)
            if (cache.length(l, h) + T > cache.capacity())
                return result::failure("layerwise_prefill: layer " + std::to_string(l) + " head " + std::to_string(h) + " holds " +
                                       std::to_string(cache.length(l, h)) + " slots; " + std::to_string(T) +
                                       " more exceed the capacity " + std::to_string(cache.capacity()));
    const std::int32_t pos0 = cache.next_position;
    const float scale = 1.0f / std::sqrt(float(hd));
    std::int64_t live = live_kv_bytes(cache), peak = live;
    const std::int64_t per_token = std::int64_t(c.n_kv_heads) * hd * 2 * std::int64_t(sizeof(float));

    // Residual stream of every prompt token; the same expressions as forward(), so every number
    // (and every cached key/value) is bit-identical to token-by-token prefill.
    std::vector<vector> X(static_cast<size_t>(T));
    for (int i = 0; i < T; ++i) X[size_t(i)] = m.tok_emb.row(tokens[size_t(i)]).transpose();
    vector xb(c.dim), q, k, v, o(c.dim), h1, h3;
    std::vector<float> scores, kbuf, vbuf;  // kbuf/vbuf: a head's rows gathered from a paged cache
    for (int l = 0; l < c.n_layers; ++l) {
        const layer_weights& w = m.layers[size_t(l)];
        for (int i = 0; i < T; ++i) {
            vector& x = X[size_t(i)];
            const std::int32_t pos = pos0 + i;
            detail::rmsnorm(xb, x, w.rms_att);
            q.noalias() = w.wq * xb;
            k.noalias() = w.wk * xb;
            v.noalias() = w.wv * xb;
            detail::rope(q.data(), c.n_heads, hd, pos);
            detail::rope(k.data(), c.n_kv_heads, hd, pos);
            if (result r = cache.append(l, k.data(), v.data(), pos); !r) return r;
            live += per_token;
            peak = std::max(peak, live);
            for (int h = 0; h < c.n_heads; ++h) {
                const int kvh = h / group, len = cache.length(l, kvh);
                Eigen::Map<const matrix> K(cache.head_keys(l, kvh, kbuf), len, hd);  // paged: gathered to kbuf
                Eigen::Map<const matrix> V(cache.head_values(l, kvh, vbuf), len, hd);
                scores.resize(size_t(len));
                Eigen::Map<vector> s(scores.data(), len);
                s.noalias() = (K * q.segment(h * hd, hd)) * scale;
                float mx = -std::numeric_limits<float>::infinity();
                for (int t = 0; t < len; ++t) mx = std::max(mx, s[t]);
                float sum = 0.0f;
                for (int t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
                s *= 1.0f / sum;
                o.segment(h * hd, hd).noalias() = V.transpose() * s;
            }
            x.noalias() += w.wo * o;
            detail::rmsnorm(xb, x, w.rms_ffn);
            h1.noalias() = w.w1 * xb;
            h3.noalias() = w.w3 * xb;
            h1 = (h1.array() / (1.0f + (-h1.array()).exp()) * h3.array()).matrix();
            x.noalias() += w.w2 * h1;
        }
        if (evict) {
            if (result r = evict(l, cache); !r) return r;
            live = live_kv_bytes(cache);
        }
    }
    detail::rmsnorm(xb, X[size_t(T - 1)], m.rms_final);
    last_logits.resize(size_t(c.vocab_size));
    Eigen::Map<vector>(last_logits.data(), c.vocab_size).noalias() = m.classifier() * xb;
    cache.next_position = pos0 + T;
    if (stats) {
        stats->peak_kv_bytes = peak;
        stats->final_kv_bytes = live_kv_bytes(cache);
    }
    return result::success();
}

/// Evicts layer `layer` of `cache` with `ev` (no window queries: for query-agnostic scorers such
/// as scorers::learned_mlp or key_norm, with selector.num_recent = 0 or >= 0) and compacts it in
/// place. Sets the layer index (layer_inputs::layer_idx / num_layers) itself. Errors: any kvevict
/// error (message kept), a policy in gqa_reduction::per_query_head mode (it needs queries; this passes none).
template <class Policy>
result evict_layer_kv(const kvevict::evictor<Policy, kvevict::cpu::backend>& ev, kv_cache& cache, int layer,
                      const kvevict::budget_request& budget) {
    if (ev.params().gqa == kvevict::gqa_reduction::per_query_head)
        return result::failure("evict_layer_kv: gqa = per_query_head needs the window queries (for q_heads); evict_layer_kv passes none "
                               "(use evict_layer on a cache repeated to q_heads)");
    if (layer < 0 || layer >= cache.n_layers()) return result::failure("evict_layer_kv: layer " + std::to_string(layer) + " out of range");
    const int H = cache.n_kv_heads();
    kvevict::layer_inputs<float> in;
    layer_page_table table;
    set_cache_inputs(in, cache, layer, table);  // HND views, or the page pools and per-head table
    in.layer_idx = layer;
    in.num_layers = cache.n_layers();
    const std::int64_t n = ev.max_selected(in, budget);
    if (n < 0) {
        const kvevict::status st = ev.can_implement(in, budget);
        return result::failure("evict_layer_kv: layer " + std::to_string(layer) + ": " + st.message());
    }
    std::vector<std::int32_t> indptr(size_t(H) + 1), idx(size_t(std::max<std::int64_t>(n, 1)));
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = idx.data();
    sel.capacity = n;
    const kvevict::status st = ev.run(in, budget, sel);
    if (!st.ok()) return result::failure("evict_layer_kv: layer " + std::to_string(layer) + ": " + st.message());
    if (cache.paged()) return compact_layer_paged(cache, layer, indptr.data(), idx.data());
    for (int h = 0; h < H; ++h)
        if (result r = cache.compact_head(layer, h, idx.data() + indptr[size_t(h)], indptr[size_t(h) + 1] - indptr[size_t(h)]); !r)
            return r;
    return result::success();
}

}  // namespace kvevict_engine
