// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU filters the spatial smoothers run over a score row x[0, n): O(n) whatever the kernel
// width (direct fp64 sums for narrow kernels, fp64 prefix sums for wide ones; a monotonic deque
// for the max).
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvevict {
namespace cpu {
namespace detail {

/// y[i] = (1/k) * sum_{j=i-k/2+s}^{i+k/2+s} x'[j], x'[j] = x[j] inside, outside: 0 (zero
/// padding) or x[clamp(j)] (replicate). `pre` is n+1 doubles of scratch.
inline void box_filter(const float* x, float* y, std::int64_t n, std::int64_t k, std::int64_t shift, bool replicate,
                       double* pre) {
  if (n <= 0) return;
  const std::int64_t half = k / 2;
  auto padded = [&](std::int64_t j) -> double {
    if (j < 0) return replicate ? static_cast<double>(x[0]) : 0.0;
    if (j > n - 1) return replicate ? static_cast<double>(x[n - 1]) : 0.0;
    return static_cast<double>(x[j]);
  };
  if (k <= 64) {
    // Narrow kernels (SnapKV 5..7, AWS k_min 5..21): each window summed directly in fp64, so a
    // tiny score next to a huge one (an attention sink) is not lost to prefix-sum cancellation.
    for (std::int64_t i = 0; i < n; ++i) {
      double s = 0.0;
      for (std::int64_t j = i - half + shift; j <= i + half + shift; ++j) s += padded(j);
      y[i] = static_cast<float>(s / static_cast<double>(k));
    }
    return;
  }
  pre[0] = 0.0;
  for (std::int64_t i = 0; i < n; ++i) pre[i + 1] = pre[i] + x[i];
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t lo = i - half + shift, hi = i + half + shift;  // inclusive
    const std::int64_t a = std::max<std::int64_t>(lo, 0), c = std::min<std::int64_t>(hi, n - 1);
    double s = a <= c ? pre[c + 1] - pre[a] : 0.0;
    if (replicate) {
      if (lo < 0) s += static_cast<double>(std::min<std::int64_t>(-lo, k)) * x[0];
      if (hi > n - 1) s += static_cast<double>(std::min<std::int64_t>(hi - (n - 1), k)) * x[n - 1];
    }
    y[i] = static_cast<float>(s / static_cast<double>(k));
  }
}

/// Centred sliding max of odd width k, -inf padding. `dq` is n int64 of scratch.
inline void max_filter(const float* x, float* y, std::int64_t n, std::int64_t k, std::int64_t* dq) {
  const std::int64_t half = k / 2;
  std::int64_t head = 0, tail = 0, next = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t hi = std::min<std::int64_t>(i + half, n - 1);
    while (next <= hi) {
      while (tail > head && !(x[dq[tail - 1]] > x[next])) --tail;
      dq[tail++] = next++;
    }
    while (dq[head] < i - half) ++head;
    y[i] = x[dq[head]];
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
