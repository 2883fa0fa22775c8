// IWYU pragma: private, include "kvevict/cuda.cuh"
// evictor<Policy, cuda::backend>: a thin driver over the backend-neutral front-end
// (frontend/frontend.hpp: validation, budget rules, the plan). It enqueues a policy's stages
// through the CUDA implementation traits (backends/cuda/impl.cuh) on one stream and adds only
// what the device needs: the workspace layout, the plan kernel (lengths and budgets on the
// device), the NaN scans, the GQA reduction, the CSR offsets. It names no scorer, smoother or
// budgeter type. run(): no allocation, no host synchronisation, graph-capturable (docs/cuda.md);
// run_sharded() synchronises for its host-side exchange (docs/distributed.md).
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/paged.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/backends/cuda/sharded.cuh"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/distributed/communicator.hpp"
#include "kvevict/distributed/exchange.hpp"
#include "kvevict/distributed/fingerprint.hpp"
#include "kvevict/evictor.hpp"
#include "kvevict/frontend/frontend.hpp"
#include "kvevict/frontend/plan.hpp"

namespace kvevict {

/// CUDA evictor. All pointers in layer_inputs, the selection, the workspace and maybe_scores
/// are DEVICE pointers (lengths and positions included).
///
///   eviction_plan pl;
///   KVEVICT_TRY(ev.plan(in, budget, &pl, opts));   // host only: validation, sizes (opts.host_lengths: exact count)
///   KVEVICT_TRY(ev.run(pl, in, sel, d_ws, pl.workspace_bytes));  // enqueues, returns at once
///
/// Differences to the CPU evictor, all forced by "no host synchronisation":
///  - plan() checks shapes and parameters on the host. Lengths live on the device: unless
///    plan_options::host_lengths gives a host copy, the kernels validate them
///    (0 <= L <= seq; equal lengths per sequence for gqa_reduction::layer_mean) and report a
///    violation through the device status word (device_status_ptr(workspace), see
///    cuda::device_status), as they do NaN/inf inputs (check_finite) and a selection larger than
///    selection.capacity. The device checks run in every run(): the data may change after plan().
///  - max_selected is the CPU's exact count when the host knows the lengths (no lengths view,
///    or plan_options::host_lengths) and the budgets (not LKV-H, whose tables are device memory,
///    nor a paged cache with pages.protected_prefix, device memory that raises budgets: the bound
///    is then batch * out_heads * capacity and plan() checks no lengths);
///    otherwise an upper bound from the shapes (eviction_plan::max_selected_exact = false):
///    batch * out_heads * min(seq, per-head bound), the bound being the base budget B (uniform,
///    AdaKV), 2B + 1 (PyramidKV's largest layer) or seq (LKV-H), plus the budgeter's total_slack per
///    sequence (AdaKV with exact_total = false: out_heads). The exact kept count of row r
///    is always indptr[r+1] - indptr[r], computed on the device (CUB DeviceScan).
///  - LKV (scorers::learned_mlp, budgeters::headwise_learned) needs its tables in device memory
///    (params.on_device = true, e.g. from cuda::lkv_device_tables, kvevict/backends/cuda/learned.cuh).
///  - A paged cache (layer_inputs::pages) has its page table in device memory too: run() checks
///    it on the device before any other kernel reads through it (device_check::page_*; a bad
///    indptr is reported before any page id is read; every length is then 0, nothing is read), and plan() knows its lengths only from plan_options::host_lengths.
///    The scorer's implementation must read K/V through cuda::head_rows (reads_pages).
/// Supported: head_dim <= 256, batch * q_heads <= 65535, the stages with a CUDA implementation
/// trait (the built-ins but CriticalKV; a user's stage specialises its trait, impl.cuh).
template <class Policy>
class evictor<Policy, cuda::backend> : public kvevict::detail::evictor_base<evictor<Policy, cuda::backend>, Policy> {
  using front = kvevict::detail::frontend<Policy>;
  using api_base = kvevict::detail::evictor_base<evictor<Policy, cuda::backend>, Policy>;
  static_assert(front::composition_ok, "kvevict: the stages of this policy do not compose (see the message above)");

 public:
  using typename api_base::params_type;
  using typename api_base::Scorer;
  using typename api_base::Temporal;
  using typename api_base::Spatial;
  using typename api_base::Budgeter;
  using typename api_base::Selector;
  using api_base::out_heads;
  using api_base::run;

 private:
  static constexpr bool has_scores = Scorer::has_scores;
  static constexpr bool needs_drift = Spatial::needs_attention_drift;
  static constexpr kvevict::detail::budget_kind kind = front::kind;
  // The stages' implementations. A stage with nothing to do is not instantiated: the scorer and
  // the spatial smoother of a policy without scores (scorers::none).
  using scorer_i = std::conditional_t<has_scores, cuda::scorer_impl<Scorer>, cuda::detail::idle_stage>;
  using spatial_i = std::conditional_t<has_scores, cuda::spatial_impl<Spatial>, cuda::detail::idle_stage>;
  using budgeter_i = cuda::budgeter_impl<Budgeter>;
  using selector_i = cuda::selector_impl<Selector>;
  // Every stage the policy runs has a CUDA implementation (else the trait's message fires here).
  static_assert(sizeof(scorer_i) > 0 && sizeof(spatial_i) > 0 && sizeof(budgeter_i) > 0 && sizeof(selector_i) > 0,
                "kvevict: a stage of this policy has no CUDA implementation");
  static_assert(!kvevict::detail::scorer_combines_heads<Scorer>::value,
                "kvevict: this scorer combines the KV heads of a sequence (combines_heads, e.g. scorers::defensive_attention): "
                "the CUDA evictor has no per-sequence pass yet; use the CPU backend");
  static_assert(!kvevict::detail::temporal_row_max<typename Policy::temporal_smoother>::value,
                "kvevict: temporal::maximum / temporal::defensive (row-maximum aggregation) run on the CPU backend only");
  static_assert(!kvevict::detail::budget_is_cap<Budgeter>::value,
                "kvevict: budgets-as-caps budgeters (budgeters::threshold) run on the CPU backend only");

 public:
  using api_base::params;
  explicit evictor(params_type p = Policy::defaults(), cuda::backend be = {}) : api_base(p), be_(be) {}

  const cuda::backend& backend() const { return be_; }
  cuda::backend& backend() { return be_; }

  /// Plan one layer (host only; nothing on the device is read): parameters, shapes, budget and
  /// the backend's limits; with opt.host_lengths (a host copy of in.lengths, batch x kv_heads
  /// row-major) also the lengths and the exact max_selected. Fixes workspace_bytes. The plan
  /// belongs to this object and goes stale when params() is taken mutably or the object is
  /// assigned another evictor. On error *out is untouched.
  template <class T>
  status plan(const layer_inputs<T>& in, const budget_request& budget, eviction_plan* out, const plan_options& opt = {}) const {
    typename front::plan_request rq = this->owned_request();
    // A paged cache's table is device memory: its lengths are known on the host only from
    // opt.host_lengths (the table's, or in.lengths', host copy).
    rq.lengths = (in.lengths.data || in.paged()) ? opt.host_lengths : nullptr;
    rq.lengths_stride[0] = in.kv_heads();
    rq.lengths_stride[1] = 1;
    // A protected prefix (device memory) changes the budgets: the host bounds them by the capacity.
    const bool prefix_on_device = in.paged() && in.pages.protected_prefix != nullptr;
    rq.lengths_known = prefix_on_device ? false
                                        : (in.paged() ? opt.host_lengths != nullptr : (in.lengths.data == nullptr || opt.host_lengths != nullptr));
    rq.host_budgets = budgeter_i::host_budgets;
    rq.num_threads = 1;
    rq.sharded = opt.sharded;
    return front::make_plan(
        in, p_, budget, rq, [&]() { return backend_check(in, opt.sharded); }, [&](int) { return workspace_size(in); }, out);
  }

  /// Enqueue the selection of one layer on be.stream with a plan of this evictor (made for
  /// inputs of these shapes; other data is fine). Checks only the plan (O(1)), the output and
  /// workspace pointers and the workspace size.
  /// @param out        device CSR buffers: indptr[batch * out_heads + 1], indices[capacity],
  ///                   optional positions[capacity]; capacity >= plan.max_selected is safe
  /// @param workspace  device memory of at least plan.workspace_bytes bytes (any alignment)
  /// @param maybe_scores optional device fp32 (batch, out_heads, seq): final scores, 0 on
  ///                   pass-through heads and protected slots
  /// Data errors (lengths, NaN/inf, capacity) land in the device status word when the stream
  /// reaches them - the outputs are then unspecified (indices untouched on a capacity error).
  template <class T>
  status run(const eviction_plan& pl, const layer_inputs<T>& in, selection_view out, void* workspace, std::size_t workspace_bytes,
             float* maybe_scores = nullptr) const {
    // The workspace the current parameters need, never less than the plan's (host-side count):
    // a plan cannot make the kernels write past the caller's memory.
    KVEVICT_TRY(this->check_run_args(pl, in, out, workspace, workspace_bytes, std::max(pl.workspace_bytes, workspace_size(in))));
    if (pl.sharded) return status::error(errc::invalid_argument, "plan was made with plan_options::sharded: call run_sharded()");
    return enqueue(pl, in, out, workspace, maybe_scores);
  }

  /// run() for a layer whose KV heads are split over the ranks of `comm` (tensor parallelism;
  /// docs/distributed.md), with the CPU backend's protocol and guarantees (evictor<Policy,
  /// cpu::backend>::run_sharded): every rank of the group calls it for the same layer with a plan
  /// made with plan_options::sharded, its own heads (in: kv_heads = shard.num_heads) and the same
  /// budget and policy parameters; every rank's selection equals the single-device selection of
  /// its heads, and any rank's error is returned on every rank, none left waiting, nothing
  /// written. Device pointers as for run(); `sh.heads` and `stats` are host memory.
  ///
  /// Unlike run(), it SYNCHRONISES be.stream: the exchange runs on the host, between the stages.
  /// Per call: once after the plans (the plans, budgets and device status word are read back, so
  /// a bad length, page table or NaN is known before round 1); for AdaKV once more after smoothing
  /// (the smoothed scores, rows x seq fp32, are copied to the host for the radix select) and after
  /// its budgets go back; for LKV-H once to read the device ratios and once after its budgets go
  /// back; with a device-buffer communicator, twice per collective. The selection is then
  /// enqueued and the call returns; it cannot be captured in a CUDA graph. LKV-H's whole-model
  /// allocation runs on the host over the gathered plans, on the device ratios copied back (the
  /// CPU's own code: budgets bit-identical). comm: host buffers (MPI, gloo) or device buffers
  /// (memory_space::device, NCCL): the latter are staged through one device buffer allocated
  /// with cudaMallocAsync on be.stream before round 1 (cuda::detail::staged_communicator;
  /// cuda::detail::exchange_max_values int64, the largest message: batch x max(256, global KV
  /// heads x (1 + 5 G), global rows x 2) values, a few KiB at batch 1). Host memory:
  /// O(batch * global rows), plus the scores for AdaKV. Errors of the communicator itself (null,
  /// bad rank or size) and a failed allocation of round 1's staging (8 + 8 x ranks values) are
  /// returned at once, as failed collectives are; a staging size that cannot be allocated is
  /// this rank's round-1 error.
  template <class T>
  status run_sharded(const eviction_plan& pl, const layer_inputs<T>& in, distributed::communicator* comm, const distributed::shard& sh,
                     selection_view out, void* workspace, std::size_t workspace_bytes, float* maybe_scores = nullptr,
                     distributed::exchange_stats* stats = nullptr) const {
    if (!comm) return status::error(errc::null_pointer, "communicator is null");
    if (comm->size() < 1 || comm->rank() < 0 || comm->rank() >= comm->size())
      return status::error(errc::invalid_argument, "communicator rank() = %d, size() = %d", comm->rank(), comm->size());
    if constexpr (!sharded_supported) {
      (void)pl, (void)in, (void)sh, (void)out, (void)workspace, (void)workspace_bytes, (void)maybe_scores, (void)stats;
      return status::error(errc::not_supported, "budgeter %s has no sharded allocation on the CUDA backend (docs/distributed.md)",
                           Budgeter::name);
    } else {
      cuda::detail::staged_communicator staged(comm, be_.stream);
      distributed::communicator* hc = comm;
      status pre;  // a staging this rank cannot allocate: its round-1 error (round 1 itself always fits)
      if (comm->space() == distributed::memory_space::device) {
        KVEVICT_TRY(staged.reserve(8 + 8 * static_cast<std::int64_t>(comm->size())));  // round 1 and the last round
        const std::int64_t gout = std::max<std::int64_t>(1, out_heads(in) / std::max<std::int64_t>(1, in.kv_heads()));
        const std::int64_t m = cuda::detail::exchange_max_values(in.batch(), sh.global_kv_heads, gout, comm->size());
        if (m < 0)
          pre = status::error(errc::not_supported,
                              "run_sharded: the exchange's messages (batch = %lld, shard.global_kv_heads = %d, %lld out rows per KV head, "
                              "%d ranks) are too large to stage",
                              static_cast<long long>(in.batch()), sh.global_kv_heads, static_cast<long long>(gout), comm->size());
        else
          pre = staged.reserve(m);
        hc = &staged;
      }
      return sharded_impl(pl, in, hc, sh, out, workspace, workspace_bytes, maybe_scores, stats, pre);
    }
  }

  /// Bytes of device workspace run() needs for these shapes (independent of the data and the
  /// budget), including 256 bytes of alignment slack: any device pointer will do.
  template <class T>
  std::size_t workspace_size(const layer_inputs<T>& in) const {
    kvevict::detail::workspace_carver c;
    carve_all(c, shape_of(in));
    return c.bytes() + kvevict::detail::workspace_carver::alignment;
  }

  /// The device status word inside a workspace passed to run() (same pointer and size).
  static cuda::device_status* device_status_ptr(void* workspace) {
    return reinterpret_cast<cuda::device_status*>(align_up(workspace));
  }

 private:
  /// The driver's own device arrays and each stage's scratch, carved from the workspace.
  struct buffers {
    cuda::device_status* status = nullptr;
    std::int32_t* len_kv = nullptr;
    std::int32_t* page_len = nullptr;             ///< [nkv] paged: the validated lengths (0 on a table error)
    unsigned long long* page_cnt = nullptr;       ///< [page slots] paged: the duplicate check's counters
    kvevict::detail::head_plan* plankv = nullptr;
    std::uint8_t* needkv = nullptr;
    kvevict::detail::head_plan* plans = nullptr;
    std::int64_t* budgets = nullptr;
    std::uint8_t* need = nullptr;
    std::int32_t* cnt = nullptr;
    double* drift = nullptr;   ///< [rows] drift per selection row
    double* qdrift = nullptr;  ///< [nq] drift per query head (the scorer's, when the smoother reads it)
    float* grows = nullptr;    ///< [nkv * Gq][S] the scorer's rows
    float* scores = nullptr;   ///< [rows][S] GQA-reduced rows (when Gout != Gq)
    typename scorer_i::scratch sc{};
    typename spatial_i::scratch sp{};
    typename budgeter_i::scratch bu{};
    typename selector_i::scratch se{};
    void* scan_tmp = nullptr;
    std::size_t scan_bytes = 0;

    cuda::plan_buffers plan_view() const {
      cuda::plan_buffers pb;
      pb.status = status;
      pb.len_kv = len_kv;
      pb.plankv = plankv;
      pb.needkv = needkv;
      pb.plans = plans;
      pb.need = need;
      return pb;
    }
  };

  static void* align_up(void* p) { return kvevict::detail::workspace_carver::align_up(p); }

  void record(int i) const {
    if (be_.stage_events && i < be_.num_stage_events) (void)cudaEventRecord(be_.stage_events[i], be_.stream);
  }

  template <class T>
  cuda::layer_shape shape_of(const layer_inputs<T>& in) const {
    return cuda::layer_shape::of(in, out_heads(in), needs_drift);
  }

  /// The backend's limits and each stage implementation's plan-time checks.
  template <class T>
  status backend_check(const layer_inputs<T>& in, bool sharded) const {
    if (sharded && !sharded_supported)
      return status::error(errc::not_supported, "plan_options.sharded: budgeter %s has no sharded allocation on the CUDA backend "
                           "(score-driven budgeters need apportion_budgets, whole-layer ones the sharded hooks of their budgeter_impl)",
                           Budgeter::name);
    if constexpr (has_scores) {
      if (in.paged() && !scorer_i::reads_pages)
        return status::error(errc::not_supported,
                             "layer_inputs::pages is set but this scorer's CUDA implementation reads contiguous K/V only: read "
                             "K/V through cuda::head_rows and declare reads_pages = true in its scorer_impl (docs/cuda.md)");
    }
    if (in.head_dim() > cuda::detail::max_head_dim)
      return status::error(errc::not_supported, "head_dim = %lld > %d is not supported by the CUDA backend",
                           static_cast<long long>(in.head_dim()), cuda::detail::max_head_dim);
    if (in.batch() * in.q_heads() > 65535 || in.batch() * out_heads(in) > 0x7fffffffLL)
      return status::error(errc::not_supported, "batch * q_heads = %lld > 65535 is not supported by the CUDA backend",
                           static_cast<long long>(in.batch() * in.q_heads()));
    if (in.window() > 0x7fffffffLL / 2)
      return status::error(errc::not_supported, "window = %lld is too large", static_cast<long long>(in.window()));
    KVEVICT_TRY(scorer_i::check(p_.scorer, in));
    KVEVICT_TRY(spatial_i::check(p_.spatial, in));
    if constexpr (kind == kvevict::detail::budget_kind::whole_layer && sharded_supported) {
      KVEVICT_TRY(sharded ? budgeter_i::check_sharded(p_.budgeter, in) : budgeter_i::check(p_.budgeter, in));
    } else {
      KVEVICT_TRY(budgeter_i::check(p_.budgeter, in));
    }
    KVEVICT_TRY(selector_i::check(p_.selector, in));
    return {};
  }

  buffers carve_all(kvevict::detail::workspace_carver& c, const cuda::layer_shape& sh) const {
    using cuda::carve_count;
    buffers bf;
    bf.status = c.template carve<cuda::device_status>(1);
    bf.len_kv = c.template carve<std::int32_t>(carve_count(sh.nkv));
    if (sh.page_slots > 0) {
      bf.page_len = c.template carve<std::int32_t>(carve_count(sh.nkv));
      bf.page_cnt = c.template carve<unsigned long long>(carve_count(sh.page_slots));
    }
    bf.plankv = c.template carve<kvevict::detail::head_plan>(carve_count(sh.nkv));
    bf.needkv = c.template carve<std::uint8_t>(carve_count(sh.nkv));
    bf.plans = c.template carve<kvevict::detail::head_plan>(carve_count(sh.rows));
    bf.budgets = c.template carve<std::int64_t>(carve_count(sh.rows));
    bf.need = c.template carve<std::uint8_t>(carve_count(sh.rows));
    bf.cnt = c.template carve<std::int32_t>(carve_count(sh.rows));
    bf.drift = c.template carve<double>(carve_count(sh.rows));
    if constexpr (has_scores) {
      bf.grows = c.template carve<float>(carve_count(sh.nkv * sh.Gq * sh.S));
      if (sh.Gout != sh.Gq) bf.scores = c.template carve<float>(carve_count(sh.rows * sh.S));
      if constexpr (needs_drift) bf.qdrift = c.template carve<double>(carve_count(sh.nq));
      bf.sc = scorer_i::carve(c, sh, p_.scorer);
      bf.sp = spatial_i::carve(c, sh, p_.spatial);
    }
    bf.bu = budgeter_i::carve(c, sh, p_.budgeter);
    bf.se = selector_i::carve(c, sh, p_.selector);
    std::size_t sb = 0;
    (void)cub::DeviceScan::InclusiveSum(nullptr, sb, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
                                        static_cast<int>(sh.rows > 0 ? sh.rows : 1), be_.stream);
    bf.scan_bytes = sb > 0 ? sb : 1;
    bf.scan_tmp = c.template carve<unsigned char>(bf.scan_bytes);
    return bf;
  }

  /// What the stages of one call share: the shapes and the workspace's buffers; after
  /// enqueue_scores, the final (smoothed) score rows.
  struct layer_run {
    cuda::layer_shape sh;
    buffers bf;
    const float* fin = nullptr;
  };

  template <class T>
  layer_run carve_run(const layer_inputs<T>& in, void* workspace) const {
    layer_run r;
    r.sh = shape_of(in);
    kvevict::detail::workspace_carver c(align_up(workspace));
    r.bf = carve_all(c, r.sh);
    return r;
  }

  /// The launches of one layer, in stage order (the stage events of cuda::backend between them).
  template <class T>
  status enqueue(const eviction_plan& pl, const layer_inputs<T>& in, selection_view out, void* workspace, float* maybe_scores) const {
    layer_run lr = carve_run(in, workspace);
    KVEVICT_TRY(enqueue_plans(pl, in, lr, false));
    KVEVICT_TRY(enqueue_scores(in, lr));
    KVEVICT_TRY(enqueue_score_budgets(lr));
    return enqueue_selection(in, out, lr, maybe_scores);
  }

  /// Stages 0-1: the page table's check, the plan kernel (lengths, plans, score-free budgets,
  /// "needs scoring" flags; sharded: whole-layer budgets are left to the host), the NaN scans.
  template <class T>
  status enqueue_plans(const eviction_plan& pl, const layer_inputs<T>& in, const layer_run& lr, bool sharded) const {
    using namespace cuda::detail;
    const cudaStream_t st = be_.stream;
    const cuda::layer_shape& sh = lr.sh;
    const buffers& bf = lr.bf;
    const int B = sh.B, Hkv = sh.Hkv, H = sh.H, Gq = sh.Gq, Gout = sh.Gout;
    const std::int64_t S = sh.S;
    const int layer_mean = p_.gqa == gqa_reduction::layer_mean ? 1 : 0;
    const unsigned T256 = block_threads;
    (void)Gq;

    record(0);
    KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.status, 0, sizeof(cuda::device_status), st));
    // 0. a paged cache: validate the device table before anything reads through it; the plan
    //    kernel then reads the validated lengths (all 0 after a table error: nothing is read).
    lengths_view lens = in.lengths;
    if (in.paged()) {
      KVEVICT_TRY(enqueue_page_table_check(paged_args_of(in), B, bf.page_cnt, bf.page_len, bf.status, st));
      lens = per_head_lengths(bf.page_len, B, Hkv);
    }
    // 1. plans, lengths, score-free budgets (whole-layer budgeters: all budgets)
    plan_shape ps;
    ps.B = B;
    ps.Hkv = Hkv;
    ps.H = H;
    ps.Gout = Gout;
    ps.S = S;
    ps.W = sh.W;
    ps.layer = sh.layer;
    ps.num_layers = sh.num_layers;
    ps.layer_mean = layer_mean;
    ps.sharded = sharded ? 1 : 0;
    plan_kernel<Budgeter, budgeter_i, has_scores, typename Selector::params><<<B, T256, 0, st>>>(
        lens, in.paged() ? in.pages.protected_prefix : nullptr, ps, pl.budget, p_.selector, p_.budgeter, bf.status, bf.len_kv, bf.plankv, bf.needkv, bf.plans, bf.budgets, bf.need,
        bf.bu);
    KVEVICT_CUDA_CHECK_LAUNCH();
    // Only what the scorer reads (as the CPU backend): scorers::none (StreamingLLM) reads no key.
    if (!Scorer::has_scores) {
    } else if (p_.check_finite && in.paged()) {
      const std::int64_t n = static_cast<std::int64_t>(B) * Hkv * S * sh.d;
      paged_finite_scan_kernel<T><<<grid_for(n), T256, 0, st>>>(in.keys, in.pages, 0, bf.len_kv, B, S, bf.status);
      KVEVICT_CUDA_CHECK_LAUNCH();
      if (in.values.data && Scorer::needs_values) {
        paged_finite_scan_kernel<T><<<grid_for(n), T256, 0, st>>>(in.values, in.pages, 1, bf.len_kv, B, S, bf.status);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
    } else if (p_.check_finite) {
      finite_scan_kernel<T><<<grid_for(in.keys.size()), T256, 0, st>>>(in.keys, 0, bf.len_kv, Hkv, 1, 0, bf.status);
      KVEVICT_CUDA_CHECK_LAUNCH();
      if (in.values.data && Scorer::needs_values) {
        finite_scan_kernel<T><<<grid_for(in.values.size()), T256, 0, st>>>(in.values, 1, bf.len_kv, Hkv, 1, 0, bf.status);
        KVEVICT_CUDA_CHECK_LAUNCH();
      }
    }
    if (p_.check_finite) {
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
    return {};
  }

  /// Stages 2-3: scoring into per-query-head rows, the GQA reduction and smoothing; lr.fin is
  /// then the final score rows [rows][S].
  template <class T>
  status enqueue_scores(const layer_inputs<T>& in, layer_run& lr) const {
    using namespace cuda::detail;
    const cudaStream_t st = be_.stream;
    const cuda::layer_shape& sh = lr.sh;
    const buffers& bf = lr.bf;
    const cuda::plan_buffers pb = bf.plan_view();
    const int B = sh.B, Hkv = sh.Hkv, H = sh.H, Gq = sh.Gq, Gout = sh.Gout;
    const std::int64_t S = sh.S, rows = sh.rows;
    const int layer_mean = p_.gqa == gqa_reduction::layer_mean ? 1 : 0;
    const unsigned T256 = block_threads;
    (void)in, (void)st, (void)pb, (void)B, (void)Hkv, (void)H, (void)Gq, (void)Gout, (void)S, (void)rows, (void)layer_mean, (void)T256;

    // 2. scoring into per-query-head rows
    if constexpr (has_scores) {
      cuda::score_job<Policy, T> job;
      job.in = &in;
      job.p = &p_;
      job.sh = sh;
      job.pb = pb;
      job.rows = bf.grows;
      job.drift = bf.qdrift;
      job.stream = st;
      // A scorer that computes no drift leaves 0 (the adaptive-window smoother reads it).
      if constexpr (needs_drift) KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.qdrift, 0, static_cast<std::size_t>(sh.nq) * sizeof(double), st));
      KVEVICT_TRY(scorer_i::score(job, bf.sc));
    }
    record(2);

    // 3. GQA reduction and smoothing
    if constexpr (has_scores) {
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
      cuda::smooth_job sj;
      sj.sh = sh;
      sj.pb = pb;
      sj.scores = scores;
      sj.drift = bf.drift;
      sj.stream = st;
      KVEVICT_TRY(spatial_i::smooth(p_.spatial, sj, bf.sp, &lr.fin));
    }
    record(3);
    return {};
  }

  /// Stage 4: score-driven budgets on the device (the budgeter's implementation).
  status enqueue_score_budgets(const layer_run& lr) const {
    if constexpr (kind == kvevict::detail::budget_kind::score_driven) {
      cuda::budget_job bj;
      bj.sh = lr.sh;
      bj.pb = lr.bf.plan_view();
      bj.scores = lr.fin;
      bj.budgets = lr.bf.budgets;
      bj.stream = be_.stream;
      KVEVICT_TRY(budgeter_i::score_budgets(p_.budgeter, bj, lr.bf.bu));
    }
    record(4);
    return {};
  }

  /// Stage 5: CSR offsets (CUB scan), selection, positions, exported scores.
  template <class T>
  status enqueue_selection(const layer_inputs<T>& in, selection_view out, const layer_run& lr, float* maybe_scores) const {
    using namespace cuda::detail;
    const cudaStream_t st = be_.stream;
    const cuda::layer_shape& sh = lr.sh;
    const buffers& bf = lr.bf;
    const cuda::plan_buffers pb = bf.plan_view();
    const std::int64_t S = sh.S, rows = sh.rows;
    const unsigned T256 = block_threads;
    const float* fin = lr.fin;
    // 5. CSR offsets (CUB scan), selection, positions, exported scores
    counts_kernel<<<ceil_div(rows, T256), T256, 0, st>>>(bf.plans, bf.budgets, rows, bf.cnt);
    KVEVICT_CUDA_CHECK_LAUNCH();
    KVEVICT_CUDA_TRY(cudaMemsetAsync(out.indptr, 0, sizeof(std::int32_t), st));
    std::size_t scan_bytes = bf.scan_bytes;
    KVEVICT_CUDA_TRY(cub::DeviceScan::InclusiveSum(bf.scan_tmp, scan_bytes, bf.cnt, out.indptr + 1, static_cast<int>(rows), st));
    capacity_kernel<<<1, 32, 0, st>>>(out.indptr, rows, out.capacity, bf.status);
    KVEVICT_CUDA_CHECK_LAUNCH();
    cuda::select_job sel;
    sel.sh = sh;
    sel.pb = pb;
    sel.budgets = bf.budgets;
    sel.scores = fin;
    sel.out = out;
    sel.positions = in.positions;
    sel.stream = st;
    KVEVICT_TRY(selector_i::select(p_.selector, sel, bf.se));
    if (maybe_scores) {
      export_scores_kernel<<<grid_for(rows * S), T256, 0, st>>>(fin, bf.plans, bf.need, rows, S, maybe_scores);
      KVEVICT_CUDA_CHECK_LAUNCH();
    }
    record(5);
    return {};
  }

  // run_sharded's requirements: per-head budgeters need nothing more; score-driven ones a
  // host-device apportion_budgets (run over the global rows on the host); whole-layer ones the
  // sharded hooks of their CUDA implementation (check_sharded, sharded_begin,
  // sharded_layer_budgets: budgeters::headwise_learned has them).
  template <class Bu>
  using has_apportion = distributed::detail::has_apportion_budgets<Bu>;
  template <class Bi, class = void>
  struct has_sharded_hooks : std::false_type {};
  template <class Bi>
  struct has_sharded_hooks<Bi, std::void_t<typename Bi::sharded_tables, decltype(&Bi::sharded_begin), decltype(&Bi::sharded_layer_budgets)>>
      : std::true_type {};
  static constexpr bool sharded_supported =
      kind == kvevict::detail::budget_kind::per_head ||
      (kind == kvevict::detail::budget_kind::score_driven && has_apportion<Budgeter>::value) ||
      (kind == kvevict::detail::budget_kind::whole_layer && has_sharded_hooks<budgeter_i>::value);
  template <class Bi, bool = has_sharded_hooks<Bi>::value>
  struct sharded_tables_of {
    struct type {};
  };
  template <class Bi>
  struct sharded_tables_of<Bi, true> {
    using type = typename Bi::sharded_tables;
  };

  /// run_sharded after the communicator is set up (comm takes host buffers). The CPU driver's
  /// sequence (backends/cpu/evictor.hpp run_impl): local checks and stages 0-1, one
  /// synchronisation, round 1-2 (agree), the budgets over the global rows on the host, stages
  /// 2-3, for score-driven budgeters a second synchronisation and rounds 3-7, the last round,
  /// then the selection. Errors before agree() travel in round 1; errors after it (a failed
  /// launch or copy, a device check) travel in the last round: every rank calls the same
  /// collectives whatever happens on it.
  template <class T>
  status sharded_impl(const eviction_plan& pl, const layer_inputs<T>& in, distributed::communicator* comm, const distributed::shard& sh,
                      selection_view out, void* workspace, std::size_t workspace_bytes, float* maybe_scores,
                      distributed::exchange_stats* stats, status pre) const {
    using kvevict::detail::head_plan;
    const cudaStream_t st = be_.stream;
    distributed::detail::layer_exchange ex(comm, sh, stats);
    const std::int64_t B = in.batch(), Hkv = in.kv_heads(), H = out_heads(in), S = in.capacity();
    const std::int64_t Gout = Hkv > 0 ? H / Hkv : 1, rows = B * H;
    distributed::detail::layer_terms terms = distributed::detail::layer_terms_of<Policy>(p_, pl.budget, in);
    typename sharded_tables_of<budgeter_i>::type tables;
    std::vector<head_plan> plans;
    std::vector<std::int64_t> budgets;
    std::vector<std::uint8_t> need;
    layer_run lr;
    // Checks and stages 0-1, read back: this rank's status in round 1.
    const status local = [&]() -> status {
      KVEVICT_TRY(pre);
      if (!pl.sharded) return status::error(errc::invalid_argument, "run_sharded() needs a plan made with plan_options::sharded");
      KVEVICT_TRY(this->check_run_args(pl, in, out, workspace, workspace_bytes, std::max(pl.workspace_bytes, workspace_size(in))));
      KVEVICT_TRY(distributed::detail::layer_exchange::check_local(sh, Hkv));
      if constexpr (kind == kvevict::detail::budget_kind::whole_layer) KVEVICT_TRY(budgeter_i::sharded_begin(p_.budgeter, sh, st, &tables, &terms.budgeter));
      lr = carve_run(in, workspace);
      KVEVICT_TRY(enqueue_plans(pl, in, lr, true));
      plans.resize(static_cast<std::size_t>(rows));
      budgets.resize(static_cast<std::size_t>(rows));
      need.resize(static_cast<std::size_t>(rows));
      cuda::device_status ds{};
      KVEVICT_CUDA_TRY(cudaMemcpyAsync(plans.data(), lr.bf.plans, plans.size() * sizeof(head_plan), cudaMemcpyDeviceToHost, st));
      KVEVICT_CUDA_TRY(cudaMemcpyAsync(budgets.data(), lr.bf.budgets, budgets.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, st));
      KVEVICT_CUDA_TRY(cudaMemcpyAsync(need.data(), lr.bf.need, need.size(), cudaMemcpyDeviceToHost, st));
      KVEVICT_CUDA_TRY(cudaMemcpyAsync(&ds, lr.bf.status, sizeof ds, cudaMemcpyDeviceToHost, st));
      KVEVICT_CUDA_TRY(cudaStreamSynchronize(st));
      return cuda::to_status(ds);  // lengths, page table, NaN/inf
    }();
    KVEVICT_TRY(ex.agree(local, B, Gout, in.layer_idx, in.num_layers, terms, plans.data()));
    // After agree() every rank calls the remaining collectives; `late` is this rank's status.
    status late;
    if constexpr (kind == kvevict::detail::budget_kind::whole_layer) {
      // the whole-layer allocation over every rank's rows (the same on every rank); this rank's slice
      late = distributed::detail::local_layer_budgets(
          ex, B, H,
          [&](std::int64_t, const head_plan* gp, std::int64_t Hg, std::int64_t* gb) {
            return budgeter_i::sharded_layer_budgets(p_.budgeter, tables, pl.budget, gp, Hg, in.layer_idx, gb);
          },
          budgets.data());
      if (late.ok()) {
        std::vector<std::uint8_t> needkv(static_cast<std::size_t>(B * Hkv), 0);
        for (std::int64_t b = 0; b < B; ++b) front::need_flags(p_, plans.data() + b * H, budgets.data() + b * H, H, need.data() + b * H);
        for (std::int64_t r = 0; r < rows; ++r) needkv[static_cast<std::size_t>(r / Gout)] |= need[static_cast<std::size_t>(r)];
        late = [&]() -> status {
          KVEVICT_CUDA_TRY(cudaMemcpyAsync(lr.bf.budgets, budgets.data(), budgets.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice, st));
          KVEVICT_CUDA_TRY(cudaMemcpyAsync(lr.bf.need, need.data(), need.size(), cudaMemcpyHostToDevice, st));
          KVEVICT_CUDA_TRY(cudaMemcpyAsync(lr.bf.needkv, needkv.data(), needkv.size(), cudaMemcpyHostToDevice, st));
          // the host vectors are read by the copies: wait for them before they go out of scope
          KVEVICT_CUDA_TRY(cudaStreamSynchronize(st));
          return {};
        }();
      }
    }
    if (late.ok()) late = enqueue_scores(in, lr);
    if constexpr (kind == kvevict::detail::budget_kind::score_driven) {
      // the smoothed scores to the host, the global winners (rounds 3-7), this rank's slice
      std::vector<float> scores(static_cast<std::size_t>(rows * S), 0.0f);
      if (late.ok()) {
        late = [&]() -> status {
          cuda::device_status ds{};
          if (rows * S > 0)
            KVEVICT_CUDA_TRY(cudaMemcpyAsync(scores.data(), lr.fin, scores.size() * sizeof(float), cudaMemcpyDeviceToHost, st));
          KVEVICT_CUDA_TRY(cudaMemcpyAsync(&ds, lr.bf.status, sizeof ds, cudaMemcpyDeviceToHost, st));
          KVEVICT_CUDA_TRY(cudaStreamSynchronize(st));
          return cuda::to_status(ds);
        }();
      }
      std::vector<const float*> rowptr(static_cast<std::size_t>(rows), nullptr);
      for (std::int64_t r = 0; r < rows; ++r)
        if (late.ok() && need[static_cast<std::size_t>(r)]) rowptr[static_cast<std::size_t>(r)] = scores.data() + r * S;
      KVEVICT_TRY(distributed::detail::local_score_budgets<Budgeter>(ex, p_.budgeter, rowptr.data(), B, H, budgets.data()));  // collectives
      if (late.ok()) {
        late = [&]() -> status {
          KVEVICT_CUDA_TRY(cudaMemcpyAsync(lr.bf.budgets, budgets.data(), budgets.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice, st));
          KVEVICT_CUDA_TRY(cudaStreamSynchronize(st));
          return {};
        }();
      }
    }
    record(4);
    // capacity (the device's count, computed from the same plans and budgets), then the last round
    status fits = late;
    if (fits.ok()) {
      std::int64_t total = 0;
      for (std::int64_t r = 0; r < rows; ++r) total += front::kept(plans[static_cast<std::size_t>(r)], budgets[static_cast<std::size_t>(r)]);
      fits = kvevict::detail::check_kept_total(total, out.capacity);
    }
    KVEVICT_TRY(ex.finish(fits));  // every rank writes, or none
    return enqueue_selection(in, out, lr, maybe_scores);
  }

  using api_base::p_;
  cuda::backend be_;
};

}  // namespace kvevict
