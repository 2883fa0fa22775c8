// IWYU pragma: private, include "kvevict/cuda.cuh"
// budgeters::adakv on CUDA (score-driven): after smoothing, one block per sequence takes the
// global top-T over the concatenated candidates of its heads (block radix select; ties: lower
// head, lower index), counts the winners per head and runs budgeters::adakv::apportion_budgets
// (the CPU's own host-device code) on thread 0 (adakv_kernel, backends/cuda/select.cuh).
#pragma once

#include <cstdint>

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/policies/budgeters.hpp"

namespace kvevict {
namespace cuda {

template <>
struct budgeter_impl<budgeters::adakv> : budgeter_impl_base {
  struct scratch {
    long long* candprefix = nullptr;        ///< [B][H + 1] candidate prefix counts
    unsigned long long* winners = nullptr;  ///< [rows]
    double* share = nullptr;                ///< [rows]
    std::int64_t* cap = nullptr;            ///< [rows]
    std::int64_t* extra = nullptr;          ///< [rows]
  };
  static scratch carve(workspace_carver& c, const layer_shape& sh, const budgeters::adakv::params&) {
    scratch s;
    s.candprefix = c.carve<long long>(carve_count(static_cast<std::int64_t>(sh.B) * (sh.H + 1)));
    s.winners = c.carve<unsigned long long>(carve_count(sh.rows));
    s.share = c.carve<double>(carve_count(sh.rows));
    s.cap = c.carve<std::int64_t>(carve_count(sh.rows));
    s.extra = c.carve<std::int64_t>(carve_count(sh.rows));
    return s;
  }
  template <int Unused = 0>  // a template, as the kernels: compiled only where a policy uses it
  static status score_budgets(const budgeters::adakv::params& p, const budget_job& j, const scratch& s) {
    detail::adakv_kernel<<<j.sh.B, detail::block_threads, 0, j.stream>>>(p, j.pb.plans, j.scores, j.sh.H, j.sh.S, s.candprefix,
                                                                          s.winners, s.share, s.cap, s.extra, j.budgets);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};

}  // namespace cuda
}  // namespace kvevict
