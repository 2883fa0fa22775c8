// Naive, independent fp64 reference implementations of everything kvevict computes.
//
// Plain loops over std::vector<double>; no Eigen, no kvevict backend code (this header includes
// nothing from kvevict). Written from the specs (../shared/spec/restkv.md, baselines.md) and
// the documented rules of the public headers, not from the backend sources. Speed is not a goal:
// use small shapes.
//
// Conventions: a matrix is row-major `mat`; one head's keys/values are L x d (row n = token n),
// window queries are w x d (row j = query of token L - w + j, oldest first). W_O of one query
// head is given as `wo` = C x d with (x W_O^h)[c] = sum_i x[i] * wo(c, i) (the model's
// [out][in] o_proj columns h*d .. h*d+d-1); a null `wo` means value space (identity).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace kvref {

using vec = std::vector<double>;

/// Row-major dense matrix of doubles.
struct mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> a;
  mat() = default;
  mat(std::int64_t r, std::int64_t c, double v = 0.0) : rows(r), cols(c), a(static_cast<std::size_t>(r * c), v) {}
  double& operator()(std::int64_t r, std::int64_t c) { return a[static_cast<std::size_t>(r * cols + c)]; }
  double operator()(std::int64_t r, std::int64_t c) const { return a[static_cast<std::size_t>(r * cols + c)]; }
  const double* row(std::int64_t r) const { return a.data() + r * cols; }
};

// ------------------------------------------------------------------------------------------
// Window attention
// ------------------------------------------------------------------------------------------

/// A (w x L): A[j][n] = softmax_n(q_j . k_n / sqrt(d)) over the visible keys n <= L - w + j
/// (causal mask inside the window block), 0 for masked keys. Max-subtracted, in fp64: small
/// weights keep their relative precision (e^-150 is representable), only 1 - A loses it.
inline mat window_attention(const mat& Q, const mat& K, std::int64_t L, std::int64_t w) {
  const std::int64_t d = K.cols;
  mat A(w, L, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t j = 0; j < w; ++j) {
    const std::int64_t vis = L - w + j + 1;
    vec lg(static_cast<std::size_t>(vis));
    double mx = -std::numeric_limits<double>::infinity();
    for (std::int64_t n = 0; n < vis; ++n) {
      double s = 0.0;
      for (std::int64_t c = 0; c < d; ++c) s += Q(j, c) * K(n, c);
      lg[static_cast<std::size_t>(n)] = s * scale;
      mx = std::max(mx, s * scale);
    }
    double z = 0.0;
    for (std::int64_t n = 0; n < vis; ++n) z += std::exp(lg[static_cast<std::size_t>(n)] - mx);
    for (std::int64_t n = 0; n < vis; ++n) A(j, n) = std::exp(lg[static_cast<std::size_t>(n)] - mx) / z;
  }
  return A;
}

// ------------------------------------------------------------------------------------------
// Temporal weights
// ------------------------------------------------------------------------------------------

enum class temporal_kind { ema, mean, sum, last, reversed_ema };

/// Row weights c_0 .. c_{w-1} (oldest first). EMA closed form from the spec: oldest
/// (1-a)^(w-1), row j >= 1: a (1-a)^(w-1-j). Reversed EMA: newest (1-a)^(w-1), row j <= w-2:
/// a (1-a)^j.
inline vec temporal_weights(temporal_kind k, double alpha, std::int64_t w) {
  vec c(static_cast<std::size_t>(w), 0.0);
  for (std::int64_t j = 0; j < w; ++j) {
    double v = 0.0;
    switch (k) {
      case temporal_kind::ema:
        v = j == 0 ? std::pow(1.0 - alpha, static_cast<double>(w - 1)) : alpha * std::pow(1.0 - alpha, static_cast<double>(w - 1 - j));
        break;
      case temporal_kind::reversed_ema:
        v = j == w - 1 ? std::pow(1.0 - alpha, static_cast<double>(w - 1)) : alpha * std::pow(1.0 - alpha, static_cast<double>(j));
        break;
      case temporal_kind::mean: v = 1.0 / static_cast<double>(w); break;
      case temporal_kind::sum: v = 1.0; break;
      case temporal_kind::last: v = j == w - 1 ? 1.0 : 0.0; break;
    }
    c[static_cast<std::size_t>(j)] = v;
  }
  return c;
}

/// The recursive EMA accumulator over the rows of X (oldest first): acc = x_0;
/// acc = alpha x_j + (1 - alpha) acc.
inline vec ema_recursive(const mat& X, double alpha) {
  vec acc(X.row(0), X.row(0) + X.cols);
  for (std::int64_t j = 1; j < X.rows; ++j)
    for (std::int64_t n = 0; n < X.cols; ++n) acc[static_cast<std::size_t>(n)] = alpha * X(j, n) + (1.0 - alpha) * acc[static_cast<std::size_t>(n)];
  return acc;
}

/// sum_j c_j X[j][n].
inline vec weighted_rows(const mat& X, const vec& c) {
  vec s(static_cast<std::size_t>(X.cols), 0.0);
  for (std::int64_t j = 0; j < X.rows; ++j)
    for (std::int64_t n = 0; n < X.cols; ++n) s[static_cast<std::size_t>(n)] += c[static_cast<std::size_t>(j)] * X(j, n);
  return s;
}

// ------------------------------------------------------------------------------------------
// Scores
// ------------------------------------------------------------------------------------------

/// Attention-weight score (SnapKV): a[n] = sum_j c_j A[j][n].
inline vec attention_weight_score(const mat& A, const vec& c) { return weighted_rows(A, c); }

/// Accumulated attention (H2O): column sums of the attention of the w given query rows
/// (w = L: the full causal mask, row i sees keys 0..i). normalize: divide column n by the
/// number of rows that see it.
inline vec accumulated_attention(const mat& Q, const mat& K, std::int64_t L, bool normalize) {
  const std::int64_t w = Q.rows;
  const mat A = window_attention(Q, K, L, w);
  vec s(static_cast<std::size_t>(L), 0.0);
  for (std::int64_t n = 0; n < L; ++n) {
    std::int64_t cnt = 0;
    for (std::int64_t j = 0; j < w; ++j) {
      s[static_cast<std::size_t>(n)] += A(j, n);
      if (n <= L - w + j) ++cnt;
    }
    if (normalize) s[static_cast<std::size_t>(n)] = cnt > 0 ? s[static_cast<std::size_t>(n)] / static_cast<double>(cnt) : 0.0;
  }
  return s;
}

/// Last-query score (TOVA): the newest window row.
inline vec last_query_score(const mat& A) { return vec(A.row(A.rows - 1), A.row(A.rows - 1) + A.cols); }

/// Key-norm score: -||k_n||.
inline vec key_norm_score(const mat& K, std::int64_t L) {
  vec s(static_cast<std::size_t>(L));
  for (std::int64_t n = 0; n < L; ++n) {
    double a = 0.0;
    for (std::int64_t c = 0; c < K.cols; ++c) a += K(n, c) * K(n, c);
    s[static_cast<std::size_t>(n)] = -std::sqrt(a);
  }
  return s;
}

/// ||x W_O^h||_2 the straightforward way: project x (d) to the hidden size C with wo (C x d);
/// wo == nullptr: ||x|| (value space).
inline double proj_norm(const double* x, std::int64_t d, const mat* wo) {
  double s = 0.0;
  if (!wo) {
    for (std::int64_t i = 0; i < d; ++i) s += x[i] * x[i];
    return std::sqrt(s);
  }
  for (std::int64_t c = 0; c < wo->rows; ++c) {
    double y = 0.0;
    for (std::int64_t i = 0; i < d; ++i) y += x[i] * (*wo)(c, i);
    s += y * y;
  }
  return std::sqrt(s);
}

/// x W_O^h (C values; or x itself in value space).
inline vec project(const double* x, std::int64_t d, const mat* wo) {
  if (!wo) return vec(x, x + d);
  vec y(static_cast<std::size_t>(wo->rows), 0.0);
  for (std::int64_t c = 0; c < wo->rows; ++c)
    for (std::int64_t i = 0; i < d; ++i) y[static_cast<std::size_t>(c)] += x[i] * (*wo)(c, i);
  return y;
}

/// ||x W_O^h||_1 by the straightforward projection to the hidden size (CriticalKV's value term):
/// sum over c < C of |sum_i x[i] wo(c, i)|; wo is C x d.
inline double proj_l1_norm(const double* x, std::int64_t d, const mat& wo) {
  double s = 0.0;
  for (std::int64_t c = 0; c < wo.rows; ++c) {
    double y = 0.0;
    for (std::int64_t i = 0; i < d; ++i) y += x[i] * wo(c, i);
    s += std::fabs(y);
  }
  return s;
}

/// How the reconstruction references evaluate the odds times the distance.
///  - straightforward: a/(1-a) * ||z W_O - v_n W_O||, both projected to the hidden size (the
///    reference code's way; loses everything when a rounds to 1);
///  - exact: the same quantity without cancellation, from the OTHER tokens' weights:
///    1 - a_n = sum_{m != n} a_m and z - a_n v_n = sum_{m != n} a_m v_m are formed by prefix +
///    suffix sums (no subtraction), then a/(1-a) ||W((z - a v_n) - (1 - a) v_n)||. Equal to
///    a * ||W (z_{-n} - v_n)|| (spec "Numerics") and valid for any weight. Requires sum c = 1.
enum class lor_eval { straightforward, exact };

namespace detail {
/// For weights a[0, L) and vectors V (rows), with "in z" flags zin[m]: other[n] = sum_{m != n}
/// a_m (all m) and num[n] = sum_{m != n, zin[m]} a_m v_m, each without subtraction.
inline void others(const vec& a, const mat& V, const std::vector<char>& zin, vec* other, mat* num) {
  const std::int64_t L = static_cast<std::int64_t>(a.size()), d = V.cols;
  *other = vec(a.size(), 0.0);
  *num = mat(L, d, 0.0);
  vec pa(a.size() + 1, 0.0), sa(a.size() + 1, 0.0);
  mat pv(L + 1, d, 0.0), sv(L + 1, d, 0.0);
  for (std::int64_t n = 0; n < L; ++n) {
    pa[static_cast<std::size_t>(n + 1)] = pa[static_cast<std::size_t>(n)] + a[static_cast<std::size_t>(n)];
    for (std::int64_t c = 0; c < d; ++c)
      pv(n + 1, c) = pv(n, c) + (zin[static_cast<std::size_t>(n)] ? a[static_cast<std::size_t>(n)] * V(n, c) : 0.0);
  }
  for (std::int64_t n = L - 1; n >= 0; --n) {
    sa[static_cast<std::size_t>(n)] = sa[static_cast<std::size_t>(n + 1)] + a[static_cast<std::size_t>(n)];
    for (std::int64_t c = 0; c < d; ++c)
      sv(n, c) = sv(n + 1, c) + (zin[static_cast<std::size_t>(n)] ? a[static_cast<std::size_t>(n)] * V(n, c) : 0.0);
  }
  for (std::int64_t n = 0; n < L; ++n) {
    (*other)[static_cast<std::size_t>(n)] = pa[static_cast<std::size_t>(n)] + sa[static_cast<std::size_t>(n + 1)];
    for (std::int64_t c = 0; c < d; ++c) (*num)(n, c) = pv(n, c) + sv(n + 1, c);
  }
}

/// s[n] = a_n / (1 - a_n) * ||W (z - v_n)||^tau for one weight row a (sum a = 1 for exact),
/// z = sum_{zin} a_m v_m.
inline vec reconstruction_row(const vec& a, const mat& V, const std::vector<char>& zin, const mat* wo, double tau,
                              lor_eval ev) {
  const std::int64_t L = static_cast<std::int64_t>(a.size()), d = V.cols;
  vec s(a.size(), 0.0);
  if (ev == lor_eval::straightforward) {
    vec z(static_cast<std::size_t>(d), 0.0);
    for (std::int64_t m = 0; m < L; ++m)
      if (zin[static_cast<std::size_t>(m)])
        for (std::int64_t c = 0; c < d; ++c) z[static_cast<std::size_t>(c)] += a[static_cast<std::size_t>(m)] * V(m, c);
    const vec zw = project(z.data(), d, wo);
    for (std::int64_t n = 0; n < L; ++n) {
      const double an = a[static_cast<std::size_t>(n)];
      if (an <= 0.0) continue;
      const vec vw = project(V.row(n), d, wo);
      double dd = 0.0;
      for (std::size_t c = 0; c < zw.size(); ++c) dd += (zw[c] - vw[c]) * (zw[c] - vw[c]);
      s[static_cast<std::size_t>(n)] = an / (1.0 - an) * std::pow(std::sqrt(dd), tau);
    }
    return s;
  }
  vec other;
  mat num;
  others(a, V, zin, &other, &num);
  vec x(static_cast<std::size_t>(d));
  for (std::int64_t n = 0; n < L; ++n) {
    const double an = a[static_cast<std::size_t>(n)], om = other[static_cast<std::size_t>(n)];
    if (an <= 0.0 || om <= 0.0) continue;
    // z - v_n = (z without n) + (zin[n] ? a_n v_n : 0) - v_n; with a_n = 1 - om when v_n is in z.
    for (std::int64_t c = 0; c < d; ++c)
      x[static_cast<std::size_t>(c)] = zin[static_cast<std::size_t>(n)] ? num(n, c) - om * V(n, c) : num(n, c) - V(n, c);
    s[static_cast<std::size_t>(n)] = an / om * std::pow(proj_norm(x.data(), d, wo), tau);
  }
  return s;
}
}  // namespace detail

/// Output-reconstruction score, "after" mode (the published configuration):
/// a_bar = sum_j c_j A[j]; z_bar = sum_{n < zlim} a_bar[n] v_n, zlim = L - w (or L with
/// include_window); s[n] = a_bar/(1 - a_bar) * ||W_O (z_bar - v_n)||^tau.
inline vec lor_after(const mat& A, const vec& c, const mat& V, std::int64_t L, std::int64_t w, const mat* wo,
                     bool include_window, double tau, lor_eval ev) {
  const vec abar = weighted_rows(A, c);
  std::vector<char> zin(static_cast<std::size_t>(L), 0);
  const std::int64_t zlim = include_window ? L : L - w;
  for (std::int64_t n = 0; n < zlim; ++n) zin[static_cast<std::size_t>(n)] = 1;
  mat Vl(L, V.cols);
  for (std::int64_t n = 0; n < L; ++n)
    for (std::int64_t k = 0; k < V.cols; ++k) Vl(n, k) = V(n, k);
  return detail::reconstruction_row(abar, Vl, zin, wo, tau, ev);
}

/// Output-reconstruction score, "before" mode (the paper's equation): per window row j,
/// z_j = A[j] V over its visible keys, S[j][n] = A/(1-A) ||W_O (z_j - v_n)||^tau, then
/// s[n] = sum_j c_j S[j][n].
inline vec lor_before(const mat& A, const vec& c, const mat& V, std::int64_t L, const mat* wo, double tau, lor_eval ev) {
  vec s(static_cast<std::size_t>(L), 0.0);
  mat Vl(L, V.cols);
  for (std::int64_t n = 0; n < L; ++n)
    for (std::int64_t k = 0; k < V.cols; ++k) Vl(n, k) = V(n, k);
  const std::vector<char> zin(static_cast<std::size_t>(L), 1);
  for (std::int64_t j = 0; j < A.rows; ++j) {
    if (c[static_cast<std::size_t>(j)] == 0.0) continue;
    const vec row(A.row(j), A.row(j) + L);
    const vec sj = detail::reconstruction_row(row, Vl, zin, wo, tau, ev);
    for (std::int64_t n = 0; n < L; ++n) s[static_cast<std::size_t>(n)] += c[static_cast<std::size_t>(j)] * sj[static_cast<std::size_t>(n)];
  }
  return s;
}

/// BRUTE FORCE for one query: attention row a over keys [0, L) (summing to 1), remove token n,
/// renormalise the rest, recompute z' W_O and return ||z W_O - z' W_O||. Equals Eq. 7 exactly.
inline double brute_force_removal(const vec& a, const mat& V, const mat* wo, std::int64_t n) {
  const std::int64_t L = static_cast<std::int64_t>(a.size()), d = V.cols;
  vec z(static_cast<std::size_t>(d), 0.0), z2(static_cast<std::size_t>(d), 0.0);
  double rest = 0.0;
  for (std::int64_t m = 0; m < L; ++m)
    if (m != n) rest += a[static_cast<std::size_t>(m)];
  for (std::int64_t m = 0; m < L; ++m)
    for (std::int64_t k = 0; k < d; ++k) {
      z[static_cast<std::size_t>(k)] += a[static_cast<std::size_t>(m)] * V(m, k);
      if (m != n) z2[static_cast<std::size_t>(k)] += a[static_cast<std::size_t>(m)] / rest * V(m, k);
    }
  const vec y = project(z.data(), d, wo), y2 = project(z2.data(), d, wo);
  double s = 0.0;
  for (std::size_t k = 0; k < y.size(); ++k) s += (y[k] - y2[k]) * (y[k] - y2[k]);
  return std::sqrt(s);
}

// ------------------------------------------------------------------------------------------
// GQA reductions
// ------------------------------------------------------------------------------------------

enum class gqa_kind { mean, max, per_query_head, layer_mean };

/// Reduce G rows (equal length) by mean or max.
inline vec reduce_rows(const std::vector<vec>& rows, gqa_kind k) {
  vec o = rows[0];
  for (std::size_t g = 1; g < rows.size(); ++g)
    for (std::size_t n = 0; n < o.size(); ++n) o[n] = k == gqa_kind::max ? std::max(o[n], rows[g][n]) : o[n] + rows[g][n];
  if (k != gqa_kind::max)
    for (double& x : o) x /= static_cast<double>(rows.size());
  return o;
}

// ------------------------------------------------------------------------------------------
// Spatial smoothing
// ------------------------------------------------------------------------------------------

/// Centred average pool of odd width k, zero padding counted in the mean.
inline vec avg_pool(const vec& x, std::int64_t k) {
  const std::int64_t N = static_cast<std::int64_t>(x.size());
  vec y(x.size(), 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    double s = 0.0;
    for (std::int64_t j = i - k / 2; j <= i + k / 2; ++j)
      if (j >= 0 && j < N) s += x[static_cast<std::size_t>(j)];
    y[static_cast<std::size_t>(i)] = s / static_cast<double>(k);
  }
  return y;
}

/// Centred max pool of odd width k, -inf padding.
inline vec max_pool(const vec& x, std::int64_t k) {
  const std::int64_t N = static_cast<std::int64_t>(x.size());
  vec y(x.size(), 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = i - k / 2; j <= i + k / 2; ++j)
      if (j >= 0 && j < N) m = std::max(m, x[static_cast<std::size_t>(j)]);
    y[static_cast<std::size_t>(i)] = m;
  }
  return y;
}

/// Adaptive-window kernel and shift for drift t (spec section 3, steps 2-3). reference_exact:
/// the reference code's floor division (t = 0 -> s = +1, t = -m beta -> -m + 1); otherwise s
/// truncates toward zero. |s| <= k / 2.
inline void aws_kernel_shift(double t, double beta, std::int64_t k_min, bool reference_exact, std::int64_t* k,
                             std::int64_t* s) {
  const std::int64_t m = static_cast<std::int64_t>(std::floor(std::fabs(t) / beta));
  std::int64_t kk = std::max<std::int64_t>(k_min, 2 * m + 1);
  std::int64_t ss;
  if (reference_exact) {
    // Python: s = t // beta if t > 0 else t // beta + 1
    const std::int64_t fl = static_cast<std::int64_t>(std::floor(t / beta));
    ss = t > 0 ? fl : fl + 1;
  } else {
    ss = static_cast<std::int64_t>(std::trunc(t / beta));
  }
  ss = std::min(ss, kk / 2);
  ss = std::max(ss, -(kk / 2));
  *k = kk;
  *s = ss;
}

/// y[i] = (1/k) sum_{j = i - k/2 + s}^{i + k/2 + s} x[clamp(j, 0, N-1)] (replicate padding).
inline vec aws_smooth(const vec& x, std::int64_t k, std::int64_t s) {
  const std::int64_t N = static_cast<std::int64_t>(x.size());
  vec y(x.size(), 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    double a = 0.0;
    for (std::int64_t j = i - k / 2 + s; j <= i + k / 2 + s; ++j) a += x[static_cast<std::size_t>(std::min(std::max<std::int64_t>(j, 0), N - 1))];
    y[static_cast<std::size_t>(i)] = a / static_cast<double>(k);
  }
  return y;
}

/// Indices of the top-K entries of p[0, n) (value desc, ties to the lower index), by full sort.
inline std::vector<std::int64_t> topk_indices(const double* p, std::int64_t n, std::int64_t K) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [p](std::int64_t a, std::int64_t b) { return p[a] > p[b]; });
  idx.resize(static_cast<std::size_t>(std::min(K, n)));
  return idx;
}

/// Drift t = D_front - D_rear: for each window row, the mean index of its top K attention
/// weights over all L columns; D_front averages rows 0 .. w/2-1, D_rear rows w/2 .. w-1.
inline double attention_drift(const mat& A, std::int64_t K) {
  const std::int64_t w = A.rows;
  double f = 0.0, r = 0.0;
  std::int64_t nf = 0, nr = 0;
  for (std::int64_t j = 0; j < w; ++j) {
    const auto idx = topk_indices(A.row(j), A.cols, K);
    double m = 0.0;
    for (auto i : idx) m += static_cast<double>(i);
    m /= static_cast<double>(idx.size());
    if (j < w / 2) {
      f += m;
      ++nf;
    } else {
      r += m;
      ++nr;
    }
  }
  return (nf > 0 && nr > 0) ? f / static_cast<double>(nf) - r / static_cast<double>(nr) : 0.0;
}

// ------------------------------------------------------------------------------------------
// Budgets
// ------------------------------------------------------------------------------------------

/// Largest remainder: floor(share) (capped), then one unit each to the largest fractional parts
/// (ties: lower index), skipping heads at their cap, cycling until the total is reached.
inline std::vector<std::int64_t> largest_remainder(const vec& share, const std::vector<std::int64_t>* cap,
                                                   std::int64_t total) {
  const std::size_t n = share.size();
  std::vector<std::int64_t> out(n, 0);
  std::int64_t sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::int64_t f = static_cast<std::int64_t>(std::floor(std::max(0.0, share[i])));
    if (cap) f = std::min(f, (*cap)[i]);
    out[i] = f;
    sum += f;
  }
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return share[a] - std::floor(share[a]) > share[b] - std::floor(share[b]);
  });
  bool progress = true;
  while (sum < total && progress) {
    progress = false;
    for (std::size_t i : order) {
      if (sum >= total) break;
      if (cap && out[i] >= (*cap)[i]) continue;
      ++out[i];
      ++sum;
      progress = true;
    }
  }
  return out;
}

/// PyramidKV candidates of layer l (P = B - protected, C = L - protected), PyramidKV's integer
/// code: min = P // beta; max = 2P - min; if max >= C: max = C, min = 2P - max;
/// step = (max - min) // (n - 1); keep max - l * step. min_c (1 for a head with nothing
/// protected, kvevict's rule) raises min before max is derived.
inline std::int64_t pyramid_integer(std::int64_t P, std::int64_t C, double beta, std::int64_t layer, std::int64_t n,
                                    std::int64_t min_c = 0) {
  if (n <= 1) return std::min(P, C);
  std::int64_t mn = std::max(min_c, static_cast<std::int64_t>(std::floor(static_cast<double>(P) / beta)));
  std::int64_t mx = 2 * P - mn;
  if (mx >= C) {
    mx = C;
    mn = 2 * P - mx;
  }
  const std::int64_t step = (mx - mn) / (n - 1);
  return std::min(C, std::max<std::int64_t>(0, mx - layer * step));
}

/// Exact-total pyramid: the real schedule max - l (max - min)/(n-1) over all n layers, rounded by
/// largest remainder (ties to the lower layer) to sum exactly n * P. Integer arithmetic: share_l
/// = num_l / (n-1) with num_l = max (n-1) - l (max - min), so fractional parts compare exactly.
/// rem (optional) receives num_l mod (n-1) per layer (the exact fractional parts times n-1).
inline std::int64_t pyramid_exact(std::int64_t P, std::int64_t C, double beta, std::int64_t layer, std::int64_t n,
                                  std::vector<std::int64_t>* rem = nullptr, std::int64_t min_c = 0) {
  if (n <= 1) return std::min(P, C);
  std::int64_t mn = std::max(min_c, static_cast<std::int64_t>(std::floor(static_cast<double>(P) / beta)));
  std::int64_t mx = 2 * P - mn;
  if (mx >= C) {
    mx = C;
    mn = 2 * P - mx;
  }
  const std::int64_t den = n - 1;
  std::vector<std::int64_t> out(static_cast<std::size_t>(n)), rm(static_cast<std::size_t>(n));
  std::int64_t sum = 0;
  for (std::int64_t l = 0; l < n; ++l) {
    const std::int64_t num = mx * den - l * (mx - mn);
    out[static_cast<std::size_t>(l)] = num / den;
    rm[static_cast<std::size_t>(l)] = num % den;
    sum += num / den;
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return rm[static_cast<std::size_t>(a)] > rm[static_cast<std::size_t>(b)]; });
  for (std::size_t i = 0; sum < n * P && i < order.size(); ++i, ++sum) ++out[static_cast<std::size_t>(order[i])];
  if (rem) *rem = rm;
  return std::min(C, std::max<std::int64_t>(0, out[static_cast<std::size_t>(layer)]));
}

/// One head as the budget and selection references see it.
struct head_plan {
  std::int64_t L = 0, base = 0, sinks = 0, recent = 0;
  bool pass = false;
  std::int64_t prot() const { return sinks + recent; }
  std::int64_t cand() const { return L - sinks - recent; }
};

/// The documented plan rule (core/selection.hpp, selectors.hpp): base B = keep_tokens, or
/// floor(f L) raised to num_sink + fixed recent (capped at L) and to 1; L <= B: pass-through;
/// sinks = min(num_sink, L); recent = floor(recent_share (B - num_sink)) if recent_share >= 0,
/// else num_recent if >= 0, else the window W; capped at L - sinks.
inline head_plan plan(std::int64_t L, std::int64_t keep_tokens, double keep_fraction, std::int64_t num_sink,
                      std::int64_t num_recent, double recent_share, std::int64_t W) {
  head_plan h;
  h.L = L;
  const std::int64_t fixed_recent = recent_share >= 0 ? 0 : (num_recent >= 0 ? num_recent : W);
  if (keep_tokens > 0) {
    h.base = keep_tokens;
  } else {
    h.base = static_cast<std::int64_t>(std::floor(keep_fraction * static_cast<double>(L)));
    h.base = std::max(h.base, std::min(num_sink + fixed_recent, L));
    h.base = std::max<std::int64_t>(h.base, 1);
  }
  if (L <= h.base) {
    h.pass = true;
    return h;
  }
  h.sinks = std::min(num_sink, L);
  std::int64_t r;
  if (recent_share >= 0) {
    const std::int64_t free = h.base - num_sink;
    r = free > 0 ? static_cast<std::int64_t>(std::floor(recent_share * static_cast<double>(free))) : 0;
  } else {
    r = num_recent >= 0 ? num_recent : W;
  }
  h.recent = std::min(r, L - h.sinks);
  return h;
}

/// AdaKV budgets for the heads of one sequence (see budgeters::adakv): T = sum (B_h - prot_h)
/// over evicting heads; top-T candidate scores over all heads (NaN lowest, ties: lower head then
/// lower index); share_h = (1 - alpha) winners_h + alpha (B_h - prot_h); largest remainder to T
/// with cap = candidates; budget = prot + extra. Pass-through heads keep L. A head with nothing
/// protected is never emptied (it takes 1 token from the head with the largest surplus).
/// exact_total = false: the reference code's per-head rounding instead of the largest remainder.
inline std::vector<std::int64_t> adakv_budgets(const std::vector<head_plan>& plans, const std::vector<vec>& scores,
                                               double alpha, bool exact_total = true) {
  struct c {
    double s;
    std::int64_t h, i;
  };
  std::vector<c> all;
  std::int64_t T = 0;
  const std::size_t H = plans.size();
  std::vector<std::int64_t> cap(H, 0);
  for (std::size_t h = 0; h < H; ++h) {
    const auto& p = plans[h];
    if (p.pass) continue;
    T += p.base - p.prot();
    cap[h] = p.cand();
    for (std::int64_t i = p.sinks; i < p.L - p.recent; ++i) all.push_back({scores[h][static_cast<std::size_t>(i)], static_cast<std::int64_t>(h), i});
  }
  T = std::min<std::int64_t>(T, static_cast<std::int64_t>(all.size()));
  std::stable_sort(all.begin(), all.end(), [](const c& a, const c& b) {
    const bool na = std::isnan(a.s), nb = std::isnan(b.s);
    if (na != nb) return nb;
    if (!na && a.s != b.s) return a.s > b.s;
    return a.h != b.h ? a.h < b.h : a.i < b.i;
  });
  std::vector<std::int64_t> win(H, 0);
  for (std::int64_t t = 0; t < T; ++t) ++win[static_cast<std::size_t>(all[static_cast<std::size_t>(t)].h)];
  vec share(H, 0.0);
  for (std::size_t h = 0; h < H; ++h)
    if (!plans[h].pass) share[h] = (1.0 - alpha) * static_cast<double>(win[h]) + alpha * static_cast<double>(plans[h].base - plans[h].prot());
  std::vector<std::int64_t> extra;
  if (exact_total) {
    extra = largest_remainder(share, &cap, T);
  } else {
    // exact_total = false, the authors' rule (AdaKV/adaptive_snapkv, AdaptiveSnapKVCluster.update_kv):
    // torch.round(c_h * (1 - floor_alpha) + int((B - w) * floor_alpha)) on a float32 tensor (half to even),
    // each head on its own, at most the head's candidates (its sorted score list)
    extra.assign(H, 0);
    for (std::size_t h = 0; h < H; ++h) {
      if (plans[h].pass) continue;
      const double a = std::round(alpha * 1e6) / 1e6;  // the Python double the float alpha was written as
      const auto F = static_cast<std::int64_t>(std::floor(a * static_cast<double>(plans[h].base - plans[h].prot())));
      const float prod = static_cast<float>(win[h]) * static_cast<float>(1.0 - a);
      const float x = prod + static_cast<float>(F);
      extra[h] = std::max<std::int64_t>(0, std::min<std::int64_t>(cap[h], static_cast<std::int64_t>(std::nearbyint(x))));
    }
  }
  // Floor: an evicting head with nothing protected and extra 0 takes 1 from the head whose
  // extra exceeds its own floor the most (first such head on ties), heads in order.
  auto floor1 = [&](std::size_t h) -> std::int64_t { return !plans[h].pass && plans[h].prot() == 0 && plans[h].cand() > 0; };
  for (std::size_t h = 0; h < H; ++h) {
    if (!floor1(h) || extra[h] != 0) continue;
    if (!exact_total) {  // no total to keep: the head takes its token
      extra[h] = 1;
      continue;
    }
    std::vector<std::int64_t> surplus(H);
    for (std::size_t j = 0; j < H; ++j) surplus[j] = extra[j] - floor1(j);
    const std::size_t donor = static_cast<std::size_t>(std::max_element(surplus.begin(), surplus.end()) - surplus.begin());
    if (surplus[donor] <= 0) throw std::logic_error("adakv_budgets: no donor");
    --extra[donor];
    ++extra[h];
  }
  std::vector<std::int64_t> out(H);
  for (std::size_t h = 0; h < H; ++h) out[h] = plans[h].pass ? plans[h].L : plans[h].prot() + extra[h];
  return out;
}

// ------------------------------------------------------------------------------------------
// Selector
// ------------------------------------------------------------------------------------------

/// Top-k with protected tokens: L <= budget keeps everything; else sinks [0, sinks) and recent
/// [L - recent, L) by rule, and budget - sinks - recent of the candidates [sinks, L - recent)
/// by score (desc, NaN below every number, ties to the lower index). Ascending output.
inline std::vector<std::int32_t> topk_select(const vec& scores, std::int64_t L, std::int64_t budget,
                                             std::int64_t sinks, std::int64_t recent) {
  std::vector<std::int32_t> out;
  if (budget >= L) {
    for (std::int64_t i = 0; i < L; ++i) out.push_back(static_cast<std::int32_t>(i));
    return out;
  }
  const std::int64_t c0 = sinks, c1 = L - recent;
  std::int64_t k = std::max<std::int64_t>(0, std::min(budget - sinks - recent, c1 - c0));
  std::vector<std::int64_t> cand;
  for (std::int64_t i = c0; i < c1; ++i) cand.push_back(i);
  std::stable_sort(cand.begin(), cand.end(), [&](std::int64_t a, std::int64_t b) {
    const double sa = scores[static_cast<std::size_t>(a)], sb = scores[static_cast<std::size_t>(b)];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;
    if (na) return false;
    return sa > sb;
  });
  for (std::int64_t i = 0; i < c0; ++i) out.push_back(static_cast<std::int32_t>(i));
  for (std::int64_t i = 0; i < k; ++i) out.push_back(static_cast<std::int32_t>(cand[static_cast<std::size_t>(i)]));
  for (std::int64_t i = c1; i < L; ++i) out.push_back(static_cast<std::int32_t>(i));
  std::sort(out.begin(), out.end());
  return out;
}

/// CriticalKV's two-stage selection (spec baselines.md; docs/criticalkv.md), written from the
/// documented rule: L <= budget keeps everything; else sinks and recent by rule; of the
/// k = min(budget - sinks - recent, candidates) candidate slots, k1 = floor(ratio * k) by a
/// (desc, ties to the lower index) and the other k - k1, among the candidates not taken by stage
/// 1, by (a + eps) * u (desc, ties to the lower index). Ascending output. `stage1` (optional)
/// receives the stage-1 slots ascending. Full sorts (std::stable_sort) instead of selection.
inline std::vector<std::int32_t> two_stage_select(const vec& a, const vec& u, std::int64_t L, std::int64_t budget,
                                                  std::int64_t sinks, std::int64_t recent, double ratio, double eps,
                                                  std::vector<std::int32_t>* stage1 = nullptr) {
  std::vector<std::int32_t> out;
  if (stage1) stage1->clear();
  if (budget >= L) {
    for (std::int64_t i = 0; i < L; ++i) out.push_back(static_cast<std::int32_t>(i));
    return out;
  }
  const std::int64_t c0 = sinks, c1 = L - recent;
  const std::int64_t k = std::max<std::int64_t>(0, std::min(budget - sinks - recent, c1 - c0));
  const std::int64_t k1 = static_cast<std::int64_t>(std::floor(ratio * static_cast<double>(k)));
  std::vector<std::int64_t> cand;
  for (std::int64_t i = c0; i < c1; ++i) cand.push_back(i);
  std::stable_sort(cand.begin(), cand.end(), [&](std::int64_t x, std::int64_t y) {
    return a[static_cast<std::size_t>(x)] > a[static_cast<std::size_t>(y)];
  });
  std::vector<char> taken(static_cast<std::size_t>(L), 0);
  for (std::int64_t i = 0; i < k1; ++i) {
    taken[static_cast<std::size_t>(cand[static_cast<std::size_t>(i)])] = 1;
    if (stage1) stage1->push_back(static_cast<std::int32_t>(cand[static_cast<std::size_t>(i)]));
  }
  std::vector<std::int64_t> rest;
  for (std::int64_t i = c0; i < c1; ++i)
    if (!taken[static_cast<std::size_t>(i)]) rest.push_back(i);
  auto crit = [&](std::int64_t x) { return (a[static_cast<std::size_t>(x)] + eps) * u[static_cast<std::size_t>(x)]; };
  std::stable_sort(rest.begin(), rest.end(), [&](std::int64_t x, std::int64_t y) { return crit(x) > crit(y); });
  for (std::int64_t i = 0; i < k - k1; ++i) taken[static_cast<std::size_t>(rest[static_cast<std::size_t>(i)])] = 1;
  for (std::int64_t i = 0; i < L; ++i)
    if (i < c0 || i >= c1 || taken[static_cast<std::size_t>(i)]) out.push_back(static_cast<std::int32_t>(i));
  if (stage1) std::sort(stage1->begin(), stage1->end());
  return out;
}

}  // namespace kvref
