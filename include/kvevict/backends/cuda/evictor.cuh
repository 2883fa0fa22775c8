// IWYU pragma: private, include "kvevict/cuda.cuh"
// evictor<Policy, cuda::backend>: the same stages as the CPU evictor, as a sequence of kernels
// on one stream. No allocation, no host synchronisation, graph-capturable (docs/cuda.md).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/scorers.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/evictor.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {

/// CUDA evictor. All pointers in layer_inputs, the selection, the workspace and maybe_scores
/// are DEVICE pointers (lengths and positions included).
///
/// Differences to the CPU evictor, all forced by "no host synchronisation":
///  - can_implement() checks shapes and parameters on the host only. Lengths live on the
///    device: run() validates them in a kernel (0 <= L <= seq; equal lengths per sequence for
///    gqa_reduction::layer_mean) and reports a violation through the device status word
///    (device_status_ptr(workspace), see cuda::device_status), as it does NaN/inf inputs
///    (check_finite) and a selection larger than selection.capacity.
///  - max_selected() is an upper bound from the shapes, not the exact count:
///    batch * out_heads * min(seq, per-head bound), the per-head bound being the base budget B
///    (uniform, AdaKV: AdaKV moves budget between heads but keeps each sequence's total at most
///    out_heads * B), 2B + 1 (PyramidKV's largest layer) or seq (LKV-H: a head can get its whole
///    length t). The exact kept count of row r is indptr[r+1] - indptr[r], computed on the
///    device (CUB DeviceScan).
///  - LKV (scorers::learned_mlp, budgeters::headwise_learned) needs its tables in device memory
///    (params.on_device = true, e.g. from cuda::lkv_device_tables, kvevict/backends/cuda/learned.cuh).
/// Supported: head_dim <= 256, batch * q_heads <= 65535, the built-in scorers and smoothers.
template <class Policy>
class evictor<Policy, cuda::backend> {
 public:
  using policy = Policy;
  using params_type = typename Policy::params;
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  using Spatial = typename Policy::spatial_smoother;
  using Budgeter = typename Policy::budgeter;

  static constexpr bool is_lor = std::is_same<Scorer, scorers::output_reconstruction>::value;
  static constexpr bool is_key_norm = std::is_same<Scorer, scorers::key_norm>::value;
  static constexpr bool is_attention = std::is_same<Scorer, scorers::attention_weight>::value ||
                                       std::is_same<Scorer, scorers::accumulated_attention>::value ||
                                       std::is_same<Scorer, scorers::last_query>::value;
  static constexpr bool is_last = std::is_same<Scorer, scorers::last_query>::value;
  static constexpr bool is_learned = std::is_same<Scorer, scorers::learned_mlp>::value;
  static constexpr bool layer_budgeter = cuda::detail::is_layer_budgeter<Budgeter>::value;
  static constexpr bool needs_drift = Spatial::needs_attention_drift;

  static_assert(!std::is_same<Scorer, scorers::attention_value_norm>::value,
                "kvevict: CriticalKV (scorers::attention_value_norm + selectors::two_stage, presets::criticalkv / "
                "critical_adakv) runs on the CPU backend only; the CUDA backend has no implementation of it");
  static_assert(std::is_same<typename Policy::selector, selectors::topk>::value,
                "kvevict: the CUDA backend implements selectors::topk only (sinks + recent window protected, top-k "
                "of the rest)");
  static_assert(is_lor || is_key_norm || is_attention || is_learned || std::is_same<Scorer, scorers::none>::value ||
                    std::is_same<Scorer, scorers::attention_value_norm>::value,
                "kvevict: this Scorer has no CUDA implementation (the CUDA backend serves the built-in scorers)");
  static_assert(std::is_same<Spatial, spatial::none>::value || std::is_same<Spatial, spatial::avg_pool>::value ||
                    std::is_same<Spatial, spatial::max_pool>::value || std::is_same<Spatial, spatial::adaptive_window>::value,
                "kvevict: this spatial smoother has no CUDA implementation");
  static_assert(!needs_drift || Scorer::window_attention,
                "kvevict: the adaptive-window smoother needs a scorer that computes the window attention");
  static_assert(!Budgeter::needs_scores || Scorer::has_scores, "kvevict: a score-based budgeter needs a scorer with scores");

  explicit evictor(params_type p = Policy::defaults(), cuda::backend be = {}) : p_(p), be_(be) {}

  const params_type& params() const { return p_; }
  params_type& params() { return p_; }
  const cuda::backend& backend() const { return be_; }
  cuda::backend& backend() { return be_; }

  /// Selection rows per sequence: kv_heads, or q_heads for gqa_reduction::per_query_head.
  template <class T>
  std::int64_t out_heads(const layer_inputs<T>& in) const {
    return p_.gqa == gqa_reduction::per_query_head ? in.q_heads() : in.kv_heads();
  }

  /// Host-side shape, parameter and budget checks (nothing on the device is read; lengths are
  /// checked by run() on the device, see the class comment).
  template <class T>
  status can_implement(const layer_inputs<T>& in, const budget_request& budget) const {
    KVEVICT_TRY((kvevict::detail::validate_layer_inputs<Policy, T>(in, p_, budget)));
    if (in.head_dim() > cuda::detail::max_head_dim)
      return status::error(errc::not_supported, "head_dim = %lld > %d is not supported by the CUDA backend",
                           static_cast<long long>(in.head_dim()), cuda::detail::max_head_dim);
    if (in.batch() * in.q_heads() > 65535 || in.batch() * out_heads(in) > 0x7fffffffLL)
      return status::error(errc::not_supported, "batch * q_heads = %lld > 65535 is not supported by the CUDA backend",
                           static_cast<long long>(in.batch() * in.q_heads()));
    if (in.window() > 0x7fffffffLL / 2)
      return status::error(errc::not_supported, "window = %lld is too large", static_cast<long long>(in.window()));
    if constexpr (is_learned) {
      if (!p_.scorer.on_device)
        return status::error(errc::invalid_argument,
                             "scorer.on_device = false: the CUDA backend needs the LKV weights in device memory (cuda::lkv_device_tables)");
      KVEVICT_TRY(Scorer::check_layer_shape(p_.scorer, in.kv_heads(), in.head_dim(), in.layer_idx, in.num_layers));
    }
    if constexpr (layer_budgeter) {
      if (!p_.budgeter.on_device)
        return status::error(errc::invalid_argument,
                             "budgeter.on_device = false: the CUDA backend needs the LKV tables in device memory (cuda::lkv_device_tables)");
      if (in.num_layers != p_.budgeter.num_layers || in.kv_heads() != p_.budgeter.kv_heads)
        return status::error(errc::shape_mismatch,
                             "budgeter table (num_layers = %d, kv_heads = %d) != layer inputs (num_layers = %d, kv_heads = %lld)",
                             p_.budgeter.num_layers, p_.budgeter.kv_heads, in.num_layers, static_cast<long long>(in.kv_heads()));
      const std::int64_t t = p_.budgeter.num_tokens > in.capacity() ? p_.budgeter.num_tokens : in.capacity();
      if (static_cast<std::int64_t>(p_.budgeter.num_layers) * p_.budgeter.kv_heads > (std::int64_t{1} << 40) / (t > 0 ? t : 1))
        return status::error(errc::not_supported, "num_layers * kv_heads * t is too large for the budget arithmetic");
    }
    return {};
  }

  /// Bytes of device workspace run() needs for these shapes (independent of the data),
  /// including 256 bytes of alignment slack: any device pointer will do.
  template <class T>
  std::size_t workspace_size(const layer_inputs<T>& in) const {
    kvevict::detail::workspace_carver c;
    carve_all(c, in);
    return c.bytes() + kvevict::detail::workspace_carver::alignment;
  }

  /// Upper bound of the kept tokens (the capacity selection.indices must have); see the class
  /// comment. -1 when can_implement() fails.
  template <class T>
  std::int64_t max_selected(const layer_inputs<T>& in, const budget_request& budget) const {
    if (!can_implement(in, budget).ok()) return -1;
    const std::int64_t S = in.capacity();
    const auto& sp = p_.selector;
    std::int64_t B;
    if (budget.keep_tokens > 0) {
      B = budget.keep_tokens;
    } else {
      B = static_cast<std::int64_t>(budget.keep_fraction * static_cast<double>(S));
      const std::int64_t fixed_recent = sp.recent_share >= 0.0f ? 0 : (sp.num_recent >= 0 ? sp.num_recent : in.window());
      std::int64_t fl = sp.num_sink + fixed_recent;
      if (fl > S) fl = S;
      if (B < fl) B = fl;
      if (B < 1) B = 1;
    }
    if (std::is_same<Budgeter, budgeters::pyramid>::value) B = 2 * B + 1;
    if (layer_budgeter) B = S;  // LKV-H: a head may keep its whole length
    const std::int64_t per = B < S ? B : S;
    return in.batch() * out_heads(in) * per;
  }

  /// The device status word inside a workspace passed to run() (same pointer and size).
  static cuda::device_status* device_status_ptr(void* workspace) {
    return reinterpret_cast<cuda::device_status*>(align_up(workspace));
  }

  /// Enqueue the selection of one layer on be.stream.
  /// @param in         device views; see layer_inputs
  /// @param out        device CSR buffers: indptr[batch * out_heads + 1], indices[capacity],
  ///                   optional positions[capacity]; capacity >= max_selected() is safe
  /// @param workspace  device memory of at least workspace_size(in) bytes
  /// @param maybe_scores optional device fp32 (batch, out_heads, seq): final scores, 0 on
  ///                   pass-through heads and protected slots
  /// Returns host-detectable errors (shapes, parameters, null pointers, launch failures)
  /// immediately; data errors (lengths, NaN/inf, capacity) land in the device status word
  /// when the stream reaches them - the outputs are then unspecified (indices untouched on a
  /// capacity error).
  template <class T>
  status run(const layer_inputs<T>& in, const budget_request& budget, selection_view out, void* workspace,
             std::size_t workspace_bytes, float* maybe_scores = nullptr) const {
    KVEVICT_TRY(can_implement(in, budget));
    if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "selection.indptr or selection.indices is null");
    const std::size_t need = workspace_size(in);
    if (!workspace || workspace_bytes < need)
      return status::error(errc::insufficient_workspace, "workspace_bytes = %zu < workspace_size() = %zu (or workspace is null)",
                           workspace_bytes, need);
    using namespace cuda::detail;
    const cudaStream_t st = be_.stream;
    kvevict::detail::workspace_carver c(align_up(workspace));
    const buffers bf = carve_all(c, in);
    const int B = static_cast<int>(in.batch()), Hkv = static_cast<int>(in.kv_heads()), H = static_cast<int>(out_heads(in));
    const int Gq = in.queries.data ? static_cast<int>(in.group_size()) : 1;
    const int Gout = H / Hkv;
    const int Hq = in.queries.data ? static_cast<int>(in.q_heads()) : Hkv;
    const std::int64_t S = in.capacity(), W = in.window(), rows = static_cast<std::int64_t>(B) * H;
    const int d = static_cast<int>(in.head_dim());
    const int layer_mean = p_.gqa == gqa_reduction::layer_mean ? 1 : 0;
    const unsigned T256 = block_threads;

    record(0);
    KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.status, 0, sizeof(cuda::device_status), st));
    // 1. plans, lengths, score-free budgets
    plan_shape sh;
    sh.B = B;
    sh.Hkv = Hkv;
    sh.H = H;
    sh.Gout = Gout;
    sh.S = S;
    sh.W = W;
    sh.layer = in.layer_idx;
    sh.num_layers = in.num_layers;
    sh.layer_mean = layer_mean;
    plan_kernel<Budgeter, Scorer::has_scores><<<B, T256, 0, st>>>(in.lengths, sh, budget, p_.selector, p_.budgeter, bf.status,
                                                                  bf.len_kv, bf.plankv, bf.needkv, bf.plans, bf.budgets, bf.need,
                                                                  bf.lb);
    KVEVICT_CUDA_CHECK_LAUNCH();
    if (p_.check_finite) {
      finite_scan_kernel<T><<<grid_for(in.keys.size()), T256, 0, st>>>(in.keys, 0, bf.len_kv, Hkv, 1, 0, bf.status);
      KVEVICT_CUDA_CHECK_LAUNCH();
      if (in.values.data && Scorer::needs_values) {
        finite_scan_kernel<T><<<grid_for(in.values.size()), T256, 0, st>>>(in.values, 1, bf.len_kv, Hkv, 1, 0, bf.status);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if (in.queries.data && Scorer::needs_queries) {
        finite_scan_kernel<T><<<grid_for(in.queries.size()), T256, 0, st>>>(in.queries, 2, bf.len_kv, Hkv, Gq, 1, bf.status);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if (Scorer::needs_wo_factor(p_.scorer)) {
        finite_scan_wo_kernel<<<grid_for(in.wo_factor.size()), T256, 0, st>>>(in.wo_factor, bf.status);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
    }
    record(1);

    // 2. scoring into per-query-head rows
    if constexpr (Scorer::has_scores) {
      if constexpr (is_key_norm) {
        dim3 g(ceil_div(S, block_warps), static_cast<unsigned>(B * Hkv * Gq));
        if (S > 0) key_norm_kernel<T><<<g, T256, 0, st>>>(in.keys, bf.len_kv, bf.needkv, Hkv, Gq, S, bf.grows);
        KVEVICT_CUDA_CHECK_LAUNCH();
      } else if constexpr (is_learned) {
        const auto& sp = p_.scorer;
        const int layer = sp.layer >= 0 ? sp.layer : in.layer_idx;
        lkv_mlp_args m;
        m.block = Scorer::block_floats(sp.head_dim, sp.hidden);
        m.w = sp.weights + static_cast<std::int64_t>(layer) * sp.kv_heads * m.block;
        m.hidden = sp.hidden;
        m.relu = sp.activation == lkv_activation::relu ? 1 : 0;
        dim3 g(ceil_div(S, lkv_tile_tokens), static_cast<unsigned>(B * Hkv));
        if (S > 0) lkv_mlp_kernel<T><<<g, T256, 0, st>>>(in.keys, in.values, bf.len_kv, bf.needkv, Hkv, Gq, S, m, bf.grows);
        KVEVICT_CUDA_CHECK_LAUNCH();
      } else {
        KVEVICT_TRY(score_window(in, bf, B, Hkv, Hq, W, S, d));
      }
    }
    record(2);

    // 3. GQA reduction and smoothing
    const float* fin = nullptr;
    if constexpr (Scorer::has_scores) {
      float* scores = bf.grows;
      if (Gout != Gq) {
        scores = bf.scores;
        gqa_reduce_kernel<<<grid_for(rows * S), T256, 0, st>>>(bf.grows, scores, B, Hkv, Gq, S,
                                                              p_.gqa == gqa_reduction::max ? 1 : 0, bf.len_kv, bf.need);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if (layer_mean) {
        layer_mean_kernel<<<grid_for(static_cast<std::int64_t>(B) * S), T256, 0, st>>>(scores, B, H, S, bf.len_kv, Hkv, bf.need);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if constexpr (needs_drift) {
        drift_reduce_kernel<<<ceil_div(B, 64), 64, 0, st>>>(bf.qdrift, bf.drift, B, Hkv, Gq, Gout, layer_mean);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if constexpr (std::is_same<Spatial, spatial::none>::value) {
        fin = scores;
      } else if constexpr (std::is_same<Spatial, spatial::max_pool>::value) {
        max_pool_kernel<<<grid_for(rows * S), T256, 0, st>>>(p_.spatial.kernel, scores, bf.fin, rows, S, bf.plans, bf.need);
        KVEVICT_CUDA_CHECK_LAUNCH();
        fin = bf.fin;
      } else {
        prefix_kernel<<<static_cast<unsigned>(rows), T256, 0, st>>>(scores, bf.pre, S, bf.plans, bf.need);
        KVEVICT_CUDA_CHECK_LAUNCH();
        box_kernel<Spatial><<<grid_for(rows * S), T256, 0, st>>>(p_.spatial, scores, bf.pre, bf.drift, bf.fin, rows, S, bf.plans,
                                                                 bf.need);
        KVEVICT_CUDA_CHECK_LAUNCH();
        fin = bf.fin;
      }
    }
    record(3);

    // 4. score-dependent budgets
    if constexpr (Budgeter::needs_scores) {
      adakv_kernel<<<B, T256, 0, st>>>(p_.budgeter, bf.plans, fin, H, S, bf.candprefix, bf.winners, bf.share, bf.cap, bf.extra,
                                      bf.budgets);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    record(4);

    // 5. CSR offsets (CUB scan), selection, positions, exported scores
    counts_kernel<<<ceil_div(rows, T256), T256, 0, st>>>(bf.plans, bf.budgets, rows, bf.cnt);
    KVEVICT_CUDA_CHECK_LAUNCH();
    KVEVICT_CUDA_TRY(cudaMemsetAsync(out.indptr, 0, sizeof(std::int32_t), st));
    std::size_t scan_bytes = bf.scan_bytes;
    KVEVICT_CUDA_TRY(cub::DeviceScan::InclusiveSum(bf.scan_tmp, scan_bytes, bf.cnt, out.indptr + 1, static_cast<int>(rows), st));
    capacity_kernel<<<1, 32, 0, st>>>(out.indptr, rows, out.capacity, bf.status);
    KVEVICT_CUDA_CHECK_LAUNCH();
    select_kernel<<<static_cast<unsigned>(rows), T256, 0, st>>>(bf.plans, bf.budgets, bf.need, fin, S, out.indptr, out.capacity,
                                                                out.indices, out.positions, in.positions, H, Gout);
    KVEVICT_CUDA_CHECK_LAUNCH();
    if (maybe_scores) {
      export_scores_kernel<<<grid_for(rows * S), T256, 0, st>>>(fin, bf.plans, bf.need, rows, S, maybe_scores);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    record(5);
    return {};
  }

 private:
  struct buffers {
    cuda::device_status* status = nullptr;
    std::int32_t* len_kv = nullptr;
    kvevict::detail::head_plan* plankv = nullptr;
    std::uint8_t* needkv = nullptr;
    kvevict::detail::head_plan* plans = nullptr;
    std::int64_t* budgets = nullptr;
    std::uint8_t* need = nullptr;
    std::int32_t* cnt = nullptr;
    double* drift = nullptr;
    float* cw = nullptr;
    float* grows = nullptr;
    float* scores = nullptr;
    float* fin = nullptr;
    double* pre = nullptr;
    float* qs = nullptr;
    double *pm = nullptr, *pz = nullptr;
    int* pa = nullptr;
    double *rm = nullptr, *rz = nullptr;
    int* ra = nullptr;
    int nsplit = 1;
    double* rowmean = nullptr;
    double* qdrift = nullptr;
    float* dbuf = nullptr;
    std::int64_t drift_blocks = 1;
    float* abar = nullptr;
    float* vscale = nullptr;
    float* rt = nullptr;
    double* zpart = nullptr;
    int nsz = 1;
    float* rzv = nullptr;
    float* RZ = nullptr;
    double* rz2 = nullptr;
    float* amc = nullptr;
    long long* candprefix = nullptr;
    unsigned long long* winners = nullptr;
    double* share = nullptr;
    std::int64_t* cap = nullptr;
    std::int64_t* extra = nullptr;
    cuda::detail::layer_budget_scratch lb;
    void* scan_tmp = nullptr;
    std::size_t scan_bytes = 0;
  };

  static void* align_up(void* p) {
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p), al = kvevict::detail::workspace_carver::alignment;
    return reinterpret_cast<void*>((a + al - 1) / al * al);
  }

  void record(int i) const {
    if (be_.stage_events && i < be_.num_stage_events) (void)cudaEventRecord(be_.stage_events[i], be_.stream);
  }

  template <class T, class Carver>
  buffers carve_all(Carver& c, const layer_inputs<T>& in) const {
    buffers bf;
    const std::int64_t B = in.batch(), Hkv = in.kv_heads(), H = out_heads(in), S = in.capacity(), W = in.window();
    const std::int64_t Gq = in.queries.data ? in.group_size() : 1;
    const std::int64_t Hq = in.queries.data ? in.q_heads() : Hkv;
    const std::int64_t rows = B * H, nkv = B * Hkv, nq = B * Hq, d = in.head_dim();
    auto n = [](std::int64_t v) { return static_cast<std::size_t>(v > 0 ? v : 1); };
    bf.status = c.template carve<cuda::device_status>(1);
    bf.len_kv = c.template carve<std::int32_t>(n(nkv));
    bf.plankv = c.template carve<kvevict::detail::head_plan>(n(nkv));
    bf.needkv = c.template carve<std::uint8_t>(n(nkv));
    bf.plans = c.template carve<kvevict::detail::head_plan>(n(rows));
    bf.budgets = c.template carve<std::int64_t>(n(rows));
    bf.need = c.template carve<std::uint8_t>(n(rows));
    bf.cnt = c.template carve<std::int32_t>(n(rows));
    bf.drift = c.template carve<double>(n(rows));
    if constexpr (Scorer::has_scores) {
      bf.grows = c.template carve<float>(n(B * Hkv * Gq * S));
      const std::int64_t Gout = H / Hkv;
      if (Gout != Gq) bf.scores = c.template carve<float>(n(rows * S));
      if constexpr (!std::is_same<Spatial, spatial::none>::value) bf.fin = c.template carve<float>(n(rows * S));
      if constexpr (std::is_same<Spatial, spatial::avg_pool>::value || std::is_same<Spatial, spatial::adaptive_window>::value)
        bf.pre = c.template carve<double>(n(rows * (S + 1)));
    }
    if constexpr (Scorer::window_attention) {
      bf.cw = c.template carve<float>(n(nkv * W));
      bf.qs = c.template carve<float>(n(nq * W * d));
      std::int64_t ns = (2048 + W - 1) / (W > 0 ? W : 1);
      const std::int64_t smax = (S + 63) / 64;
      if (ns > smax) ns = smax;
      if (ns > 64) ns = 64;
      if (ns < 1) ns = 1;
      bf.nsplit = static_cast<int>(ns);
      bf.pm = c.template carve<double>(n(nq * ns * W));
      bf.pz = c.template carve<double>(n(nq * ns * W));
      bf.pa = c.template carve<int>(n(nq * ns * W));
      bf.rm = c.template carve<double>(n(nq * W));
      bf.rz = c.template carve<double>(n(nq * W));
      bf.ra = c.template carve<int>(n(nq * W));
      if constexpr (needs_drift) {
        bf.rowmean = c.template carve<double>(n(nq * W));
        bf.qdrift = c.template carve<double>(n(nq));
        std::int64_t nb = (std::int64_t{1} << 24) / (S > 0 ? S : 1);
        if (nb > nq * W) nb = nq * W;
        if (nb < 1) nb = 1;
        bf.drift_blocks = nb;
        bf.dbuf = c.template carve<float>(n(nb * S));
      }
      if constexpr (is_lor) {
        bf.abar = c.template carve<float>(n(nq * S));
        bf.vscale = c.template carve<float>(n(nkv));
        if (p_.scorer.use_wo) bf.rt = c.template carve<float>(n(Hq * d * d));
        std::int64_t nz = (S + 4095) / 4096;
        if (nz > 64) nz = 64;
        if (nz < 1) nz = 1;
        bf.nsz = static_cast<int>(nz);
        bf.zpart = c.template carve<double>(n(nq * nz * d));
        bf.rzv = c.template carve<float>(n(nq * d));
        bf.RZ = c.template carve<float>(n(nq * W * d));
        bf.rz2 = c.template carve<double>(n(nq * W));
        bf.amc = c.template carve<float>(n(nq * W));
      }
    }
    if constexpr (layer_budgeter) {
      const std::int64_t nh = static_cast<std::int64_t>(p_.budgeter.num_layers) * p_.budgeter.kv_heads;
      bf.lb.n = nh > 0 ? nh : 1;
      bf.lb.share = c.template carve<double>(n(B * bf.lb.n));
      bf.lb.capv = c.template carve<std::int64_t>(n(B * bf.lb.n));
      bf.lb.all = c.template carve<std::int64_t>(n(B * bf.lb.n));
      bf.lb.clipped = c.template carve<unsigned char>(n(B * bf.lb.n));
    }
    if constexpr (Budgeter::needs_scores) {
      bf.candprefix = c.template carve<long long>(n(B * (H + 1)));
      bf.winners = c.template carve<unsigned long long>(n(rows));
      bf.share = c.template carve<double>(n(rows));
      bf.cap = c.template carve<std::int64_t>(n(rows));
      bf.extra = c.template carve<std::int64_t>(n(rows));
    }
    std::size_t sb = 0;
    (void)cub::DeviceScan::InclusiveSum(nullptr, sb, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
                                        static_cast<int>(rows > 0 ? rows : 1), be_.stream);
    bf.scan_bytes = sb > 0 ? sb : 1;
    bf.scan_tmp = c.template carve<unsigned char>(bf.scan_bytes);
    return bf;
  }

  /// Window-attention scorers: staging, softmax statistics, aggregation, drift, LOR.
  template <class T>
  status score_window(const layer_inputs<T>& in, const buffers& bf, int B, int Hkv, int Hq, std::int64_t W, std::int64_t S,
                      int d) const {
    using namespace cuda::detail;
    const cudaStream_t st = be_.stream;
    const unsigned T256 = block_threads;
    const int nq = B * Hq;
    temporal_weights_kernel<Temporal><<<grid_for(static_cast<std::int64_t>(B) * Hkv * W), T256, 0, st>>>(
        p_.temporal, bf.len_kv, static_cast<std::int64_t>(B) * Hkv, W, is_last ? 1 : 0, bf.cw);
    KVEVICT_CUDA_CHECK_LAUNCH();
    stage_queries_kernel<T><<<grid_for(in.queries.size()), T256, 0, st>>>(in.queries, bf.qs, in.queries.size());
    KVEVICT_CUDA_CHECK_LAUNCH();
    head_args<T> a;
    a.keys = in.keys;
    a.values = in.values;
    a.q = bf.qs;
    a.len = bf.len_kv;
    a.needkv = bf.needkv;
    a.cw = bf.cw;
    a.Hkv = Hkv;
    a.Hq = Hq;
    a.G = Hq / Hkv;
    a.W = static_cast<int>(W);
    a.d = d;
    a.S = S;
    a.scale = static_cast<double>(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
    a.last_only = is_last ? 1 : 0;
    const std::size_t qsmem = static_cast<std::size_t>(32) * d * sizeof(float);
    const std::int64_t zchunks = (W + 31) / 32;
    const unsigned gz = static_cast<unsigned>(zchunks < 65535 ? (zchunks > 0 ? zchunks : 1) : 65535);
    attn_stats_partial_kernel<T><<<dim3(bf.nsplit, nq, gz), T256, qsmem, st>>>(a, bf.nsplit, bf.pm, bf.pz, bf.pa);
    KVEVICT_CUDA_CHECK_LAUNCH();
    attn_stats_combine_kernel<T><<<grid_for(static_cast<std::int64_t>(nq) * W), T256, 0, st>>>(a, bf.nsplit, nq, bf.pm, bf.pz,
                                                                                                bf.pa, bf.rm, bf.rz, bf.ra);
    KVEVICT_CUDA_CHECK_LAUNCH();
    const dim3 gkeys(ceil_div(S > 0 ? S : 1, block_threads), nq);
    const dim3 gwarp(ceil_div(S > 0 ? S : 1, block_warps), nq);
    if constexpr (is_attention) {
      int mode = 1;
      if constexpr (std::is_same<Scorer, scorers::accumulated_attention>::value) mode = p_.scorer.normalize_by_visible ? 2 : 1;
      attn_accum_kernel<T><<<gkeys, T256, qsmem, st>>>(a, bf.rm, bf.rz, mode, bf.grows);
      KVEVICT_CUDA_CHECK_LAUNCH();
    } else if constexpr (is_lor) {
      lor_args o;
      o.vscale = bf.vscale;
      o.rt = p_.scorer.use_wo ? bf.rt : nullptr;
      o.tau = p_.scorer.tau;
      o.include_window = p_.scorer.include_window_in_output ? 1 : 0;
      value_scale_kernel<T><<<B * Hkv, T256, 0, st>>>(in.values, bf.len_kv, bf.needkv, Hkv, bf.vscale);
      KVEVICT_CUDA_CHECK_LAUNCH();
      if (p_.scorer.use_wo) {
        const std::int64_t nr = static_cast<std::int64_t>(Hq) * d * d;
        stage_rt_kernel<<<grid_for(nr), T256, 0, st>>>(in.wo_factor, bf.rt, nr);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
      if (p_.scorer.aggregation == scorers::output_reconstruction::mode::after) {
        attn_accum_kernel<T><<<gkeys, T256, qsmem, st>>>(a, bf.rm, bf.rz, 0, bf.abar);
        KVEVICT_CUDA_CHECK_LAUNCH();
        lor_z_partial_kernel<T><<<dim3(bf.nsz, nq), T256, 0, st>>>(a, o, bf.abar, bf.nsz, bf.zpart);
        KVEVICT_CUDA_CHECK_LAUNCH();
        lor_z_finalize_kernel<T><<<nq, T256, 0, st>>>(a, o, bf.nsz, bf.zpart, bf.rzv);
        KVEVICT_CUDA_CHECK_LAUNCH();
        lor_after_dist_kernel<T><<<gwarp, T256, 0, st>>>(a, o, bf.abar, bf.rzv, bf.grows);
        KVEVICT_CUDA_CHECK_LAUNCH();
        lor_after_dominant_kernel<T><<<nq, T256, 0, st>>>(a, o, bf.rm, bf.rz, bf.abar, bf.grows);
        KVEVICT_CUDA_CHECK_LAUNCH();
      } else {
        lor_before_row_kernel<T><<<dim3(static_cast<unsigned>(W), nq), T256, 0, st>>>(a, o, bf.rm, bf.rz, bf.ra, bf.RZ, bf.rz2,
                                                                                      bf.amc);
        KVEVICT_CUDA_CHECK_LAUNCH();
        lor_before_acc_kernel<T><<<gwarp, T256, 0, st>>>(a, o, bf.rm, bf.rz, bf.ra, bf.RZ, bf.rz2, bf.amc, bf.grows);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
    }
    if constexpr (needs_drift) {
      const std::int64_t total = static_cast<std::int64_t>(nq) * W;
      drift_rows_kernel<T><<<static_cast<unsigned>(bf.drift_blocks), T256, 0, st>>>(a, bf.rm, bf.rz, bf.plankv, total, bf.dbuf,
                                                                                     bf.rowmean);
      KVEVICT_CUDA_CHECK_LAUNCH();
      drift_finalize_kernel<T><<<ceil_div(nq, 64), 64, 0, st>>>(a, nq, bf.rowmean, bf.qdrift);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    return {};
  }

  params_type p_;
  cuda::backend be_;
};

}  // namespace kvevict
