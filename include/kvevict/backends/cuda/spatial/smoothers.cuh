// IWYU pragma: private, include "kvevict/cuda.cuh"
// The built-in spatial smoothers on CUDA, one specialisation each (kernels in
// backends/cuda/select.cuh):
//   spatial::none             the reduced rows are final
//   spatial::avg_pool         box filter with zero padding from fp64 prefix sums (prefix + box kernels)
//   spatial::adaptive_window  the same box filter, kernel and shift from the row's drift, replicate padding
//   spatial::max_pool         centred sliding max, direct O(k) per output
// One file: avg_pool and adaptive_window share the prefix-sum box filter, and each specialisation
// is a few lines.
#pragma once

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cuda {

template <>
struct spatial_impl<spatial::none> : spatial_impl_base {
  static status smooth(const spatial::none::params&, const smooth_job& j, const scratch&, const float** out) {
    *out = j.scores;
    return {};
  }
};

template <>
struct spatial_impl<spatial::max_pool> : spatial_impl_base {
  struct scratch {
    float* out = nullptr;  ///< [rows][S]
  };
  static scratch carve(workspace_carver& c, const layer_shape& sh, const spatial::max_pool::params&) {
    scratch s;
    s.out = c.carve<float>(carve_count(sh.rows * sh.S));
    return s;
  }
  template <int Unused = 0>  // a template, as the kernels: compiled only where a policy uses it
  static status smooth(const spatial::max_pool::params& p, const smooth_job& j, const scratch& s, const float** out) {
    detail::max_pool_kernel<<<detail::grid_for(j.sh.rows * j.sh.S), detail::block_threads, 0, j.stream>>>(
        p.kernel, j.scores, s.out, j.sh.rows, j.sh.S, j.pb.plans, j.pb.need);
    KVEVICT_CUDA_CHECK_LAUNCH();
    *out = s.out;
    return {};
  }
};

namespace detail {
/// avg_pool and adaptive_window: fp64 prefix sums of each scored row (block scan), then the box
/// filter box_kernel<Spatial> (zero padding, or the drift's kernel and shift with replicate padding).
template <class Spatial>
struct box_smoother : spatial_impl_base {
  struct scratch {
    float* out = nullptr;   ///< [rows][S]
    double* pre = nullptr;  ///< [rows][S + 1]
  };
  static scratch carve(workspace_carver& c, const layer_shape& sh, const typename Spatial::params&) {
    scratch s;
    s.out = c.carve<float>(carve_count(sh.rows * sh.S));
    s.pre = c.carve<double>(carve_count(sh.rows * (sh.S + 1)));
    return s;
  }
  static status smooth(const typename Spatial::params& p, const smooth_job& j, const scratch& s, const float** out) {
    const std::int64_t rows = j.sh.rows, S = j.sh.S;
    prefix_kernel<<<static_cast<unsigned>(rows), block_threads, 0, j.stream>>>(j.scores, s.pre, S, j.pb.plans, j.pb.need);
    KVEVICT_CUDA_CHECK_LAUNCH();
    box_kernel<Spatial><<<grid_for(rows * S), block_threads, 0, j.stream>>>(p, j.scores, s.pre, j.drift, s.out, rows, S, j.pb.plans,
                                                                           j.pb.need);
    KVEVICT_CUDA_CHECK_LAUNCH();
    *out = s.out;
    return {};
  }
};
}  // namespace detail

template <>
struct spatial_impl<spatial::avg_pool> : detail::box_smoother<spatial::avg_pool> {};
template <>
struct spatial_impl<spatial::adaptive_window> : detail::box_smoother<spatial::adaptive_window> {};

}  // namespace cuda
}  // namespace kvevict
