// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Temporal smoothers: how the w observation-window rows of the attention (or of per-row scores)
// are combined into one row. The built-in temporal smoothers are LINEAR row weightings (but two, below)
// c_0 .. c_{w-1}: smoothed[n] = sum_j c_j x_j[n], rows ordered oldest (j = 0) to newest.
// That lets backends fuse them with the window attention.
//
// Two built-ins are not linear: `maximum` and `defensive` (DefensiveKV's worst-case aggregation) take
// the maximum over the rows instead (detail::temporal_row_max); the CPU window scorers whose aggregate
// is the attention itself run them (see `maximum`).
//
// A user-defined temporal smoother is a struct with a nested `params`, a
// `static status check(const params&)` and a
// `KVEVICT_HOST_DEVICE static double weight(const params&, int j, int w)` (see
// examples/custom_policy.cpp).
#pragma once

#include <type_traits>

#include "kvevict/core/status.hpp"

namespace kvevict {
namespace temporal {

namespace detail {
KVEVICT_HOST_DEVICE inline double ipow(double b, int e) {
  double r = 1.0;
  while (e > 0) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}
}  // namespace detail

/// Exponential moving average over the window rows (ReST-KV, ICLR 2026, Sec. 3.3, "temporal
/// smoothing"). acc = x_0; for j = 1..w-1: acc = alpha * x_j + (1 - alpha) * acc.
/// Weights: c_0 = (1-alpha)^(w-1), c_j = alpha (1-alpha)^(w-1-j) for j >= 1; they sum to 1.
/// Published alpha = 0.3. Error: alpha outside (0, 1] or not finite.
struct ema {
  struct params {
    float alpha = 0.3f;
  };
  static constexpr const char* name = "ema";
  static status check(const params& p) {
    if (!(p.alpha > 0.0f && p.alpha <= 1.0f))
      return status::error(errc::invalid_argument, "temporal.alpha = %g must be in (0, 1]", static_cast<double>(p.alpha));
    return {};
  }
  KVEVICT_HOST_DEVICE static double weight(const params& p, int j, int w) {
    const double a = p.alpha;
    if (j == 0) return detail::ipow(1.0 - a, w - 1);
    return a * detail::ipow(1.0 - a, w - 1 - j);
  }
};

/// EMA run from the newest row to the oldest (the "reversed EMA" ablation of ReST-KV):
/// c_{w-1} = (1-alpha)^(w-1), c_j = alpha (1-alpha)^j for j <= w-2.
struct reversed_ema {
  struct params {
    float alpha = 0.3f;
  };
  static constexpr const char* name = "reversed_ema";
  static status check(const params& p) { return ema::check(ema::params{p.alpha}); }
  KVEVICT_HOST_DEVICE static double weight(const params& p, int j, int w) {
    const double a = p.alpha;
    if (j == w - 1) return detail::ipow(1.0 - a, w - 1);
    return a * detail::ipow(1.0 - a, j);
  }
};

/// Mean over the window rows, c_j = 1/w.
struct mean {
  struct params {};
  static constexpr const char* name = "mean";
  static status check(const params&) { return {}; }
  KVEVICT_HOST_DEVICE static double weight(const params&, int, int w) { return 1.0 / w; }
};

/// Sum over the window rows, c_j = 1 (SnapKV, Li et al. 2024, arXiv 2404.14469; and H2O's
/// accumulated attention when the window is the whole prompt). Ranks like `mean`.
struct sum {
  struct params {};
  static constexpr const char* name = "sum";
  static status check(const params&) { return {}; }
  KVEVICT_HOST_DEVICE static double weight(const params&, int, int) { return 1.0; }
};

/// Only the newest row, c_{w-1} = 1 (TOVA, Oren et al. 2024, arXiv 2401.06104).
struct last {
  struct params {};
  static constexpr const char* name = "last";
  static status check(const params&) { return {}; }
  KVEVICT_HOST_DEVICE static double weight(const params&, int j, int w) { return j == w - 1 ? 1.0 : 0.0; }
};

/// Maximum over the window rows: a[n] = max_j A[j, n], the worst case over the observation window
/// instead of its mean (the aggregation DefensiveKV argues for: Feng et al., "Taming the Fragility of
/// KV Cache Eviction in LLM Inference", ICLR 2026, arXiv 2510.13334). Combined with the GQA reduction
/// as usual (gqa_reduction::max: the maximum over the group as well). Not a linear row weighting:
/// on the CPU backend it runs in the window loop of the scorers whose aggregate is the attention itself
/// (attention_weight, attention_value_norm's primary row, last_query); output_reconstruction,
/// defensive_attention and accumulated_attention (H2O: a sum over every prompt query), which weight
/// rows linearly inside, refuse it at compile time (when run() is instantiated), a scorer without
/// window attention at once, and the CUDA evictor with a static_assert.
struct maximum {
  struct params {};
  static constexpr const char* name = "maximum";
  /// The rows are combined by their maximum (detail::temporal_row_max).
  static constexpr bool row_max = true;
  static status check(const params&) { return {}; }
};

/// DefensiveKV's defensive aggregation (arXiv 2510.13334, "defensive aggregation"): the maximum over
/// the window rows, then, after the GQA reduction (and layer_mean) and before the spatial smoother,
/// every score row floored at its own mean over the columns before the observation window, n < L - w
/// (w = min(window, L); the columns DefensiveKV scores): a[n] = max(M[n], mean_{n' < L - w} M[n']) for
/// n < L - w, the window's columns left as they are, with M the reduced row maximum. With
/// gqa_reduction::max, M is the maximum over the window rows and the group, as the paper defines it.
/// The range is the scorer's, not the selector's candidates: sinks or a protected prefix count in the
/// mean, and with num_recent below the window the unprotected window columns are not floored. Same
/// support as `maximum`.
struct defensive {
  struct params {};
  static constexpr const char* name = "defensive";
  static constexpr bool row_max = true;
  /// After the GQA reduction each row is floored at its mean over the candidates (detail::temporal_floor_at_mean).
  static constexpr bool floor_at_mean = true;
  static status check(const params&) { return {}; }
};

}  // namespace temporal

namespace detail {
/// True when temporal smoother T combines the window rows by their maximum (`row_max`).
template <class T, class = void>
struct temporal_row_max : std::false_type {};
template <class T>
struct temporal_row_max<T, std::void_t<decltype(T::row_max)>> : std::integral_constant<bool, T::row_max> {};
/// True when temporal smoother T floors each reduced row at its mean over the candidates (`floor_at_mean`).
template <class T, class = void>
struct temporal_floor_at_mean : std::false_type {};
template <class T>
struct temporal_floor_at_mean<T, std::void_t<decltype(T::floor_at_mean)>> : std::integral_constant<bool, T::floor_at_mean> {};
}  // namespace detail
}  // namespace kvevict
