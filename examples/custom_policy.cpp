// Writing your own policies: a custom scorer and a custom spatial smoother, composed at compile
// time with kvevict's temporal smoother, budgeter and selector.
//
// A policy is backend-neutral: parameters, check(), capability flags. Each backend runs it
// through an implementation trait that the policy's author specialises, exactly as kvevict's
// built-in policies do (backends/cpu/impl.hpp; the CUDA twin is examples/custom_policy_cuda.cu):
//  - value_norm_scorer: keeps tokens whose VALUE vectors are large (a query-free heuristic in
//    the spirit of VATP / "value norms matter"); its CPU implementation is
//    kvevict::cpu::scorer_impl<value_norm_scorer>, here the simple form cpu::head_scorer, which
//    hands it fp32 copies of one (sequence, KV head) at a time (cpu::head_inputs).
//  - median3: a 3-tap median filter as a spatial smoother; its CPU implementation is
//    kvevict::cpu::spatial_impl<median3> (in place over the row's evictable region).
// A policy without an implementation for the backend it is used with fails to compile with a
// message naming the stage and the backend.
#include <kvevict/cpu.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

// The scorer: the policy and its CPU implementation (examples/value_norm/; the same policy runs on
// CUDA with value_norm_cuda.cuh, examples/custom_policy_cuda.cu).
#include "value_norm/value_norm.hpp"
#include "value_norm/value_norm_cpu.hpp"

struct median3 {
  struct params {};
  static constexpr const char* name = "median3";
  static constexpr bool needs_attention_drift = false;
  static kvevict::status check(const params&) { return {}; }
};

// The CPU implementation of median3: x[0, n) in place; tmp is n floats of scratch (pre and dq,
// the prefix-sum and deque scratch the built-in smoothers use, are not needed here).
template <>
struct kvevict::cpu::spatial_impl<median3> {
  static void smooth(const median3::params&, float* x, std::int64_t n, double /*drift*/, float* tmp, double* /*pre*/,
                     std::int64_t* /*dq*/) {
    for (std::int64_t i = 0; i < n; ++i) {
      float a = x[std::max<std::int64_t>(i - 1, 0)], b = x[i], c = x[std::min<std::int64_t>(i + 1, n - 1)];
      tmp[i] = std::max(std::min(a, b), std::min(std::max(a, b), c));
    }
    std::copy(tmp, tmp + n, x);
  }
};

using my_policy = kvevict::eviction_policy<value_norm_scorer, kvevict::temporal::last, median3,
                                           kvevict::budgeters::uniform, kvevict::selectors::topk>;

int main() {
  const int kv_heads = 4, seq = 200, dim = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> k(kv_heads * seq * dim), v(k.size());
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);

  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), 1, kv_heads, seq, dim, kvevict::kv_layout::hnd);
  in.values = kvevict::make_kv_view<const float>(v.data(), 1, kv_heads, seq, dim, kvevict::kv_layout::hnd);

  auto p = my_policy::defaults();
  p.selector.num_sink = 4;     // keep 4 attention sinks ...
  p.selector.num_recent = 16;  // ... and the last 16 tokens by rule
  kvevict::evictor<my_policy, kvevict::cpu::backend> ev(p);
  const auto budget = kvevict::budget_request::fraction(0.25);
  std::vector<std::int32_t> indptr(kv_heads + 1), idx(ev.max_selected(in, budget));
  kvevict::selection_view sel{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())};
  kvevict::status st = ev.run(in, budget, sel);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  for (int h = 0; h < kv_heads; ++h) std::printf("head %d keeps %d tokens\n", h, indptr[h + 1] - indptr[h]);
  return 0;
}
