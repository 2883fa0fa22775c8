// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::last_query on CUDA (TOVA): the attention of the last window row only
// (backends/cuda/scorers/window_attention.cuh with last_only).
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers/window_attention.cuh"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::last_query> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  using scratch = detail::window_scratch;
  static scratch carve(workspace_carver& c, const layer_shape& sh, const scorers::last_query::params&) {
    return scratch::carve(c, sh);
  }
  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch& s) {
    return detail::score_window_attention(job, s, /*last_only=*/true, /*mode=*/1);
  }
};

}  // namespace cuda
}  // namespace kvevict
