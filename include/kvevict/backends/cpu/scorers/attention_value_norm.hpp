// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::attention_value_norm (CriticalKV, Feng et al. 2025): the
// primary row is SnapKV's window attention (the shared window loop); the secondary row of each
// query head is u[n] = ||v_n W_O^h||_1 (value_l1_norms), read by selectors::two_stage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvevict/backends/cpu/gemm.hpp"
#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// CriticalKV's secondary score of query head hq (scorers::attention_value_norm):
///   u[n] = || v_n W_O^hq ||_1 = sum_{c < C} | sum_{i < d} wo(c, hq d + i) v_n[i] |,  n < L.
/// V: the head's values (L rows of d), read through a row_source that divides them by 2^vexp
/// (vexp = V.scale_exp from safe_exponent, so the products cannot overflow), a block at a time. The W_O slice (C x d) is widened to fp32 into s.wbuf and scaled
/// the same way; the projection runs as fp32 GEMMs of value_norm_token_block tokens into s.pbuf,
/// |y_c| is summed in fp64, then multiplied back by 2^(vexp + wexp) and saturated to FLT_MAX.
template <class T>
inline void value_l1_norms(const layer_inputs<T>& in, std::int64_t hq, const row_source<T>& V, std::int64_t L, head_scratch& s,
                           float* u) {
  const std::int64_t d = V.cols, C = in.wo.extent[0];
  const int vexp = V.scale_exp;
  float wmax = 0.0f;
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t i = 0; i < d; ++i) {
      const float x = to_float(in.wo(c, hq * d + i));
      s.wbuf[c * d + i] = x;
      wmax = std::max(wmax, std::fabs(x));
    }
  const int wexp = safe_exponent(wmax);
  if (wexp != 0) scale_pow2(s.wbuf, C * d, -wexp);
  cmap_rm W(s.wbuf, C, d, Eigen::OuterStride<>(d));
  const double back = std::ldexp(1.0, vexp + wexp);
  for (std::int64_t n0 = 0; n0 < L; n0 += value_norm_token_block) {
    const std::int64_t nb = std::min(value_norm_token_block, L - n0);
    map_rm Y(s.pbuf, nb, C, Eigen::OuterStride<>(C));
    gemm_nt(1.0f, V.rows(n0, nb, s.vbuf), W, Y);
    for (std::int64_t t = 0; t < nb; ++t) {
      const float* y = s.pbuf + t * C;
      double acc = 0.0;
      for (std::int64_t c = 0; c < C; ++c) acc += std::fabs(static_cast<double>(y[c]));
      u[n0 + t] = saturate(acc * back);
    }
  }
}

}  // namespace detail

template <>
struct scorer_impl<scorers::attention_value_norm> : detail::window_scorer<scorer_impl<scorers::attention_value_norm>>,
                                                    detail::window_hooks {
  /// The scratch holds a W_O slice and a block of projected values (head_scratch::carve_projection).
  static constexpr bool hidden_projection = true;

  /// The head's values are read rescaled by 2^-vexp into a safe range, for value_l1_norms (only
  /// when score() is asked for the secondary rows: the evictor computes them per selection row).
  template <class Ctx>
  static void finish_head(Ctx& c, detail::head_scratch& s, std::int64_t g, float* out, float* rows2) {
    for (std::int64_t n = 0; n < c.L; ++n) out[n] = detail::saturate(out[n]);
    if (!rows2) return;
    if (g == 0) {
      c.vexp = detail::safe_exponent(detail::max_abs_rows(c.vsrc, c.L));
      c.vsrc.scale_exp = c.vexp;
    }
    detail::value_l1_norms(c.in, c.h * c.G + g, c.vsrc, c.L, s, rows2 + g * c.L);
  }

  /// The secondary row of query head hq of sequence b on its own, tokens [t0, t1) of its first L
  /// (into u[0, t1 - t0)), for the evictor to compute it where the selector reads it instead of
  /// holding every head's row (rows2 = nullptr in score()). t0 a multiple of
  /// value_norm_token_block: bit for bit what score() writes to rows2. s needs vbuf
  /// (value_norm_token_block x d floats) and the projection scratch (carve_projection).
  template <class T>
  static void secondary_row(const layer_inputs<T>& in, std::int64_t b, std::int64_t hq, std::int64_t L, std::int64_t t0,
                            std::int64_t t1, detail::head_scratch& s, float* u) {
    const std::int64_t h = hq / in.group_size();
    detail::row_source<T> v = detail::head_rows(in, in.values, b, h);
    v.scale_exp = detail::safe_exponent(detail::max_abs_rows(v, L));  // over the whole head, as score()
    v = v.from_row(t0);
    detail::value_l1_norms(in, hq, v, t1 - t0, s, u);
  }
};

}  // namespace cpu
}  // namespace kvevict
