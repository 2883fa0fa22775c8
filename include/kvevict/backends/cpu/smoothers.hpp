// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU implementations of the spatial smoothers (cpu::spatial_impl<Spatial>, one file each
// under backends/cpu/spatial/; this is the CPU smoother list), the legacy smooth() hook of a
// user's smoother, and smooth_row, a convenience for tests and benchmarks (the evictor calls the
// trait).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/spatial/adaptive_window.hpp"
#include "kvevict/backends/cpu/spatial/avg_pool.hpp"
#include "kvevict/backends/cpu/spatial/filters.hpp"
#include "kvevict/backends/cpu/spatial/max_pool.hpp"
#include "kvevict/backends/cpu/spatial/none.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// A user smoother's legacy CPU hook: static void smooth(const params&, const float* in, float* out, int64 n).
template <class S, class = void>
struct has_smooth_hook : std::false_type {};
template <class S>
struct has_smooth_hook<S, std::void_t<decltype(S::smooth(std::declval<const typename S::params&>(), std::declval<const float*>(),
                                                         std::declval<float*>(), std::int64_t{}))>> : std::true_type {};

}  // namespace detail

/// A smoother with the legacy hook needs no specialisation: its output is sanitised (NaN ranks
/// below everything, +-inf saturated to +-FLT_MAX) and copied back.
template <class S>
struct spatial_impl<S, std::enable_if_t<detail::has_smooth_hook<S>::value>> {
  static void smooth(const typename S::params& p, float* x, std::int64_t n, double, float* tmp, double*, std::int64_t*) {
    if (n <= 0) return;
    S::smooth(p, x, tmp, n);
    for (std::int64_t i = 0; i < n; ++i)
      if (!(tmp[i] == tmp[i])) tmp[i] = -std::numeric_limits<float>::max();
      else if (tmp[i] > std::numeric_limits<float>::max()) tmp[i] = std::numeric_limits<float>::max();
      else if (tmp[i] < -std::numeric_limits<float>::max()) tmp[i] = -std::numeric_limits<float>::max();
    std::copy(tmp, tmp + n, x);
  }
};

namespace detail {

/// Apply spatial smoother S to x[0, n) in place (cpu::spatial_impl<S>). `drift` is the
/// adaptive-window statistic t. Scratch: tmp (n floats), pre (n+1 doubles), dq (n int64).
template <class S>
inline void smooth_row(const typename S::params& p, float* x, std::int64_t n, double drift, float* tmp, double* pre,
                       std::int64_t* dq) {
  spatial_impl<S>::smooth(p, x, n, drift, tmp, pre, dq);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
