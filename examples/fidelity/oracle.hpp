// kvevict_fidelity: the two greedy-search rows - per layer, greedy token removal that directly minimises an
// attention-output error (references for what a search of the same size finds, not methods). They are
// not bounds: greedy removal is not optimal, the objective is one layer's output error, not the KL the
// report measures, and rows of the report beat them on some excerpts (docs/fidelity.md). The code
// still calls them oracles (window_oracle_method, oracle_method) after what they are given.
//
// "Greedy-W" (window_oracle_method): the error ReST-KV approximates - summed over the observation
// window's queries and the GQA group's query heads, after W_O - with the window kept, as the presets.
// "Greedy-next" (oracle_method): the first decoding query's error before W_O, nothing kept by rule (it
// sees the future query). Its details:
//
// Objective, per KV head h with query heads g of its GQA group (the metric of the report, whose squared
// error is a sum over query heads, so heads are independent):
//   E(keep) = sum_g || o_g - o_g(keep) ||^2,  o_g(keep) = softmax over (keep + new token) of q_g k / sqrt(d), times V
// where q_g is the first decode token's query, the new token's own key/value is always attended (it
// is appended before attention) and o_g is the full-cache output. Greedy backward elimination: while
// the head holds more than its budget, remove the token whose removal gives the smallest E (ties: lower
// slot). Each step is exact (not an approximation of E): with the kept set's running sums
// S_g = sum e_gn and N_g = sum e_gn v_n (e_gn = exp(logit - max)), removing n gives
// o_g' = (N_g - e_gn v_n) / (S_g - e_gn), O(G d) per candidate, O(L^2 G d) per head in all (fp64).
// Greedy elimination is not guaranteed optimal (the exact optimum is a subset search); it is the
// "cheaper but honest form" of brute force: every removal is chosen by the exact objective.
// Budget per head: the same rule as the presets with nothing protected (kvevict::detail::plan_head,
// num_sink 0, num_recent 0): floor(f * L) for a fraction, raised to 1.
#pragma once

#include "evict.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kvevict_fidelity {

/// Greedy oracle keep list of one KV head.
/// @param K, V   (L, d) row-major keys (post-RoPE) and values of the cached tokens
/// @param q      (G, d) the next token's queries of the group's query heads (post-RoPE, unscaled)
/// @param k_new, v_new  (d) the next token's key and value (always attended)
/// @param budget kept tokens (>= 0); budget >= L keeps everything
/// @param keep   out: kept slots, ascending
inline void oracle_keep_head(const float* K, const float* V, int L, int d, const float* q, int G, const float* k_new,
                             const float* v_new, int budget, std::vector<std::int32_t>& keep) {
    keep.clear();
    if (budget >= L) {
        for (int n = 0; n < L; ++n) keep.push_back(n);
        return;
    }
    const double scale = 1.0 / std::sqrt(double(d));
    std::vector<double> e(size_t(G) * size_t(L + 1), 0.0), S(size_t(G), 0.0), N(size_t(G) * size_t(d), 0.0), o(size_t(G) * size_t(d), 0.0);
    for (int g = 0; g < G; ++g) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int n = 0; n <= L; ++n) {
            const float* k = n < L ? K + size_t(n) * size_t(d) : k_new;
            double s = 0;
            for (int c = 0; c < d; ++c) s += double(q[g * d + c]) * k[c];
            e[size_t(g) * size_t(L + 1) + size_t(n)] = s * scale;
            mx = std::max(mx, s * scale);
        }
        double sum = 0;
        for (int n = 0; n <= L; ++n) {
            double& x = e[size_t(g) * size_t(L + 1) + size_t(n)];
            x = std::exp(x - mx);
            sum += x;
            const float* v = n < L ? V + size_t(n) * size_t(d) : v_new;
            for (int c = 0; c < d; ++c) N[size_t(g * d + c)] += x * v[c];
        }
        S[size_t(g)] = sum;
        for (int c = 0; c < d; ++c) o[size_t(g * d + c)] = N[size_t(g * d + c)] / sum;
    }
    std::vector<char> alive(size_t(L), 1);
    for (int left = L; left > budget; --left) {
        int best = -1;
        double best_err = std::numeric_limits<double>::infinity();
        for (int n = 0; n < L; ++n) {
            if (!alive[size_t(n)]) continue;
            const float* v = V + size_t(n) * size_t(d);
            double err = 0;
            for (int g = 0; g < G; ++g) {
                const double en = e[size_t(g) * size_t(L + 1) + size_t(n)];
                const double inv = 1.0 / (S[size_t(g)] - en);  // > 0: the new token is always attended
                for (int c = 0; c < d; ++c) {
                    const double diff = o[size_t(g * d + c)] - (N[size_t(g * d + c)] - en * v[c]) * inv;
                    err += diff * diff;
                }
            }
            if (err < best_err || best < 0) { best_err = err; best = n; }  // a NaN error still removes some token
        }
        if (best < 0) break;
        alive[size_t(best)] = 0;
        const float* v = V + size_t(best) * size_t(d);
        for (int g = 0; g < G; ++g) {
            const double en = e[size_t(g) * size_t(L + 1) + size_t(best)];
            S[size_t(g)] -= en;
            for (int c = 0; c < d; ++c) N[size_t(g * d + c)] -= en * v[c];
        }
    }
    for (int n = 0; n < L; ++n)
        if (alive[size_t(n)]) keep.push_back(n);
}

/// Greedy window oracle keep list of one KV head (the "Greedy-W" row).
/// Objective (fp64): E(keep) = sum_{g < G} sum_{j < w} || R_g (o_gj - o_gj(keep)) ||^2, where query j of
/// the window (slot L - w + j, RoPE applied, unscaled) sees slots [0, L - w + j], o_gj is its full-cache
/// attention output and R_g the W_O factor of query head g (||R_g x|| = ||W_O^g x||, y = R_g x, (d, d)
/// row-major). The window's w slots are always kept; candidates are the slots before it. Greedy backward
/// elimination: while more than `budget` slots are kept, remove the candidate whose removal gives the
/// smallest E (ties: lower slot). Each step is exact: with S_gj = sum e_gjn and N_gj = sum e_gjn v_n over
/// the kept slots, removing n gives R_g o_gj' = (R_g N_gj - e_gjn R_g v_n) / (S_gj - e_gjn), O(G w d) per
/// candidate (R_g N_gj and R_g v_n are kept), O(L^2 G w d) per head in all.
/// @param K, V   (L, d) row-major keys (post-RoPE) and values of the cached tokens
/// @param Q      query of (query head g, window row j) at Q + g * q_head_stride + j * q_row_stride (d floats)
/// @param R      (G, d, d) the group's W_O factors
/// @param w      window rows, 0 <= w <= L (the last w slots are theirs)
/// @param budget kept slots (>= w; budget >= L keeps everything)
/// @param keep   out: kept slots, ascending
inline void window_oracle_keep_head(const float* K, const float* V, int L, int d, const float* Q, std::int64_t q_head_stride,
                                    std::int64_t q_row_stride, const float* R, int G, int w, int budget, std::vector<std::int32_t>& keep) {
    keep.clear();
    const int C = L - w;  // candidates: slots [0, C)
    if (budget >= L || C <= 0) {
        for (int n = 0; n < L; ++n) keep.push_back(n);
        return;
    }
    const double scale = 1.0 / std::sqrt(double(d));
    const size_t D = size_t(d), GW = size_t(G) * size_t(w);
    // S = Sw + Sc: the window's own mass Sw (never removed, > 0) apart from the candidates' Sc, so that a
    // denominator Sw + (Sc - e_n) cannot cancel to 0 when one candidate holds nearly all the attention.
    std::vector<double> e(GW * size_t(C)), Sw(GW), Sc(GW), RN(GW * D), Ro(GW * D), Rv(size_t(G) * size_t(C) * D), N(D),
        lg(static_cast<size_t>(L));
    auto Rmul = [&](int g, const double* x, double* y) {  // y = R_g x
        const float* Rg = R + size_t(g) * D * D;
        for (int i = 0; i < d; ++i) {
            double acc = 0;
            for (int c = 0; c < d; ++c) acc += double(Rg[size_t(i) * D + size_t(c)]) * x[c];
            y[i] = acc;
        }
    };
    std::vector<double> x(D);
    for (int g = 0; g < G; ++g) {
        for (int n = 0; n < C; ++n) {
            for (int c = 0; c < d; ++c) x[size_t(c)] = V[size_t(n) * D + size_t(c)];
            Rmul(g, x.data(), &Rv[(size_t(g) * size_t(C) + size_t(n)) * D]);
        }
        for (int j = 0; j < w; ++j) {
            const float* q = Q + std::int64_t(g) * q_head_stride + std::int64_t(j) * q_row_stride;
            const int vis = C + j + 1;  // slots [0, L - w + j]
            double mx = -std::numeric_limits<double>::infinity();
            for (int n = 0; n < vis; ++n) {
                double sdot = 0;
                for (int c = 0; c < d; ++c) sdot += double(q[c]) * K[size_t(n) * D + size_t(c)];
                lg[size_t(n)] = sdot * scale;
                mx = std::max(mx, lg[size_t(n)]);
            }
            double sw = 0, sc = 0;
            std::fill(N.begin(), N.end(), 0.0);
            const size_t gj = size_t(g) * size_t(w) + size_t(j);
            for (int n = 0; n < vis; ++n) {
                const double en = std::exp(lg[size_t(n)] - mx);
                if (n < C) {
                    e[gj * size_t(C) + size_t(n)] = en;
                    sc += en;
                } else {
                    sw += en;
                }
                for (int c = 0; c < d; ++c) N[size_t(c)] += en * V[size_t(n) * D + size_t(c)];
            }
            Sw[gj] = sw;
            Sc[gj] = sc;
            const double sum = sw + sc;
            Rmul(g, N.data(), &RN[gj * D]);
            for (int c = 0; c < d; ++c) x[size_t(c)] = N[size_t(c)] / sum;
            Rmul(g, x.data(), &Ro[gj * D]);
        }
    }
    std::vector<char> alive(size_t(C), 1);
    for (int left = L; left > budget; --left) {
        int best = -1;
        double best_err = std::numeric_limits<double>::infinity();
        for (int n = 0; n < C; ++n) {
            if (!alive[size_t(n)]) continue;
            double err = 0;
            for (int g = 0; g < G; ++g) {
                const double* rv = &Rv[(size_t(g) * size_t(C) + size_t(n)) * D];
                for (int j = 0; j < w; ++j) {
                    const size_t gj = size_t(g) * size_t(w) + size_t(j);
                    const double en = e[gj * size_t(C) + size_t(n)];
                    const double rest = Sc[gj] - en;
                    const double inv = 1.0 / (Sw[gj] + (rest > 0 ? rest : 0.0));  // Sw > 0: the window's own slots stay
                    const double* rn = &RN[gj * D];
                    const double* ro = &Ro[gj * D];
                    for (int c = 0; c < d; ++c) {
                        const double diff = ro[c] - (rn[c] - en * rv[c]) * inv;
                        err += diff * diff;
                    }
                }
            }
            if (err < best_err || best < 0) { best_err = err; best = n; }  // a NaN error still removes some token
        }
        if (best < 0) break;  // no candidate left (cannot happen while left > budget >= w)
        alive[size_t(best)] = 0;
        for (int g = 0; g < G; ++g) {
            const double* rv = &Rv[(size_t(g) * size_t(C) + size_t(best)) * D];
            for (int j = 0; j < w; ++j) {
                const size_t gj = size_t(g) * size_t(w) + size_t(j);
                const double en = e[gj * size_t(C) + size_t(best)];
                Sc[gj] -= en;
                for (int c = 0; c < d; ++c) RN[gj * D + size_t(c)] -= en * rv[c];
            }
        }
    }
    for (int n = 0; n < L; ++n)
        if (n >= C || alive[size_t(n)]) keep.push_back(n);
}

/// The cache shape the oracles read: the model's layers and head_dim, heads that divide the query heads
/// (GQA-native or repeated to q_heads), a layer in range. Error naming the values otherwise.
inline kvevict_engine::result check_oracle_cache(const char* who, const kvevict_engine::layer_state& s) {
    const kvevict_engine::kv_cache& c = *s.cache;
    const kvevict_engine::config& cfg = s.m->cfg;
    if (c.n_layers() != cfg.n_layers || c.head_dim() != cfg.head_dim() || c.n_kv_heads() < 1 || cfg.n_heads % c.n_kv_heads() != 0 ||
        c.n_kv_heads() != cfg.n_kv_heads * c.kv_repeat())
        return kvevict_engine::result::failure(std::string(who) + ": kv_cache of " + std::to_string(c.n_layers()) + " layers, " +
                                               std::to_string(c.n_kv_heads()) + " heads (kv_repeat " + std::to_string(c.kv_repeat()) +
                                               "), head_dim " + std::to_string(c.head_dim()) + " does not match the model");
    if (s.layer < 0 || s.layer >= c.n_layers())
        return kvevict_engine::result::failure(std::string(who) + ": layer " + std::to_string(s.layer) + " outside 0.." +
                                               std::to_string(c.n_layers() - 1));
    return kvevict_engine::result::success();
}

/// Registry row "Greedy-W": window_oracle_keep_head per KV head over the last `window` prompt queries
/// (layer_state::queries) and the W_O factors (layer_state::wo); budget per head as the presets'
/// (kvevict::detail::plan_head with num_sink 0 and the window kept: floor(f * L), at least the window).
/// The objective sums over the query heads that read a cache head: the GQA group on a GQA-native cache;
/// `repeat_kv` (a cache repeated to q_heads, "Greedy-W-pqh"): one query head, a selection per query head.
inline kvevict_engine::method window_oracle_method(std::string name = "Greedy-W", int window = 32, bool repeat_kv = false) {
    kvevict_engine::method m;
    m.name = std::move(name);
    m.window = window;
    m.repeat_kv = repeat_kv;
    auto run = [](const kvevict_engine::layer_state& s, int window) -> kvevict_engine::result {
        using kvevict_engine::result;
        if (!s.m || !s.cache || !s.queries || !s.wo || s.wo->empty())
            return result::failure("oracle-W: layer_state.m, .cache, .queries and .wo must be set");
        kvevict_engine::kv_cache& c = *s.cache;
        if (const result r = check_oracle_cache("oracle-W", s); !r) return r;
        const int H = c.n_kv_heads(), d = c.head_dim(), G = kvevict_engine::query_heads_per_cache_head(s.m->cfg, c), l = s.layer;
        const kvevict::query_view<const float> q = s.queries->view(l, window);
        const int w = q.data ? int(q.extent[2]) : 0;
        const kvevict::strided_view<const float, 3> R = s.wo->view(l);
        kvevict::selectors::topk::params sp;
        sp.num_sink = 0;
        sp.num_recent = w;
        if (const kvevict::status st = kvevict::detail::validate_budget(s.budget, sp, w); !st.ok())
            return result::failure(std::string("oracle-W: ") + st.message());
        std::vector<std::int32_t> indptr(size_t(H) + 1, 0), indices, keep;
        std::vector<float> kbuf, vbuf;
        for (int h = 0; h < H; ++h) {
            const int L = c.length(l, h);
            const int wh = std::min(w, L);
            const kvevict::detail::head_plan pl = kvevict::detail::plan_head(s.budget, sp, L, wh);
            const float* Qh = wh > 0 ? q.data + size_t(h) * size_t(G) * size_t(q.stride[1]) + size_t(w - wh) * size_t(q.stride[2]) : nullptr;
            window_oracle_keep_head(c.head_keys(l, h, kbuf), c.head_values(l, h, vbuf), L, d, Qh, q.stride[1], q.stride[2],
                                    R.data + size_t(h) * size_t(G) * size_t(R.stride[0]), G, wh,
                                    pl.pass_through ? L : std::max(int(pl.base_budget), wh), keep);
            indices.insert(indices.end(), keep.begin(), keep.end());
            indptr[size_t(h) + 1] = std::int32_t(indices.size());
        }
        if (indices.empty()) indices.push_back(0);
        return kvevict_engine::apply_selection(c, l, indptr.data(), indices.data());
    };
    m.evict = [run, window](const kvevict_engine::layer_state& s) { return run(s, window); };
    m.evict_with_window = run;
    m.plan = [](const kvevict::budget_request& req, std::int64_t length, int w) {
        kvevict::selectors::topk::params sp;
        sp.num_sink = 0;
        sp.num_recent = -1;
        return kvevict::detail::plan_head(req, sp, length, std::min<std::int64_t>(w, length));
    };
    return m;
}

/// Registry row for the look-ahead oracle ("Greedy-next"). Needs layer_state::next_query / next_key / next_value (the report
/// provides them; the engine's sessions do not, so the oracle fails there with a clear error).
inline kvevict_engine::method oracle_method(std::string name = "Greedy-next") {
    kvevict_engine::method m;
    m.name = std::move(name);
    m.window = 0;
    m.needs_lookahead = true;
    m.evict = [](const kvevict_engine::layer_state& s) -> kvevict_engine::result {
        using kvevict_engine::result;
        if (!s.m || !s.cache) return result::failure("oracle: layer_state.m and .cache must be set");
        if (!s.next_query || !s.next_key || !s.next_value)
            return result::failure("oracle: needs the next token's query, key and value (layer_state::next_*)");
        kvevict_engine::kv_cache& c = *s.cache;
        if (const result r = check_oracle_cache("oracle", s); !r) return r;
        const int H = c.n_kv_heads(), d = c.head_dim(), G = kvevict_engine::query_heads_per_cache_head(s.m->cfg, c), l = s.layer;
        kvevict::selectors::topk::params sp;
        sp.num_sink = 0;
        sp.num_recent = 0;
        if (const kvevict::status st = kvevict::detail::validate_budget(s.budget, sp, 0); !st.ok())
            return result::failure(std::string("oracle: ") + st.message());
        std::vector<std::int32_t> indptr(size_t(H) + 1, 0), indices, keep;
        std::vector<float> kbuf, vbuf;  // a paged cache's rows of one head, gathered
        for (int h = 0; h < H; ++h) {
            const int L = c.length(l, h);
            const kvevict::detail::head_plan pl = kvevict::detail::plan_head(s.budget, sp, L, 0);
            oracle_keep_head(c.head_keys(l, h, kbuf), c.head_values(l, h, vbuf), L, d, s.next_query + size_t(h) * size_t(G) * size_t(d), G,
                             s.next_key + size_t(h / c.kv_repeat()) * size_t(d), s.next_value + size_t(h / c.kv_repeat()) * size_t(d),
                             pl.pass_through ? L : int(pl.base_budget), keep);
            indices.insert(indices.end(), keep.begin(), keep.end());
            indptr[size_t(h) + 1] = std::int32_t(indices.size());
        }
        if (indices.empty()) indices.push_back(0);  // valid pointer; indptr says 0 kept
        return kvevict_engine::apply_selection(c, l, indptr.data(), indices.data());
    };
    m.plan = [](const kvevict::budget_request& req, std::int64_t length, int) {
        kvevict::selectors::topk::params sp;
        sp.num_sink = 0;
        sp.num_recent = 0;
        return kvevict::detail::plan_head(req, sp, length, 0);
    };
    return m;
}

}  // namespace kvevict_fidelity
