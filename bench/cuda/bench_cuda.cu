// CUDA benchmarks (Google Benchmark, manual time from cudaEvents). Shapes: batch 1, q_heads 32,
// kv_heads 8, head_dim 128, window 32, bf16, HND, seq_len 4k / 32k / 128k, budget seq/4.
//
//   BM_d2d_copy            device-to-device cudaMemcpyAsync of 1 GiB: the measured memory
//                          bandwidth (bytes read + written per second) the other rows are
//                          compared against
//   BM_run/<preset>/<seq>  one evictor::run(); counters: per-stage milliseconds (stage events
//                          of cuda::backend), bytes = K + V + Q read once (the minimum traffic),
//                          ws_MB = workspace
//   BM_compact/<seq>       dense compaction of K and V with the ReST-KV selection
//   BM_run_lkv_full/<seq>  one evictor<lkv::full>::run() (learned MLP scorer + learned global
//                          budgets, no queries, keep fraction 0.25) with a synthetic table of the
//                          artifact's layout (32 layers x 8 KV heads, head_dim 128, hidden 32,
//                          silu; layer 31); bytes = K + V read once, GBps over the whole run,
//                          score_GBps over the scoring stage; tables_MB = device tables
// Without a device every benchmark reports SkipWithError. scripts/device_check.sh turns the
// JSON output into the table of docs/cuda.md.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <vector>

#include "kvevict/backends/cuda/learned.cuh"
#include "kvevict/cuda.cuh"

namespace kv = kvevict;

namespace {

constexpr int kB = 1, kHq = 32, kHkv = 8, kD = 128, kW = 32;

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/// Device inputs of one shape, filled once with seeded bf16 data.
struct device_inputs {
  std::int64_t S = 0;
  kv::bfloat16_t *k = nullptr, *v = nullptr, *q = nullptr;
  float* wo = nullptr;
  bool ok = false;
  explicit device_inputs(std::int64_t seq) : S(seq) {
    const std::size_t nkv = static_cast<std::size_t>(kB) * kHkv * S * kD, nq = static_cast<std::size_t>(kB) * kHq * kW * kD;
    std::vector<kv::bfloat16_t> h(nkv > nq ? nkv : nq);
    std::vector<float> w(static_cast<std::size_t>(kHq) * kD * kD);
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : h) x = kv::from_float<kv::bfloat16_t>(u(rng));
    for (auto& x : w) x = u(rng) * 0.088f;
    ok = cudaMalloc(&k, nkv * 2) == cudaSuccess && cudaMalloc(&v, nkv * 2) == cudaSuccess && cudaMalloc(&q, nq * 2) == cudaSuccess &&
         cudaMalloc(&wo, w.size() * 4) == cudaSuccess && cudaMemcpy(k, h.data(), nkv * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(v, h.data(), nkv * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(q, h.data(), nq * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(wo, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  ~device_inputs() {
    cudaFree(k);
    cudaFree(v);
    cudaFree(q);
    cudaFree(wo);
  }
  kv::layer_inputs<kv::bfloat16_t> views() const {
    kv::layer_inputs<kv::bfloat16_t> in;
    in.keys = kv::make_kv_view<const kv::bfloat16_t>(k, kB, kHkv, S, kD, kv::kv_layout::hnd);
    in.values = kv::make_kv_view<const kv::bfloat16_t>(v, kB, kHkv, S, kD, kv::kv_layout::hnd);
    in.queries = kv::make_query_view<const kv::bfloat16_t>(q, kB, kHq, kW, kD, kv::kv_layout::hnd);
    in.wo_factor.data = wo;
    in.wo_factor.extent[0] = kHq;
    in.wo_factor.extent[1] = kD;
    in.wo_factor.extent[2] = kD;
    in.wo_factor.stride[0] = static_cast<std::int64_t>(kD) * kD;
    in.wo_factor.stride[1] = kD;
    in.wo_factor.stride[2] = 1;
    return in;
  }
  double kvq_bytes() const {
    return 2.0 * (2.0 * kB * kHkv * static_cast<double>(S) * kD + static_cast<double>(kB) * kHq * kW * kD);
  }
};

void BM_d2d_copy(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t bytes = std::size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    state.SkipWithError("cudaMalloc failed");
    return;
  }
  cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (auto _ : state) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(ms / 1e3);
  }
  state.counters["bytes"] = 2.0 * static_cast<double>(bytes);  // read + write
  state.counters["GBps"] = benchmark::Counter(2.0 * static_cast<double>(bytes) * state.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
}

template <class P>
void BM_run(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::int64_t S = state.range(0);
  device_inputs di(S);
  if (!di.ok) {
    state.SkipWithError("input allocation failed");
    return;
  }
  const auto in = di.views();
  const int nev = 6;
  cudaEvent_t ev[nev];
  for (auto& e : ev) cudaEventCreate(&e);
  kv::cuda::backend be;
  be.stage_events = ev;
  be.num_stage_events = nev;
  kv::evictor<P, kv::cuda::backend> evc(P::defaults(), be);
  const auto budget = kv::budget_request::tokens(static_cast<std::int32_t>(S / 4));
  const std::int64_t rows = in.batch() * evc.out_heads(in), cap = evc.max_selected(in, budget);
  const std::size_t wsb = evc.workspace_size(in);
  std::int32_t *indptr = nullptr, *indices = nullptr;
  void* ws = nullptr;
  if (cap < 0 || cudaMalloc(&indptr, (rows + 1) * 4) != cudaSuccess || cudaMalloc(&indices, cap * 4) != cudaSuccess ||
      cudaMalloc(&ws, wsb) != cudaSuccess) {
    state.SkipWithError("setup failed");
    return;
  }
  kv::selection_view sel;
  sel.indptr = indptr;
  sel.indices = indices;
  sel.capacity = cap;
  double stage_ms[nev - 1] = {};
  kv::status st = evc.run(in, budget, sel, ws, wsb);  // warm-up
  cudaDeviceSynchronize();
  for (auto _ : state) {
    st = evc.run(in, budget, sel, ws, wsb);
    cudaEventSynchronize(ev[nev - 1]);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, ev[0], ev[nev - 1]);
    state.SetIterationTime(ms / 1e3);
    for (int i = 1; i < nev; ++i) {
      float m = 0.0f;
      cudaEventElapsedTime(&m, ev[i - 1], ev[i]);
      stage_ms[i - 1] += m;
    }
  }
  if (!st.ok()) state.SkipWithError(st.message());
  const kv::status dev = kv::cuda::read_device_status(evc.device_status_ptr(ws));
  if (!dev.ok()) state.SkipWithError(dev.message());
  const char* names[nev - 1] = {"plan_ms", "score_ms", "reduce_smooth_ms", "budget_ms", "select_ms"};
  for (int i = 0; i < nev - 1; ++i) state.counters[names[i]] = stage_ms[i] / static_cast<double>(state.iterations());
  state.counters["bytes"] = di.kvq_bytes();
  state.counters["ws_MB"] = static_cast<double>(wsb) / 1e6;
  state.counters["GBps"] = benchmark::Counter(di.kvq_bytes() * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  for (auto& e : ev) cudaEventDestroy(e);
  cudaFree(indptr);
  cudaFree(indices);
  cudaFree(ws);
}

void BM_compact(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::int64_t S = state.range(0);
  device_inputs di(S);
  const auto in = di.views();
  using P = kv::presets::restkv;
  kv::evictor<P, kv::cuda::backend> evc;
  const auto budget = kv::budget_request::tokens(static_cast<std::int32_t>(S / 4));
  const std::int64_t rows = in.batch() * evc.out_heads(in), cap = evc.max_selected(in, budget), keep = S / 4;
  const std::size_t wsb = evc.workspace_size(in);
  std::int32_t *indptr = nullptr, *indices = nullptr;
  void* ws = nullptr;
  kv::bfloat16_t *dk = nullptr, *dv = nullptr;
  if (!di.ok || cap < 0 || cudaMalloc(&indptr, (rows + 1) * 4) != cudaSuccess || cudaMalloc(&indices, cap * 4) != cudaSuccess ||
      cudaMalloc(&ws, wsb) != cudaSuccess || cudaMalloc(&dk, rows * keep * kD * 2) != cudaSuccess ||
      cudaMalloc(&dv, rows * keep * kD * 2) != cudaSuccess) {
    state.SkipWithError("setup failed");
    return;
  }
  kv::selection_view sel;
  sel.indptr = indptr;
  sel.indices = indices;
  sel.capacity = cap;
  if (!evc.run(in, budget, sel, ws, wsb).ok()) state.SkipWithError("run failed");
  cudaDeviceSynchronize();
  const auto dstk = kv::make_kv_view(dk, kB, kHkv, keep, kD, kv::kv_layout::hnd);
  const auto dstv = kv::make_kv_view(dv, kB, kHkv, keep, kD, kv::kv_layout::hnd);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (auto _ : state) {
    cudaEventRecord(e0);
    kv::status a = kv::cuda::compact(in.keys, kv::const_selection_view(sel, rows), dstk);
    kv::status b = kv::cuda::compact(in.values, kv::const_selection_view(sel, rows), dstv);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    if (!a.ok() || !b.ok()) state.SkipWithError("compact failed");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(ms / 1e3);
  }
  const double bytes = 2.0 * 2.0 * 2.0 * static_cast<double>(rows) * keep * kD;  // K and V, read + write, bf16
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = benchmark::Counter(bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(indptr);
  cudaFree(indices);
  cudaFree(ws);
  cudaFree(dk);
  cudaFree(dv);
}

/// Synthetic LKV tables of the artifact's layout for the benchmark shapes (seeded).
kv::io::lkv_artifact bench_lkv_tables(int layers, int hidden) {
  kv::io::lkv_artifact a;
  a.version = kv::io::lkv_format_version;
  a.num_layers = layers;
  a.kv_heads = kHkv;
  a.head_dim = kD;
  a.mlp_hidden = hidden;
  a.activation = kv::lkv_activation::silu;
  a.temperature = 1.0f;
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  a.logits.resize(static_cast<std::size_t>(a.heads()));
  for (auto& x : a.logits) x = 2.0f * u(rng);
  a.mlp.resize(static_cast<std::size_t>(a.heads() * a.block()));
  for (auto& x : a.mlp) x = u(rng) * 0.06f;
  return a;
}

void BM_run_lkv_full(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  using P = kv::lkv::full;
  constexpr int kLayers = 32, kHidden = 32;
  const std::int64_t S = state.range(0);
  device_inputs di(S);
  if (!di.ok) {
    state.SkipWithError("input allocation failed");
    return;
  }
  kv::cuda::lkv_device_tables tables;
  if (!tables.upload(bench_lkv_tables(kLayers, kHidden)).ok()) {
    state.SkipWithError("table upload failed");
    return;
  }
  auto in = di.views();
  in.queries = {};  // query-agnostic: no window queries
  in.wo_factor = {};
  in.layer_idx = kLayers - 1;
  in.num_layers = kLayers;
  const int nev = 6;
  cudaEvent_t ev[nev];
  for (auto& e : ev) cudaEventCreate(&e);
  kv::cuda::backend be;
  be.stage_events = ev;
  be.num_stage_events = nev;
  kv::evictor<P, kv::cuda::backend> evc(kv::lkv::full_params(tables), be);
  const auto budget = kv::budget_request::fraction(0.25);
  const std::int64_t rows = in.batch() * evc.out_heads(in), cap = evc.max_selected(in, budget);
  const std::size_t wsb = evc.workspace_size(in);
  std::int32_t *indptr = nullptr, *indices = nullptr;
  void* ws = nullptr;
  if (cap < 0 || cudaMalloc(&indptr, (rows + 1) * 4) != cudaSuccess || cudaMalloc(&indices, cap * 4) != cudaSuccess ||
      cudaMalloc(&ws, wsb) != cudaSuccess) {
    state.SkipWithError("setup failed");
    return;
  }
  kv::selection_view sel;
  sel.indptr = indptr;
  sel.indices = indices;
  sel.capacity = cap;
  double stage_ms[nev - 1] = {};
  kv::status st = evc.run(in, budget, sel, ws, wsb);  // warm-up
  cudaDeviceSynchronize();
  for (auto _ : state) {
    st = evc.run(in, budget, sel, ws, wsb);
    cudaEventSynchronize(ev[nev - 1]);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, ev[0], ev[nev - 1]);
    state.SetIterationTime(ms / 1e3);
    for (int i = 1; i < nev; ++i) {
      float m = 0.0f;
      cudaEventElapsedTime(&m, ev[i - 1], ev[i]);
      stage_ms[i - 1] += m;
    }
  }
  if (!st.ok()) state.SkipWithError(st.message());
  const kv::status dev = kv::cuda::read_device_status(evc.device_status_ptr(ws));
  if (!dev.ok()) state.SkipWithError(dev.message());
  std::int32_t kept = 0;
  cudaMemcpy(&kept, indptr + rows, 4, cudaMemcpyDeviceToHost);
  const char* names[nev - 1] = {"plan_ms", "score_ms", "reduce_smooth_ms", "budget_ms", "select_ms"};
  for (int i = 0; i < nev - 1; ++i) state.counters[names[i]] = stage_ms[i] / static_cast<double>(state.iterations());
  const double kv_bytes = 2.0 * 2.0 * kB * kHkv * static_cast<double>(S) * kD;  // K + V, bf16, read once
  state.counters["bytes"] = kv_bytes;
  state.counters["ws_MB"] = static_cast<double>(wsb) / 1e6;
  state.counters["tables_MB"] = static_cast<double>(tables.bytes()) / 1e6;
  state.counters["kept_frac"] = static_cast<double>(kept) / (static_cast<double>(rows) * static_cast<double>(S));
  state.counters["GBps"] = benchmark::Counter(kv_bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  const double score_ms = stage_ms[1] / static_cast<double>(state.iterations());
  state.counters["score_GBps"] = score_ms > 0.0 ? kv_bytes / (score_ms / 1e3) / 1e9 : 0.0;
  for (auto& e : ev) cudaEventDestroy(e);
  cudaFree(indptr);
  cudaFree(indices);
  cudaFree(ws);
}

}  // namespace

BENCHMARK(BM_d2d_copy)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(20);
BENCHMARK_TEMPLATE(BM_run, kv::presets::restkv)->Name("BM_run/restkv")->Arg(4096)->Arg(32768)->Arg(131072)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK_TEMPLATE(BM_run, kv::presets::snapkv)->Name("BM_run/snapkv")->Arg(4096)->Arg(32768)->Arg(131072)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK_TEMPLATE(BM_run, kv::presets::key_norm)->Name("BM_run/key_norm")->Arg(4096)->Arg(32768)->Arg(131072)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK(BM_run_lkv_full)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK(BM_compact)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);

BENCHMARK_MAIN();
