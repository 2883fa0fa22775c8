// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::attention_weight (SnapKV, Li et al. 2024): the temporal-smoothed
// window attention a[n] = sum_j c_j A[j, n] of every query head (max_j A[j, n] with a row-maximum
// smoother, temporal::maximum / defensive), the shared window loop as is.
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::attention_weight> : detail::window_scorer<scorer_impl<scorers::attention_weight>>, detail::window_hooks {
  using detail::window_scorer<scorer_impl<scorers::attention_weight>>::score;
};

}  // namespace cpu
}  // namespace kvevict
