// IWYU pragma: private, include "kvevict/cuda.cuh"
// scorers::output_reconstruction on CUDA (ReST-KV): the window attention
// (backends/cuda/scorers/window_attention.cuh), then the reconstruction score in value space or
// through the W_O factors, "after" aggregation (z = sum a_bar v, per key ||R z - R v_n||, the
// exact dominant-token path) or "before" (per window row z_j, the row argmax's exact
// contribution, then the sum over rows). Kernels in backends/cuda/scorers.cuh; same math as
// the CPU backend.
#pragma once

#include <cstdint>

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers.cuh"
#include "kvevict/backends/cuda/scorers/window_attention.cuh"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cuda {

template <>
struct scorer_impl<scorers::output_reconstruction> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // reads K/V through cuda::head_rows
  using Scorer = scorers::output_reconstruction;

  struct scratch {
    detail::window_scratch win;
    float* abar = nullptr;    ///< [nq][S] aggregated attention ("after")
    float* vscale = nullptr;  ///< [nkv] power-of-two value scales
    float* rt = nullptr;      ///< [Hq][d][d] transposed W_O factors (use_wo)
    double* zpart = nullptr;  ///< [nq][nsz][d] split partials of z
    int nsz = 1;
    float* rzv = nullptr;   ///< [nq][d] R z
    float* RZ = nullptr;    ///< [nq][W][d] "before": R z_j
    double* rz2 = nullptr;  ///< [nq][W] |R z_j|^2
    float* amc = nullptr;   ///< [nq][W] the row argmax's contribution
  };

  static scratch carve(workspace_carver& c, const layer_shape& sh, const Scorer::params& p) {
    scratch s;
    s.win = detail::window_scratch::carve(c, sh);
    const std::int64_t nq = sh.nq, S = sh.S, W = sh.W, d = sh.d;
    s.abar = c.carve<float>(carve_count(nq * S));
    s.vscale = c.carve<float>(carve_count(sh.nkv));
    if (p.use_wo) s.rt = c.carve<float>(carve_count(static_cast<std::int64_t>(sh.Hq) * d * d));
    std::int64_t nz = (S + 4095) / 4096;
    if (nz > 64) nz = 64;
    if (nz < 1) nz = 1;
    s.nsz = static_cast<int>(nz);
    s.zpart = c.carve<double>(carve_count(nq * nz * d));
    s.rzv = c.carve<float>(carve_count(nq * d));
    s.RZ = c.carve<float>(carve_count(nq * W * d));
    s.rz2 = c.carve<double>(carve_count(nq * W));
    s.amc = c.carve<float>(carve_count(nq * W));
    return s;
  }

  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch& s) {
    using namespace detail;
    const auto& sp = job.p->scorer;
    const layer_shape& sh = job.sh;
    const cudaStream_t st = job.stream;
    const unsigned T256 = block_threads;
    window_pass<T> wp;
    KVEVICT_TRY(window_attention_begin(job, s.win, /*last_only=*/false, &wp));
    const head_args<T>& a = wp.a;
    const int nq = wp.nq, d = sh.d;
    const std::int64_t W = sh.W;
    const window_scratch& ws = s.win;
    lor_args o;
    o.vscale = s.vscale;
    o.rt = sp.use_wo ? s.rt : nullptr;
    o.tau = sp.tau;
    o.include_window = sp.include_window_in_output ? 1 : 0;
    value_scale_kernel<T><<<sh.B * sh.Hkv, T256, 0, st>>>(job.in->values, job.in->pages, job.pb.len_kv, job.pb.needkv, sh.Hkv, s.vscale);
    KVEVICT_CUDA_CHECK_LAUNCH();
    if (sp.use_wo) {
      const std::int64_t nr = static_cast<std::int64_t>(sh.Hq) * d * d;
      stage_rt_kernel<<<grid_for(nr), T256, 0, st>>>(job.in->wo_factor, s.rt, nr);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    if (sp.aggregation == Scorer::mode::after) {
      attn_accum_kernel<T><<<wp.gkeys, T256, wp.qsmem, st>>>(a, ws.rm, ws.rz, 0, s.abar);
      KVEVICT_CUDA_CHECK_LAUNCH();
      lor_z_partial_kernel<T><<<dim3(s.nsz, nq), T256, 0, st>>>(a, o, s.abar, s.nsz, s.zpart);
      KVEVICT_CUDA_CHECK_LAUNCH();
      lor_z_finalize_kernel<T><<<nq, T256, 0, st>>>(a, o, s.nsz, s.zpart, s.rzv);
      KVEVICT_CUDA_CHECK_LAUNCH();
      lor_after_dist_kernel<T><<<wp.gwarp, T256, 0, st>>>(a, o, s.abar, s.rzv, job.rows);
      KVEVICT_CUDA_CHECK_LAUNCH();
      lor_after_dominant_kernel<T><<<nq, T256, 0, st>>>(a, o, ws.rm, ws.rz, s.abar, job.rows);
      KVEVICT_CUDA_CHECK_LAUNCH();
    } else {
      lor_before_row_kernel<T><<<dim3(static_cast<unsigned>(W), nq), T256, 0, st>>>(a, o, ws.rm, ws.rz, ws.ra, s.RZ, s.rz2, s.amc);
      KVEVICT_CUDA_CHECK_LAUNCH();
      lor_before_acc_kernel<T><<<wp.gwarp, T256, 0, st>>>(a, o, ws.rm, ws.rz, ws.ra, s.RZ, s.rz2, s.amc, job.rows);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    return window_attention_end(job, ws, wp);
  }
};

}  // namespace cuda
}  // namespace kvevict
