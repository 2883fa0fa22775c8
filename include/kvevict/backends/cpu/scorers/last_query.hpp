// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::last_query (TOVA, Oren et al. 2024): the attention of the newest
// window row only (c_{w-1} = 1, the other rows are not computed).
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::last_query> : detail::window_scorer<scorer_impl<scorers::last_query>>, detail::window_hooks {
  using detail::window_scorer<scorer_impl<scorers::last_query>>::score;
  static constexpr bool last_only = true;
};

}  // namespace cpu
}  // namespace kvevict
