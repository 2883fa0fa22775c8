// IWYU pragma: private, include "kvevict/cuda.cuh"
// What every window-attention scorer on CUDA shares (attention_weight, accumulated_attention,
// last_query, output_reconstruction): its scratch, the first stage (the temporal weights
// c_j through temporal_impl, fp32 query staging, the split-key softmax statistics of every
// window row) and the last one (the adaptive-window drift per query head when the spatial
// smoother reads it). A scorer calls window_attention_begin(), launches its own kernels on the
// statistics (kernels in backends/cuda/scorers.cuh), then window_attention_end().
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/scorers.cuh"

namespace kvevict {
namespace cuda {
namespace detail {

/// Workspace of the window attention: temporal weights, staged queries, the split partials and
/// merged statistics (max logit, sum of the other keys' exp, argmax) of every window row, and
/// the drift scratch when the smoother reads the drift.
struct window_scratch {
  float* cw = nullptr;  ///< [nkv][W] temporal weights over the effective window
  float* qs = nullptr;  ///< [nq][W][d] fp32 queries
  double *pm = nullptr, *pz = nullptr;
  int* pa = nullptr;  ///< split partials [nq][nsplit][W]
  double *rm = nullptr, *rz = nullptr;
  int* ra = nullptr;  ///< merged statistics [nq][W]
  int nsplit = 1;
  double* rowmean = nullptr;  ///< drift: [nq][W] mean index of each row's top-K
  float* dbuf = nullptr;      ///< drift: [drift_blocks][S] one probability row per block
  std::int64_t drift_blocks = 1;

  static window_scratch carve(workspace_carver& c, const layer_shape& sh) {
    window_scratch w;
    const std::int64_t W = sh.W, S = sh.S, nq = sh.nq;
    w.cw = c.carve<float>(carve_count(sh.nkv * W));
    w.qs = c.carve<float>(carve_count(nq * W * sh.d));
    std::int64_t ns = (2048 + W - 1) / (W > 0 ? W : 1);
    const std::int64_t smax = (S + 63) / 64;
    if (ns > smax) ns = smax;
    if (ns > 64) ns = 64;
    if (ns < 1) ns = 1;
    w.nsplit = static_cast<int>(ns);
    w.pm = c.carve<double>(carve_count(nq * ns * W));
    w.pz = c.carve<double>(carve_count(nq * ns * W));
    w.pa = c.carve<int>(carve_count(nq * ns * W));
    w.rm = c.carve<double>(carve_count(nq * W));
    w.rz = c.carve<double>(carve_count(nq * W));
    w.ra = c.carve<int>(carve_count(nq * W));
    if (sh.drift) {
      w.rowmean = c.carve<double>(carve_count(nq * W));
      std::int64_t nb = (std::int64_t{1} << 24) / (S > 0 ? S : 1);
      if (nb > nq * W) nb = nq * W;
      if (nb < 1) nb = 1;
      w.drift_blocks = nb;
      w.dbuf = c.carve<float>(carve_count(nb * S));
    }
    return w;
  }
};

/// The launch geometry of a scorer's kernels after window_attention_begin().
template <class T>
struct window_pass {
  head_args<T> a;         ///< the heads, staged queries and temporal weights
  dim3 gkeys;             ///< (ceil(S / 256), nq): thread per key (attn_accum_kernel)
  dim3 gwarp;             ///< (ceil(S / 8), nq): warp per key
  std::size_t qsmem = 0;  ///< dynamic shared memory of 32 staged query rows
  int nq = 0;             ///< query heads of the layer (B * Hq)
};

/// Temporal weights (last_only: the last row only, last_query), fp32 queries, split softmax
/// statistics (attn_stats_partial + combine into ws.rm / rz / ra).
template <class Policy, class T>
status window_attention_begin(const score_job<Policy, T>& job, const window_scratch& ws, bool last_only, window_pass<T>* wp) {
  using Temporal = typename Policy::temporal_smoother;
  const layer_inputs<T>& in = *job.in;
  const layer_shape& sh = job.sh;
  const cudaStream_t st = job.stream;
  const unsigned T256 = block_threads;
  const int B = sh.B, Hkv = sh.Hkv, Hq = sh.Hq, d = sh.d;
  const std::int64_t W = sh.W, S = sh.S;
  const int nq = B * Hq;
  KVEVICT_TRY(temporal_impl<Temporal>::weights(job.p->temporal, job.pb.len_kv, static_cast<std::int64_t>(B) * Hkv, W, last_only,
                                               ws.cw, st));
  stage_queries_kernel<T><<<grid_for(in.queries.size()), T256, 0, st>>>(in.queries, ws.qs, in.queries.size());
  KVEVICT_CUDA_CHECK_LAUNCH();
  head_args<T>& a = wp->a;
  a.keys = in.keys;
  a.values = in.values;
  a.pages = in.pages;
  a.q = ws.qs;
  a.len = job.pb.len_kv;
  a.needkv = job.pb.needkv;
  a.cw = ws.cw;
  a.Hkv = Hkv;
  a.Hq = Hq;
  a.G = Hq / Hkv;
  a.W = static_cast<int>(W);
  a.d = d;
  a.S = S;
  a.scale = static_cast<double>(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  a.last_only = last_only ? 1 : 0;
  wp->qsmem = static_cast<std::size_t>(32) * d * sizeof(float);
  wp->nq = nq;
  const std::int64_t zchunks = (W + 31) / 32;
  const unsigned gz = static_cast<unsigned>(zchunks < 65535 ? (zchunks > 0 ? zchunks : 1) : 65535);
  attn_stats_partial_kernel<T><<<dim3(ws.nsplit, nq, gz), T256, wp->qsmem, st>>>(a, ws.nsplit, ws.pm, ws.pz, ws.pa);
  KVEVICT_CUDA_CHECK_LAUNCH();
  attn_stats_combine_kernel<T><<<grid_for(static_cast<std::int64_t>(nq) * W), T256, 0, st>>>(a, ws.nsplit, nq, ws.pm, ws.pz, ws.pa,
                                                                                              ws.rm, ws.rz, ws.ra);
  KVEVICT_CUDA_CHECK_LAUNCH();
  wp->gkeys = dim3(ceil_div(S > 0 ? S : 1, block_threads), nq);
  wp->gwarp = dim3(ceil_div(S > 0 ? S : 1, block_warps), nq);
  return {};
}

/// The adaptive-window drift of every query head into job.drift (only when the smoother reads
/// it, job.sh.drift): per window row the mean index of its top-K probabilities (drift_rows), then
/// front half minus rear half (drift_finalize).
template <class Policy, class T>
status window_attention_end(const score_job<Policy, T>& job, const window_scratch& ws, const window_pass<T>& wp) {
  if (!job.sh.drift) return {};
  const cudaStream_t st = job.stream;
  const std::int64_t total = static_cast<std::int64_t>(wp.nq) * job.sh.W;
  drift_rows_kernel<T><<<static_cast<unsigned>(ws.drift_blocks), block_threads, 0, st>>>(wp.a, ws.rm, ws.rz, job.pb.plankv, total,
                                                                                        ws.dbuf, ws.rowmean);
  KVEVICT_CUDA_CHECK_LAUNCH();
  drift_finalize_kernel<T><<<ceil_div(wp.nq, 64), 64, 0, st>>>(wp.a, wp.nq, ws.rowmean, job.drift);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

/// The attention-weight family (attention_weight, accumulated_attention, last_query): window
/// attention, then the fused softmax + temporal aggregation sum_j c_j A[j, n] into job.rows
/// (attn_accum_kernel; mode 1: saturated, mode 2: divided by the visible count first), then the
/// drift.
template <class Policy, class T>
status score_window_attention(const score_job<Policy, T>& job, const window_scratch& ws, bool last_only, int mode) {
  window_pass<T> wp;
  KVEVICT_TRY(window_attention_begin(job, ws, last_only, &wp));
  attn_accum_kernel<T><<<wp.gkeys, block_threads, wp.qsmem, job.stream>>>(wp.a, ws.rm, ws.rz, mode, job.rows);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return window_attention_end(job, ws, wp);
}

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
