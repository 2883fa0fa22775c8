// kvevict_engine: LKV decoding, mode A and mode B (spec lkv.md "Decoding"; paper: Zhou, Hao, Wang
// et al., "LKV", arXiv 2605.06676), example code.
//
//   lkv_decode_mode      a: budgets fixed at prefill, generated tokens appended (the cache grows by
//                        one token per head and step); b: the budget tracks t, the tokens seen: after
//                        the prefill and after every `interval`-th decoded token the global budgets
//                        are recomputed for the current t and every head over its budget drops its
//                        lowest-utility tokens (kvevict::lkv::decode_step).
//   lkv_decode_options   mode, budget (keep fraction R, or keep_tokens), interval s, layer-wise prefill
//   lkv_session          one sequence: prefill() (layer-wise by default: each layer is scored and
//                        evicted as soon as it has processed the prompt), decode(), the cache with
//                        per-head ragged lengths, the utilities stored beside it, counters.
//
// Utilities: each token is scored ONCE by the LKV-T MLP (kvevict::lkv::score_tokens on its cached,
// RoPE-rotated key and its value) when it enters the cache, and the float is kept in a buffer
// slot-aligned with the cache (utility(l, h, s) belongs to slot s of KV head h of layer l); when
// slots are dropped, the kept rows (key, value, position, utility) move down together, in order.
// Mode A does not need them after the prefill and does not score generated tokens.
//
// The prefill eviction is the mode-B rule at t = prompt length with every head full, which keeps
// exactly what kvevict::evictor<lkv::full> keeps (tests/lkv/test_lkv_decode.cpp checks it).
// Multi-turn is not supported: prefill() needs an empty session (reset() first).
//
// Paged (lkv_decode_options::page_size > 0): the session's kv_cache keeps one-head pages with a page
// table per KV head; tokens are scored page run by page run (the same floats) and a head that drops
// tokens returns the pages it no longer needs to the layer's free list, so LKV's head-wise budgets
// free real pages. Tokens, logits and kept slots equal the contiguous session's bit for bit
// (tests/engine/test_paged.cpp). on_layer_evicted reports each layer's pages before -> after.
#pragma once

#include "forward.hpp"
#include "kv_cache.hpp"
#include "layerwise_prefill.hpp"
#include "model.hpp"

#include <kvevict/backends/cpu/learned.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace kvevict_engine {

/// LKV decode policy (spec lkv.md "Decoding").
enum class lkv_decode_mode {
    a,  ///< budgets fixed at prefill; generated tokens appended (no eviction while decoding)
    b,  ///< budgets recomputed for the current t every `interval` decoded tokens; heads over budget drop
};

/// Settings of an lkv_session.
struct lkv_decode_options {
    lkv_decode_mode mode = lkv_decode_mode::b;
    /// R = keep_fraction in (0, 1]: B_total(t) = floor(R * N * t) over the N = layers * kv_heads heads
    /// (keep_tokens B: N * min(B, t)); see kvevict::lkv::decode_budgets.
    kvevict::budget_request budget = kvevict::budget_request::fraction(0.1);
    /// Mode B: a step after every `interval` decoded tokens (1 = every token, the spec's default). Between
    /// steps a head holds at most its budget at the last step + interval tokens. Ignored in mode A.
    int interval = 1;
    /// Prefill layer by layer (evict each layer as soon as it is done: lower peak memory, same caches).
    bool layerwise = true;
    /// Never evicted (both modes' prefill eviction, mode-B steps): the first min(protect_prefix, prompt)
    /// tokens and the protect_recent most recent tokens of every head (kvevict::decode_schedule's
    /// protection). Their utilities rank above every other token's, and every head's budget is at least
    /// protect_prefix + protect_recent (headwise_learned::params::min_budget; at most t).
    int protect_prefix = 0, protect_recent = 0;
    int page_size = 0;  ///< > 0: a paged cache of page_size-slot one-head pages (kv_cache's paged mode); 0: contiguous
};

/// One sequence decoded with LKV (mode A or B). Owns its kv_cache (`capacity` slots per head, rounded up
/// to whole pages when paged: prompt + generated tokens always suffices; mode A needs that much in its
/// heads, mode B only a head's largest budget + interval), the utilities and every per-step buffer (kvevict::lkv::decode_budget_scratch
/// included), all allocated at construction: a mode-B step allocates nothing (forward() itself uses a few
/// Eigen temporaries). The scorer/budgeter parameters point into an artifact that must outlive the
/// session, as must the model.
class lkv_session {
public:
    lkv_session(const model& m, const kvevict::scorers::learned_mlp::params& scorer,
                const kvevict::budgeters::headwise_learned::params& budgeter, lkv_decode_options o, int capacity)
        : m_(&m), sp_(scorer), bp_(budgeter), opt_(o), cache_(m.cfg, std::max(capacity, 0), std::max(o.page_size, 0)) {
        const int N = m.cfg.n_layers * m.cfg.n_kv_heads, cap = cache_.capacity();  // paged: rounded up to whole pages
        util_.assign(size_t(N) * size_t(cap), 0.0f);
        lens_.assign(size_t(N), 0);
        budgets_.assign(size_t(N), 0);
        drop_indptr_.assign(size_t(N) + 1, 0);
        drop_indices_.assign(size_t(N) * size_t(std::max(cap, 1)), 0);
        scratch_.assign(size_t(std::max(cap, 1)), 0);
        head_util_.assign(size_t(std::max(cap, 1)), 0.0f);
        bp_user_min_ = bp_.min_budget;
        ratios_.assign(size_t(N), 0.0);
        share_.assign(size_t(N), 0.0);
        capv_.assign(size_t(N), 0);
        clipped_.assign(size_t(N), 0);
        bs_.ratios = ratios_.data();
        bs_.share = share_.data();
        bs_.capv = capv_.data();
        bs_.clipped = clipped_.data();
        pages_before_.assign(size_t(m.cfg.n_kv_heads), 0);
        pages_after_.assign(size_t(m.cfg.n_kv_heads), 0);
    }
    lkv_session(const lkv_session&) = delete;
    lkv_session& operator=(const lkv_session&) = delete;

    /// Checks options and tables. Errors: interval < 1 in mode B, capacity < 1, scorer/budgeter invalid or
    /// not shaped like the model (names the field), a bad budget request.
    result check() const {
        const config& c = m_->cfg;
        if (cache_.capacity() < 1) return result::failure("lkv_session: capacity = " + std::to_string(cache_.capacity()) + " must be >= 1");
        if (opt_.mode == lkv_decode_mode::b && opt_.interval < 1)
            return result::failure("lkv_session: interval = " + std::to_string(opt_.interval) + " must be >= 1 in mode B");
        if (const kvevict::status s = kvevict::decode_schedule::check(schedule_options()); !s.ok())
            return result::failure(std::string("lkv_session: ") + s.message());
        if (const kvevict::status s = kvevict::scorers::learned_mlp::check(sp_); !s.ok()) return result::failure(std::string("lkv_session: ") + s.message());
        if (sp_.num_layers != c.n_layers || sp_.kv_heads != c.n_kv_heads || sp_.head_dim != c.head_dim())
            return result::failure("lkv_session: scorer table (layers " + std::to_string(sp_.num_layers) + ", kv_heads " +
                                   std::to_string(sp_.kv_heads) + ", head_dim " + std::to_string(sp_.head_dim) + ") != model (" +
                                   std::to_string(c.n_layers) + ", " + std::to_string(c.n_kv_heads) + ", " + std::to_string(c.head_dim()) + ")");
        if (bp_.num_layers != c.n_layers || bp_.kv_heads != c.n_kv_heads)
            return result::failure("lkv_session: budgeter table (layers " + std::to_string(bp_.num_layers) + ", kv_heads " +
                                   std::to_string(bp_.kv_heads) + ") != model (" + std::to_string(c.n_layers) + ", " +
                                   std::to_string(c.n_kv_heads) + ")");
        std::vector<std::int64_t> b(size_t(c.n_layers) * size_t(c.n_kv_heads));
        if (const kvevict::status s = kvevict::lkv::decode_budgets(bp_, opt_.budget, 1, b.data()); !s.ok())
            return result::failure(std::string("lkv_session: ") + s.message());
        return result::success();
    }

    /// Prefills `tokens` into the empty session and evicts to the budgets of t = tokens.size() (both
    /// modes). `logits`: the logits after the last token (computed before the eviction, as in the papers).
    /// Errors: the session holds tokens already, empty tokens, prompt longer than the capacity, check().
    result prefill(const std::vector<int>& tokens, std::vector<float>& logits) {
        if (result r = check(); !r) return r;
        if (t_ != 0) return result::failure("lkv_session::prefill: the session already holds " + std::to_string(t_) + " tokens; reset() first");
        if (tokens.empty()) return result::failure("lkv_session::prefill: empty token list");
        if (int(tokens.size()) > cache_.capacity())
            return result::failure("lkv_session::prefill: " + std::to_string(tokens.size()) + " tokens exceed the capacity " +
                                   std::to_string(cache_.capacity()));
        const std::int64_t T = std::int64_t(tokens.size());
        if (const kvevict::status s = sched_.init(schedule_options()); !s.ok()) return result::failure(std::string("lkv_session: ") + s.message());
        kvevict::decode_action a;
        if (const kvevict::status s = sched_.after_prefill(T, &a); !s.ok()) return result::failure(std::string("lkv_session::prefill: ") + s.message());
        prefix_ = sched_.protected_prefix();
        bp_.min_budget = std::int32_t(std::max<std::int64_t>(bp_user_min_, std::int64_t(opt_.protect_prefix) + opt_.protect_recent));
        if (const kvevict::status s = kvevict::lkv::prepare_decode_scratch(bp_, bs_); !s.ok())
            return result::failure(std::string("lkv_session::prefill: ") + s.message());
        if (const kvevict::status s = kvevict::lkv::decode_budgets(bp_, opt_.budget, T, budgets_.data(), &bs_); !s.ok())
            return result::failure(std::string("lkv_session::prefill: ") + s.message());
        const std::int64_t slot_bytes = std::int64_t(cache_.head_dim()) * 2 * std::int64_t(sizeof(float));  // one K+V row
        if (opt_.layerwise) {
            layerwise_stats st;
            if (result r = layerwise_prefill(*m_, cache_, tokens, logits, [this](int l, kv_cache&) { return evict_prefill_layer(l); }, &st); !r)
                return r;
            peak_ = std::max(peak_, st.peak_kv_bytes / slot_bytes);
        } else {
            if (result r = kvevict_engine::prefill(*m_, cache_, tokens, logits); !r) return r;
            peak_ = std::max(peak_, kv_tokens());
            for (int l = 0; l < cache_.n_layers(); ++l)
                if (result r = evict_prefill_layer(l); !r) return r;
        }
        t_ = T;
        ++steps_;
        if (const kvevict::status s = sched_.evicted(a); !s.ok()) return result::failure(std::string("lkv_session::prefill: ") + s.message());
        return result::success();
    }

    /// Runs one generated token (appended to every head; in mode B scored at once), then, in mode B after
    /// every `interval`-th decoded token, a step at the current t. `logits`: after this token (before the
    /// step). Errors: no prefill yet, a full head (capacity), an invalid token, a kvevict error.
    result decode(int token, std::vector<float>& logits) {
        if (t_ == 0) return result::failure("lkv_session::decode: prefill() first");
        if (result r = forward(*m_, cache_, token, logits); !r) return r;
        ++t_;
        peak_ = std::max(peak_, kv_tokens());
        if (opt_.mode == lkv_decode_mode::a) return result::success();
        const int H = cache_.n_kv_heads();
        for (int l = 0; l < cache_.n_layers(); ++l)
            for (int h = 0; h < H; ++h) {
                const int s = cache_.length(l, h) - 1;  // the new token's slot
                if (const kvevict::status st = kvevict::lkv::score_tokens(sp_, l, h, cache_.key(l, h, s), cache_.value(l, h, s), 1,
                                                                        cache_.slot_stride(), &util_[slot_index(l, h, s)]);
                    !st.ok())
                    return result::failure(std::string("lkv_session::decode: ") + st.message());
            }
        kvevict::decode_action a;
        if (const kvevict::status s = sched_.after_decode(1, &a); !s.ok()) return result::failure(std::string("lkv_session::decode: ") + s.message());
        if (!a.evict) return result::success();
        if (result r = step(); !r) return r;
        if (const kvevict::status s = sched_.evicted(a); !s.ok()) return result::failure(std::string("lkv_session::decode: ") + s.message());
        return result::success();
    }

    /// Mode-B step now at the current t (decode() calls it on schedule): budgets for t, then every head over
    /// its budget drops its lowest-utility slots (keys, values, positions, utilities move down in order).
    result step() {
        const int L = cache_.n_layers(), H = cache_.n_kv_heads();
        for (int l = 0; l < L; ++l)
            for (int h = 0; h < H; ++h) lens_[size_t(l * H + h)] = cache_.length(l, h);
        kvevict::lkv::decode_cache_view cv;
        cv.utilities = protected_utilities();
        cv.utility_stride = cache_.capacity();
        cv.lengths = lens_.data();
        kvevict::lkv::decode_step_buffers out;
        out.budgets = budgets_.data();
        out.drop_indptr = drop_indptr_.data();
        out.drop_indices = drop_indices_.data();
        out.drop_capacity = std::int64_t(drop_indices_.size());
        out.scratch = scratch_.data();
        out.scratch_size = std::int64_t(scratch_.size());
        out.budget_scratch = &bs_;
        if (const kvevict::status s = kvevict::lkv::decode_step(bp_, opt_.budget, t_, cv, out); !s.ok())
            return result::failure("lkv_session::step at t = " + std::to_string(t_) + ": " + s.message());
        last_drops_ = drop_indptr_[size_t(L * H)];
        for (int l = 0; l < L; ++l) {
            if (on_layer_evicted) layer_pages(l, pages_before_);
            for (int h = 0; h < H; ++h) {
                const size_t n = size_t(l * H + h);
                if (result r = remove_slots(l, h, drop_indices_.data() + drop_indptr_[n], drop_indptr_[n + 1] - drop_indptr_[n]); !r)
                    return r;
            }
            report_pages(l);
        }
        ++steps_;
        return result::success();
    }

    /// Back to the freshly constructed state (empty cache, t = 0, counters 0).
    void reset() {
        cache_.reset();
        t_ = 0;
        sched_.reset();
        prefix_ = 0;
        steps_ = 0;
        peak_ = 0;
        last_drops_ = 0;
    }

    const kv_cache& cache() const { return cache_; }
    const lkv_decode_options& options_used() const { return opt_; }
    /// Called after each layer's eviction (the prefill's, and every mode-B step's) with the pages each
    /// KV head held before and holds after it (all 0 in a contiguous cache). Optional. During prefill()
    /// it runs before tokens_seen() and evictions() count the prefill.
    std::function<void(int layer, const std::vector<int>& before, const std::vector<int>& after)> on_layer_evicted;
    /// Tokens seen: prompt + decoded (the t of the budgets).
    std::int64_t tokens_seen() const { return t_; }
    /// Stored utility of slot s of KV head h in layer l (valid for s < cache().length(l, h); generated
    /// tokens are scored in mode B only).
    float utility(int l, int h, int s) const { return util_[slot_index(l, h, s)]; }
    /// Budgets of the last eviction (prefill or step), int64 (layers * kv_heads), n = l * kv_heads + h.
    const std::vector<std::int64_t>& budgets() const { return budgets_; }
    /// Evictions run (the prefill's counts as one) since construction / reset().
    int evictions() const { return steps_; }
    /// Slots dropped by the last step().
    std::int64_t last_drops() const { return last_drops_; }
    /// Valid slots over every layer and head now.
    std::int64_t kv_tokens() const {
        std::int64_t n = 0;
        for (int l = 0; l < cache_.n_layers(); ++l)
            for (int h = 0; h < cache_.n_kv_heads(); ++h) n += cache_.length(l, h);
        return n;
    }
    /// Largest kv_tokens() the session reached (layer-wise prefill: one full layer + the compressed ones;
    /// decode: right after a token is appended, before a step), since construction, reset() or reset_peak().
    std::int64_t peak_kv_tokens() const { return peak_; }
    /// Restarts peak_kv_tokens() at the current size (e.g. after the prefill, to watch the decode phase).
    void reset_peak() { peak_ = kv_tokens(); }

private:
    size_t slot_index(int l, int h, int s) const {
        return (size_t(l) * size_t(cache_.n_kv_heads()) + size_t(h)) * size_t(cache_.capacity()) + size_t(s);
    }
    /// Pages each KV head of layer l holds, into `out` (n_kv_heads, sized at construction: no allocation).
    void layer_pages(int l, std::vector<int>& out) const {
        for (int h = 0; h < cache_.n_kv_heads(); ++h) out[size_t(h)] = cache_.pages_in_use(l, h);
    }
    /// on_layer_evicted(l, pages_before_, pages after), when set.
    void report_pages(int l) {
        if (!on_layer_evicted) return;
        layer_pages(l, pages_after_);
        on_layer_evicted(l, pages_before_, pages_after_);
    }
    /// Scores slots [0, len) of head h of layer l into util_: one call over a contiguous cache, one per
    /// page run over a paged one (the rows of a head are contiguous only within a page; every token's
    /// float is the same either way, learned_mlp_rows is bit-identical per token).
    kvevict::status score_head(int l, int h, int len) {
        const int run_max = cache_.paged() ? cache_.page_size() : std::max(len, 1);
        for (int s0 = 0; s0 < len; s0 += run_max) {
            const int n = std::min(run_max, len - s0);
            if (const kvevict::status s = kvevict::lkv::score_tokens(sp_, l, h, cache_.key(l, h, s0), cache_.value(l, h, s0), n,
                                                                    cache_.slot_stride(), &util_[slot_index(l, h, s0)]);
                !s.ok())
                return s;
        }
        return {};
    }
    // Scores every token of layer l (all heads hold the prompt), then drops to the prefill budgets.
    result evict_prefill_layer(int l) {
        const int H = cache_.n_kv_heads();
        if (on_layer_evicted) layer_pages(l, pages_before_);
        for (int h = 0; h < H; ++h) {
            const int len = cache_.length(l, h);
            if (const kvevict::status s = score_head(l, h, len); !s.ok())
                return result::failure(std::string("lkv_session::prefill: ") + s.message());
            const float* u = &util_[slot_index(l, h, 0)];
            if (protects()) {
                std::copy(u, u + len, head_util_.begin());
                protect_head(head_util_.data(), len);
                u = head_util_.data();
            }
            std::int64_t k = 0;
            if (const kvevict::status s = kvevict::lkv::select_drops(u, len, budgets_[size_t(l * H + h)],
                                                                    scratch_.data(), drop_indices_.data(), &k);
                !s.ok())
                return result::failure("lkv_session::prefill: layer " + std::to_string(l) + " head " + std::to_string(h) + ": " + s.message());
            if (result r = remove_slots(l, h, drop_indices_.data(), std::int32_t(k)); !r) return r;
        }
        report_pages(l);
        return result::success();
    }
    kvevict::decode_schedule_options schedule_options() const {
        kvevict::decode_schedule_options so;
        so.interval = opt_.mode == lkv_decode_mode::b ? opt_.interval : 1;
        so.budget = opt_.budget;
        so.protect_prefix = opt_.protect_prefix;
        so.protect_recent = opt_.protect_recent;
        const std::int64_t protected_tokens = std::int64_t(so.protect_prefix) + so.protect_recent;
        if (so.budget.keep_tokens > 0 && so.budget.keep_tokens < protected_tokens && protected_tokens <= std::numeric_limits<std::int32_t>::max())
            so.budget.keep_tokens = std::int32_t(protected_tokens);  // LKV-H raises budgets to the protection itself
        return so;
    }
    bool protects() const { return opt_.protect_prefix > 0 || opt_.protect_recent > 0; }
    // Protected slots of a head of `len` slots get the largest finite utility (kept before any other).
    void protect_head(float* u, int len) const {
        const float top = std::numeric_limits<float>::max();
        for (int s = 0; s < std::min<std::int64_t>(prefix_, len); ++s) u[s] = top;
        for (int s = std::max(0, len - opt_.protect_recent); s < len; ++s) u[s] = top;
    }
    // The utilities a mode-B step sees: util_ itself, or a copy with the protected slots raised.
    const float* protected_utilities() {
        if (!protects()) return util_.data();
        util_protected_ = util_;
        const int H = cache_.n_kv_heads();
        for (int l = 0; l < cache_.n_layers(); ++l)
            for (int h = 0; h < H; ++h) protect_head(&util_protected_[slot_index(l, h, 0)], cache_.length(l, h));
        return util_protected_.data();
    }
    /// Drops slots drop[0..n) (ascending) of head h of layer l: the kept rows (key, value, position,
    /// utility) move down in order; paged, the pages past the new length return to the free list.
    result remove_slots(int l, int h, const std::int32_t* drop, std::int32_t n) {
        if (n <= 0) return result::success();
        const int len = cache_.length(l, h), hd = cache_.head_dim();
        std::int32_t* pos = cache_.positions(l) + std::int64_t(h) * cache_.position_head_stride();
        float* u = &util_[slot_index(l, h, 0)];
        int w = drop[0], d = 0;
        for (int s = drop[0]; s < len; ++s) {
            if (d < n && drop[d] == s) {
                ++d;
                continue;
            }
            std::memmove(cache_.key(l, h, w), cache_.key(l, h, s), sizeof(float) * size_t(hd));
            std::memmove(cache_.value(l, h, w), cache_.value(l, h, s), sizeof(float) * size_t(hd));
            pos[w] = pos[s];
            u[w] = u[s];
            ++w;
        }
        return cache_.set_length(l, h, w);
    }

    const model* m_;
    kvevict::scorers::learned_mlp::params sp_;
    kvevict::budgeters::headwise_learned::params bp_;
    lkv_decode_options opt_;
    kv_cache cache_;
    std::vector<float> util_, util_protected_, head_util_;
    kvevict::decode_schedule sched_;
    std::int64_t prefix_ = 0, bp_user_min_ = 0;
    std::vector<std::int32_t> lens_, drop_indptr_, drop_indices_, scratch_;
    std::vector<std::int64_t> budgets_, capv_;
    std::vector<double> ratios_, share_;
    std::vector<unsigned char> clipped_;
    std::vector<int> pages_before_, pages_after_;  ///< on_layer_evicted's arguments (n_kv_heads each)
    kvevict::lkv::decode_budget_scratch bs_;
    std::int64_t t_ = 0, peak_ = 0, last_drops_ = 0;
    int steps_ = 0;
};

}  // namespace kvevict_engine
