// Writing your own scorer for the CUDA backend: the value-norm scorer of custom_policy.cpp
// (score = ||v_n||^power: keep tokens whose VALUE vectors are large, query-free), implemented by
// specialising kvevict::cuda::scorer_impl with its own kernel, composed at compile time with
// kvevict's temporal smoother, spatial smoother (max pooling), budgeter (AdaKV) and selector, and
// run through evictor<..., cuda::backend>. docs/cuda.md ("Adding a stage") explains the traits.
//
// Without a CUDA device it prints a skip message and exits 0.
#include <kvevict/cuda.cuh>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

// 1. The policy (backend-neutral) and 2. its CUDA implementation: a kernel and the trait
//    kvevict::cuda::scorer_impl<value_norm_scorer>, in files of their own (examples/value_norm/).
#include "value_norm/value_norm.hpp"
#include "value_norm/value_norm_cuda.cuh"

// 3. The composition: kvevict's temporal smoother (unused by a query-free scorer), max pooling,
//    AdaKV budgets (budget moves to the heads with the largest scores) and top-k selection.
using my_policy = kvevict::eviction_policy<value_norm_scorer, kvevict::temporal::last, kvevict::spatial::max_pool,
                                           kvevict::budgeters::adakv, kvevict::selectors::topk>;

#define CHECK_CUDA(expr)                                                                            \
  do {                                                                                              \
    const cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) return std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)), 1; \
  } while (0)

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("custom_policy_cuda: SKIPPED - no usable CUDA device\n");
    return 0;
  }
  const int kv_heads = 4, seq = 200, dim = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> k(static_cast<std::size_t>(kv_heads) * seq * dim), v(k.size());
  for (float& x : k) x = normal(rng);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = normal(rng) * (1.0f + 0.25f * static_cast<float>(i / (seq * dim)));  // head h: x (1 + h/4)

  float *dk = nullptr, *dv = nullptr;
  CHECK_CUDA(cudaMalloc(&dk, k.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  kvevict::layer_inputs<float> in;  // device views, no lengths: every head holds seq tokens
  in.keys = kvevict::make_kv_view<const float>(dk, 1, kv_heads, seq, dim, kvevict::kv_layout::hnd);
  in.values = kvevict::make_kv_view<const float>(dv, 1, kv_heads, seq, dim, kvevict::kv_layout::hnd);

  auto p = my_policy::defaults();
  p.selector.num_sink = 4;     // keep 4 attention sinks ...
  p.selector.num_recent = 16;  // ... and the last 16 tokens by rule
  p.spatial.kernel = 3;
  kvevict::evictor<my_policy, kvevict::cuda::backend> ev(p);
  const auto budget = kvevict::budget_request::fraction(0.25);
  kvevict::eviction_plan plan;
  kvevict::status st = ev.plan(in, budget, &plan);  // host-side checks and sizes, nothing launched
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  std::int32_t *indptr = nullptr, *indices = nullptr;
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&indptr, static_cast<std::size_t>(plan.rows + 1) * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&indices, static_cast<std::size_t>(plan.max_selected) * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  kvevict::selection_view sel{indptr, indices, nullptr, plan.max_selected};
  st = ev.run(plan, in, sel, ws, plan.workspace_bytes);  // enqueues the kernels, returns at once
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  st = kvevict::cuda::read_device_status(ev.device_status_ptr(ws));  // synchronises
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  std::vector<std::int32_t> hptr(static_cast<std::size_t>(plan.rows + 1));
  CHECK_CUDA(cudaMemcpy(hptr.data(), indptr, hptr.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  for (int h = 0; h < kv_heads; ++h) std::printf("head %d keeps %d tokens\n", h, hptr[h + 1] - hptr[h]);
  // Without a lengths view the plan's count is exact: AdaKV moves budget between heads, the total stays.
  std::printf("kept %d of %d tokens (plan: %lld, %s)\n", hptr[kv_heads], kv_heads * seq, static_cast<long long>(plan.max_selected),
              plan.max_selected_exact ? "exact" : "bound");
  const bool ok = plan.max_selected_exact && hptr[kv_heads] == plan.max_selected;
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(indptr);
  cudaFree(indices);
  cudaFree(ws);
  return ok ? 0 : 1;
}
