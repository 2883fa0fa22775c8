// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::key_norm on CUDA: -||k_n|| per token (key_norm_kernel, fp64 warp reduction), query-free.
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers.cuh"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::key_norm> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch&) {
    const layer_shape& sh = job.sh;
    const dim3 g(detail::ceil_div(sh.S, detail::block_warps), static_cast<unsigned>(sh.B * sh.Hkv * sh.Gq));
    if (sh.S > 0)
      detail::key_norm_kernel<T><<<g, detail::block_threads, 0, job.stream>>>(job.in->keys, job.in->pages, job.pb.len_kv, job.pb.needkv, sh.Hkv,
                                                                              sh.Gq, sh.S, job.rows);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};

}  // namespace cuda
}  // namespace kvevict
