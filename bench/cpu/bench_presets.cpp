// Whole-preset benchmarks: evictor<Preset, cpu::backend>::run() for one layer (batch 1,
// q_heads 32, kv_heads 8, d = 128, w = 32), float and bf16 storage, budget B =
// bench_budget(L) tokens per head (1024 for L >= 8k, L/4 below), published defaults
// (check_finite on: the run scans Q, K, V once for NaN/inf, as a user's call would).
//
// Cost model (per call): bytes = every input read once (K, V where the scorer reads them, the
// queries, the W_O factor) + the selection written; flops = the scorer's (cpu_stage.hpp):
//   restkv   lor_flops(L) (+ drift, smoothing, selection: no flops counted)
//   snapkv / adakv   window attention 2 * 32 w L d + 2 * 32 w L
//   lkv      lkv::full with a synthetic 32-layer table: the MLP, kv_heads * L * (4 * hidden * d + 4 * hidden)
//   lkv_scorer_scalar / lkv_scorer_blocked: that MLP alone on one layer, utility() per token vs
//            cpu::learned_mlp_rows::score_rows (one thread; same flops)
//   critical_adakv / defensivekv  (f32, 1k and 4k) SnapKV's window attention + the value norms
//            ||v W_O^h||_1 of every query head, 2 q_heads L d C with C = 4096 (W_O read once)
//   h2o      the whole prompt as window (W = L): 2 * 32 L^2 d + 2 * 32 L^2, i.e. what the
//            blocked CPU scorer computes (each 32-row block computes all L logits, the causal
//            upper triangle is masked after the product). O(L^2): measured at 1k and 4k only.
// Counters: extra_bytes = workspace_size() + the heap bytes run() allocates itself (peak,
// measured with the malloc counter of bench/common/alloc_counter.hpp around one run).
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "common/alloc_counter.hpp"
#include "common/bench_data.hpp"
#include "common/cpu_stage.hpp"
#include "kvevict/backends/cpu/learned.hpp"
#include "kvevict/cpu.hpp"

namespace kb = kvevict_bench;
using kvevict::bfloat16_t;

namespace {

template <class Preset, class T>
void run_preset(benchmark::State& st, std::int64_t W, double flops, const typename Preset::params& p = Preset::defaults(),
                std::int32_t num_layers = 0, int threads = 0) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<T>(L, W);
  auto in = data.inputs();
  if (num_layers > 0) in.num_layers = num_layers;  // layer 0 of a num_layers model (LKV's global budgets)
  if constexpr (kvevict::detail::scorer_needs_wo_matrix<typename Preset::scorer>::value) {
    static_assert(std::is_same<T, float>::value, "the W_O benchmarks are fp32");
    const std::vector<float>& wo = kb::wo_matrix();  // (C, q_heads * d), [out][in]
    in.wo = kvevict::strided_view<const float, 2>{wo.data(), {kb::kHidden, kb::kQHeads * kb::kHeadDim}, {kb::kQHeads * kb::kHeadDim, 1}};
  }
  kvevict::evictor<Preset, kvevict::cpu::backend> ev(p, kvevict::cpu::backend{threads});
  const auto budget = kvevict::budget_request::tokens(static_cast<std::int32_t>(kb::bench_budget(L)));
  const kvevict::status ok = ev.can_implement(in, budget);
  if (!ok.ok()) {
    st.SkipWithError(ok.message());
    return;
  }
  const std::size_t ws_bytes = ev.workspace_size(in);
  const std::int64_t cap = ev.max_selected(in, budget);
  kb::aligned_buffer ws(ws_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(in.batch() * ev.out_heads(in) + 1)), indices(static_cast<std::size_t>(cap));
  kvevict::selection_view sel{indptr.data(), indices.data(), nullptr, cap};
  // One untimed run under the heap counter.
  kb::alloc_counter::reset();
  kvevict::status s = ev.run(in, budget, sel, ws.data, ws.bytes);
  const std::int64_t heap = kb::alloc_counter::peak_extra();
  if (!s.ok()) {
    st.SkipWithError(s.message());
    return;
  }
  for (auto _ : st) {
    s = ev.run(in, budget, sel, ws.data, ws.bytes);
    benchmark::DoNotOptimize(indices.data());
    benchmark::ClobberMemory();
  }
  if (!s.ok()) st.SkipWithError(s.message());
  const double sz = sizeof(T), d = kb::kHeadDim;
  double bytes = kb::D(kb::kKvHeads * L) * d * sz + kb::D(kb::kQHeads * W) * d * sz + static_cast<double>(cap) * 4.0;
  if (Preset::scorer::needs_values) bytes += kb::D(kb::kKvHeads * L) * d * sz;
  if (Preset::scorer::needs_wo_factor(ev.params().scorer)) bytes += kb::kQHeads * d * d * 4.0;
  if constexpr (kvevict::detail::scorer_needs_wo_matrix<typename Preset::scorer>::value) bytes += kb::D(kb::kHidden) * kb::kQHeads * d * 4.0;
  kb::set_cost(st, static_cast<double>(L), bytes, flops);
  st.counters["workspace_bytes"] = static_cast<double>(ws_bytes);
  st.counters["extra_bytes"] = static_cast<double>(ws_bytes + static_cast<std::size_t>(heap));
  st.counters["kept"] = static_cast<double>(indptr.back());
}

double snap_flops(std::int64_t L, std::int64_t W) { return kb::window_attention_flops(L, W) + 2.0 * kb::D(kb::kQHeads * W * L); }

template <class T>
void BM_restkv(benchmark::State& st) {
  run_preset<kvevict::presets::restkv, T>(st, kb::kWindow, kb::lor_flops(st.range(0)));
}
template <class T>
void BM_snapkv(benchmark::State& st) {
  run_preset<kvevict::presets::snapkv, T>(st, kb::kWindow, snap_flops(st.range(0), kb::kWindow));
}
template <class T>
void BM_adakv(benchmark::State& st) {
  run_preset<kvevict::presets::adakv, T>(st, kb::kWindow, snap_flops(st.range(0), kb::kWindow));
}
/// The value norms ||v W_O^h||_1 of CriticalKV and DefensiveKV: every query head projects every value
/// to the hidden size, 2 q_heads L d C.
double value_norm_flops(std::int64_t L) { return 2.0 * kb::D(kb::kQHeads * L) * kb::kHeadDim * kb::D(kb::kHidden); }
void BM_critical_adakv(benchmark::State& st) {
  run_preset<kvevict::presets::critical_adakv, float>(st, kb::kWindow, snap_flops(st.range(0), kb::kWindow) + value_norm_flops(st.range(0)));
}
void BM_defensivekv(benchmark::State& st) {
  // + the pooling of every window row (G w L k adds, not counted)
  run_preset<kvevict::presets::defensivekv, float>(st, kb::kWindow, snap_flops(st.range(0), kb::kWindow) + value_norm_flops(st.range(0)));
}
template <class T>
void BM_h2o(benchmark::State& st) {
  run_preset<kvevict::presets::h2o, T>(st, st.range(0), snap_flops(st.range(0), st.range(0)));
}

/// Full LKV (learned MLP scorer + learned global head-wise budgets) with a synthetic table of
/// an 8B-class model's shape: 32 layers x 8 KV heads, head_dim 128, MLP hidden 32, seeded
/// weights (the cost does not depend on their values). flops: the MLP per token and KV head,
/// 2 * hidden * 2d (first layer) + 4 * hidden (activation-free count of the rest).
struct lkv_table {
  static constexpr std::int32_t layers = 32, hidden = 32;
  std::vector<float> weights, logits;
  lkv_table() {
    const std::int64_t n = static_cast<std::int64_t>(layers) * kb::kKvHeads;
    weights.resize(static_cast<std::size_t>(n * kvevict::scorers::learned_mlp::block_floats(kb::kHeadDim, hidden)));
    logits.resize(static_cast<std::size_t>(n));
    std::uint32_t x = 12345u;
    auto next = [&x] {
      x = x * 1664525u + 1013904223u;
      return static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
    };
    for (auto& w : weights) w = 0.1f * next();
    for (auto& z : logits) z = next();
  }
  kvevict::lkv::full::params params() const {
    auto p = kvevict::lkv::full::defaults();
    p.scorer.weights = weights.data();
    p.scorer.num_layers = layers;
    p.scorer.kv_heads = static_cast<std::int32_t>(kb::kKvHeads);
    p.scorer.head_dim = static_cast<std::int32_t>(kb::kHeadDim);
    p.scorer.hidden = hidden;
    p.budgeter.logits = logits.data();
    p.budgeter.num_layers = layers;
    p.budgeter.kv_heads = static_cast<std::int32_t>(kb::kKvHeads);
    return p;
  }
};
template <class T>
void BM_lkv(benchmark::State& st) {
  static const lkv_table table;
  const double flops = kb::D(kb::kKvHeads * st.range(0)) * (2.0 * lkv_table::hidden * 2.0 * kb::kHeadDim + 4.0 * lkv_table::hidden);
  run_preset<kvevict::lkv::full, T>(st, kb::kWindow, flops, table.params(), lkv_table::layers);
}

/// The LKV-T scorer alone on one layer's 8 KV heads (f32 K/V, the calling thread only, the
/// lkv_table MLPs of layer 0): lkv_scorer_scalar calls learned_mlp::utility token by token (the
/// definition; the CPU path until 2026-11-29), lkv_scorer_blocked calls cpu::learned_mlp_rows::score_rows
/// (what score_kv_head and lkv::score_tokens run; bit-identical scores). Same flops as preset_lkv.
template <bool Blocked>
void BM_lkv_scorer(benchmark::State& st) {
  static const lkv_table table;
  const std::int64_t L = st.range(0), d = kb::kHeadDim;
  const auto& data = kb::get_layer<float>(L, kb::kWindow);
  const kvevict::scorers::learned_mlp::params p = table.params().scorer;
  std::vector<float> out(static_cast<std::size_t>(kb::kKvHeads * L));
  for (auto _ : st) {
    for (std::int64_t h = 0; h < kb::kKvHeads; ++h) {
      const float* k = data.k.data() + h * L * d;
      const float* v = data.v.data() + h * L * d;
      float* o = out.data() + h * L;
      if (Blocked) {
        kvevict::cpu::learned_mlp_rows::score_rows(p, 0, h, k, v, L, d, o);
      } else {
        for (std::int64_t n = 0; n < L; ++n) o[n] = kvevict::scorers::learned_mlp::utility(p, 0, h, k + n * d, v + n * d);
      }
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double flops = kb::D(kb::kKvHeads * L) * (2.0 * lkv_table::hidden * 2.0 * kb::kHeadDim + 4.0 * lkv_table::hidden);
  kb::set_cost(st, kb::D(L), kb::D(2 * kb::kKvHeads * L * d * 4 + kb::kKvHeads * L * 4), flops);
}

/// A 1-thread SnapKV call (fp32) with the caller's OpenMP and Eigen at N threads, as
/// torch.set_num_threads(N) leaves OpenMP: cpu::detail::thread_scope keeps the call on its one
/// thread, so its time should match N = 1 (before it, Eigen parallelised the products inside:
/// 3.8-10.3x slower from Python). Caller settings restored after the benchmark.
template <int N>
void BM_caller_threads(benchmark::State& st) {
#if defined(_OPENMP)
  const int omp_saved = omp_get_max_threads(), eigen_saved = Eigen::nbThreads();
  omp_set_num_threads(N);
  Eigen::setNbThreads(N);
#endif
  run_preset<kvevict::presets::snapkv, float>(st, kb::kWindow, snap_flops(st.range(0), kb::kWindow), kvevict::presets::snapkv::defaults(), 0, 1);
#if defined(_OPENMP)
  omp_set_num_threads(omp_saved);
  Eigen::setNbThreads(eigen_saved);
#endif
}

int iters_preset(std::int64_t L) { return L >= 32768 ? 3 : 0; }
int iters_once(std::int64_t) { return 1; }
int iters_h2o(std::int64_t L) { return L >= 4096 ? 1 : 0; }
int iters_value_norms(std::int64_t L) { return L >= 4096 ? 2 : 0; }

struct registrar {
  registrar() {
    kb::register_seq("preset_restkv/f32", BM_restkv<float>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_restkv/bf16", BM_restkv<bfloat16_t>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_snapkv/f32", BM_snapkv<float>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_snapkv/bf16", BM_snapkv<bfloat16_t>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_adakv/f32", BM_adakv<float>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_adakv/bf16", BM_adakv<bfloat16_t>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_lkv/f32", BM_lkv<float>, kb::kSeqLens, iters_preset);
    kb::register_seq("preset_lkv/bf16", BM_lkv<bfloat16_t>, kb::kSeqLens, iters_preset);
    kb::register_seq("lkv_scorer_scalar/f32", BM_lkv_scorer<false>, {4096}, iters_once);
    kb::register_seq("lkv_scorer_blocked/f32", BM_lkv_scorer<true>, {4096, 32768}, nullptr);
    kb::register_seq("preset_critical_adakv/f32", BM_critical_adakv, {1024, 4096}, iters_value_norms);
    kb::register_seq("preset_defensivekv/f32", BM_defensivekv, {1024, 4096}, iters_value_norms);
    kb::register_seq("preset_h2o/f32", BM_h2o<float>, {1024, 4096}, iters_h2o);
    kb::register_seq("preset_h2o/bf16", BM_h2o<bfloat16_t>, {1024, 4096}, iters_h2o);
    kb::register_seq("caller_threads_1/snapkv_1thread/f32", BM_caller_threads<1>, {4096, 16384}, nullptr);
    kb::register_seq("caller_threads_2/snapkv_1thread/f32", BM_caller_threads<2>, {4096, 16384}, nullptr);
    kb::register_seq("caller_threads_8/snapkv_1thread/f32", BM_caller_threads<8>, {4096, 16384}, nullptr);
  }
} the_registrar;

}  // namespace
