// Shared inputs and helpers of kvevict's CPU benchmarks (see bench_data.hpp).
#include "common/bench_data.hpp"

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "kvevict/cpu.hpp"

namespace kvevict_bench {

namespace {
inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class T>
void fill_storage(std::vector<T>& out, std::size_t n, std::uint64_t seed) {
  std::vector<float> tmp(n);
  fill_uniform(tmp.data(), n, seed);
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = kvevict::from_float<T>(tmp[i]);
}

struct cache_t {
  std::mutex m;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<layer_data<float>>> f32;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<layer_data<kvevict::bfloat16_t>>> bf16;
};
cache_t& cache() {
  static cache_t c;
  return c;
}
template <class T>
auto& cache_map();
template <>
auto& cache_map<float>() {
  return cache().f32;
}
template <>
auto& cache_map<kvevict::bfloat16_t>() {
  return cache().bf16;
}
}  // namespace

void fill_uniform(float* x, std::size_t n, std::uint64_t seed, float var) {
  std::uint64_t s = seed * 0x2545F4914F6CDD1Dull + 1;
  const float a = std::sqrt(3.0f * var);  // uniform(-a, a) has variance a^2 / 3
  for (std::size_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;  // [0, 1)
    x[i] = static_cast<float>((2.0 * u - 1.0) * a);
  }
}

aligned_buffer::aligned_buffer(std::size_t n) : bytes(n) {
  raw.reset(new unsigned char[n + 64]());
  const auto a = reinterpret_cast<std::uintptr_t>(raw.get());
  data = raw.get() + ((64 - a % 64) % 64);
}

template <class T>
kvevict::layer_inputs<T> layer_data<T>::inputs() const {
  kvevict::layer_inputs<T> in;
  in.queries = kvevict::make_query_view<const T>(q.data(), kBatch, kQHeads, W, kHeadDim, kvevict::kv_layout::hnd);
  in.keys = kvevict::make_kv_view<const T>(k.data(), kBatch, kKvHeads, L, kHeadDim, kvevict::kv_layout::hnd);
  in.values = kvevict::make_kv_view<const T>(v.data(), kBatch, kKvHeads, L, kHeadDim, kvevict::kv_layout::hnd);
  in.wo_factor = kvevict::cpu::wo_factor_view(wo_factors().data(), kQHeads, kHeadDim);
  return in;
}

template <class T>
const layer_data<T>& get_layer(std::int64_t L, std::int64_t W) {
  std::lock_guard<std::mutex> lock(cache().m);
  auto& m = cache_map<T>();
  auto& slot = m[{L, W}];
  if (!slot) {
    auto d = std::make_unique<layer_data<T>>();
    d->L = L;
    d->W = W;
    const std::size_t nkv = static_cast<std::size_t>(kBatch * kKvHeads * L * kHeadDim);
    fill_storage(d->q, static_cast<std::size_t>(kBatch * kQHeads * W * kHeadDim), 1000 + static_cast<std::uint64_t>(L + W));
    fill_storage(d->k, nkv, 2000 + static_cast<std::uint64_t>(L));
    fill_storage(d->v, nkv, 3000 + static_cast<std::uint64_t>(L));
    slot = std::move(d);
  }
  return *slot;
}

template struct layer_data<float>;
template struct layer_data<kvevict::bfloat16_t>;
template const layer_data<float>& get_layer<float>(std::int64_t, std::int64_t);
template const layer_data<kvevict::bfloat16_t>& get_layer<kvevict::bfloat16_t>(std::int64_t, std::int64_t);

void clear_layers() {
  std::lock_guard<std::mutex> lock(cache().m);
  cache().f32.clear();
  cache().bf16.clear();
}

const std::vector<float>& wo_matrix() {
  static const std::vector<float> w = [] {
    std::vector<float> x(static_cast<std::size_t>(kHidden * kQHeads * kHeadDim));
    // Variance 1/C: a unit-variance input keeps a unit-scale output (Xavier-like).
    fill_uniform(x.data(), x.size(), 4242, 1.0f / static_cast<float>(kHidden));
    return x;
  }();
  return w;
}

const std::vector<float>& wo_factors() {
  static const std::vector<float> r = [] {
    std::vector<float> out(static_cast<std::size_t>(kQHeads * kHeadDim * kHeadDim));
    kvevict::strided_view<const float, 2> wv;
    wv.data = wo_matrix().data();
    wv.extent[0] = kHidden;
    wv.extent[1] = kQHeads * kHeadDim;
    wv.stride[0] = kQHeads * kHeadDim;
    wv.stride[1] = 1;
    const kvevict::status s = kvevict::cpu::compute_wo_factors(wv, kQHeads, kHeadDim, out.data());
    if (!s.ok()) out.assign(out.size(), 0.0f);  // cannot happen for these shapes; scores would show it
    return out;
  }();
  return r;
}

void set_cost(benchmark::State& st, double tokens, double bytes, double flops) {
  using C = benchmark::Counter;
  st.counters["tokens"] = C(tokens);
  st.counters["bytes"] = C(bytes);
  st.counters["flops"] = C(flops);
  st.counters["tokens/s"] = C(tokens, C::kIsIterationInvariantRate);
  st.counters["GB/s"] = C(bytes * 1e-9, C::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = C(flops * 1e-9, C::kIsIterationInvariantRate);
}

void register_seq(const char* name, void (*fn)(benchmark::State&), const std::vector<std::int64_t>& seq_lens,
                  iters_fn iters) {
  for (const std::int64_t L : seq_lens) {
    auto* b = benchmark::RegisterBenchmark(name, fn);
    b->Arg(L)->ArgName("L")->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
    const int n = iters ? iters(L) : 0;
    if (n > 0) b->Iterations(n);
  }
}

}  // namespace kvevict_bench
