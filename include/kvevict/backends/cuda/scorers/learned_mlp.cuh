// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::learned_mlp on CUDA (LKV-T, docs/lkv.md): u = b2 + w2 . act(W1 [k ; v] + b1) per
// token of every scored KV head (lkv_mlp_kernel, a shared-memory tiled fp64 GEMM), written to
// its Gq query-head rows. The weights must be device memory (cuda::lkv_device_tables,
// kvevict/backends/cuda/learned.cuh).
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers.cuh"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::learned_mlp> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  using Scorer = scorers::learned_mlp;

  /// The weights live on the device and match the layer's shapes.
  template <class T>
  static status check(const Scorer::params& p, const layer_inputs<T>& in) {
    if (!p.on_device)
      return status::error(errc::invalid_argument,
                           "scorer.on_device = false: the CUDA backend needs the LKV weights in device memory (cuda::lkv_device_tables)");
    KVEVICT_TRY(Scorer::check_layer_shape(p, in.kv_heads(), in.head_dim(), in.layer_idx, in.num_layers));
    return {};
  }

  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch&) {
    const layer_shape& sh = job.sh;
    const auto& sp = job.p->scorer;
    const int layer = sp.layer >= 0 ? sp.layer : job.in->layer_idx;
    detail::lkv_mlp_args m;
    m.block = Scorer::block_floats(sp.head_dim, sp.hidden);
    m.w = sp.weights + static_cast<std::int64_t>(layer) * sp.kv_heads * m.block;
    m.hidden = sp.hidden;
    m.relu = sp.activation == lkv_activation::relu ? 1 : 0;
    const dim3 g(detail::ceil_div(sh.S, detail::lkv_tile_tokens), static_cast<unsigned>(sh.B * sh.Hkv));
    if (sh.S > 0)
      detail::lkv_mlp_kernel<T><<<g, detail::block_threads, 0, job.stream>>>(job.in->keys, job.in->values, job.in->pages, job.pb.len_kv,
                                                                             job.pb.needkv, sh.Hkv, sh.Gq, sh.S, m, job.rows);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};

}  // namespace cuda
}  // namespace kvevict
