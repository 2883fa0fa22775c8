// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::output_reconstruction (ReST-KV, An et al., ICLR 2026, Eq. 7):
// s[n] = a[n] / (1 - a[n]) * ||R_h (z - v_n)||^tau on the shared window loop (window_scorer).
//  - "after" mode (published): the loop accumulates a_bar; then z of every head of the group in
//    one pass over V, the value projections Y = V [R_1 .. R_G]^T tile by tile (one GEMM per tile,
//    the tile stays in L2) and the distances (phase 2), and the exact limit of dominant tokens,
//    a_bar > 15/16, recomputed from their head's attention rows (phase 3);
//  - "before" mode (the paper's equation): per window row, inside the loop (on_block), with the
//    value projections of all L tokens held at once (full_projection).
// Values are rescaled by a power of two into a safe range (docs/restkv.md "Numerics").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/backends/cpu/gemm.hpp"
#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::output_reconstruction> : detail::window_scorer<scorer_impl<scorers::output_reconstruction>>,
                                                     detail::window_hooks {
  /// The temporal weights enter the distances and the exact limit (st_c): linear smoothers only.
  static constexpr bool linear_temporal_only = true;
  using params = scorers::output_reconstruction::params;

  /// "before" mode holds the value projections of every token (head_scratch::carve full_y).
  static bool full_projection(const params& p) { return p.aggregation == scorers::output_reconstruction::mode::before; }

  template <class Ctx>
  static void prepare(Ctx& c, detail::head_scratch& s) {
    using namespace detail;
    const auto& in = c.in;
    const auto& P = c.P;
    const std::int64_t L = c.L, d = c.d, G = c.G, w = c.w, h = c.h;
    // The reconstruction score needs a = a convex combination of attention rows (odds a/(1-a),
    // exact limit): normalise the weights (temporal::sum then ranks like temporal::mean).
    double csum = 0.0;
    for (std::int64_t j = 0; j < w; ++j) csum += s.st_c[j];
    if (csum > 0.0)
      for (std::int64_t j = 0; j < w; ++j) s.st_c[j] = static_cast<float>(s.st_c[j] / csum);

    // Values, scaled by a power of two into a safe range (vscale: 2^e in fp64: for max |v| in
    // [2^127, FLT_MAX] 2^128 is inf in fp32). "after" mode reads them tile by tile through
    // c.vsrc (rescaled as they are staged); "before" mode stages all L of them (c.V).
    c.before = P.scorer.aggregation == scorers::output_reconstruction::mode::before;
    const float vmax = max_abs_rows(c.vsrc, L);
    if (vmax > 0.0f && (vmax > 0x1p32f || vmax < 0x1p-32f)) {
      int e;
      std::frexp(vmax, &e);
      c.vscale = std::ldexp(1.0, e);
      c.vsrc.scale_exp = e;
    }
    if (c.before) new (&c.V) cmap_rm(c.vsrc.rows(0, L, s.vbuf));
    c.tau = P.scorer.tau;
    c.out_scale = std::pow(c.vscale, static_cast<double>(c.tau));

    // Value projections of the whole GQA group in one GEMM: Y_all = V [R_1; ..; R_G]^T, an
    // L x (G d) matrix whose columns [g d, g d + d) are Y_g = V R_g^T (V is packed once, not G
    // times). In value space Y = V for every head.
    // "before" mode holds them for all L tokens (y_stride = G d; value space: Y = V itself);
    // "after" mode computes them tile by tile after the loop over the group's heads.
    c.use_r = P.scorer.use_wo;
    if (P.scorer.use_wo) {
      c.rcat.resize(G * d, d);
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t r = 0; r < d; ++r)
          for (std::int64_t k = 0; k < d; ++k) c.rcat(g * d + r, k) = in.wo_factor(h * G + g, r, k);
      c.y_stride = G * d;
      if (c.before) {
        map_rm Yall(s.ybuf, L, G * d, Eigen::OuterStride<>(G * d));
        gemm_nt(1.0f, c.V, c.rcat, Yall);
      }
    } else if (c.before) {
      c.y_base = c.V.data();
      c.y_stride = c.V.outerStride();
    }
  }

  /// "before" mode, rows [j0, j0 + rb) of head g: z_j = A_j V, RZ_j = R z_j;
  /// dist^2 = |RZ_j|^2 - 2 RZ_j . Y_n + |Y_n|^2, Y = V R^T (columns [g d, g d + d) of the group's
  /// projections; V itself in value space).
  template <class Ctx>
  static void on_block(Ctx& c, detail::head_scratch& s, std::int64_t g, std::int64_t j0, std::int64_t rb, const float* pg,
                       const float* lgg, const detail::row_stats& st, const detail::cmap_rm& Pb, float* out) {
    using namespace detail;
    if (!c.before) return;
    const std::int64_t L = c.L, d = c.d, w = c.w;
    const float tau = c.tau;
    const bool use_r = c.use_r;
    const cmap_rm& V = c.V;
    cmap_rm Y(c.y_base + (use_r ? g * d : 0), L, d, Eigen::OuterStride<>(c.y_stride));
    const Eigen::VectorXf ynorm2 = Y.rowwise().squaredNorm();
    mat_rm Zb = Pb * V;
    mat_rm RZ = use_r ? mat_rm(Zb * c.rcat.middleRows(g * d, d).transpose()) : Zb;
    map_rm cross(s.cross, rb, L, Eigen::OuterStride<>(L));
    gemm_nt(1.0f, RZ, Y, cross);
    for (std::int64_t r = 0; r < rb; ++r) {
      const std::int64_t j = j0 + r;
      const std::int64_t vis = L - w + j + 1;
      const double rz2 = static_cast<double>(RZ.row(r).squaredNorm());
      const float cj = s.st_c[j];
      if (cj == 0.0f) continue;
      const float* pr = pg + r * L;
      const float* cr = s.cross + r * L;
      const std::int32_t am = st.arg[r];
      for (std::int64_t n = 0; n < vis; ++n) {
        if (n == am || pr[n] == 0.0f) continue;
        const double d2 = std::max(0.0, rz2 - 2.0 * cr[n] + ynorm2[n]);
        const double dist = tau == 1.0f ? std::sqrt(d2) : std::pow(d2, 0.5 * tau);
        out[n] += cj * static_cast<float>(pr[n] / (1.0 - pr[n]) * dist);
      }
      // Row argmax: a/(1-a) ||R(z - v)|| = a ||R(z_{-n} - v)||, z_{-n} without cancellation.
      const float pm = pr[am];
      double sc;
      if (pm <= 15.0f / 16.0f) {
        const double d2 = std::max(0.0, rz2 - 2.0 * cr[am] + ynorm2[am]);
        const double dist = tau == 1.0f ? std::sqrt(d2) : std::pow(d2, 0.5 * tau);
        sc = pm / (1.0 - pm) * dist;
      } else {
        const float* lr = lgg + r * L;
        float m2 = -std::numeric_limits<float>::infinity();
        for (std::int64_t n = 0; n < vis; ++n)
          if (n != am) m2 = std::max(m2, lr[n]);
        Eigen::VectorXd zhat = Eigen::VectorXd::Zero(d);
        double den = 0.0;
        for (std::int64_t n = 0; n < vis; ++n) {
          if (n == am) continue;
          const double e = std::exp(static_cast<double>(lr[n]) - m2);
          if (e == 0.0) continue;
          den += e;
          zhat += e * V.row(n).transpose().cast<double>();
        }
        if (den > 0.0) zhat /= den;
        Eigen::VectorXd diff = zhat - V.row(am).transpose().cast<double>();
        const double dist = use_r ? (c.rcat.middleRows(g * d, d).template cast<double>() * diff).norm() : diff.norm();
        // log(1 - a) = log(z_other) - log(1 + z_other), z_other = e^(m2 - M) * den
        const double log_zo = (static_cast<double>(m2) - st.max_logit[r]) + std::log(den);
        const double log1m = log_zo - std::log1p(std::exp(log_zo));
        const double a = 1.0 / (1.0 + std::exp(log_zo));
        sc = a * std::exp((tau - 1.0) * log1m) * std::pow(dist, static_cast<double>(tau));
        // Only the token itself is visible (e.g. row 0 when L == w): nothing to renormalise,
        // no contribution (log(den) = -inf made sc NaN and zeroed the token's whole score).
        if (!(den > 0.0)) sc = 0.0;
      }
      out[am] += cj * static_cast<float>(sc);
    }
  }

  template <class Ctx>
  static void finish_head(Ctx& c, detail::head_scratch& s, std::int64_t g, float* out, float*) {
    using namespace detail;
    const std::int64_t L = c.L;
    if (c.before) {
      for (std::int64_t n = 0; n < L; ++n) out[n] = saturate(static_cast<double>(out[n]) * c.out_scale);
    } else {
      // "after", phase 1 (per head): a_bar (held in the output row) and the dominant token.
      // The scores s[n] = a/(1-a) ||R z - Y_n||^tau, z = sum_{n < zlim} a[n] v_n, are
      // computed in finish_group for the whole GQA group: z of every head in one pass over V,
      // then Y_n = R v_n tile by tile (phase 2), then the exact limit of dominant tokens (phase 3).
      std::int64_t dom = 0;
      for (std::int64_t n = 1; n < L; ++n)
        if (out[n] > out[dom]) dom = n;
      s.dom[g] = dom;
      s.adom[g] = L > 0 ? out[dom] : 0.0f;
    }
  }

  template <class Ctx>
  static void finish_group(Ctx& c, detail::head_scratch& s, float* rows) {
    using namespace detail;
    if (c.before) return;
    const auto& in = c.in;
    const auto& P = c.P;
    const std::int64_t L = c.L, d = c.d, G = c.G, w = c.w, b = c.b, h = c.h;
    const float tau = c.tau;
    const bool use_r = c.use_r;
    const double out_scale = c.out_scale;
    const auto& vsrc = c.vsrc;
    const auto& rcat = c.rcat;
    const std::int64_t row_begin = c.row_begin;
    const float scale = c.scale;
    // "after", phase 2: z_g = V^T a_bar_g for the G heads at once (one pass over V, a GEMM per
    // tile of value_tile tokens accumulated in order) and R_g z_g; then per tile of
    // lor_token_tile tokens, Y = V_tile [R_1 .. R_G]^T (one GEMM for the group; the tile stays
    // in L2) and for every head g and token n of the tile s[n] = a/(1-a) ||R_g z_g - Y_n||^tau,
    // a = a_bar_g[n] (held in the output row). In value space Y_n = v_n.
    const std::int64_t zlim = P.scorer.include_window_in_output ? L : L - w;
    {
      Eigen::MatrixXf Z = Eigen::MatrixXf::Zero(d, G);
      for (std::int64_t n0 = 0; n0 < zlim; n0 += value_tile) {
        const std::int64_t nb = std::min(value_tile, zlim - n0);
        Z.noalias() += vsrc.rows(n0, nb, s.vbuf).transpose() * cmap_rm(rows + n0, G, nb, Eigen::OuterStride<>(L)).transpose();
      }
      for (std::int64_t g = 0; g < G; ++g) {
        Eigen::Map<Eigen::VectorXf> rz(s.rzs + g * d, d);
        if (use_r) rz.noalias() = rcat.middleRows(g * d, d) * Z.col(g);
        else rz = Z.col(g);
      }
    }
    for (std::int64_t n0 = 0; n0 < L; n0 += lor_token_tile) {
      const std::int64_t nb = std::min(lor_token_tile, L - n0);
      const cmap_rm Vt = vsrc.rows(n0, nb, s.vbuf);
      const float* yb = Vt.data();
      std::int64_t ys = Vt.outerStride();
      if (use_r) {
        map_rm Yt(s.ybuf, nb, G * d, Eigen::OuterStride<>(G * d));
        gemm_nt(1.0f, Vt, rcat, Yt);
        yb = s.ybuf;
        ys = G * d;
      }
      for (std::int64_t g = 0; g < G; ++g) {
        float* out = rows + g * L;
        const float* rz = s.rzs + g * d;
        const float* yg = yb + (use_r ? g * d : 0);
        // ||R z - Y_n||^2 of the tile's tokens in fp32 (vectorised over d; relative error
        // ~1e-6). A sum that overflowed or fell below 2^-100 (|differences| near the fp32
        // range limits) is recomputed with fp64 squares.
        for (std::int64_t t = 0; t < nb; ++t) {
          const std::int64_t n = n0 + t;
          const float a = out[n];
          if (a <= 0.0f) {
            out[n] = 0.0f;
            continue;
          }
          double d2 = static_cast<double>(sq_dist_f32(rz, yg + t * ys, d));
          if (!(d2 <= 3.0e38) || d2 < 0x1p-100) d2 = sq_dist_fp64(rz, yg + t * ys, d);
          const double dist = std::sqrt(d2);
          const double dd = tau == 1.0f ? dist : std::pow(dist, static_cast<double>(tau));
          out[n] = saturate(static_cast<double>(a) / (1.0 - static_cast<double>(a)) * dd * out_scale);
        }
      }
    }
    // Phase 3: a dominant token (a_bar > 15/16) gets its exact limit, recomputed from the
    // attention rows of its head (rare: only heads with such a token pay for it).
    for (std::int64_t g = 0; g < G; ++g) {
      if (!(s.adom[g] > 15.0f / 16.0f)) continue;
      const std::int64_t hq = h * G + g;
      float* out = rows + g * L;
      const auto* qbase = in.queries.data + b * in.queries.stride[0] + hq * in.queries.stride[1] +
                          (in.window() - w) * in.queries.stride[2];
      {
        // Exact limit for the dominant token: a * (1-a)^(tau-1) * ||R(z_{-n} - v_n)||^tau with
        // weights of the other tokens computed relative to their largest log-weight E.
        const std::int64_t n0 = s.dom[g];
        Eigen::VectorXd num = Eigen::VectorXd::Zero(d);
        double den = 0.0, E = -std::numeric_limits<double>::infinity();
        for (std::int64_t j0 = row_begin; j0 < w; j0 += c.rb) {
          const std::int64_t rb = std::min(c.rb, w - j0);
          const row_stats st{s.st_max, s.st_zo, s.st_arg, s.st_inv};  // only the logits and z_other are read
          // the weights go to the second half of the logits buffer (max(G, 2) rb L floats), unread
          attention_block(stage_rows(qbase + j0 * in.queries.stride[2], rb, d, in.queries.stride[2], in.queries.stride[3], s.qbuf),
                          c.keys, L, w, j0, rb, scale, s.logits, s.logits + rb * L, st, false);
          for (std::int64_t r = 0; r < rb; ++r) {
            const std::int64_t j = j0 + r;
            const double cj = s.st_c[j];
            if (cj <= 0.0) continue;
            const std::int64_t vis = L - w + j + 1;
            const double lam = std::log(cj) - std::log1p(st.z_other[r]) - st.max_logit[r];
            const float* lr = s.logits + r * L;
            double rmax = -std::numeric_limits<double>::infinity();
            for (std::int64_t n = 0; n < vis; ++n)
              if (n != n0) rmax = std::max(rmax, static_cast<double>(lr[n]) + lam);
            if (rmax == -std::numeric_limits<double>::infinity()) continue;
            if (rmax > E) {
              const double f = std::exp(E - rmax);
              num *= f;
              den *= f;
              E = rmax;
            }
            for (std::int64_t n = 0; n < vis; ++n) {
              if (n == n0) continue;
              const double wgt = std::exp(static_cast<double>(lr[n]) + lam - E);
              if (wgt == 0.0) continue;
              den += wgt;
              if (n < zlim) num += wgt * vsrc.rows(n, 1, s.vbuf).row(0).transpose().template cast<double>();
            }
          }
        }
        if (den > 0.0) {
          // v_n0 is part of z only when n0 < zlim. A window token left out of z (possible
          // candidate when fewer than w recent tokens are protected) has no cancellation:
          // s = a / (1-a) * ||R(z - v_n0)||^tau, z = num * e^E, with the exact 1 - a.
          const bool in_z = n0 < zlim;
          Eigen::VectorXd diff = (in_z ? Eigen::VectorXd(num / den) : Eigen::VectorXd(num * std::exp(E))) -
                                 vsrc.rows(n0, 1, s.vbuf).row(0).transpose().template cast<double>();
          const double dist = use_r ? (rcat.middleRows(g * d, d).template cast<double>() * diff).norm() : diff.norm();
          const double log1m = std::log(den) + E;
          const double a = s.adom[g];
          const double sc = a * std::exp((in_z ? tau - 1.0 : -1.0) * log1m) * std::pow(dist, static_cast<double>(tau));
          out[n0] = saturate(sc * out_scale);
        } else {
          // No other token has weight (a head of one visible token): nothing to renormalise,
          // no contribution, as in "before" mode (phase 2's odds a/(1-a) saturated here).
          out[n0] = 0.0f;
        }
      }
    }
  }
};

}  // namespace cpu
}  // namespace kvevict
