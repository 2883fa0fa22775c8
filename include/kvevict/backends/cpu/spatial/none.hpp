// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of spatial::none: the row is left as it is.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/spatial/filters.hpp"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cpu {

template <>
struct spatial_impl<spatial::none> {
  static void smooth(const spatial::none::params&, float*, std::int64_t, double, float*, double*, std::int64_t*) {}
};

}  // namespace cpu
}  // namespace kvevict
