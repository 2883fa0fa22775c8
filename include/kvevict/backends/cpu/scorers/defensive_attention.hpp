// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::defensive_attention (DefensiveKV, Feng et al., ICLR 2026, arXiv
// 2510.13334). Per (sequence, KV head), on the shared window loop (window_scorer):
//   on_block      every window row of every query head of the group: its mass on the candidates,
//                 the row avg-pooled and rescaled to that mass, max-accumulated (aux block 2), and
//                 the row's window share (aux_stat)
//   finish_head   the temporal-weighted attention (the loop's output row) becomes the mass row
//                 (aux block 0), the projected value norms ||v W_O^hg||_1 go to aux block 1, and
//                 the pooled maximum becomes the score row
//   finish_group  the maximum over the group, clamped below at its mean over the candidates
//                 (defensive aggregation), in every row of the group
// then once per sequence, over its KV heads (combine_heads): the value weighting normalised over
// the heads and the mass stage (policies/scorers.hpp, steps 3 and 4).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/backends/cpu/scorers/attention_value_norm.hpp"
#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::defensive_attention> : detail::window_scorer<scorer_impl<scorers::defensive_attention>>,
                                                   detail::window_hooks {
  using params = scorers::defensive_attention::params;
  /// The scratch holds a W_O slice and a block of projected values (value_l1_norms).
  static constexpr bool hidden_projection = true;
  /// head_job::aux blocks the scorer writes: mass rows, value-norm rows, pooled maxima (scratch).
  static constexpr int aux_rows = 3;
  /// The first aux_kept blocks are reduced over the group (mean) and read by combine_heads.
  static constexpr int aux_kept = 2;
  /// The loop's aggregate is the mass row of the mass stage (the temporal weights' mean): linear only;
  /// the scorer takes the maximum over the rows itself.
  static constexpr bool linear_temporal_only = true;

  template <class Ctx>
  static void prepare(Ctx& c, detail::head_scratch&) {
    std::fill(c.job.aux + 2 * c.G * c.L, c.job.aux + 3 * c.G * c.L, 0.0f);
    std::fill(c.job.aux_stat, c.job.aux_stat + c.G, 0.0);
  }

  template <class Ctx>
  static void on_block(Ctx& c, detail::head_scratch&, std::int64_t g, std::int64_t j0, std::int64_t rb, const float* pg, const float*,
                       const detail::row_stats& st, const detail::cmap_rm&, float*) {
    const std::int64_t L = c.L, w = c.w, Lc = L - w;
    if (Lc <= 0) return;
    const auto& sp = c.P.scorer;
    const std::int64_t k = sp.kernel, half = k / 2;
    float* dmax = c.job.aux + (2 * c.G + g) * L;
    const double rows = static_cast<double>(w - c.row_begin);
    for (std::int64_t r = 0; r < rb; ++r) {
      const float* e = pg + r * L;
      const float inv = st.inv_z[r];
      const std::int64_t j = j0 + r;
      // the probability fl(e * inv_z), as the other window scorers read it
      auto p = [e, inv](std::int64_t n) { return static_cast<double>(e[n] * inv); };
      // window share of this row (averaged over the window rows)
      double share = 0.0;
      if (sp.share == scorers::defensive_attention::share_rule::preceding_keys) {
        for (std::int64_t n = std::max<std::int64_t>(0, Lc - w); n < Lc; ++n) share += p(n);
      } else if (sp.share == scorers::defensive_attention::share_rule::window) {
        for (std::int64_t n = Lc; n <= Lc + j && n < L; ++n) share += p(n);
      }
      c.job.aux_stat[g] += share / rows;
      // the row's mass on the candidates and the mass of its pooled form (sum over n of the
      // zero-padded window average = sum over m of p[m] times the windows that hold m, over k)
      double mass = 0.0, pooled_mass = 0.0;
      for (std::int64_t m = 0; m < Lc; ++m) {
        const double pm = p(m);
        mass += pm;
        const std::int64_t cnt = std::min(m, half) + std::min(Lc - 1 - m, half) + 1;
        pooled_mass += pm * static_cast<double>(cnt);
      }
      pooled_mass /= static_cast<double>(k);
      if (!(pooled_mass > 0.0)) continue;  // a row with no mass on the candidates pools to 0
      const double scale = mass / (pooled_mass * static_cast<double>(k));
      for (std::int64_t n = 0; n < Lc; ++n) {
        double acc = 0.0;
        const std::int64_t m1 = std::min(Lc - 1, n + half);
        for (std::int64_t m = std::max<std::int64_t>(0, n - half); m <= m1; ++m) acc += p(m);
        dmax[n] = std::max(dmax[n], detail::saturate(acc * scale));
      }
    }
  }

  template <class Ctx>
  static void finish_head(Ctx& c, detail::head_scratch& s, std::int64_t g, float* out, float*) {
    const std::int64_t L = c.L, Lc = std::max<std::int64_t>(L - c.w, 0);
    float* mass = c.job.aux + g * L;
    float* unorm = c.job.aux + (c.G + g) * L;
    const float* dmax = c.job.aux + (2 * c.G + g) * L;
    for (std::int64_t n = 0; n < L; ++n) mass[n] = detail::saturate(out[n]);
    if (g == 0) {
      c.vexp = detail::safe_exponent(detail::max_abs_rows(c.vsrc, L));
      c.vsrc.scale_exp = c.vexp;
    }
    detail::value_l1_norms(c.in, c.h * c.G + g, c.vsrc, L, s, unorm);
    for (std::int64_t n = 0; n < Lc; ++n) out[n] = dmax[n];
    std::fill(out + Lc, out + L, 0.0f);
  }

  template <class Ctx>
  static void finish_group(Ctx& c, detail::head_scratch&, float* rows) {
    const std::int64_t L = c.L, Lc = std::max<std::int64_t>(L - c.w, 0);
    double sum = 0.0;
    for (std::int64_t n = 0; n < Lc; ++n) {
      float m = rows[n];
      for (std::int64_t g = 1; g < c.G; ++g) m = std::max(m, rows[g * L + n]);
      rows[n] = m;
      sum += m;
    }
    if (c.P.scorer.clamp_at_mean && Lc > 0) {
      const float floor_v = static_cast<float>(sum / static_cast<double>(Lc));
      for (std::int64_t n = 0; n < Lc; ++n) rows[n] = std::max(rows[n], floor_v);
    }
    for (std::int64_t g = 1; g < c.G; ++g) std::copy(rows, rows + L, rows + g * L);
  }

  /// Steps 3 and 4 of scorers::defensive_attention for one sequence of H KV heads: `scores` (H rows
  /// of stride S: S_h on entry, F_h on exit), `aux` (per head 2 rows of stride S: the mass row, the
  /// value-norm row, each reduced over the group), `stat` (per head: its mean window share), the
  /// heads' plans (their lengths L), the observation window W (a head's window: min(W, L)), and
  /// `need` (heads kept whole were not scored and take no part). Scratch: U (S doubles), order (S int32).
  static void combine_heads(const params& p, const kvevict::detail::head_plan* plans, const std::uint8_t* need, std::int64_t W,
                            std::int64_t H, std::int64_t S, float* scores, const float* aux, const double* stat, double* U,
                            std::int32_t* order) {
    auto len_of = [plans](std::int64_t h) { return plans[h].length; };
    auto win_of = [plans, W](std::int64_t h) { return std::min(W, plans[h].length); };
    std::int64_t Lmax = 0, scored = 0;
    double share = 0.0;
    for (std::int64_t h = 0; h < H; ++h) {
      if (!need[h]) continue;
      Lmax = std::max(Lmax, len_of(h) - win_of(h));
      share += stat[h];
      ++scored;
    }
    if (scored == 0) return;
    share /= static_cast<double>(scored);
    // 3. value weighting, normalised over the heads at each position
    std::fill(U, U + std::max<std::int64_t>(Lmax, 0), 0.0);
    for (std::int64_t h = 0; h < H; ++h) {
      if (!need[h]) continue;
      const float* u = aux + (2 * h + 1) * S;
      for (std::int64_t n = 0; n < len_of(h) - win_of(h); ++n) U[n] += u[n];
    }
    float fmax = 0.0f;
    for (std::int64_t h = 0; h < H; ++h) {
      if (!need[h]) continue;
      float* f = scores + h * S;
      const float* u = aux + (2 * h + 1) * S;
      for (std::int64_t n = 0; n < len_of(h) - win_of(h); ++n) {
        f[n] = U[n] > 0.0 ? detail::saturate(static_cast<double>(f[n]) * (static_cast<double>(u[n]) / U[n])) : 0.0f;
        fmax = std::max(fmax, f[n]);
      }
    }
    // 4. the mass stage: per head, the highest-mass candidates up to the threshold, forced in just
    // above every other score (the authors set them to the maximum, where they tie with the best
    // candidate; a tie broken against a forced token would drop it)
    const float fup = fmax < std::numeric_limits<float>::max() ? std::nextafter(fmax, std::numeric_limits<float>::max()) : fmax;
    const double tau = static_cast<double>(p.mass_threshold) - share;
    for (std::int64_t h = 0; h < H; ++h) {
      if (!need[h]) continue;
      const std::int64_t Lc = len_of(h) - win_of(h);
      float* f = scores + h * S;
      std::fill(f + std::max<std::int64_t>(Lc, 0), f + len_of(h), fup);  // the window, as the authors' padding
      if (!(p.mass_threshold > 0.0f) || !(tau > 0.0) || Lc <= 0) continue;
      const float* m = aux + 2 * h * S;
      double total = 0.0;
      for (std::int64_t n = 0; n < Lc; ++n) total += m[n];
      if (!(total > 0.0)) continue;
      for (std::int64_t n = 0; n < Lc; ++n) order[n] = static_cast<std::int32_t>(n);
      std::stable_sort(order, order + Lc, [m](std::int32_t a, std::int32_t b) { return m[a] > m[b]; });
      std::int64_t count = 0;  // the first rank whose cumulative mass reaches tau (none: 0)
      double cum = 0.0;
      for (std::int64_t i = 0; i < Lc; ++i) {
        cum += static_cast<double>(m[order[i]]) / total;
        if (cum >= tau) {
          count = i;
          break;
        }
      }
      // Forced: those of the first `count` ranks that are the selector's candidates [sinks, L - recent),
      // at most the head's candidate budget (base budget minus its protected tokens: the window by
      // default, as the reference's int(L (1 - r)) - w), so that every forced token fits the head's
      // share of the layer total and none is dropped by a tie.
      const auto& pl = plans[h];
      std::int64_t cap = std::max<std::int64_t>(pl.base_budget - pl.protected_count(), 0);
      for (std::int64_t i = 0; i < count && cap > 0; ++i) {
        const std::int32_t n = order[i];
        if (n < pl.sinks || n >= pl.evictable_end()) continue;
        f[n] = fup;
        --cap;
      }
    }
  }
};

}  // namespace cpu
}  // namespace kvevict
