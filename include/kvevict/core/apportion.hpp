// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Exact, deterministic integer apportionment (largest remainder), used by every head-wise
// budgeter: integer budgets that sum EXACTLY to the requested total, never above a head's cap.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/core/config.hpp"

namespace kvevict {
namespace detail {

/// out[i] = floor(share[i]) plus one unit for the largest fractional parts until
/// sum(out) == total; ties go to the lower index; 0 <= out[i] <= cap[i] (cap may be null:
/// no cap). Requires sum(cap) >= total (when caps are given) and total >= 0. Shares that are
/// negative or not finite count as 0. O(n^2) worst case for the remainder loop, n is the
/// number of heads (small). Works on host and device.
KVEVICT_HOST_DEVICE inline void apportion(const double* share, const std::int64_t* cap, std::int64_t n,
                                          std::int64_t total, std::int64_t* out) {
  std::int64_t assigned = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double s = share[i];
    if (!(s > 0.0) || !(s < 9.0e18)) s = (s >= 9.0e18) ? 9.0e18 : 0.0;
    std::int64_t f = static_cast<std::int64_t>(std::floor(s));
    if (cap && f > cap[i]) f = cap[i];
    out[i] = f;
    assigned += f;
  }
  // Too many (rounding of the shares): remove from the smallest fractional parts, highest index first.
  while (assigned > total) {
    std::int64_t best = -1;
    double best_frac = 2.0;
    for (std::int64_t i = n - 1; i >= 0; --i) {
      if (out[i] <= 0) continue;
      double fr = share[i] - std::floor(share[i]);
      if (!(fr >= 0.0)) fr = 0.0;
      if (fr < best_frac) {
        best_frac = fr;
        best = i;
      }
    }
    if (best < 0) break;
    --out[best];
    --assigned;
  }
  // Too few: one unit each to the largest fractional parts (ties: lower index), cycling.
  while (assigned < total) {
    std::int64_t best = -1;
    double best_frac = -1.0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (cap && out[i] >= cap[i]) continue;
      double s = share[i];
      // A head that already got its rounded-up unit ranks by what it still lacks.
      double fr = (s > 0.0 && s < 9.0e18) ? s - static_cast<double>(out[i]) : -0.5;
      if (fr > best_frac) {
        best_frac = fr;
        best = i;
      }
    }
    if (best < 0) break;  // every head at its cap
    ++out[best];
    ++assigned;
  }
}

}  // namespace detail
}  // namespace kvevict
