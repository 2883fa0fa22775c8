// IWYU pragma: private, include "kvevict/cuda.cuh"
// selectors::topk on CUDA: one block per row keeps the sinks and the recent window by rule and
// the best k = budget - protected candidates by block radix select on an order-preserving key of
// the score (NaN lowest, -0 = +0, ties to the lower index), written ascending with their
// positions (select_kernel, backends/cuda/select.cuh).
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/policies/selectors.hpp"

namespace kvevict {
namespace cuda {

template <>
struct selector_impl<selectors::topk> : selector_impl_base {
  template <int Unused = 0>  // a template, as the kernels: compiled only where a policy uses it
  static status select(const selectors::topk::params&, const select_job& j, const scratch&) {
    detail::select_kernel<<<static_cast<unsigned>(j.sh.rows), detail::block_threads, 0, j.stream>>>(
        j.pb.plans, j.budgets, j.pb.need, j.scores, j.sh.S, j.out.indptr, j.out.capacity, j.out.indices, j.out.positions, j.positions,
        j.sh.H, j.sh.Gout);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};

}  // namespace cuda
}  // namespace kvevict
