// Stage drivers for the CPU benchmarks: run ONE stage of kvevict's CPU pipeline over a whole
// layer exactly as evictor<Policy, cpu::backend>::run() drives it (same detail:: functions,
// same OpenMP split over (sequence, KV head) tasks, same per-thread scratch), so that each
// stage can be timed alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/bench_data.hpp"
#include "kvevict/cpu.hpp"

namespace kvevict_bench {

/// Scoring stage (scorer + temporal aggregation, before GQA reduction) of Policy for every
/// (sequence, KV head) of a layer: G score rows of length L per KV head into `rows`
/// (kv_heads * G * L floats). drift_topk > 0 also computes the adaptive-window drift (as the
/// ReST-KV preset does with K = B - w). Memory: the per-thread head_scratch the evictor
/// carves for the backend's score_block_bytes (the logits of a block of window rows of the
/// group, at most 16 MiB by default; K and V tiles; one 256-token projection tile; one drift
/// row of L floats) plus the output rows.
template <class Policy, class T>
struct scorer_stage {
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  kvevict::cpu::backend be{};
  int nt = 1;
  std::int64_t drift_topk = 0;
  aligned_buffer ws;
  std::vector<kvevict::cpu::detail::head_scratch> scratch;
  std::vector<float> rows;
  std::vector<double> drift;
  bool full_y_ = false;

  /// `p`: the parameters run() will get (they decide the scratch, e.g. ReST-KV's "before" mode
  /// holds every token's value projections, "after" mode one tile).
  /// `block_bytes`: the backend's score_block_bytes (0: its default).
  scorer_stage(const kvevict::layer_inputs<T>& in, std::int64_t drift_k, const typename Policy::params& p = Policy::defaults(),
               std::size_t block_bytes = 0)
      : drift_topk(drift_k) {
    if (block_bytes > 0) be.score_block_bytes = block_bytes;
    nt = kvevict::cpu::detail::max_threads(be);
    const std::int64_t G = in.group_size();
    const bool full_y = kvevict::cpu::detail::needs_full_projection<Scorer>(p.scorer);
    full_y_ = full_y;
    kvevict::detail::workspace_carver counter;
    kvevict::cpu::detail::head_scratch tmp;
    using impl = kvevict::cpu::scorer_impl<Scorer>;
    kvevict::cpu::detail::head_scratch::options so;  // as the evictor carves it
    so.full_y = full_y;
    so.block_bytes = be.score_block_bytes;
    so.full_kv = impl::full_kv();
    so.all_queries = impl::all_queries();
    so.rows_max = impl::block_rows_max(in.window());
    so.drift_row = drift_topk > 0;
    for (int t = 0; t < nt; ++t) tmp.carve(counter, in.capacity(), in.window(), in.head_dim(), G, so);
    ws = aligned_buffer(counter.bytes());
    kvevict::detail::workspace_carver c(ws.data);
    scratch.resize(static_cast<std::size_t>(nt));
    for (int t = 0; t < nt; ++t) scratch[static_cast<std::size_t>(t)].carve(c, in.capacity(), in.window(), in.head_dim(), G, so);
    rows.assign(static_cast<std::size_t>(in.batch() * in.q_heads() * in.capacity()), 0.0f);
    drift.assign(static_cast<std::size_t>(in.batch() * in.q_heads()), 0.0);
  }

  /// Bytes of scratch + output this stage holds (what the evictor's workspace carves for it).
  std::size_t held_bytes() const { return ws.bytes + rows.size() * sizeof(float) + drift.size() * sizeof(double); }

  void run(const kvevict::layer_inputs<T>& in, const typename Policy::params& p) {
    if (kvevict::cpu::detail::needs_full_projection<Scorer>(p.scorer) && !full_y_)
      throw std::invalid_argument("scorer_stage: run() params need the full value projections; construct the stage with them");
    const std::int64_t Hkv = in.kv_heads(), G = in.group_size(), S = in.capacity();
    kvevict::cpu::detail::parallel_for(be, in.batch() * Hkv, [&](std::int64_t task, int tid) {
      const std::int64_t b = task / Hkv, h = task % Hkv;
      const std::int64_t L = in.length(b, h);
      kvevict::cpu::detail::head_job<Policy, T> job{&in, &p, b, h, L, std::min<std::int64_t>(in.window(), L), drift_topk};
      job.rows_per_block = kvevict::cpu::detail::block_rows(be.score_block_bytes, G, L, job.w);
      kvevict::cpu::detail::score_kv_head<Scorer, Temporal>(job, scratch[static_cast<std::size_t>(tid)],
                                                            rows.data() + task * G * S, drift.data() + task * G);
    });
  }
};

/// FLOPs of the output-reconstruction ("after", W_O factor) scorer for one layer, as the CPU
/// backend computes them: per query head 2 w L d (Q K^T) + 2 w L (EMA-weighted column sum)
/// + 2 L d^2 (Y = V R^T) + 2 L d (z) + 2 d^2 (R z) + 3 L d (||R z - Y_n||).
inline double lor_flops(std::int64_t L, std::int64_t W = kWindow) {
  const double l = static_cast<double>(L), w = static_cast<double>(W), d = static_cast<double>(kHeadDim);
  return static_cast<double>(kQHeads) * (2 * w * l * d + 2 * w * l + 2 * l * d * d + 2 * l * d + 2 * d * d + 3 * l * d);
}
/// FLOPs of the window attention (Q K^T only; softmax exps not counted) for one layer.
inline double window_attention_flops(std::int64_t L, std::int64_t W = kWindow) {
  return static_cast<double>(kQHeads) * 2.0 * static_cast<double>(W) * static_cast<double>(L) * kHeadDim;
}

}  // namespace kvevict_bench
