// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::attention_weight on CUDA (SnapKV, PyramidKV, AdaKV): the window attention aggregated
// by the temporal weights, sum_j c_j A[j, n] (backends/cuda/scorers/window_attention.cuh).
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers/window_attention.cuh"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::attention_weight> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  using scratch = detail::window_scratch;
  static scratch carve(workspace_carver& c, const layer_shape& sh, const scorers::attention_weight::params&) {
    return scratch::carve(c, sh);
  }
  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch& s) {
    return detail::score_window_attention(job, s, /*last_only=*/false, /*mode=*/1);
  }
};

}  // namespace cuda
}  // namespace kvevict
