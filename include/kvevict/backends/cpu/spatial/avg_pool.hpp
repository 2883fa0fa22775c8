// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of spatial::avg_pool (SnapKV): centred mean of odd width k, zero padding counted.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/spatial/filters.hpp"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cpu {

template <>
struct spatial_impl<spatial::avg_pool> {
  static void smooth(const spatial::avg_pool::params& p, float* x, std::int64_t n, double, float* tmp, double* pre, std::int64_t*) {
    if (n <= 0) return;
    detail::box_filter(x, tmp, n, p.kernel, 0, false, pre);
    std::copy(tmp, tmp + n, x);
  }
};

}  // namespace cpu
}  // namespace kvevict
