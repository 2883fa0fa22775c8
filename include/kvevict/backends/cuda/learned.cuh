// LKV on the CUDA backend: the learned budgeter and scorer (kvevict/policies/learned.hpp) with
// evictor<..., cuda::backend>, their device tables, and the named compositions. No Eigen.
//
//   kvevict::io::lkv_artifact art;                                     // tools/lkv/train.py output
//   KVEVICT_TRY(kvevict::io::read_lkv_artifact(path, &art));
//   kvevict::cuda::lkv_device_tables tables;                          // once, at set-up
//   KVEVICT_TRY(tables.upload(art));                                  // cudaMalloc + copies (synchronous)
//   kvevict::evictor<kvevict::lkv::full, kvevict::cuda::backend> ev(kvevict::lkv::full_params(tables), {stream});
//   ev.run(layer_inputs, kvevict::budget_request::fraction(0.1), selection, ws, ws_bytes);  // layer by layer
//
// How the pieces run on the device (their implementation traits, docs/cuda.md):
//  - scorers::learned_mlp (backends/cuda/scorers/learned_mlp.cuh): cuda::detail::lkv_mlp_kernel,
//    a shared-memory tiled fp64 GEMM of the tokens' [k ; v] with the layer's MLPs, into the
//    per-query-head score rows.
//  - budgeters::headwise_learned (backends/cuda/budgeters/headwise_learned.cuh): the plan
//    kernel's block of each sequence runs the steps of
//    headwise_learned::layer_slice (the CPU hook's own host-device code; the apportionment by
//    the whole block, bit for bit) on the ratios r that lkv_device_tables computed on the host
//    with detail::lkv_ratios, so budgets are bit-identical to the CPU backend's. Scratch comes
//    from the workspace.
//
// The compositions (lkv::full, uniform_budgets, budgets_restkv, budgets_attention) are defined
// once, backend-neutral, in kvevict/presets.hpp; this header adds their parameters from device
// tables (the CPU header adds them from a host artifact).
#pragma once

#include <cstdint>
#include <vector>

#include "kvevict/cuda.cuh"
#include "kvevict/io/lkv_artifact.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {

namespace cuda {

/// Device copy of an LKV artifact's tables for the CUDA backend: the scorer's MLPs (fp32,
/// (num_layers, kv_heads, block)), the budget logits (fp32, (num_layers, kv_heads)) and the
/// ratios r = softmax(logits / temperature) (fp64, computed on the host by
/// detail::lkv_ratios, the CPU's own code). Owns the device memory (cudaFree on destruction
/// or re-upload); move-only. upload() allocates and copies synchronously: call it at set-up,
/// never inside a stream capture. The params it hands out point into it (on_device = true)
/// and must not outlive it.
class lkv_device_tables {
 public:
  lkv_device_tables() = default;
  ~lkv_device_tables() { release(); }
  lkv_device_tables(const lkv_device_tables&) = delete;
  lkv_device_tables& operator=(const lkv_device_tables&) = delete;
  lkv_device_tables(lkv_device_tables&& o) noexcept { take(o); }
  lkv_device_tables& operator=(lkv_device_tables&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }

  /// Upload the tables of a loaded artifact (io::read_lkv_artifact). Errors: invalid_argument
  /// (shapes non-positive, table sizes not matching the shapes, temperature <= 0),
  /// non_finite_input (a logit), cuda_error (allocation / copy). On error nothing is held.
  status upload(const io::lkv_artifact& a) {
    release();
    if (a.num_layers < 1 || a.kv_heads < 1 || a.head_dim < 1 || a.mlp_hidden < 1)
      return status::error(errc::invalid_argument, "artifact shape (num_layers = %d, kv_heads = %d, head_dim = %d, mlp_hidden = %d) must be >= 1",
                           a.num_layers, a.kv_heads, a.head_dim, a.mlp_hidden);
    const std::int64_t n = a.heads(), blk = a.block();
    if (static_cast<std::int64_t>(a.logits.size()) != n || static_cast<std::int64_t>(a.mlp.size()) != n * blk)
      return status::error(errc::invalid_argument, "artifact tables hold %zu logits and %zu MLP floats; the shapes need %lld and %lld",
                           a.logits.size(), a.mlp.size(), static_cast<long long>(n), static_cast<long long>(n * blk));
    if (!(a.temperature > 0.0f))
      return status::error(errc::invalid_argument, "artifact temperature = %g must be > 0", static_cast<double>(a.temperature));
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(a.logits[static_cast<std::size_t>(i)]))
        return status::error(errc::non_finite_input, "artifact logits[%lld] = %g is not finite", static_cast<long long>(i),
                             static_cast<double>(a.logits[static_cast<std::size_t>(i)]));
    std::vector<double> r(static_cast<std::size_t>(n));
    if (!kvevict::detail::lkv_ratios(a.logits.data(), n, static_cast<double>(a.temperature), r.data()))
      return status::error(errc::non_finite_input, "artifact logits / temperature give no finite softmax");
    status s = copy_in(a.mlp.data(), a.logits.data(), r.data(), n, blk);
    if (!s.ok()) {
      release();
      return s;
    }
    num_layers_ = a.num_layers;
    kv_heads_ = a.kv_heads;
    head_dim_ = a.head_dim;
    hidden_ = a.mlp_hidden;
    activation_ = a.activation;
    temperature_ = a.temperature;
    return {};
  }

  /// Scorer params pointing into the device tables (on_device = true, layer = -1).
  scorers::learned_mlp::params scorer_params() const {
    scorers::learned_mlp::params p;
    p.weights = mlp_;
    p.num_layers = num_layers_;
    p.kv_heads = kv_heads_;
    p.head_dim = head_dim_;
    p.hidden = hidden_;
    p.activation = activation_;
    p.on_device = true;
    return p;
  }

  /// Budgeter params pointing into the device tables (on_device = true, the artifact's
  /// temperature; min_budget and num_tokens 0).
  budgeters::headwise_learned::params budgeter_params() const {
    budgeters::headwise_learned::params p;
    p.logits = logits_;
    p.num_layers = num_layers_;
    p.kv_heads = kv_heads_;
    p.temperature = temperature_;
    p.on_device = true;
    p.ratios = ratios_;
    p.ratios_temperature = temperature_;
    return p;
  }

  bool empty() const { return mlp_ == nullptr; }
  /// Device bytes held.
  std::size_t bytes() const {
    const std::int64_t n = static_cast<std::int64_t>(num_layers_) * kv_heads_;
    return empty() ? 0
                   : static_cast<std::size_t>(n * scorers::learned_mlp::block_floats(head_dim_, hidden_)) * sizeof(float) +
                         static_cast<std::size_t>(n) * (sizeof(float) + sizeof(double));
  }

 private:
  status copy_in(const float* mlp, const float* logits, const double* r, std::int64_t n, std::int64_t blk) {
    const std::size_t mb = static_cast<std::size_t>(n * blk) * sizeof(float), lb = static_cast<std::size_t>(n) * sizeof(float),
                      rb = static_cast<std::size_t>(n) * sizeof(double);
    KVEVICT_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&mlp_), mb));
    KVEVICT_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&logits_), lb));
    KVEVICT_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&ratios_), rb));
    KVEVICT_CUDA_TRY(cudaMemcpy(mlp_, mlp, mb, cudaMemcpyHostToDevice));
    KVEVICT_CUDA_TRY(cudaMemcpy(logits_, logits, lb, cudaMemcpyHostToDevice));
    KVEVICT_CUDA_TRY(cudaMemcpy(ratios_, r, rb, cudaMemcpyHostToDevice));
    return {};
  }
  void release() {
    if (mlp_) (void)cudaFree(mlp_);
    if (logits_) (void)cudaFree(logits_);
    if (ratios_) (void)cudaFree(ratios_);
    mlp_ = nullptr;
    logits_ = nullptr;
    ratios_ = nullptr;
    num_layers_ = kv_heads_ = head_dim_ = hidden_ = 0;
  }
  void take(lkv_device_tables& o) {
    mlp_ = o.mlp_;
    logits_ = o.logits_;
    ratios_ = o.ratios_;
    num_layers_ = o.num_layers_;
    kv_heads_ = o.kv_heads_;
    head_dim_ = o.head_dim_;
    hidden_ = o.hidden_;
    activation_ = o.activation_;
    temperature_ = o.temperature_;
    o.mlp_ = nullptr;
    o.logits_ = nullptr;
    o.ratios_ = nullptr;
    o.num_layers_ = o.kv_heads_ = o.head_dim_ = o.hidden_ = 0;
  }

  float* mlp_ = nullptr;
  float* logits_ = nullptr;
  double* ratios_ = nullptr;
  std::int32_t num_layers_ = 0, kv_heads_ = 0, head_dim_ = 0, hidden_ = 0;
  lkv_activation activation_ = lkv_activation::silu;
  float temperature_ = 1.0f;
};

}  // namespace cuda

namespace lkv {

/// Parameters of the compositions pointing into device tables (which must outlive them), for
/// evictor<..., cuda::backend>. (The CPU overloads taking an io::lkv_artifact live in
/// kvevict/backends/cpu/learned.hpp.)
inline full::params full_params(const cuda::lkv_device_tables& t) {
  full::params p = full::defaults();
  p.scorer = t.scorer_params();
  p.budgeter = t.budgeter_params();
  return p;
}
inline uniform_budgets::params uniform_budgets_params(const cuda::lkv_device_tables& t) {
  uniform_budgets::params p = uniform_budgets::defaults();
  p.scorer = t.scorer_params();
  return p;
}
inline budgets_restkv::params budgets_restkv_params(const cuda::lkv_device_tables& t) {
  budgets_restkv::params p = budgets_restkv::defaults();
  p.budgeter = t.budgeter_params();
  return p;
}
inline budgets_attention::params budgets_attention_params(const cuda::lkv_device_tables& t) {
  budgets_attention::params p = budgets_attention::defaults();
  p.budgeter = t.budgeter_params();
  return p;
}

}  // namespace lkv
}  // namespace kvevict
