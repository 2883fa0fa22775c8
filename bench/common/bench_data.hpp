// Shared inputs and helpers of kvevict's CPU benchmarks.
//
// Shapes (one layer, batch 1, the Llama-3.1-8B attention geometry):
//   q_heads 32, kv_heads 8 (GQA group G = 4), head_dim d = 128, observation window w = 32,
//   hidden size C = 4096 (W_O is C x (q_heads * d)), seq_len L from the benchmark argument.
// Storage: float or kvevict::bfloat16_t, HND layout ([batch][heads][seq][head_dim]), dense.
// Data: deterministic uniform values with unit variance (splitmix64 seeds fixed per tensor), so
// the window attention is a realistic soft distribution (logits ~ N(0, 1)) - the cost of every
// stage is data-independent except nth_element, which sees random (typical) orders.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace kvevict_bench {

inline constexpr std::int64_t kBatch = 1;
inline constexpr std::int64_t kQHeads = 32;
inline constexpr std::int64_t kKvHeads = 8;
inline constexpr std::int64_t kGroup = kQHeads / kKvHeads;
inline constexpr std::int64_t kHeadDim = 128;
inline constexpr std::int64_t kWindow = 32;
inline constexpr std::int64_t kHidden = 4096;

/// int64 -> double for cost-model arithmetic (exact below 2^53).
inline double D(std::int64_t x) { return static_cast<double>(x); }

/// Budget (tokens per head, window included) used by selection, budgeting and the presets:
/// B = 1024 (the paper's largest LongBench budget), or L / 4 when L <= 4096 would make
/// B >= L / 4 (so short sequences still evict 3/4 of their tokens).
inline std::int64_t bench_budget(std::int64_t L) { return L >= 8192 ? 1024 : L / 4; }

/// Fill with deterministic uniform values of variance `var` (seeded).
void fill_uniform(float* x, std::size_t n, std::uint64_t seed, float var = 1.0f);

/// 64-byte aligned, zero-initialised owning byte buffer.
struct aligned_buffer {
  std::unique_ptr<unsigned char[]> raw;
  unsigned char* data = nullptr;
  std::size_t bytes = 0;
  explicit aligned_buffer(std::size_t n = 0);
};

/// One layer's Q (w rows), K, V in storage type T, HND, plus the fp32 W_O matrix and its
/// per-head factors (shared by every layer). Cached: get_layer<T>(L, W) builds it once.
template <class T>
struct layer_data {
  std::int64_t L = 0, W = 0;
  std::vector<T> q, k, v;  // (1, 32, W, 128), (1, 8, L, 128), (1, 8, L, 128)
  kvevict::layer_inputs<T> inputs() const;
  std::size_t kv_bytes() const { return 2 * k.size() * sizeof(T); }
};

template <class T>
const layer_data<T>& get_layer(std::int64_t L, std::int64_t W = kWindow);

/// Drop every cached layer (frees memory between benchmark groups).
void clear_layers();

/// The layer's output projection W_O, fp32, (C = 4096, q_heads * d = 4096), [out][in].
const std::vector<float>& wo_matrix();
/// cpu::compute_wo_factors(W_O): (q_heads, d, d) fp32.
const std::vector<float>& wo_factors();

/// Per-iteration cost model of a benchmark (bytes read once + written once, useful FLOPs),
/// recorded as plain counters ("bytes", "flops", "tokens") and as rates ("GB/s", "GFLOP/s",
/// "tokens/s"; kIsIterationInvariantRate: value * iterations / time). scripts/run_bench.sh
/// recomputes the rates from real_time, which every benchmark here reports (UseRealTime).
void set_cost(benchmark::State& st, double tokens, double bytes, double flops);

/// Seq lengths of the suite: 1k, 4k, 16k, 32k; 8k is added where a target is stated at 8k.
inline const std::vector<std::int64_t> kSeqLens = {1024, 4096, 16384, 32768};
inline const std::vector<std::int64_t> kSeqLensWith8k = {1024, 4096, 8192, 16384, 32768};

/// Register `fn` once per L as "<name>/L:<L>[/iterations:n]/process_time/real_time"
/// (state.range(0) = L), milliseconds; real_time = wall clock, cpu_time = CPU time of the
/// whole process (all threads; run with OMP_WAIT_POLICY=passive so idle threads do not spin). `iters(L)` > 0 fixes the iteration count for that L (fewer
/// repetitions for the long runs); 0 leaves it to --benchmark_min_time. iters may be null.
using iters_fn = int (*)(std::int64_t L);
void register_seq(const char* name, void (*fn)(benchmark::State&), const std::vector<std::int64_t>& seq_lens,
                  iters_fn iters = nullptr);

}  // namespace kvevict_bench
