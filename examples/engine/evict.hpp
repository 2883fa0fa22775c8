// kvevict_engine: KV-cache eviction inside the engine (example code).
//
// evict.hpp connects the engine's kv_cache to kvevict:
//   wo_factors            W_O factors of every layer (kvevict::cpu::compute_wo_factors), once per model
//   query_log             captures the RoPE-rotated queries of forward() through on_query
//   layer_state           the engine state one eviction of one layer sees
//   evict_layer<Policy>() kvevict::evictor<Policy, cpu::backend> on one layer, then in-place compaction
//   apply_selection()     compacts one layer in place from a CSR selection (kvevict::cpu::compact; a paged
//                         cache: kvevict::cpu::compact_paged, freed pages back to the cache, paged_layer.hpp)
//   method                a named "evict one layer" function (a row of the fidelity report)
//   eviction_session      one sequence: one-shot / chunked prefill eviction, decode-time cap, multi-turn
//
// Slots and positions: compaction moves kept rows down (slots change) and keeps their logical positions
// (kv_cache::positions), so RoPE-rotated keys stay valid. kv_cache::next_position never changes on
// eviction. A paged kv_cache (kv_cache.hpp, session_options::page_size) is read by kvevict through its page
// pools and per-KV-head page tables (layer_inputs::pages); the selections are logical slots either way, so the
// contiguous and the paged cache keep the same tokens. Papers: ReST-KV (An et al., ICLR 2026), SnapKV, PyramidKV, AdaKV, H2O, TOVA, StreamingLLM
// (see kvevict/presets.hpp).
#pragma once

#include "forward.hpp"
#include "kv_cache.hpp"
#include "model.hpp"
#include "paged_layer.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kvevict_engine {

/// W_O factors of every layer: layer l holds fp32 (n_heads, head_dim, head_dim) row-major R_h with
/// ||R_h x|| = ||W_O^h x|| (kvevict::cpu::compute_wo_factors on model::wo(l), [out][in] = (dim, dim)).
/// Compute once per model load; read-only afterwards (shareable across sessions and threads).
class wo_factors {
public:
    /// Computes the factors of every layer of `m`. Error (object unchanged): non-finite weights.
    result compute(const model& m) {
        const config& c = m.cfg;
        const int hd = c.head_dim();
        std::vector<std::vector<float>> f(size_t(c.n_layers), std::vector<float>(size_t(c.n_heads) * size_t(hd) * size_t(hd)));
        for (int l = 0; l < c.n_layers; ++l) {
            const matrix& wo = m.wo(l);
            kvevict::strided_view<const float, 2> v;
            v.data = wo.data();
            v.extent[0] = wo.rows();
            v.extent[1] = wo.cols();
            v.stride[0] = wo.cols();  // row-major [out][in]
            v.stride[1] = 1;
            const kvevict::status s = kvevict::cpu::compute_wo_factors(v, c.n_heads, hd, f[size_t(l)].data());
            if (!s.ok()) return result::failure("wo_factors: layer " + std::to_string(l) + ": " + s.message());
        }
        f_ = std::move(f);
        n_heads_ = c.n_heads;
        head_dim_ = hd;
        return result::success();
    }
    bool empty() const { return f_.empty(); }
    int n_layers() const { return int(f_.size()); }
    /// Factors of `layer` as the view layer_inputs::wo_factor takes. Precondition: computed, valid layer.
    kvevict::strided_view<const float, 3> view(int layer) const {
        return kvevict::cpu::wo_factor_view(f_[size_t(layer)].data(), n_heads_, head_dim_);
    }

private:
    std::vector<std::vector<float>> f_;
    int n_heads_ = 0, head_dim_ = 0;
};

/// The queries forward() computed since the last clear(), per layer, token-major: row t of layer l is
/// the (n_heads, head_dim) query (RoPE applied, before the 1/sqrt(head_dim) scaling) of the t-th token
/// seen. `keep` > 0 bounds the rows held to the most recent `keep` (memory O(keep)); keep < 0 holds all
/// of them (H2O needs every prompt query).
/// Usage: `query_log log(cfg, 32); opts.on_query = log.hook();` The log must outlive the options.
class query_log {
public:
    query_log() = default;
    query_log(const config& c, int keep) : n_heads_(c.n_heads), head_dim_(c.head_dim()), keep_(keep), rows_(size_t(c.n_layers)) {}

    /// Hook for forward_options::on_query.
    std::function<void(int, std::int32_t, const float*)> hook() {
        return [this](int l, std::int32_t, const float* q) { push(l, q); };
    }
    /// Appends one query (n_heads * head_dim floats) to `layer`.
    void push(int layer, const float* q) {
        std::vector<float>& r = rows_[size_t(layer)];
        const size_t row = size_t(n_heads_) * size_t(head_dim_);
        r.insert(r.end(), q, q + row);
        if (keep_ > 0 && r.size() >= 2 * size_t(keep_) * row)  // amortised trim to the last `keep` rows
            r.erase(r.begin(), r.end() - std::ptrdiff_t(size_t(keep_) * row));
    }
    /// Queries held for `layer` (at most keep when keep > 0).
    int count(int layer) const {
        const int n = int(rows_[size_t(layer)].size() / (size_t(n_heads_) * size_t(head_dim_)));
        return keep_ > 0 ? std::min(n, keep_) : n;
    }
    /// The last min(window, count) queries of `layer` (window < 0: all held) as the logical
    /// (batch 1, n_heads, window, head_dim) view kvevict takes (NHD strides, no copy). Empty view
    /// (data == nullptr) when nothing is held. Valid until the next push()/clear().
    kvevict::query_view<const float> view(int layer, int window) const {
        const int n = count(layer);
        const int w = window < 0 ? n : std::min(window, n);
        if (w <= 0) return {};
        const std::vector<float>& r = rows_[size_t(layer)];
        const size_t row = size_t(n_heads_) * size_t(head_dim_);
        const float* first = r.data() + r.size() - size_t(w) * row;
        return kvevict::make_query_view(first, 1, n_heads_, w, head_dim_, kvevict::kv_layout::nhd);
    }
    void clear() { for (auto& r : rows_) r.clear(); }

private:
    int n_heads_ = 0, head_dim_ = 0, keep_ = 32;
    std::vector<std::vector<float>> rows_;
};

/// What one eviction of one layer sees.
struct layer_state {
    const model* m = nullptr;
    const wo_factors* wo = nullptr;       ///< may be null for methods that do not use W_O
    kv_cache* cache = nullptr;            ///< compacted in place
    int layer = 0;
    const query_log* queries = nullptr;   ///< queries of the tokens appended since the last eviction
    kvevict::budget_request budget;       ///< per-head budget (see kvevict::budget_request)
    int num_threads = 1;                  ///< kvevict::cpu::backend::num_threads
    /// Look-ahead, for oracle methods only (null in the engine's modes): the next token's query at this
    /// layer (n_heads, head_dim), after RoPE, before scaling; and its key (after RoPE) and value, (kv_dim).
    const float* next_query = nullptr;
    const float* next_key = nullptr;
    const float* next_value = nullptr;
    /// Decode-time eviction (eviction_session with a decode schedule): the schedule and the eviction it
    /// asked for. evict_layer() then runs with decode_schedule::apply() applied to the params and budget
    /// (protected prefix / recent tokens); `budget` above is the action's. Null otherwise.
    const kvevict::decode_schedule* schedule = nullptr;
    const kvevict::decode_action* action = nullptr;
};

/// Compacts layer `layer` of `cache` in place from a CSR selection with n_kv_heads rows
/// (indptr[h]..indptr[h+1] are the kept slots of head h, strictly ascending, each < length): keys,
/// values and positions move with kvevict::cpu::compact, then len[h] = kept count. A paged cache goes
/// through compact_layer_paged() (kvevict::cpu::compact_paged; the pages left empty return to the free list).
/// Errors (cache unchanged): malformed selection (named by kvevict's status message).
inline result apply_selection(kv_cache& cache, int layer, const std::int32_t* indptr, const std::int32_t* indices) {
    const int H = cache.n_kv_heads();
    for (int h = 0; h < H; ++h) {
        const std::int32_t a = indptr[h], b = indptr[h + 1];
        if (b - a > cache.length(layer, h))
            return result::failure("apply_selection: layer " + std::to_string(layer) + " head " + std::to_string(h) + " keeps " +
                                   std::to_string(b - a) + " > length " + std::to_string(cache.length(layer, h)));
        for (std::int32_t i = a; i < b; ++i)
            if (indices[i] < 0 || indices[i] >= cache.length(layer, h) || (i > a && indices[i] <= indices[i - 1]))
                return result::failure("apply_selection: layer " + std::to_string(layer) + " head " + std::to_string(h) +
                                       ": kept slots must be strictly ascending in 0.." + std::to_string(cache.length(layer, h) - 1));
    }
    if (cache.paged()) return compact_layer_paged(cache, layer, indptr, indices);
    const kvevict::const_selection_view sel(indptr, indices, H);
    auto kv = [&](float* p) { return kvevict::make_kv_view(p, 1, H, cache.capacity(), cache.head_dim(), kvevict::kv_layout::hnd); };
    const kvevict::kv_view<float> k = kv(cache.keys(layer)), v = kv(cache.values(layer));
    const kvevict::kv_view<std::int32_t> p = positions_rows(cache, layer);  // (1, n_kv_heads, capacity, 1) rows of one int32
    for (const auto& pr : {std::make_pair(k, "keys"), std::make_pair(v, "values")}) {
        const kvevict::status s = kvevict::cpu::compact<float>(pr.first, sel, pr.first);
        if (!s.ok()) return result::failure(std::string("apply_selection: ") + pr.second + ": " + s.message());
    }
    if (const kvevict::status s = kvevict::cpu::compact<std::int32_t>(p, sel, p); !s.ok())
        return result::failure(std::string("apply_selection: positions: ") + s.message());
    for (int h = 0; h < H; ++h)
        if (result r = cache.set_length(layer, h, indptr[h + 1] - indptr[h]); !r) return r;
    return result::success();
}

/// Runs kvevict::evictor<Policy, kvevict::cpu::backend> with params `p` on layer `s.layer` of
/// `*s.cache` and compacts it in place.
/// Inputs built (set_cache_inputs): keys/values = HND views over the whole capacity (paged cache: the
/// layer's pools of one-head pages with pages = its per-KV-head page table, kvevict::page_pool_per_head),
/// lengths = per-head lengths (kvevict::per_head_lengths), positions = kvevict::make_positions_view, queries = the last `window`
/// queries of s.queries (window < 0: all held, as H2O wants; 0: none), wo_factor = s.wo's view when
/// non-null, wo = the model's W_O of the layer for scorers that read it (CriticalKV), layer_idx /
/// num_layers from the model.
/// A cache repeated to q_heads heads (kv_cache::kv_repeat() == kv_group(), method::repeat_kv) is one cache
/// head per query head: kvevict then sees GQA group 1, and gqa_reduction::per_query_head (one selection
/// per query head, the reference code's form) fits it row for row.
/// Errors (cache unchanged): null state fields, gqa_reduction::per_query_head on a cache with fewer heads
/// than query heads (its selections have q_heads rows; a GQA-native cache has kv_heads), and every kvevict
/// error (message kept, e.g. a budget below the protected window).
template <class Policy>
result select_layer(const layer_state& s, const typename Policy::params& p, int window, std::vector<std::int32_t>& indptr,
                    std::vector<std::int32_t>& indices, std::vector<float>* scores = nullptr) {
    if (!s.m || !s.cache) return result::failure("evict_layer: layer_state.m and .cache must be set");
    kv_cache& c = *s.cache;
    const config& cfg = s.m->cfg;
    if (p.gqa == kvevict::gqa_reduction::per_query_head && c.n_kv_heads() != cfg.n_heads)
        return result::failure("evict_layer: gqa = per_query_head selects one row per query head (" + std::to_string(cfg.n_heads) +
                               "); this cache has " + std::to_string(c.n_kv_heads()) +
                               " heads: repeat it to q_heads (kv_cache kv_repeat = kv_group, method::repeat_kv)");
    if (s.layer < 0 || s.layer >= c.n_layers())
        return result::failure("evict_layer: layer " + std::to_string(s.layer) + " outside 0.." + std::to_string(c.n_layers() - 1));
    const int l = s.layer, H = c.n_kv_heads();
    kvevict::layer_inputs<float> in;
    layer_page_table table;
    set_cache_inputs(in, c, l, table);
    if (s.queries && window != 0) in.queries = s.queries->view(l, window);
    if (s.wo && !s.wo->empty()) in.wo_factor = s.wo->view(l);
    if constexpr (kvevict::detail::scorer_needs_wo_matrix<typename Policy::scorer>::value) {
        // CriticalKV's ||v W_O^h||_1 needs the output projection itself: (dim, n_heads * head_dim), [out][in].
        const matrix& wo = s.m->wo(l);
        in.wo = kvevict::strided_view<const float, 2>{wo.data(), {wo.rows(), wo.cols()}, {wo.cols(), 1}};
    }
    in.layer_idx = l;
    in.num_layers = cfg.n_layers;

    typename Policy::params pp = p;
    kvevict::budget_request budget = s.budget;
    if (s.schedule && s.action) {  // decode-time eviction: the schedule's protection and budget
        const std::int64_t rows = in.queries.data ? in.queries.extent[2] : 0;
        if (const kvevict::status st = s.schedule->apply(*s.action, pp, rows, &budget); !st.ok())
            return result::failure("evict_layer: layer " + std::to_string(l) + ": " + st.message());
    }
    kvevict::evictor<Policy, kvevict::cpu::backend> ev(pp, kvevict::cpu::backend{s.num_threads});
    if (const kvevict::status st = ev.can_implement(in, budget); !st.ok())
        return result::failure("evict_layer: layer " + std::to_string(l) + ": " + st.message());
    const std::int64_t cap = ev.max_selected(in, budget);
    indptr.assign(size_t(H) + 1, 0);
    indices.assign(size_t(std::max<std::int64_t>(cap, 1)), 0);
    if (scores) scores->assign(size_t(H) * size_t(c.capacity()), 0.0f);
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = indices.data();
    sel.capacity = std::int64_t(indices.size());
    if (const kvevict::status st = ev.run(in, budget, sel, scores ? scores->data() : nullptr); !st.ok())
        return result::failure("evict_layer: layer " + std::to_string(l) + ": " + st.message());
    return result::success();
}

/// Runs kvevict::evictor<Policy, kvevict::cpu::backend> with params `p` on layer `s.layer` of
/// `*s.cache` (select_layer) and compacts it in place (apply_selection).
template <class Policy>
result evict_layer(const layer_state& s, const typename Policy::params& p, int window = 32,
                   std::int64_t* kept_tokens = nullptr) {
    std::vector<std::int32_t> indptr, indices;
    if (result r = select_layer<Policy>(s, p, window, indptr, indices); !r) return r;
    if (kept_tokens) *kept_tokens = indptr.back();
    return apply_selection(*s.cache, s.layer, indptr.data(), indices.data());
}

/// A named eviction method: a function that evicts one layer of the cache given the engine state.
/// `window`: queries the method reads from layer_state::queries (> 0: the last `window`; -1: all since
/// the last eviction, e.g. H2O; 0: none). Sessions capture enough queries for it.
struct method {
    std::string name;
    int window = 32;
    std::function<result(const layer_state&)> evict;
    /// True when `evict` needs layer_state::next_query / next_key / next_value (oracles); such methods
    /// cannot run in eviction_session, which has no look-ahead.
    bool needs_lookahead = false;
    /// True when the method runs on a cache repeated to q_heads heads (kv_cache kv_repeat = kv_group: one
    /// cache head per query head, kv_group times the KV memory), as the reference code of ReST-KV, SnapKV
    /// and AdaKV does; eviction_session and the fidelity report then build such a cache. policy_method()
    /// sets it for params with gqa_reduction::per_query_head.
    bool repeat_kv = false;
    /// The plan of one head of `length` tokens at budget `req` with observation window `window` (-1: every
    /// query): its budget after the library raises it to the tokens always kept, and those tokens (sinks +
    /// protected recent ones; kvevict::detail::plan_head with the method's selector params). The fidelity
    /// report counts the tokens chosen by score from it and leaves out a row whose budget was raised. Null
    /// for a method that states nothing: the report then takes `window` tokens as kept always.
    std::function<kvevict::detail::head_plan(const kvevict::budget_request& req, std::int64_t length, int window)> plan;
    /// The same eviction with another observation window (the queries read and the recent tokens kept);
    /// null when the method cannot change it. The report shrinks the window of a row whose budget cannot
    /// hold it (docs/fidelity.md, "Honest budgets").
    std::function<result(const layer_state&, int window)> evict_with_window;
};

/// A method running kvevict preset/policy `Policy` with params `p` (the papers' defaults by default).
/// p.gqa == gqa_reduction::per_query_head makes a repeat_kv method (its cache is repeated to q_heads).
template <class Policy>
method policy_method(std::string name, typename Policy::params p = Policy::defaults(), int window = 32) {
    method m;
    m.name = std::move(name);
    m.window = window;
    m.repeat_kv = p.gqa == kvevict::gqa_reduction::per_query_head;
    m.evict = [p, window](const layer_state& s) { return evict_layer<Policy>(s, p, window); };
    m.plan = [sp = p.selector](const kvevict::budget_request& req, std::int64_t length, int w) {
        return kvevict::detail::plan_head(req, sp, length, w < 0 ? length : std::min<std::int64_t>(w, length));
    };
    // Only a window that is also the protected recent part can shrink (not H2O's every query, nor a
    // query-free row, nor an explicit recent count).
    if (window > 0 && p.selector.num_recent == -1 && !(p.selector.recent_share >= 0.0f))
        m.evict_with_window = [p](const layer_state& s, int w) { return evict_layer<Policy>(s, p, w); };
    return m;
}

/// A method running `Policy` with ONE budget over every layer and KV head (kvevict::layer_wide_topk;
/// Layer-DefensiveKV with presets::defensivekv): the call for layer 0 scores every layer of the cache
/// (select_layer with maybe_scores; nothing compacted), cuts the candidates of all layers at
/// T = sum over (layer, head) of (base budget - protected tokens), and compacts every layer; the calls
/// for layers 1.. find their layer already done. The engine evicts the layers in order after the prefill
/// (one-shot, eviction_session::evict_all), so every layer still holds its full cache at layer 0's call.
/// Per-head budgets then differ between layers; their mean is the label's.
template <class Policy>
result evict_layer_wide(const layer_state& s, const typename Policy::params& p, int window) {
        if (s.layer != 0) return result::success();  // done at layer 0's call
        if (!s.m || !s.cache) return result::failure("layer_wide_method: layer_state.m and .cache must be set");
        kv_cache& c = *s.cache;
        const int nl = c.n_layers(), H = c.n_kv_heads();
        kvevict::layer_wide_topk wide;
        if (const kvevict::status st = wide.reset(nl, H); !st.ok()) return result::failure(st.message());
        std::int64_t total = 0;
        std::vector<std::int32_t> indptr, indices;
        std::vector<float> scores;
        std::vector<std::int64_t> len(static_cast<size_t>(H)), sinks(static_cast<size_t>(H)), recent(static_cast<size_t>(H));
        for (int l = 0; l < nl; ++l) {
            layer_state sl = s;
            sl.layer = l;
            if (result r = select_layer<Policy>(sl, p, window, indptr, indices, &scores); !r) return r;
            typename Policy::params pp = p;
            kvevict::budget_request budget = s.budget;
            if (s.schedule && s.action) {  // decode-time eviction: the schedule's protection and budget
                const std::int64_t q = (s.queries && window != 0) ? s.queries->view(l, window).extent[2] : 0;
                if (const kvevict::status st = s.schedule->apply(*s.action, pp, q, &budget); !st.ok()) return result::failure(st.message());
            }
            const std::int64_t w = s.queries && window != 0 ? s.queries->view(l, window).extent[2] : 0;
            std::int64_t planned = 0;  // the evictor's own total must be the plans' (an exact-total budgeter)
            for (int h = 0; h < H; ++h) {
                const std::int64_t L = c.length(l, h);
                const kvevict::detail::head_plan hp = kvevict::detail::plan_head(budget, pp.selector, L, std::min<std::int64_t>(w, L));
                len[size_t(h)] = L;
                planned += hp.pass_through ? L : hp.base_budget;
                if (hp.pass_through) {  // kept whole: no candidates
                    sinks[size_t(h)] = L;
                    recent[size_t(h)] = 0;
                    continue;
                }
                sinks[size_t(h)] = hp.sinks;
                recent[size_t(h)] = hp.recent;
                total += hp.base_budget - hp.protected_count();
            }
            if (planned != indptr[size_t(H)])
                return result::failure("layer_wide_method: layer " + std::to_string(l) + ": the plans give " + std::to_string(planned) +
                                       " kept tokens, the evictor " + std::to_string(indptr[size_t(H)]) +
                                       " (the method's protection or budgeter is not the one planned here)");
            if (const kvevict::status st = wide.add_layer(l, scores.data(), c.capacity(), len.data(), sinks.data(), recent.data()); !st.ok())
                return result::failure("layer_wide_method: " + std::string(st.message()));
        }
        if (const kvevict::status st = wide.cut(total); !st.ok()) return result::failure(st.message());
        // every layer's selection first, then the compactions (a failure leaves the cache untouched)
        std::vector<std::vector<std::int32_t>> ptrs(static_cast<size_t>(nl)), idxs(static_cast<size_t>(nl));
        for (int l = 0; l < nl; ++l) {
            ptrs[size_t(l)].assign(size_t(H) + 1, 0);
            idxs[size_t(l)].assign(size_t(std::max<std::int64_t>(wide.kept(l), 1)), 0);
            kvevict::selection_view sel;
            sel.indptr = ptrs[size_t(l)].data();
            sel.indices = idxs[size_t(l)].data();
            sel.capacity = std::int64_t(idxs[size_t(l)].size());
            if (const kvevict::status st = wide.selection(l, sel); !st.ok()) return result::failure(st.message());
        }
        for (int l = 0; l < nl; ++l)
            if (result r = apply_selection(c, l, ptrs[size_t(l)].data(), idxs[size_t(l)].data()); !r) return r;
        return result::success();
}

template <class Policy>
method layer_wide_method(std::string name, typename Policy::params p = Policy::defaults(), int window = 32) {
    method m = policy_method<Policy>(std::move(name), p, window);
    m.evict = [p, window](const layer_state& s) { return evict_layer_wide<Policy>(s, p, window); };
    if (m.evict_with_window) m.evict_with_window = [p](const layer_state& s, int w) { return evict_layer_wide<Policy>(s, p, w); };
    return m;
}

/// When the cache of a session is evicted during prefill.
enum class prefill_mode {
    none,      ///< no eviction during prefill (decode-time cap may still apply)
    one_shot,  ///< once, after the last prompt token (the papers' setting)
    chunked,   ///< after every `chunk` tokens: each chunk is scored against the already-compressed cache,
               ///< its last queries being the window
};

/// Eviction settings of a session.
struct session_options {
    prefill_mode prefill = prefill_mode::one_shot;
    int chunk = 0;                   ///< chunked: tokens per chunk, >= 1
    kvevict::budget_request budget;  ///< per-head budget of every eviction (fraction: of the current length)
    /// > 0: decode-time eviction through kvevict::decode_schedule: an eviction at the end of every prefill
    /// and after every `decode_interval` decoded tokens, each with the schedule's budget: budget.keep_tokens
    /// B is a cap (no head holds more than B + decode_interval slots while generating, uniform budgeters),
    /// budget.keep_fraction r is floor(r * tokens seen) per head at each eviction.
    int decode_interval = 0;
    /// Decode-time eviction only: the first protect_prefix tokens of the request and the protect_recent most
    /// recent tokens are never evicted (kvevict::decode_schedule::apply on the method's params).
    int protect_prefix = 0, protect_recent = 0;
    /// false (default): an eviction's observation window is the queries since the previous eviction (at
    /// most the method's window). true: always the method's last `window` queries, across evictions (the
    /// decoding report: a decode-time eviction every token still sees a full window).
    bool window_across_evictions = false;
    int num_threads = 1;             ///< kvevict CPU threads
    /// > 0: the session's kv_cache is paged with this many slots per page (kv_cache.hpp); evictions then
    /// free pages (kvevict::cpu::compact_paged). 0: contiguous.
    int page_size = 0;
};

/// One sequence with eviction. All state (cache, captured queries, counters) is per session; reset()
/// returns to the freshly constructed state, so the same request gives the same output whatever ran
/// before. Multi-turn: calling prefill() again appends the next prompt to the compressed cache (positions
/// continue from next_position) and compresses again as the mode says. Not copyable (the query hook
/// refers to the session).
class eviction_session {
public:
    /// `capacity`: slots per head of the session's kv_cache (one-shot: prompt + generated tokens;
    /// chunked / decode cap: budget + chunk / interval suffices; o.page_size > 0: a paged cache;
    /// meth.repeat_kv: every KV head repeated to the query heads of its group, kv_group times the memory).
    /// `m` and `wo` must outlive the session.
    eviction_session(const model& m, const wo_factors& wo, method meth, session_options o, int capacity)
        : m_(&m), wo_(&wo), meth_(std::move(meth)), opt_(o), cache_(m.cfg, capacity, o.page_size, meth_.repeat_kv ? m.cfg.kv_group() : 1),
          log_(m.cfg, meth_.window < 0 ? -1 : std::max(meth_.window, 1)) {}
    eviction_session(const eviction_session&) = delete;
    eviction_session& operator=(const eviction_session&) = delete;

    /// Checks the options. Errors: chunk < 1 in chunked mode, decode cap without keep_tokens, no method.
    result check() const {
        if (!meth_.evict && (opt_.prefill != prefill_mode::none || opt_.decode_interval > 0))
            return result::failure("eviction_session: method '" + meth_.name + "' has no evict function");
        if (opt_.prefill == prefill_mode::chunked && opt_.chunk < 1)
            return result::failure("eviction_session: chunk = " + std::to_string(opt_.chunk) + " must be >= 1 in chunked mode");
        if (opt_.decode_interval < 0)
            return result::failure("eviction_session: decode_interval = " + std::to_string(opt_.decode_interval) + " must be >= 0");
        if (opt_.decode_interval > 0) {
            if (const kvevict::status s = kvevict::decode_schedule::check(schedule_options()); !s.ok())
                return result::failure(std::string("eviction_session: ") + s.message());
        } else if (opt_.protect_prefix != 0 || opt_.protect_recent != 0) {
            return result::failure("eviction_session: protect_prefix / protect_recent need the decode-time schedule (decode_interval > 0)");
        }
        return result::success();
    }

    /// Appends `tokens` (a prompt or the next turn) and evicts as the mode says; `logits` gets the logits
    /// after the last token (computed before that token's eviction, as in the papers).
    result prefill(const std::vector<int>& tokens, std::vector<float>& logits) {
        if (result r = check(); !r) return r;
        if (tokens.empty()) return result::failure("eviction_session::prefill: empty token list");
        if (opt_.decode_interval > 0 && !sched_.initialized())
            if (const kvevict::status s = sched_.init(schedule_options()); !s.ok()) return result::failure(std::string("eviction_session: ") + s.message());
        const forward_options fo = options();
        const size_t step = opt_.prefill == prefill_mode::chunked ? size_t(opt_.chunk) : tokens.size();
        for (size_t i = 0; i < tokens.size(); i += step) {
            const size_t end = std::min(tokens.size(), i + step);
            for (size_t t = i; t < end; ++t)
                if (result r = forward_one(tokens[t], logits, fo); !r) return r;
            const bool last = end == tokens.size();
            // with the decode-time schedule every chunk (or the whole prompt) is a prefill it is told of, so
            // each eviction gets its budget and protection
            if (opt_.decode_interval > 0 && (last || opt_.prefill == prefill_mode::chunked)) {
                kvevict::decode_action a;
                if (const kvevict::status s = sched_.after_prefill(std::int64_t(end - i), &a); !s.ok())
                    return result::failure(std::string("eviction_session::prefill: ") + s.message());
                if (a.evict) {
                    if (result r = evict_all(&a); !r) return r;
                    if (const kvevict::status s = sched_.evicted(a); !s.ok()) return result::failure(std::string("eviction_session: ") + s.message());
                }
            } else if (opt_.prefill == prefill_mode::chunked || (last && opt_.prefill == prefill_mode::one_shot)) {
                if (result r = evict_all(); !r) return r;
            }
        }
        return result::success();
    }

    /// Runs one generated token; with the decode-time schedule, evicts when it says (after every
    /// decode_interval tokens, with its budget and protection).
    result decode(int token, std::vector<float>& logits) {
        if (result r = check(); !r) return r;
        if (opt_.decode_interval > 0 && sched_.tokens_seen() == 0) return result::failure("eviction_session::decode: prefill() first");
        if (result r = forward_one(token, logits, options()); !r) return r;
        if (opt_.decode_interval <= 0) return result::success();
        kvevict::decode_action a;
        if (const kvevict::status s = sched_.after_decode(1, &a); !s.ok()) return result::failure(std::string("eviction_session::decode: ") + s.message());
        if (!a.evict) return result::success();
        if (result r = evict_all(&a); !r) return r;
        if (const kvevict::status s = sched_.evicted(a); !s.ok()) return result::failure(std::string("eviction_session: ") + s.message());
        return result::success();
    }

    /// Evicts every layer now (window = queries since the last eviction, or the method's last `window`
    /// with window_across_evictions), then clears the query log (kept with window_across_evictions).
    /// `action`: a decode-time eviction of the session's schedule (its budget and protection); null: the
    /// session's budget as it is.
    result evict_all(const kvevict::decode_action* action = nullptr) {
        for (int l = 0; l < m_->cfg.n_layers; ++l) {
            layer_state s;
            s.m = m_;
            s.wo = wo_;
            s.cache = &cache_;
            s.layer = l;
            s.queries = &log_;
            s.budget = action ? action->budget : opt_.budget;
            s.num_threads = opt_.num_threads;
            if (action) {
                s.schedule = &sched_;
                s.action = action;
            }
            if (result r = meth_.evict(s); !r) return result::failure("method '" + meth_.name + "': " + r.error);
        }
        if (!opt_.window_across_evictions) log_.clear();
        ++evictions_;
        return result::success();
    }

    /// Back to the freshly constructed state (empty cache, next_position 0, no queries, counters 0).
    void reset() {
        cache_.reset();
        log_.clear();
        sched_ = kvevict::decode_schedule{};
        evictions_ = 0;
        max_len_ = 0;
        peak_tokens_ = 0;
    }

    const kv_cache& cache() const { return cache_; }
    kv_cache& cache() { return cache_; }
    const method& eviction_method() const { return meth_; }
    const session_options& options_used() const { return opt_; }
    /// Evictions run since construction / reset().
    int evictions() const { return evictions_; }
    /// Largest per-head length any layer reached right after a forward step (the peak cache size),
    /// since construction, reset() or reset_peak().
    int max_length_seen() const { return max_len_; }
    /// Largest number of valid slots over every layer and KV head right after a forward step (the peak KV
    /// memory in tokens; fp32 K+V bytes = this * 2 * head_dim * 4), since construction, reset() or reset_peak().
    std::int64_t peak_kv_tokens() const { return peak_tokens_; }
    /// Restarts max_length_seen() and peak_kv_tokens() (e.g. after the prefill, to watch the decode phase alone).
    void reset_peak() {
        max_len_ = 0;
        peak_tokens_ = 0;
    }
    /// The decode-time schedule (initialized at the first prefill when decode_interval > 0).
    const kvevict::decode_schedule& schedule() const { return sched_; }

private:
    kvevict::decode_schedule_options schedule_options() const {
        kvevict::decode_schedule_options so;
        so.interval = opt_.decode_interval;
        so.budget = opt_.budget;
        so.protect_prefix = opt_.protect_prefix;
        so.protect_recent = opt_.protect_recent;
        return so;
    }
    forward_options options() {
        forward_options fo;
        fo.on_query = log_.hook();
        return fo;
    }
    result forward_one(int token, std::vector<float>& logits, const forward_options& fo) {
        if (result r = forward(*m_, cache_, token, logits, fo); !r) return r;
        std::int64_t total = 0;
        for (int l = 0; l < cache_.n_layers(); ++l)
            for (int h = 0; h < cache_.n_kv_heads(); ++h) {
                max_len_ = std::max(max_len_, cache_.length(l, h));
                total += cache_.length(l, h);
            }
        peak_tokens_ = std::max(peak_tokens_, total);
        return result::success();
    }

    const model* m_;
    const wo_factors* wo_;
    method meth_;
    session_options opt_;
    kv_cache cache_;
    query_log log_;
    kvevict::decode_schedule sched_;
    int evictions_ = 0, max_len_ = 0;
    std::int64_t peak_tokens_ = 0;
};

}  // namespace kvevict_engine
