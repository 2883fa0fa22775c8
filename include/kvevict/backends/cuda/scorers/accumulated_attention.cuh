// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::accumulated_attention on CUDA (H2O): the window attention summed over the window rows
// by the temporal weights, optionally divided by the number of rows that see each key
// (normalize_by_visible), backends/cuda/scorers/window_attention.cuh.
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers/window_attention.cuh"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::accumulated_attention> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  using scratch = detail::window_scratch;
  static scratch carve(workspace_carver& c, const layer_shape& sh, const scorers::accumulated_attention::params&) {
    return scratch::carve(c, sh);
  }
  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch& s) {
    return detail::score_window_attention(job, s, /*last_only=*/false, job.p->scorer.normalize_by_visible ? 2 : 1);
  }
};

}  // namespace cuda
}  // namespace kvevict
