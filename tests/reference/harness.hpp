// Test harness: random problems in fp64, their storage in every layout and storage type, the
// whole-pipeline reference (built only from tests/reference/reference.hpp) and a runner for the
// CPU evictor. Included by the test translation units that use the CPU backend (Eigen).
#pragma once

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "common/tolerance.hpp"
#include "reference/reference.hpp"

namespace kvtest {

/// Memory layouts the tests store K/V/Q in:
///  - hnd, nhd: dense (make_kv_view);
///  - padded: NHD inside a bigger buffer, head_dim padded by 3, 5 extra elements per seq row,
///    an offset of 7 elements; padding filled with NaN (must never be read);
///  - interleaved: HND with element stride 2 (column stride != 1), gaps filled with NaN.
enum class layout { hnd, nhd, padded, interleaved };
inline const char* to_string(layout l) {
  switch (l) {
    case layout::hnd: return "hnd";
    case layout::nhd: return "nhd";
    case layout::padded: return "padded";
    case layout::interleaved: return "interleaved";
  }
  return "?";
}

struct shape {
  std::int64_t batch = 1, kv_heads = 2, group = 2, cap = 48, d = 16, window = 8, hidden = 0;  ///< hidden 0: no W_O
  std::int64_t q_heads() const { return kv_heads * group; }
};

/// One layer's data in fp64 (the values the library sees after storage rounding).
struct problem {
  shape s;
  std::vector<double> K, V, Q, WO;  ///< K,V (b, h, n, c); Q (b, hq, j, c); WO (C, hq*d + i)
  std::vector<std::int32_t> lens;   ///< (b, h); empty: cap everywhere
  std::size_t kv_idx(std::int64_t b, std::int64_t h, std::int64_t n, std::int64_t c) const {
    return static_cast<std::size_t>(((b * s.kv_heads + h) * s.cap + n) * s.d + c);
  }
  std::size_t q_idx(std::int64_t b, std::int64_t hq, std::int64_t j, std::int64_t c) const {
    return static_cast<std::size_t>(((b * s.q_heads() + hq) * s.window + j) * s.d + c);
  }
  std::int64_t length(std::int64_t b, std::int64_t h) const {
    return lens.empty() ? s.cap : lens[static_cast<std::size_t>(b * s.kv_heads + h)];
  }
  /// Head (b, h)'s first L keys / values as L x d.
  kvref::mat keys(std::int64_t b, std::int64_t h) const { return slab(K, b, h); }
  kvref::mat values(std::int64_t b, std::int64_t h) const { return slab(V, b, h); }
  /// Query head hq of sequence b: its last w window rows as w x d.
  kvref::mat queries(std::int64_t b, std::int64_t hq, std::int64_t w) const {
    kvref::mat m(w, s.d);
    for (std::int64_t j = 0; j < w; ++j)
      for (std::int64_t c = 0; c < s.d; ++c) m(j, c) = Q[q_idx(b, hq, s.window - w + j, c)];
    return m;
  }
  /// W_O^hq as C x d.
  kvref::mat wo(std::int64_t hq) const {
    kvref::mat m(s.hidden, s.d);
    for (std::int64_t c = 0; c < s.hidden; ++c)
      for (std::int64_t i = 0; i < s.d; ++i) m(c, i) = WO[static_cast<std::size_t>(c * s.q_heads() * s.d + hq * s.d + i)];
    return m;
  }

 private:
  kvref::mat slab(const std::vector<double>& X, std::int64_t b, std::int64_t h) const {
    const std::int64_t L = length(b, h);
    kvref::mat m(L, s.d);
    for (std::int64_t n = 0; n < L; ++n)
      for (std::int64_t c = 0; c < s.d; ++c) m(n, c) = X[kv_idx(b, h, n, c)];
    return m;
  }
};

/// Random N(0, scale^2) data; slots beyond a head's length are NaN (never read).
inline problem make_problem(const shape& s, std::uint64_t seed, double kscale = 1.0, double qscale = 1.0,
                            double vscale = 1.0, std::vector<std::int32_t> lens = {}) {
  problem p;
  p.s = s;
  p.lens = std::move(lens);
  rng r(seed);
  p.K.resize(static_cast<std::size_t>(s.batch * s.kv_heads * s.cap * s.d));
  p.V.resize(p.K.size());
  p.Q.resize(static_cast<std::size_t>(s.batch * s.q_heads() * s.window * s.d));
  for (auto& x : p.K) x = kscale * r.normal();
  for (auto& x : p.V) x = vscale * r.normal();
  for (auto& x : p.Q) x = qscale * r.normal();
  if (s.hidden > 0) {
    p.WO.resize(static_cast<std::size_t>(s.hidden * s.q_heads() * s.d));
    for (auto& x : p.WO) x = r.normal() / std::sqrt(static_cast<double>(s.hidden));
  }
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.kv_heads; ++h)
      for (std::int64_t n = p.length(b, h); n < s.cap; ++n)
        for (std::int64_t c = 0; c < s.d; ++c) {
          p.K[p.kv_idx(b, h, n, c)] = std::numeric_limits<double>::quiet_NaN();
          p.V[p.kv_idx(b, h, n, c)] = std::numeric_limits<double>::quiet_NaN();
        }
  return p;
}

/// Round K, V, Q to storage type T (the reference then sees exactly the stored values).
/// W_O stays fp32-exact (the factor is computed from fp32 weights).
template <class T>
void quantize(problem& p) {
  auto q = [](std::vector<double>& v) {
    for (auto& x : v) x = static_cast<double>(kvevict::to_float(kvevict::from_float<T>(static_cast<float>(x))));
  };
  q(p.K);
  q(p.V);
  q(p.Q);
  for (auto& x : p.WO) x = static_cast<double>(static_cast<float>(x));
}

/// Round W_O to storage type T (for layer_inputs::wo, which CriticalKV reads in type T).
template <class T>
void quantize_wo(problem& p) {
  for (auto& x : p.WO) x = static_cast<double>(kvevict::to_float(kvevict::from_float<T>(static_cast<float>(x))));
}

/// The problem stored for the library in type T and a layout; owns the buffers.
template <class T>
struct stored {
  std::vector<T> kbuf, vbuf, qbuf;
  std::vector<float> wo, R;
  std::vector<T> wot;  ///< W_O in storage type T for layer_inputs::wo (CriticalKV)
  std::vector<std::int32_t> lens;
  kvevict::layer_inputs<T> in;
};

namespace detail {
/// Store a (n0, n1, n2, n3) tensor given by get(i0, i1, i2, i3) in layout l; returns the view.
template <class T, class F>
kvevict::strided_view<const T, 4> store4(std::vector<T>& buf, std::int64_t n0, std::int64_t n1, std::int64_t n2,
                                         std::int64_t n3, layout l, F get) {
  kvevict::strided_view<const T, 4> v;
  std::int64_t off = 0;
  v.extent[0] = n0;
  v.extent[1] = n1;
  v.extent[2] = n2;
  v.extent[3] = n3;
  std::size_t total;
  switch (l) {
    case layout::hnd:
      v.stride[3] = 1, v.stride[2] = n3, v.stride[1] = n2 * n3, v.stride[0] = n1 * n2 * n3;
      total = static_cast<std::size_t>(n0 * n1 * n2 * n3);
      break;
    case layout::nhd:
      v.stride[3] = 1, v.stride[1] = n3, v.stride[2] = n1 * n3, v.stride[0] = n2 * n1 * n3;
      total = static_cast<std::size_t>(n0 * n1 * n2 * n3);
      break;
    case layout::padded:
      off = 7;
      v.stride[3] = 1, v.stride[1] = n3 + 3, v.stride[2] = n1 * (n3 + 3) + 5, v.stride[0] = n2 * (n1 * (n3 + 3) + 5) + 2;
      total = static_cast<std::size_t>(off + n0 * v.stride[0] + 11);
      break;
    default:  // interleaved
      v.stride[3] = 2, v.stride[2] = 2 * n3, v.stride[1] = n2 * 2 * n3, v.stride[0] = n1 * n2 * 2 * n3;
      total = static_cast<std::size_t>(n0 * n1 * n2 * n3 * 2);
      break;
  }
  buf.assign(total, kvevict::from_float<T>(std::numeric_limits<float>::quiet_NaN()));
  for (std::int64_t a = 0; a < n0; ++a)
    for (std::int64_t b = 0; b < n1; ++b)
      for (std::int64_t c = 0; c < n2; ++c)
        for (std::int64_t e = 0; e < n3; ++e)
          buf[static_cast<std::size_t>(off + a * v.stride[0] + b * v.stride[1] + c * v.stride[2] + e * v.stride[3])] =
              kvevict::from_float<T>(static_cast<float>(get(a, b, c, e)));
  v.data = buf.data() + off;
  return v;
}
}  // namespace detail

/// Store p for the library. Views are set for keys, values, queries, lengths and (hidden > 0)
/// the W_O factor, computed with cpu::compute_wo_factors from fp32 W_O.
template <class T>
void store(const problem& p, layout l, stored<T>& st) {
  const auto& s = p.s;
  st.in = kvevict::layer_inputs<T>{};
  st.in.keys = detail::store4(st.kbuf, s.batch, s.kv_heads, s.cap, s.d, l, [&](auto b, auto h, auto n, auto c) { return p.K[p.kv_idx(b, h, n, c)]; });
  st.in.values = detail::store4(st.vbuf, s.batch, s.kv_heads, s.cap, s.d, l, [&](auto b, auto h, auto n, auto c) { return p.V[p.kv_idx(b, h, n, c)]; });
  st.in.queries = detail::store4(st.qbuf, s.batch, s.q_heads(), s.window, s.d, l, [&](auto b, auto h, auto j, auto c) { return p.Q[p.q_idx(b, h, j, c)]; });
  if (!p.lens.empty()) {
    st.lens = p.lens;
    st.in.lengths = kvevict::per_head_lengths(st.lens.data(), s.batch, s.kv_heads);
  }
  if (s.hidden > 0) {
    st.wo.assign(p.WO.begin(), p.WO.end());
    st.R.assign(static_cast<std::size_t>(s.q_heads() * s.d * s.d), 0.0f);
    kvevict::strided_view<const float, 2> wv{st.wo.data(), {s.hidden, s.q_heads() * s.d}, {s.q_heads() * s.d, 1}};
    const kvevict::status r = kvevict::cpu::compute_wo_factors(wv, s.q_heads(), s.d, st.R.data());
    (void)r;
    st.in.wo_factor = kvevict::cpu::wo_factor_view(st.R.data(), s.q_heads(), s.d);
    // The full W_O, row-major [out][in], in type T (round p.WO with quantize_wo<T> first when
    // T is not float, so the reference sees the stored values).
    st.wot.resize(p.WO.size());
    for (std::size_t i = 0; i < p.WO.size(); ++i) st.wot[i] = kvevict::from_float<T>(static_cast<float>(p.WO[i]));
    st.in.wo = kvevict::strided_view<const T, 2>{st.wot.data(), {s.hidden, s.q_heads() * s.d}, {s.q_heads() * s.d, 1}};
  }
}

// ------------------------------------------------------------------------------------------
// Whole-pipeline reference
// ------------------------------------------------------------------------------------------

enum class scorer_kind { attention_weight, accumulated, last_query, key_norm, lor, attention_value_norm };
enum class spatial_kind { none, avg_pool, max_pool, adaptive };
enum class budget_kind { uniform, pyramid, adakv };

struct ref_config {
  scorer_kind scorer = scorer_kind::attention_weight;
  kvref::temporal_kind temporal = kvref::temporal_kind::sum;
  double alpha = 0.3;
  spatial_kind spatial = spatial_kind::none;
  std::int64_t kernel = 5;
  double beta = 2000.0;
  std::int64_t k_min = 5;
  bool reference_exact = true;
  kvref::gqa_kind gqa = kvref::gqa_kind::mean;
  // output reconstruction
  bool before = false, use_wo = true, include_window = false, normalize_visible = false;
  double tau = 1.0;
  kvref::lor_eval eval = kvref::lor_eval::straightforward;
  // budget
  std::int64_t keep_tokens = 0;
  double keep_fraction = 0.0;
  std::int64_t num_sink = 0, num_recent = -1;
  double recent_share = -1.0;
  budget_kind budgeter = budget_kind::uniform;
  double pyramid_beta = 20.0;
  bool pyramid_exact = true;
  double adakv_alpha = 0.2;
  bool adakv_exact_total = true;  ///< false: the reference code's per-head rounding (presets::adakv_published)
  std::int64_t layer = 0, num_layers = 1;
  // CriticalKV (scorer attention_value_norm): selection in two stages
  double first_stage_ratio = 0.5, eps = 1e-4;
};

/// ReST-KV's LOR scorer with EMA and no spatial smoothing: the raw (temporal-smoothed) score
/// reaches maybe_scores, and score_kv_head's rows are the per-query-head reference rows.
using lor_plain = kvevict::eviction_policy<kvevict::scorers::output_reconstruction, kvevict::temporal::ema, kvevict::spatial::none>;

/// The fp64 reference configuration of lor_plain with these options (EMA alpha 0.3 as fp32).
inline ref_config lor_ref_config(bool before, bool use_wo, bool include_window, double tau = 1.0,
                                 kvref::lor_eval ev = kvref::lor_eval::exact) {
  ref_config c;
  c.scorer = scorer_kind::lor;
  c.temporal = kvref::temporal_kind::ema;
  c.alpha = static_cast<double>(0.3f);
  c.before = before;
  c.use_wo = use_wo;
  c.include_window = include_window;
  c.tau = tau;
  c.eval = ev;
  return c;
}

/// lor_plain's parameters with these options (the library side of lor_ref_config).
inline lor_plain::params lor_plain_params(bool before, bool use_wo, bool include_window, float tau = 1.0f) {
  auto p = lor_plain::defaults();
  p.scorer.aggregation = before ? kvevict::scorers::output_reconstruction::mode::before
                                : kvevict::scorers::output_reconstruction::mode::after;
  p.scorer.use_wo = use_wo;
  p.scorer.include_window_in_output = include_window;
  p.scorer.tau = tau;
  return p;
}

struct ref_row {
  kvref::head_plan plan;
  std::int64_t budget = 0;
  std::vector<double> scores;  ///< final (reduced, smoothed) over [0, L); empty when not scored
  std::vector<std::int32_t> kept;
  double drift = 0.0;
  std::vector<double> secondary;       ///< CriticalKV: reduced ||v W_O^h||_1 over [0, L)
  std::vector<std::int32_t> stage1;    ///< CriticalKV: the stage-1 slots (ascending)
};

/// CriticalKV's value term of query head hq over KV head h: u[n] = ||v_n W_O^hq||_1, n < L.
inline std::vector<double> reference_value_norms(const problem& p, std::int64_t b, std::int64_t h, std::int64_t hq) {
  const std::int64_t L = p.length(b, h);
  const kvref::mat V = p.values(b, h), WO = p.wo(hq);
  std::vector<double> u(static_cast<std::size_t>(L));
  for (std::int64_t n = 0; n < L; ++n) u[static_cast<std::size_t>(n)] = kvref::proj_l1_norm(V.row(n), p.s.d, WO);
  return u;
}

/// Raw score row (length L) of query head hq over KV head h of sequence b, plus its drift.
inline std::vector<double> reference_head_scores(const problem& p, const ref_config& cfg, std::int64_t b, std::int64_t h,
                                                 std::int64_t hq, std::int64_t drift_k, double* drift) {
  const std::int64_t L = p.length(b, h), w = std::min(p.s.window, L);
  const kvref::mat K = p.keys(b, h);
  *drift = 0.0;
  if (cfg.scorer == scorer_kind::key_norm) return kvref::key_norm_score(K, L);
  const kvref::mat Q = p.queries(b, hq, w);
  if (cfg.scorer == scorer_kind::accumulated) {
    // Temporal weights of the policy are all 1 (temporal::sum) for H2O.
    return kvref::accumulated_attention(Q, K, L, cfg.normalize_visible);
  }
  const kvref::mat A = kvref::window_attention(Q, K, L, w);
  if (drift_k > 0) *drift = kvref::attention_drift(A, drift_k);
  const kvref::vec c = kvref::temporal_weights(cfg.temporal, cfg.alpha, w);
  switch (cfg.scorer) {
    case scorer_kind::attention_weight:
    case scorer_kind::attention_value_norm: return kvref::attention_weight_score(A, c);
    case scorer_kind::last_query: return kvref::last_query_score(A);
    case scorer_kind::lor: {
      const kvref::mat V = p.values(b, h);
      kvref::mat WO;
      if (cfg.use_wo) WO = p.wo(hq);
      const kvref::mat* wo = cfg.use_wo ? &WO : nullptr;
      return cfg.before ? kvref::lor_before(A, c, V, L, wo, cfg.tau, cfg.eval)
                        : kvref::lor_after(A, c, V, L, w, wo, cfg.include_window, cfg.tau, cfg.eval);
    }
    default: return {};
  }
}

/// The full reference pipeline: rows r = b * out_heads + h.
inline std::vector<ref_row> reference_run(const problem& p, const ref_config& cfg) {
  const auto& s = p.s;
  const std::int64_t G = s.group, Hkv = s.kv_heads;
  const std::int64_t H = cfg.gqa == kvref::gqa_kind::per_query_head ? s.q_heads() : Hkv;
  const std::int64_t Gout = H / Hkv;
  std::vector<ref_row> rows(static_cast<std::size_t>(s.batch * H));
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t hr = 0; hr < H; ++hr) {
      auto& R = rows[static_cast<std::size_t>(b * H + hr)];
      R.plan = kvref::plan(p.length(b, hr / Gout), cfg.keep_tokens, cfg.keep_fraction, cfg.num_sink, cfg.num_recent,
                           cfg.recent_share, s.window);
    }
    // raw scores per query head, then reduction
    std::vector<std::vector<double>> qrows(static_cast<std::size_t>(s.q_heads()));
    std::vector<std::vector<double>> urows(static_cast<std::size_t>(s.q_heads()));  // CriticalKV
    std::vector<double> qdrift(static_cast<std::size_t>(s.q_heads()), 0.0);
    bool any = false;
    for (std::int64_t hr = 0; hr < H; ++hr) any = any || !rows[static_cast<std::size_t>(b * H + hr)].plan.pass;
    if (!any) {
      for (std::int64_t hr = 0; hr < H; ++hr) {
        auto& R = rows[static_cast<std::size_t>(b * H + hr)];
        R.budget = R.plan.L;
        R.kept = kvref::topk_select({}, R.plan.L, R.plan.L, 0, 0);
      }
      continue;
    }
    for (std::int64_t h = 0; h < Hkv; ++h) {
      const auto& pl0 = rows[static_cast<std::size_t>(b * H + h * Gout)].plan;
      const std::int64_t w = std::min(s.window, pl0.L);
      const std::int64_t dk = cfg.spatial == spatial_kind::adaptive ? std::max<std::int64_t>(1, pl0.base - w) : 0;
      for (std::int64_t g = 0; g < G; ++g) {
        const std::int64_t hq = h * G + g;
        if (pl0.L == 0) continue;
        qrows[static_cast<std::size_t>(hq)] = reference_head_scores(p, cfg, b, h, hq, dk, &qdrift[static_cast<std::size_t>(hq)]);
        if (cfg.scorer == scorer_kind::attention_value_norm) urows[static_cast<std::size_t>(hq)] = reference_value_norms(p, b, h, hq);
      }
    }
    std::vector<std::vector<double>> out(static_cast<std::size_t>(H)), uout(static_cast<std::size_t>(H));
    std::vector<double> odrift(static_cast<std::size_t>(H), 0.0);
    const bool critical = cfg.scorer == scorer_kind::attention_value_norm;
    for (std::int64_t hr = 0; hr < H; ++hr) {
      if (critical) {  // the value norms reduced by the same GQA rule as the scores
        if (cfg.gqa == kvref::gqa_kind::per_query_head) {
          uout[static_cast<std::size_t>(hr)] = urows[static_cast<std::size_t>(hr)];
        } else if (cfg.gqa == kvref::gqa_kind::layer_mean) {
          std::vector<std::vector<double>> grp_means;
          for (std::int64_t h2 = 0; h2 < Hkv; ++h2)
            grp_means.push_back(kvref::reduce_rows(
                std::vector<std::vector<double>>(urows.begin() + h2 * G, urows.begin() + (h2 + 1) * G), kvref::gqa_kind::mean));
          uout[static_cast<std::size_t>(hr)] = kvref::reduce_rows(grp_means, kvref::gqa_kind::mean);
        } else if (!urows[static_cast<std::size_t>(hr * G)].empty()) {
          uout[static_cast<std::size_t>(hr)] = kvref::reduce_rows(
              std::vector<std::vector<double>>(urows.begin() + hr * G, urows.begin() + (hr + 1) * G), cfg.gqa);
        }
      }
      if (cfg.gqa == kvref::gqa_kind::per_query_head) {
        out[static_cast<std::size_t>(hr)] = qrows[static_cast<std::size_t>(hr)];
        odrift[static_cast<std::size_t>(hr)] = qdrift[static_cast<std::size_t>(hr)];
      } else if (cfg.gqa == kvref::gqa_kind::layer_mean) {
        std::vector<std::vector<double>> all(qrows.begin(), qrows.end());
        out[static_cast<std::size_t>(hr)] = kvref::reduce_rows(all, kvref::gqa_kind::mean);
        double d = 0.0;
        for (double x : qdrift) d += x;
        odrift[static_cast<std::size_t>(hr)] = d / static_cast<double>(qdrift.size());
      } else {
        std::vector<std::vector<double>> grp(qrows.begin() + hr * G, qrows.begin() + (hr + 1) * G);
        if (grp[0].empty()) continue;
        out[static_cast<std::size_t>(hr)] = kvref::reduce_rows(grp, cfg.gqa);
        double d = 0.0;
        for (std::int64_t g = 0; g < G; ++g) d += qdrift[static_cast<std::size_t>(hr * G + g)];
        odrift[static_cast<std::size_t>(hr)] = d / static_cast<double>(G);
      }
    }
    // smoothing over [0, L - recent)
    for (std::int64_t hr = 0; hr < H; ++hr) {
      auto& R = rows[static_cast<std::size_t>(b * H + hr)];
      if (R.plan.pass || out[static_cast<std::size_t>(hr)].empty()) continue;
      std::vector<double> x = out[static_cast<std::size_t>(hr)];
      const std::int64_t N = R.plan.L - R.plan.recent;
      std::vector<double> head(x.begin(), x.begin() + N), y;
      switch (cfg.spatial) {
        case spatial_kind::none: y = head; break;
        case spatial_kind::avg_pool: y = kvref::avg_pool(head, cfg.kernel); break;
        case spatial_kind::max_pool: y = kvref::max_pool(head, cfg.kernel); break;
        case spatial_kind::adaptive: {
          std::int64_t k, sh;
          kvref::aws_kernel_shift(odrift[static_cast<std::size_t>(hr)], cfg.beta, cfg.k_min, cfg.reference_exact, &k, &sh);
          y = kvref::aws_smooth(head, k, sh);
          break;
        }
      }
      std::copy(y.begin(), y.end(), x.begin());
      R.scores = x;
      R.drift = odrift[static_cast<std::size_t>(hr)];
      if (critical) R.secondary = uout[static_cast<std::size_t>(hr)];
    }
    // budgets
    std::vector<kvref::head_plan> plans;
    std::vector<kvref::vec> sc;
    for (std::int64_t hr = 0; hr < H; ++hr) {
      plans.push_back(rows[static_cast<std::size_t>(b * H + hr)].plan);
      sc.push_back(rows[static_cast<std::size_t>(b * H + hr)].scores);
    }
    std::vector<std::int64_t> bud(static_cast<std::size_t>(H));
    if (cfg.budgeter == budget_kind::adakv) {
      bud = kvref::adakv_budgets(plans, sc, cfg.adakv_alpha, cfg.adakv_exact_total);
    } else {
      for (std::int64_t hr = 0; hr < H; ++hr) {
        const auto& pl = plans[static_cast<std::size_t>(hr)];
        if (pl.pass) bud[static_cast<std::size_t>(hr)] = pl.L;
        else if (cfg.budgeter == budget_kind::uniform) bud[static_cast<std::size_t>(hr)] = pl.base;
        else {
          const std::int64_t P = pl.base - pl.prot(), min_c = pl.prot() == 0 ? 1 : 0;
          bud[static_cast<std::size_t>(hr)] =
              pl.prot() + (cfg.pyramid_exact ? kvref::pyramid_exact(P, pl.cand(), cfg.pyramid_beta, cfg.layer, cfg.num_layers, nullptr, min_c)
                                             : kvref::pyramid_integer(P, pl.cand(), cfg.pyramid_beta, cfg.layer, cfg.num_layers, min_c));
        }
      }
    }
    for (std::int64_t hr = 0; hr < H; ++hr) {
      auto& R = rows[static_cast<std::size_t>(b * H + hr)];
      R.budget = bud[static_cast<std::size_t>(hr)];
      if (critical && !R.scores.empty())
        R.kept = kvref::two_stage_select(R.scores, R.secondary, R.plan.L, R.budget, R.plan.sinks, R.plan.recent,
                                         cfg.first_stage_ratio, cfg.eps, &R.stage1);
      else
        R.kept = kvref::topk_select(R.scores, R.plan.L, R.budget, R.plan.sinks, R.plan.recent);
    }
  }
  return rows;
}

// ------------------------------------------------------------------------------------------
// Library runner
// ------------------------------------------------------------------------------------------

struct lib_result {
  kvevict::status st;
  std::int64_t rows = 0, cap = 0;
  std::vector<std::int32_t> indptr, indices, positions;
  std::vector<float> scores;  ///< (rows, cap)
  std::vector<std::int32_t> kept(std::int64_t r) const {
    return std::vector<std::int32_t>(indices.begin() + indptr[static_cast<std::size_t>(r)],
                                     indices.begin() + indptr[static_cast<std::size_t>(r + 1)]);
  }
  const float* row_scores(std::int64_t r) const { return scores.data() + r * cap; }
};

template <class Policy, class T>
lib_result run_lib(const kvevict::evictor<Policy, kvevict::cpu::backend>& ev, const kvevict::layer_inputs<T>& in,
                   kvevict::budget_request budget) {
  lib_result res;
  res.rows = in.batch() * ev.out_heads(in);
  res.cap = in.capacity();
  const std::int64_t n = ev.max_selected(in, budget);
  res.indptr.assign(static_cast<std::size_t>(res.rows + 1), -7);
  res.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)), -7);
  res.positions.assign(res.indices.size(), -7);
  res.scores.assign(static_cast<std::size_t>(res.rows * res.cap), -7.0f);
  kvevict::selection_view sel{res.indptr.data(), res.indices.data(), res.positions.data(), std::max<std::int64_t>(n, 0)};
  res.st = ev.run(in, budget, sel, res.scores.data());
  return res;
}

/// Compare a library run with the reference rows: budgets, exact counts, protected tokens,
/// ascending order, no NaN/inf, scores (where scored) and selections. Returns "" when all agree,
/// else a description of the first disagreement.
inline std::string compare(const lib_result& lib, const std::vector<ref_row>& ref, double rtol = score_rtol,
                           double atol = score_atol, int* sets_compared = nullptr) {
  if (!lib.st.ok()) return std::string("library failed: ") + lib.st.message();
  if (static_cast<std::int64_t>(ref.size()) != lib.rows) return "row count differs";
  for (std::int64_t r = 0; r < lib.rows; ++r) {
    const auto& R = ref[static_cast<std::size_t>(r)];
    const std::string at = "row " + std::to_string(r) + ": ";
    const auto kept = lib.kept(r);
    for (std::int64_t n = 0; n < lib.cap; ++n)
      if (!std::isfinite(lib.row_scores(r)[n])) return at + "non-finite score at " + std::to_string(n);
    if (static_cast<std::int64_t>(kept.size()) != std::min(R.budget, R.plan.L))
      return at + "kept " + std::to_string(kept.size()) + " != budget " + std::to_string(std::min(R.budget, R.plan.L));
    for (std::size_t i = 1; i < kept.size(); ++i)
      if (kept[i] <= kept[i - 1]) return at + "indices not strictly ascending";
    for (std::size_t i = 0; i < kept.size(); ++i)
      if (lib.positions[static_cast<std::size_t>(lib.indptr[static_cast<std::size_t>(r)]) + i] != kept[i])
        return at + "positions != slots";
    if (R.plan.pass || R.budget >= R.plan.L) {  // nothing to evict (head-wise budgets can reach L)
      if (kept != R.kept) return at + "head with budget >= length does not keep everything in order";
      continue;
    }
    // protected tokens
    for (std::int64_t i = 0; i < R.plan.sinks; ++i)
      if (!std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(i))) return at + "sink lost";
    for (std::int64_t i = R.plan.L - R.plan.recent; i < R.plan.L; ++i)
      if (!std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(i))) return at + "recent token lost";
    if (R.scores.empty()) {
      if (kept != R.kept) return at + "selection differs (no scores)";
      continue;
    }
    const std::int64_t c0 = R.plan.sinks, c1 = R.plan.L - R.plan.recent;
    // fp32 absolute errors scale with the largest score of the row's unprotected-by-recency part
    // (sinks included): e.g. attention weights far below 1e-38 are all 0 (or FLT_MIN) in fp32.
    double row_scale = 0.0;
    for (std::int64_t i = 0; i < c1; ++i) row_scale = std::max(row_scale, std::fabs(R.scores[static_cast<std::size_t>(i)]));
    double worst = 0.0;
    const std::int64_t bad = first_mismatch(lib.row_scores(r), R.scores, c0, c1, rtol, atol, &worst, row_scale);
    if (bad >= 0)
      return at + "score " + std::to_string(bad) + ": lib " + std::to_string(lib.row_scores(r)[bad]) + " ref " +
             std::to_string(R.scores[static_cast<std::size_t>(bad)]) + " (worst err/tol " + std::to_string(worst) + ")";
    std::vector<std::int32_t> lc, rc;
    for (auto i : kept)
      if (i >= c0 && i < c1) lc.push_back(i);
    for (auto i : R.kept)
      if (i >= c0 && i < c1) rc.push_back(i);
    const auto chk = compare_kept_candidates(lc, rc, R.scores, c0, c1, rtol, atol, row_scale);
    if (!chk.ok) return at + chk.why;
    if (sets_compared && chk.compared_as_sets) ++*sets_compared;
  }
  return "";
}

}  // namespace kvtest
