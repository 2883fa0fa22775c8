// kvevict Python binding, CUDA unit (nvcc; built when the CUDA toolkit is found): every method the
// CUDA backend implements (all presets but CriticalKV, and LKV from an artifact uploaded to the
// device) behind the evictor_iface of binding.hpp.
//
// select(): the inputs are device tensors of one device (read in place); the plan is made on the
// host with a host copy of the lengths (exact kept count) and cached like the CPU one; the
// workspace and the device output buffers are cached and only grow. The run is enqueued on the
// caller's stream (the tensors' current stream), which is then synchronised to read the device
// status word (errors) and to copy the selection (small: kept indices) to host memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <kvevict/backends/cuda/learned.cuh>
#include <kvevict/cuda.cuh>

#include "binding.hpp"
#include "evictor_base.hpp"
#include "inputs.hpp"
#include "params.hpp"

namespace kvevict_py {

namespace {

/// Device memory that only grows (cudaMalloc / cudaFree), owned.
struct device_buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (p) cudaFree(p);
  }
  status reserve(std::size_t n, std::int64_t* allocs = nullptr) {
    if (n <= bytes && p) return {};
    if (p) cudaFree(p);
    p = nullptr;
    bytes = 0;
    KVEVICT_CUDA_TRY(cudaMalloc(&p, n ? n : 1));
    bytes = n;
    if (allocs) ++*allocs;
    return {};
  }
};

/// Every given tensor must live on CUDA device `dev`.
status check_device(const select_args& a, int dev) {
  const std::pair<const tensor_arg*, const char*> all[] = {{&a.queries, "queries"}, {&a.keys, "keys"},     {&a.values, "values"},
                                                           {&a.lengths, "lengths"}, {&a.positions, "positions"}, {&a.wo, "wo"},
                                                           {&a.wo_factor, "wo_factor"}};
  for (const auto& t : all)
    if (t.first->given() && (t.first->device_type != 2 || t.first->device_id != dev))
      return status::error(errc::invalid_argument, "%s is on %s:%d but keys on cuda:%d; kvevict needs every tensor on the keys' device",
                           t.second, t.first->device_type == 2 ? "cuda" : "cpu", t.first->device_id, dev);
  return {};
}

template <class Policy>
class cuda_evictor final : public evictor_base<Policy, kvevict::cuda::backend> {
  using base = evictor_base<Policy, kvevict::cuda::backend>;
  using base::ev_;
  using base::plans_;
  using base::stats_;

 public:
  cuda_evictor(const char* name, const typename base::params_type& p, std::shared_ptr<const void> keep_alive, int device)
      : base(name, p, std::move(keep_alive)), device_(device) {}

  status select(const select_args& a, select_result* out) override {
    if (!out) return status::error(errc::null_pointer, "out is null");
    KVEVICT_TRY(check_device(a, device_));
    KVEVICT_CUDA_TRY(cudaSetDevice(device_));
    return dispatch_storage(a.keys.type, "keys", [&](auto tag) { return run<decltype(tag)>(a, out); });
  }

 private:
  template <class T>
  status run(const select_args& a, select_result* out) {
    kvevict::layer_inputs<T> in;
    KVEVICT_TRY(build_inputs(a, &in));
    const cudaStream_t stream = reinterpret_cast<cudaStream_t>(a.stream);
    // A host copy of the lengths: the plan checks them and gives the exact kept count.
    std::vector<std::int32_t> host_len;
    if (in.lengths.data) {
      if (in.lengths.stride[1] != 1 || in.lengths.stride[0] != in.lengths.extent[1])
        return status::error(errc::invalid_argument, "lengths must be contiguous (batch, kv_heads) int32 on CUDA");
      host_len.resize(static_cast<std::size_t>(in.lengths.extent[0] * in.lengths.extent[1]));
      KVEVICT_CUDA_TRY(cudaMemcpyAsync(host_len.data(), in.lengths.data, host_len.size() * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToHost, stream));
      KVEVICT_CUDA_TRY(cudaStreamSynchronize(stream));
    }
    kvevict::budget_request budget;
    budget.keep_tokens = a.keep_tokens;
    budget.keep_fraction = a.keep_fraction;
    std::vector<std::int64_t> key = cache_key(a, in, /*host_lengths=*/false);
    key.insert(key.end(), host_len.begin(), host_len.end());
    typename base::plan_map::iterator it;
    KVEVICT_TRY(this->find_plan(std::move(key), [&](kvevict::eviction_plan* pl) {
      kvevict::plan_options opt;
      opt.host_lengths = host_len.empty() ? nullptr : host_len.data();
      return ev_.plan(in, budget, pl, opt);
    }, &it));
    const kvevict::eviction_plan& pl = it->second;
    KVEVICT_TRY(ws_.reserve(pl.workspace_bytes, &stats_.workspace_allocs));
    stats_.workspace_bytes = ws_.bytes;
    const std::size_t cap = static_cast<std::size_t>(std::max<std::int64_t>(pl.max_selected, 1));
    KVEVICT_TRY(indptr_.reserve(static_cast<std::size_t>(pl.rows + 1) * sizeof(std::int32_t)));
    KVEVICT_TRY(indices_.reserve(cap * sizeof(std::int32_t)));
    KVEVICT_TRY(positions_.reserve(cap * sizeof(std::int32_t)));
    const std::int64_t B = in.batch(), H = pl.out_heads, S = in.capacity();
    if (a.want_scores) KVEVICT_TRY(scores_.reserve(static_cast<std::size_t>(B * H * S) * sizeof(float)));
    kvevict::selection_view sel{static_cast<std::int32_t*>(indptr_.p), static_cast<std::int32_t*>(indices_.p),
                                static_cast<std::int32_t*>(positions_.p),
                                static_cast<std::int64_t>(indices_.bytes / sizeof(std::int32_t))};
    ev_.backend().stream = stream;
    status st = ev_.run(pl, in, sel, ws_.p, ws_.bytes, a.want_scores ? static_cast<float*>(scores_.p) : nullptr);
    if (st.ok()) st = kvevict::cuda::read_device_status(ev_.device_status_ptr(ws_.p), stream);  // synchronises
    if (!st.ok()) {
      plans_.erase(it);
      return st;
    }
    ++stats_.runs;
    select_result r;
    r.batch = B;
    r.out_heads = H;
    r.seq = S;
    r.indptr.resize(static_cast<std::size_t>(pl.rows + 1));
    KVEVICT_CUDA_TRY(cudaMemcpy(r.indptr.data(), indptr_.p, r.indptr.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    const std::size_t n = static_cast<std::size_t>(r.indptr.back());
    r.indices.resize(n);
    r.positions.resize(n);
    if (n) {
      KVEVICT_CUDA_TRY(cudaMemcpy(r.indices.data(), indices_.p, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      KVEVICT_CUDA_TRY(cudaMemcpy(r.positions.data(), positions_.p, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    }
    if (a.want_scores) {
      r.scores.resize(static_cast<std::size_t>(B * H * S));
      KVEVICT_CUDA_TRY(cudaMemcpy(r.scores.data(), scores_.p, r.scores.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
    *out = std::move(r);
    return {};
  }

  int device_;
  device_buffer ws_, indptr_, indices_, positions_, scores_;  // cached; only grow
};

template <class Policy>
status make(const char* name, const param_map& overrides, int device, std::unique_ptr<evictor_iface>* out,
            typename Policy::params base = Policy::defaults(), std::shared_ptr<const void> keep_alive = nullptr) {
  return make_with<cuda_evictor, Policy>(name, overrides, out, base, std::move(keep_alive), device);
}

}  // namespace

bool cuda_built() { return true; }

status make_cuda_evictor(const std::string& method, const param_map& overrides, const std::string& artifact, int device,
                         std::unique_ptr<evictor_iface>* out) {
  namespace P = kvevict::presets;
  namespace L = kvevict::lkv;
  KVEVICT_CUDA_TRY(cudaSetDevice(device));
  if (method == "restkv") return make<P::restkv>("restkv", overrides, device, out);
  if (method == "snapkv") return make<P::snapkv>("snapkv", overrides, device, out);
  if (method == "pyramidkv") return make<P::pyramidkv>("pyramidkv", overrides, device, out);
  if (method == "adakv") return make<P::adakv>("adakv", overrides, device, out);
  if (method == "h2o") return make<P::h2o>("h2o", overrides, device, out);
  if (method == "tova") return make<P::tova>("tova", overrides, device, out);
  if (method == "streaming_llm") return make<P::streaming_llm>("streaming_llm", overrides, device, out);
  if (method == "key_norm") return make<P::key_norm>("key_norm", overrides, device, out);
  if (method == "criticalkv" || method == "critical_adakv" || method == "defensivekv")
    return status::error(errc::not_supported, "method '%s' runs on the CPU backend only (docs/cuda.md): pass CPU tensors",
                         method.c_str());
  if (method == "adakv_published")  // not instantiated in the binding's CUDA unit (compile time); the C++ backend has it
    return status::error(errc::not_supported, "method 'adakv_published' runs on the CPU backend only in the Python binding: pass CPU tensors");
  const bool learned = method == "lkv" || method == "lkv_uniform_budgets" || method == "lkv_budgets_restkv" ||
                       method == "lkv_budgets_attention";
  if (!learned) return status::error(errc::invalid_argument, "method = '%s' is not a kvevict method", method.c_str());
  if (artifact.empty())
    return status::error(errc::invalid_argument, "artifact is required for method '%s' (the path of an LKV artifact)", method.c_str());
  kvevict::io::lkv_artifact host;
  KVEVICT_TRY(kvevict::io::read_lkv_artifact(artifact.c_str(), &host));
  auto tables = std::make_shared<kvevict::cuda::lkv_device_tables>();
  KVEVICT_TRY(tables->upload(host));
  const kvevict::cuda::lkv_device_tables& t = *tables;
  if (method == "lkv") return make<P::lkv>("lkv", overrides, device, out, L::full_params(t), tables);
  if (method == "lkv_uniform_budgets")
    return make<P::lkv_uniform_budgets>("lkv_uniform_budgets", overrides, device, out, L::uniform_budgets_params(t), tables);
  if (method == "lkv_budgets_restkv")
    return make<P::lkv_budgets_restkv>("lkv_budgets_restkv", overrides, device, out, L::budgets_restkv_params(t), tables);
  return make<P::lkv_budgets_attention>("lkv_budgets_attention", overrides, device, out, L::budgets_attention_params(t), tables);
}

}  // namespace kvevict_py
