// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of spatial::max_pool: centred max of odd width k, -inf padding.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/spatial/filters.hpp"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cpu {

template <>
struct spatial_impl<spatial::max_pool> {
  static void smooth(const spatial::max_pool::params& p, float* x, std::int64_t n, double, float* tmp, double*, std::int64_t* dq) {
    if (n <= 0) return;
    detail::max_filter(x, tmp, n, p.kernel, dq);
    std::copy(tmp, tmp + n, x);
  }
};

}  // namespace cpu
}  // namespace kvevict
