// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Spatial smoothers: smoothing of one head's score row along the sequence, over the evictable
// region [0, N) (N = L - num_recent: the tokens before the protected recent window).
// The parameters and the backend-neutral rules live here; the loops live in the backends.
//
// A user-defined spatial smoother (CPU) is a struct with `params`, `static status
// check(const params&)`, `static constexpr bool needs_attention_drift = false` and
// `static void smooth(const params&, const float* in, float* out, std::int64_t n)`.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/core/status.hpp"

namespace kvevict {
namespace spatial {

/// No spatial smoothing.
struct none {
  struct params {};
  static constexpr const char* name = "none";
  static constexpr bool needs_attention_drift = false;
  static status check(const params&) { return {}; }
};

/// Centred average pooling of odd width k, stride 1, zero padding counted in the mean
/// (PyTorch avg_pool1d(count_include_pad=True)), as in SnapKV (Li et al. 2024, arXiv
/// 2404.14469). Error: even or non-positive kernel.
struct avg_pool {
  struct params {
    int kernel = 5;
  };
  static constexpr const char* name = "avg_pool";
  static constexpr bool needs_attention_drift = false;
  static status check(const params& p) {
    if (p.kernel < 1 || p.kernel % 2 == 0)
      return status::error(errc::invalid_argument, "spatial.kernel = %d must be odd and >= 1", p.kernel);
    return {};
  }
};

/// Centred max pooling of odd width k, stride 1, -inf padding (SnapKV's maxpool variant).
struct max_pool {
  struct params {
    int kernel = 5;
  };
  static constexpr const char* name = "max_pool";
  static constexpr bool needs_attention_drift = false;
  static status check(const params& p) { return avg_pool::check(avg_pool::params{p.kernel}); }
};

/// Adaptive-window spatial smoothing (AWS) of ReST-KV (An et al., ICLR 2026, Sec. 3.4).
/// From the drift t = D_front - D_rear of the window attention (mean index of each window
/// row's top-(B - w) weights, front half minus rear half of the rows):
///   m = floor(|t| / beta), kernel k = max(k_min, 2m + 1), shift s = trunc(t / beta),
///   y[i] = (1/k) sum_{j = i - k/2 + s}^{i + k/2 + s} x[clamp(j, 0, N-1)]  (replicate padding).
/// With `reference_exact` (default, as the published numbers were produced) the shift follows
/// the reference code's floor division: s = floor(t/beta) for t > 0 and floor(t/beta) + 1 for
/// t <= 0 (so t = 0 gives s = +1 and t = -m*beta gives -m+1). |s| <= k/2 always.
/// Published beta = 2000, k_min = 5 (21 for RULER/InfiniteBench). Errors: beta <= 0 or not
/// finite, k_min even or < 1.
struct adaptive_window {
  struct params {
    float beta = 2000.0f;
    int k_min = 5;
    bool reference_exact = true;
  };
  static constexpr const char* name = "adaptive_window";
  static constexpr bool needs_attention_drift = true;
  static status check(const params& p) {
    if (!(p.beta > 0.0f) || !std::isfinite(p.beta))
      return status::error(errc::invalid_argument, "spatial.beta = %g must be finite and > 0", static_cast<double>(p.beta));
    if (p.k_min < 1 || p.k_min % 2 == 0)
      return status::error(errc::invalid_argument, "spatial.k_min = %d must be odd and >= 1", p.k_min);
    return {};
  }
  /// The kernel width k and shift s for drift t (in tokens). `max_kernel` bounds k (the
  /// row length suffices: a wider replicate-padded window changes nothing but the cost).
  KVEVICT_HOST_DEVICE static void kernel_and_shift(const params& p, double t, std::int64_t* k, std::int64_t* s) {
    const double beta = p.beta;
    const double q = t / beta;
    double m = std::floor(std::fabs(q));
    if (m > 1e15) m = 1e15;
    const std::int64_t mi = static_cast<std::int64_t>(m);
    std::int64_t kk = 2 * mi + 1;
    if (kk < p.k_min) kk = p.k_min;
    std::int64_t ss;
    if (p.reference_exact) {
      double f = std::floor(q);
      if (f > 1e15) f = 1e15;  // a tiny beta: t / beta beyond int64 (the shift is clamped below anyway)
      if (f < -1e15) f = -1e15;
      ss = static_cast<std::int64_t>(t > 0.0 ? f : f + 1.0);
    } else {
      ss = static_cast<std::int64_t>(q < 0 ? -m : m);
    }
    const std::int64_t half = kk / 2;
    if (ss > half) ss = half;
    if (ss < -half) ss = -half;
    *k = kk;
    *s = ss;
  }
};

}  // namespace spatial
}  // namespace kvevict
