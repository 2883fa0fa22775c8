// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of spatial::adaptive_window (ReST-KV, ICLR 2026, Sec. 3.4): the kernel width
// and shift come from the drift (adaptive_window::kernel_and_shift, host-device, shared with
// CUDA); a replicate-padded shifted box filter.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/spatial/filters.hpp"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cpu {

template <>
struct spatial_impl<spatial::adaptive_window> {
  static void smooth(const spatial::adaptive_window::params& p, float* x, std::int64_t n, double drift, float* tmp, double* pre,
                     std::int64_t*) {
    if (n <= 0) return;
    std::int64_t k, s;
    spatial::adaptive_window::kernel_and_shift(p, drift, &k, &s);
    detail::box_filter(x, tmp, n, k, s, true, pre);
    std::copy(tmp, tmp + n, x);
  }
};

}  // namespace cpu
}  // namespace kvevict
