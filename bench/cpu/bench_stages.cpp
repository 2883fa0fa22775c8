// Per-stage benchmarks of kvevict's CPU backend, one layer (batch 1, q_heads 32, kv_heads 8,
// head_dim d = 128, window w = 32), seq_len L in {1k, 4k, (8k), 16k, 32k}, float and bf16
// storage (s = 4 or 2 bytes per element). Threads: OpenMP's default (all cores).
//
// Cost model (per call; "bytes" = every input read once + every output written once, i.e.
// the traffic a perfect implementation needs; "flops" = useful arithmetic, multiply-add = 2):
//   window_attention      logits + softmax of the 32 window rows of every query head (a GQA
//                         group per call, in place and unnormalised, as the scorers run it).
//                         bytes = K (8 L d s) + Q (32 w d s); flops = 2 * 32 * w L d.
//   score_attention_weight  SnapKV scorer alone = window attention + temporal aggregation
//                         (sum over the rows): + output 32 L * 4 bytes, + 2 * 32 w L flops.
//   score_reconstruction  ReST-KV LOR scorer ("after", W_O factor R, EMA 0.3) alone:
//                         bytes = K + V (16 L d s) + Q + R (32 d^2 * 4) + output 32 L * 4;
//                         flops = lor_flops(L) (cpu_stage.hpp), ~2 * 32 L d^2 dominant.
//   score_reconstruction_rows8  the same at 32k with blocks of 8 window rows (score_block_bytes
//                         4 MiB; 4 passes over K), the block the default gives at 128k.
//   score_reconstruction_drift  the same plus the adaptive-window drift statistic (top-(B-w)
//                         mean index of every window row: nth_element over L per row), as the
//                         ReST-KV preset runs it; same bytes and flops (no arithmetic counted
//                         for the selection).
//   smooth_avg_pool / smooth_adaptive_window  spatial smoothing of the 8 GQA-reduced score
//                         rows of length L - w (fp32; dtype-independent): bytes = 8 (L-w) * 4
//                         * 2 (read + write); flops = 3 per element (prefix sum, difference, scale).
//   budget_adakv          AdaKV head-wise budgets over the 8 rows of one sequence: bytes =
//                         8 (L - w) * 4 read; flops 0 (selection work: nth_element).
//   select_topk           top-(B - w) per row with the window protected, 8 rows: bytes = 8 L * 4
//                         read + kept indices * 4 written; flops 0.
//   compact               gather L/4 kept rows (random, ascending) of K and V into a dense cache
//                         with cpu::compact: bytes = 2 (K, V) * 8 (L/4) d s * 2 (read + write)
//                         + indices read; flops 0.
// B = bench_budget(L) = 1024 for L >= 8k, L/4 below.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/bench_data.hpp"
#include "common/cpu_stage.hpp"
#include "kvevict/cpu.hpp"

namespace kb = kvevict_bench;
namespace kc = kvevict::cpu;
using kvevict::bfloat16_t;

namespace {

int iters_scorer(std::int64_t L) { return L >= 32768 ? 3 : 0; }

// --- window attention alone ------------------------------------------------------------------
template <class T>
void BM_window_attention(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<T>(L);
  const auto in = data.inputs();
  kb::scorer_stage<kvevict::presets::snapkv, T> stage(in, 0);  // for its scratch only
  const std::int64_t d = kb::kHeadDim, w = kb::kWindow, G = kb::kGroup;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (auto _ : st) {
    kc::detail::parallel_for(stage.be, kb::kKvHeads, [&](std::int64_t h, int tid) {
      auto& s = stage.scratch[static_cast<std::size_t>(tid)];
      const T* kbase = in.keys.data + h * in.keys.stride[1];
      kc::detail::cmap_rm K = kc::detail::stage_rows(kbase, L, d, in.keys.stride[2], in.keys.stride[3], s.kbuf);
      // As score_kv_head outside ReST-KV's "before" mode: the group's G x w window rows staged
      // (fp32), one block per 32 rows, the softmax in place over the logits, unnormalised.
      for (std::int64_t j0 = 0; j0 < w; j0 += kc::detail::attention_row_block) {
        const std::int64_t rb = std::min(kc::detail::attention_row_block, w - j0);
        kc::detail::attention_block(kc::detail::stage_group_queries(in, 0, h, G, w, j0, rb, s.qbuf), K, L, w, j0, rb, scale,
                                    s.logits, s.logits, kc::detail::row_stats{s.st_max, s.st_zo, s.st_arg, s.st_inv}, false);
      }
      benchmark::DoNotOptimize(s.logits);
    });
    benchmark::ClobberMemory();
  }
  const double s = sizeof(T);
  kb::set_cost(st, static_cast<double>(L), kb::D(kb::kKvHeads * L * d + kb::kQHeads * w * d) * s, kb::window_attention_flops(L));
}

// --- scorers alone ---------------------------------------------------------------------------
template <class Policy, class T>
void run_scorer(benchmark::State& st, std::int64_t drift_topk, double bytes, double flops, std::size_t block_bytes = 0) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<T>(L);
  const auto in = data.inputs();
  const auto p = Policy::defaults();
  kb::scorer_stage<Policy, T> stage(in, drift_topk, p, block_bytes);
  for (auto _ : st) {
    stage.run(in, p);
    benchmark::DoNotOptimize(stage.rows.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), bytes, flops);
  st.counters["held_bytes"] = static_cast<double>(stage.held_bytes());
}

template <class T>
void BM_score_attention_weight(benchmark::State& st) {
  const std::int64_t L = st.range(0), d = kb::kHeadDim, w = kb::kWindow;
  const double s = sizeof(T);
  run_scorer<kvevict::presets::snapkv, T>(st, 0, kb::D(kb::kKvHeads * L * d + kb::kQHeads * w * d) * s + kb::D(kb::kQHeads * L) * 4.0,
                                          kb::window_attention_flops(L) + 2.0 * kb::D(kb::kQHeads * w * L));
}

inline double lor_bytes(std::int64_t L, double s) {
  const double d = kb::kHeadDim;
  return (2.0 * kb::D(kb::kKvHeads * L) * d + kb::D(kb::kQHeads * kb::kWindow) * d) * s + kb::D(kb::kQHeads) * d * d * 4.0 +
         kb::D(kb::kQHeads * L) * 4.0;
}

template <class T>
void BM_score_reconstruction(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  run_scorer<kvevict::presets::restkv, T>(st, 0, lor_bytes(L, sizeof(T)), kb::lor_flops(L));
}

/// The same with score_block_bytes = 4 MiB: blocks of 8 window rows at L = 32k (4 passes over
/// K), the block the default 16 MiB gives at 128k: what the bounded scratch costs there.
template <class T>
void BM_score_reconstruction_rows8(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  run_scorer<kvevict::presets::restkv, T>(st, 0, lor_bytes(L, sizeof(T)), kb::lor_flops(L), std::size_t{4} << 20);
}

template <class T>
void BM_score_reconstruction_drift(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  run_scorer<kvevict::presets::restkv, T>(st, std::max<std::int64_t>(1, kb::bench_budget(L) - kb::kWindow), lor_bytes(L, sizeof(T)),
                                          kb::lor_flops(L));
}

// --- spatial smoothing -----------------------------------------------------------------------
template <class S>
void run_smooth(benchmark::State& st, const typename S::params& p, double drift) {
  const std::int64_t L = st.range(0), n = L - kb::kWindow, rows = kb::kKvHeads;
  std::vector<float> x(static_cast<std::size_t>(rows * L));
  kb::fill_uniform(x.data(), x.size(), 77);
  for (auto& v : x) v = std::fabs(v);
  kc::backend be{};
  const int nt = kc::detail::max_threads(be);
  std::vector<float> tmp(static_cast<std::size_t>(nt * L));
  std::vector<double> pre(static_cast<std::size_t>(nt * (L + 1)));
  std::vector<std::int64_t> dq(static_cast<std::size_t>(nt * L));
  for (auto _ : st) {
    kc::detail::parallel_for(be, rows, [&](std::int64_t r, int tid) {
      kc::detail::smooth_row<S>(p, x.data() + r * L, n, drift, tmp.data() + tid * L, pre.data() + tid * (L + 1), dq.data() + tid * L);
    });
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), kb::D(rows * n) * 4.0 * 2.0, kb::D(rows * n) * 3.0);
}

void BM_smooth_avg_pool(benchmark::State& st) { run_smooth<kvevict::spatial::avg_pool>(st, {}, 0.0); }
// Drift t = 12345 tokens with beta 2000: kernel 13, shift +6 (a typical long-context drift).
void BM_smooth_adaptive_window(benchmark::State& st) { run_smooth<kvevict::spatial::adaptive_window>(st, {}, 12345.0); }

// --- budgeting and selection -----------------------------------------------------------------
std::vector<float> random_scores(std::int64_t rows, std::int64_t L) {
  std::vector<float> x(static_cast<std::size_t>(rows * L));
  kb::fill_uniform(x.data(), x.size(), 99);
  return x;
}

void BM_budget_adakv(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads;
  const auto sc = random_scores(H, L);
  const kvevict::selectors::topk::params sp{};
  const auto budget = kvevict::budget_request::tokens(static_cast<std::int32_t>(kb::bench_budget(L)));
  std::vector<kvevict::detail::head_plan> plans(static_cast<std::size_t>(H));
  std::vector<const float*> ptr(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h) {
    plans[static_cast<std::size_t>(h)] = kvevict::detail::plan_head(budget, sp, L, kb::kWindow);
    ptr[static_cast<std::size_t>(h)] = sc.data() + h * L;
  }
  std::vector<std::int64_t> budgets(static_cast<std::size_t>(H));
  const kvevict::budgeters::adakv::params bp{};
  for (auto _ : st) {
    kc::detail::adakv_budgets(bp, plans.data(), ptr.data(), H, budgets.data());
    benchmark::DoNotOptimize(budgets.data());
  }
  kb::set_cost(st, static_cast<double>(L), kb::D(H * (L - kb::kWindow)) * 4.0, 0.0);
}

void BM_select_topk(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads, B = kb::bench_budget(L);
  const auto sc = random_scores(H, L);
  const kvevict::selectors::topk::params sp{};
  const auto plan = kvevict::detail::plan_head(kvevict::budget_request::tokens(static_cast<std::int32_t>(B)), sp, L, kb::kWindow);
  kc::backend be{};
  const int nt = kc::detail::max_threads(be);
  std::vector<std::int32_t> out(static_cast<std::size_t>(H * B)), idx(static_cast<std::size_t>(nt * L));
  for (auto _ : st) {
    kc::detail::parallel_for(be, H, [&](std::int64_t r, int tid) {
      kc::detail::select_head(plan, B, sc.data() + r * L, out.data() + r * B, idx.data() + tid * L);
    });
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), kb::D(H * L) * 4.0 + kb::D(H * B) * 4.0, 0.0);
}

// --- compaction --------------------------------------------------------------------------
template <class T>
void BM_compact(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads, d = kb::kHeadDim, keep = L / 4;
  const auto& data = kb::get_layer<T>(L);
  const auto in = data.inputs();
  // Random ascending selection of `keep` slots per head (deterministic).
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(H + 1)), indices(static_cast<std::size_t>(H * keep));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(L));
  std::uint64_t seed = 12345;
  for (std::int64_t h = 0; h < H; ++h) {
    std::iota(perm.begin(), perm.end(), 0);
    for (std::int64_t i = 0; i < keep; ++i) {  // partial Fisher-Yates
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      const std::int64_t j = i + static_cast<std::int64_t>((seed >> 33) % static_cast<std::uint64_t>(L - i));
      std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(j)]);
    }
    std::sort(perm.begin(), perm.begin() + keep);
    std::copy(perm.begin(), perm.begin() + keep, indices.begin() + h * keep);
    indptr[static_cast<std::size_t>(h + 1)] = static_cast<std::int32_t>((h + 1) * keep);
  }
  const kvevict::const_selection_view sel(indptr.data(), indices.data(), H);
  std::vector<T> kd(static_cast<std::size_t>(H * keep * d)), vd(kd.size());
  auto kdst = kvevict::make_kv_view(kd.data(), 1, H, keep, d, kvevict::kv_layout::hnd);
  auto vdst = kvevict::make_kv_view(vd.data(), 1, H, keep, d, kvevict::kv_layout::hnd);
  for (auto _ : st) {
    kvevict::status s1 = kc::compact(in.keys, sel, kdst);
    kvevict::status s2 = kc::compact(in.values, sel, vdst);
    if (!s1.ok() || !s2.ok()) {
      st.SkipWithError(s1.ok() ? s2.message() : s1.message());
      break;
    }
    benchmark::DoNotOptimize(kd.data());
    benchmark::DoNotOptimize(vd.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), 2.0 * kb::D(H * keep * d) * sizeof(T) * 2.0 + kb::D(H * keep) * 4.0, 0.0);
}

struct registrar {
  registrar() {
    kb::register_seq("window_attention/f32", BM_window_attention<float>, kb::kSeqLens);
    kb::register_seq("window_attention/bf16", BM_window_attention<bfloat16_t>, kb::kSeqLens);
    kb::register_seq("score_attention_weight/f32", BM_score_attention_weight<float>, kb::kSeqLens);
    kb::register_seq("score_attention_weight/bf16", BM_score_attention_weight<bfloat16_t>, kb::kSeqLens);
    kb::register_seq("score_reconstruction/f32", BM_score_reconstruction<float>, kb::kSeqLensWith8k, iters_scorer);
    kb::register_seq("score_reconstruction/bf16", BM_score_reconstruction<bfloat16_t>, kb::kSeqLensWith8k, iters_scorer);
    kb::register_seq("score_reconstruction_rows8/f32", BM_score_reconstruction_rows8<float>, {32768}, iters_scorer);
    kb::register_seq("score_reconstruction_rows8/bf16", BM_score_reconstruction_rows8<bfloat16_t>, {32768}, iters_scorer);
    kb::register_seq("score_reconstruction_drift/f32", BM_score_reconstruction_drift<float>, kb::kSeqLens, iters_scorer);
    kb::register_seq("score_reconstruction_drift/bf16", BM_score_reconstruction_drift<bfloat16_t>, kb::kSeqLens, iters_scorer);
    kb::register_seq("smooth_avg_pool/f32", BM_smooth_avg_pool, kb::kSeqLens);
    kb::register_seq("smooth_adaptive_window/f32", BM_smooth_adaptive_window, kb::kSeqLens);
    kb::register_seq("budget_adakv/f32", BM_budget_adakv, kb::kSeqLens);
    kb::register_seq("select_topk/f32", BM_select_topk, kb::kSeqLens);
    kb::register_seq("compact/f32", BM_compact<float>, kb::kSeqLens);
    kb::register_seq("compact/bf16", BM_compact<bfloat16_t>, kb::kSeqLens);
  }
} the_registrar;

}  // namespace
