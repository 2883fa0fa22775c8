// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::attention_value_norm (CriticalKV, Feng et al. 2025): the
// primary row is SnapKV's window attention (the shared window loop); the secondary row of each
// query head is u[n] = ||v_n W_O^h||_1 (value_l1_norms), read by selectors::two_stage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// CriticalKV's secondary score of query head hq (scorers::attention_value_norm):
///   u[n] = || v_n W_O^hq ||_1 = sum_{c < C} | sum_{i < d} wo(c, hq d + i) v_n[i] |,  n < L.
/// V: the head's L x d values in fp32, already divided by 2^vexp (vexp from safe_exponent, so the
/// products cannot overflow). The W_O slice (C x d) is widened to fp32 into s.wbuf and scaled
/// the same way; the projection runs as fp32 GEMMs of value_norm_token_block tokens into s.pbuf,
/// |y_c| is summed in fp64, then multiplied back by 2^(vexp + wexp) and saturated to FLT_MAX.
template <class T>
inline void value_l1_norms(const layer_inputs<T>& in, std::int64_t hq, const cmap_rm& V, int vexp, head_scratch& s,
                           float* u) {
  const std::int64_t L = V.rows(), d = V.cols(), C = in.wo.extent[0];
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
    Y.noalias() = V.middleRows(n0, nb) * W.transpose();
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

  /// The head's values, rescaled by 2^-vexp into a safe range, for value_l1_norms.
  template <class Ctx>
  static void prepare(Ctx& c, detail::head_scratch& s) {
    using namespace detail;
    const auto& in = c.in;
    const auto* vbase = in.values.data + c.b * in.values.stride[0] + c.h * in.values.stride[1];
    new (&c.V) cmap_rm(stage_rows(vbase, c.L, c.d, in.values.stride[2], in.values.stride[3], s.vbuf));
    c.vexp = safe_exponent(max_abs(c.V));
    if (c.vexp != 0) {
      map_rm vs(s.vbuf, c.L, c.d, Eigen::OuterStride<>(c.d));
      if (c.V.data() != s.vbuf) vs = c.V;
      scale_pow2(s.vbuf, c.L * c.d, -c.vexp);
      new (&c.V) cmap_rm(s.vbuf, c.L, c.d, Eigen::OuterStride<>(c.d));
    }
  }
  template <class Ctx>
  static void finish_head(Ctx& c, detail::head_scratch& s, std::int64_t g, float* out, float* rows2) {
    for (std::int64_t n = 0; n < c.L; ++n) out[n] = detail::saturate(out[n]);
    detail::value_l1_norms(c.in, c.h * c.G + g, c.V, c.vexp, s, rows2 + g * c.L);
  }
};

}  // namespace cpu
}  // namespace kvevict
