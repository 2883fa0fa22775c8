// IWYU pragma: private, include "kvevict/cuda.cuh"
// The CUDA backend's implementation traits: one per stage. evictor<Policy, cuda::backend>
// (backends/cuda/evictor.cuh) is a driver over the backend-neutral front-end
// (frontend/frontend.hpp: validation, budget rules, the plan); it runs a policy's stages through
// these traits and names no policy type itself.
//
//   cuda::scorer_impl<Scorer>       score rows of every scored KV head        (backends/cuda/scorers/)
//   cuda::temporal_impl<Temporal>   the window-row weights c_j (any smoother with a host-device weight())
//   cuda::spatial_impl<Spatial>     smoothing of the reduced score rows       (backends/cuda/spatial/smoothers.cuh)
//   cuda::budgeter_impl<Budgeter>   device budgets: per head, score-driven, whole layer (backends/cuda/budgeters/)
//   cuda::selector_impl<Selector>   the kept slots of every row               (backends/cuda/selectors/)
//   GQA reduction                   a runtime choice, not a type: the driver's kernels (select.cuh)
//
// A specialisation owns its device scratch: a `scratch` struct (pointers into the workspace),
// `static scratch carve(workspace_carver&, const layer_shape&, const params&)` (called twice with
// the same shapes: counting, with a null base, for workspace_size(); then on the caller's
// workspace in run()), its launches on the job's stream (enqueue only: no allocation, no host
// synchronisation, so a run stays graph-capturable) and optionally
// `template <class T> static status check(const params&, const layer_inputs<T>&)`, its plan-time
// checks against the layer's shapes. Deriving from the stage's *_impl_base gives the defaults
// (no scratch, no checks). A built-in policy specialises its trait in a file of its own; a
// user's policy does the same (examples/custom_policy_cuda.cu, docs/cuda.md). A policy whose
// stage has no specialisation fails to compile where the evictor is instantiated, with a
// message naming the stage and the backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/config.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/frontend/frontend.hpp"

namespace kvevict {
namespace cuda {

using kvevict::detail::workspace_carver;

/// The shapes of one layer as the driver resolved them (host values; the same for carve() and
/// the launches). Counts fit int after the plan's checks (batch * q_heads <= 65535).
struct layer_shape {
  int B = 0;     ///< batch
  int Hkv = 0;   ///< KV heads
  int Hq = 0;    ///< query heads (= Hkv without queries)
  int Gq = 1;    ///< score rows per KV head: query heads per KV head (1 without queries)
  int H = 0;     ///< selection rows per sequence (out_heads)
  int Gout = 1;  ///< H / Hkv
  int d = 0;     ///< head_dim
  std::int64_t S = 0;     ///< capacity (seq extent)
  std::int64_t W = 0;     ///< window rows (0 without queries)
  std::int64_t rows = 0;  ///< B * H selection rows
  std::int64_t nkv = 0;   ///< B * Hkv
  std::int64_t nq = 0;    ///< B * Hq
  int layer = 0, num_layers = 1;
  std::int64_t page_slots = 0;  ///< paged: the page-table check's counters (num_pages, x kv_heads for per-head tables over pages of every head); 0: contiguous
  bool drift = false;  ///< the spatial smoother reads the per-query-head window drift (score_job::drift)

  template <class T>
  static layer_shape of(const layer_inputs<T>& in, std::int64_t out_heads, bool drift) {
    layer_shape s;
    s.B = static_cast<int>(in.batch());
    s.Hkv = static_cast<int>(in.kv_heads());
    s.Hq = in.queries.data ? static_cast<int>(in.q_heads()) : s.Hkv;
    s.Gq = in.queries.data ? static_cast<int>(in.group_size()) : 1;
    s.H = static_cast<int>(out_heads);
    s.Gout = s.Hkv > 0 ? s.H / s.Hkv : 1;
    s.d = static_cast<int>(in.head_dim());
    s.S = in.capacity();
    s.W = in.window();
    s.rows = in.batch() * out_heads;
    s.nkv = in.batch() * in.kv_heads();
    s.nq = in.batch() * s.Hq;
    s.layer = in.layer_idx;
    s.num_layers = in.num_layers;
    s.drift = drift;
    if (in.paged()) s.page_slots = in.keys.extent[0] * ((in.pages.per_head && in.keys.stride[1] != 0) ? in.kv_heads() : 1);
    return s;
  }
};

/// At least one element (a carve of zero elements still gets a distinct aligned slot).
inline std::size_t carve_count(std::int64_t v) { return static_cast<std::size_t>(v > 0 ? v : 1); }

/// What the plan kernel wrote (device arrays in the workspace), read by every later stage.
struct plan_buffers {
  device_status* status = nullptr;                     ///< the device status word (report())
  const std::int32_t* len_kv = nullptr;                ///< [nkv] validated, clamped lengths
  const kvevict::detail::head_plan* plankv = nullptr;  ///< [nkv] plan of each KV head
  const std::uint8_t* needkv = nullptr;                ///< [nkv] 1: some row of this KV head is scored
  const kvevict::detail::head_plan* plans = nullptr;   ///< [rows] plan of each selection row
  const std::uint8_t* need = nullptr;                  ///< [rows] 1: this row is scored
};

/// The scoring stage's job. The scorer writes, for every KV head kvi = b * Hkv + h with
/// pb.needkv[kvi] and every valid token n < pb.len_kv[kvi], its Gq score rows
/// rows[(kvi * Gq + g) * S + n] (g: the query head h * Gq + g; a query-free scorer writes the same
/// row Gq times), finite fp32, higher = keep; other entries are never read. With sh.drift it
/// writes drift[b * Hq + hq], the adaptive-window drift of each query head (window-attention
/// scorers only; frontend.hpp checks the composition).
template <class Policy, class T>
struct score_job {
  const layer_inputs<T>* in = nullptr;         ///< device views (K, V, Q, W_O factors)
  const typename Policy::params* p = nullptr;  ///< the policy's parameters: p->scorer, p->temporal, ...
  layer_shape sh;
  plan_buffers pb;
  float* rows = nullptr;    ///< out: [nkv * Gq][S]
  double* drift = nullptr;  ///< out: [nq], null unless sh.drift
  cudaStream_t stream = nullptr;
};

/// The smoothing stage's job: smooth the reduced rows scores[rows][S] (rows with pb.need, tokens
/// [sinks, evictable_end) of pb.plans; tokens in [evictable_end, L) are copied) and return the
/// final rows (the input itself, or the smoother's own buffer).
struct smooth_job {
  layer_shape sh;
  plan_buffers pb;
  const float* scores = nullptr;  ///< [rows][S] GQA-reduced score rows
  const double* drift = nullptr;  ///< [rows] adaptive-window drift of each row (meaningful with sh.drift)
  cudaStream_t stream = nullptr;
};

/// The score-driven budget stage's job (budget_kind::score_driven, after smoothing): move budget
/// between the rows of each sequence from their final scores, keeping each sequence's total.
struct budget_job {
  layer_shape sh;
  plan_buffers pb;
  const float* scores = nullptr;     ///< [rows][S] final scores
  std::int64_t* budgets = nullptr;   ///< [rows] in: base budgets (length on pass-through rows); out: budgets
  cudaStream_t stream = nullptr;
};

/// The selection stage's job: write the kept slots of every row r ascending to
/// out.indices[out.indptr[r] ...] (count min(budgets[r], L); indptr is already the inclusive
/// CSR scan of those counts) and their positions to out.positions when set; write nothing when
/// indptr[rows] > out.capacity (the driver reports it).
struct select_job {
  layer_shape sh;
  plan_buffers pb;
  const std::int64_t* budgets = nullptr;  ///< [rows]
  const float* scores = nullptr;          ///< [rows][S] final scores, null when the scorer has none
  selection_view out;
  positions_view positions;  ///< layer_inputs::positions (device; may be unset)
  cudaStream_t stream = nullptr;
};

/// No scratch.
struct no_scratch {};

/// Defaults of a stage implementation: no scratch, no plan-time checks.
struct stage_impl_base {
  using scratch = no_scratch;
  template <class P>
  static scratch carve(workspace_carver&, const layer_shape&, const P&) {
    return {};
  }
  template <class P, class T>
  static status check(const P&, const layer_inputs<T>&) {
    return {};
  }
};

/// CUDA scorer implementation of Scorer. A specialisation provides
///   template <class Policy, class T> static status score(const score_job<Policy, T>&, const scratch&);
/// enqueuing the kernels that fill job.rows (and job.drift) as score_job describes, plus
/// scratch / carve / check (scorer_impl_base: none). Window-attention scorers share
/// detail::window_attention_begin/end (backends/cuda/scorers/window_attention.cuh). A scorer with
/// has_scores = false (scorers::none) needs none: nothing is scored.
template <class Scorer, class Enable = void>
struct scorer_impl {
  static_assert(kvevict::detail::dependent_false<Scorer>,
                "kvevict: this Scorer has no CUDA implementation (backend cuda::backend): specialise "
                "kvevict::cuda::scorer_impl<Scorer> with a score() that launches its kernel (see "
                "examples/custom_policy_cuda.cu and docs/cuda.md); a CPU hook (score_kv_head) does not run on the "
                "device; a built-in scorer's file must be in the CUDA stage list, kvevict/cuda.cuh. CriticalKV (scorers::attention_value_norm + selectors::two_stage, presets::criticalkv / "
                "critical_adakv) runs on the CPU backend only");
};
/// reads_pages: the implementation reads K/V through cuda::head_rows (backends/cuda/paged.cuh), so
/// it accepts paged caches (layer_inputs::pages); false by default: the evictor refuses a paged
/// cache for a scorer that indexes contiguous views itself.
struct scorer_impl_base : stage_impl_base {
  static constexpr bool reads_pages = false;
};

/// CUDA implementation of a temporal smoother: weights() enqueues the fp32 row weights of every
/// KV head's effective window. Served for every smoother with a KVEVICT_HOST_DEVICE
/// static double weight(const params&, int j, int w) (every built-in but the row-maximum
/// temporal::maximum / defensive, which the CUDA evictor refuses; docs/architecture.md); others need a
/// specialisation. Read by the window-attention scorers.
template <class Temporal, class Enable = void>
struct temporal_impl {
  static_assert(kvevict::detail::dependent_false<Temporal>,
                "kvevict: this temporal smoother has no CUDA implementation (backend cuda::backend): give it a "
                "KVEVICT_HOST_DEVICE static double weight(const params&, int j, int w) (a linear row weighting) or "
                "specialise kvevict::cuda::temporal_impl<Temporal>");
};
template <class Temporal>
struct temporal_impl<Temporal, std::void_t<decltype(Temporal::weight(std::declval<const typename Temporal::params&>(), 0, 1))>> {
  /// cw[kvi][j] = (float) weight(p, j, w) over the effective window w = min(W, len_kv[kvi]) of
  /// each of the nkv KV heads (0 for j >= w); last_only: 1 on the last row, 0 elsewhere.
  static status weights(const typename Temporal::params& p, const std::int32_t* len_kv, std::int64_t nkv, std::int64_t W,
                        bool last_only, float* cw, cudaStream_t st) {
    detail::temporal_weights_kernel<Temporal><<<detail::grid_for(nkv * W), detail::block_threads, 0, st>>>(p, len_kv, nkv, W,
                                                                                                          last_only ? 1 : 0, cw);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};

/// CUDA implementation of a spatial smoother:
///   static status smooth(const params&, const smooth_job&, const scratch&, const float** out);
/// (see smooth_job), plus scratch / carve / check (spatial_impl_base: none). Only instantiated
/// for a scorer with scores.
template <class Spatial, class Enable = void>
struct spatial_impl {
  static_assert(kvevict::detail::dependent_false<Spatial>,
                "kvevict: this spatial smoother has no CUDA implementation (backend cuda::backend): specialise "
                "kvevict::cuda::spatial_impl<Spatial> with a smooth() that launches its kernel (a CPU smooth() hook "
                "does not run on the device)");
};
struct spatial_impl_base : stage_impl_base {};

/// CUDA implementation of a budgeter. The plan kernel (select.cuh) runs the budget rules of
/// frontend.hpp on the device (lengths live there); by budget_kind it needs of the trait:
///  - per_head:     nothing (the plan kernel calls the budgeter's KVEVICT_HOST_DEVICE
///                  head_budget; backends/cuda/budgeters/per_head.cuh serves every such budgeter);
///  - score_driven: static status score_budgets(const params&, const budget_job&, const scratch&),
///                  enqueued after smoothing;
///  - whole_layer:  __device__ static void sequence_budgets(int b, const detail::plan_shape&,
///                  const budget_request&, const params&, bool has_scores, const head_plan* plans,
///                  int64* budgets, uint8* need, device_status*, const scratch&), called by every
///                  thread of sequence b's block in the plan kernel after the block wrote the
///                  plans (it calls __syncthreads() before reading them): the budgets and
///                  "needs scoring" flags of the sequence's H rows.
/// plus scratch / carve / check and `static constexpr bool host_budgets` (budgeter_impl_base:
/// none, true). host_budgets = false: the host cannot compute the budgets (device-only tables),
/// so plan() gives an upper bound of max_selected instead of the exact count.
template <class Budgeter, class Enable = void>
struct budgeter_impl {
  static_assert(kvevict::detail::dependent_false<Budgeter>,
                "kvevict: this budgeter has no CUDA implementation (backend cuda::backend): specialise "
                "kvevict::cuda::budgeter_impl<Budgeter> (budgeters with a KVEVICT_HOST_DEVICE head_budget and no "
                "score-driven or whole-layer allocation are served automatically)");
};
struct budgeter_impl_base : stage_impl_base {
  static constexpr bool host_budgets = true;
};

/// CUDA implementation of a selector:
///   static status select(const params&, const select_job&, const scratch&);
/// (see select_job), plus scratch / carve / check (selector_impl_base: none).
template <class Selector, class Enable = void>
struct selector_impl {
  static_assert(kvevict::detail::dependent_false<Selector>,
                "kvevict: this selector has no CUDA implementation (backend cuda::backend): specialise "
                "kvevict::cuda::selector_impl<Selector>; the CUDA backend implements selectors::topk (sinks + recent "
                "window protected, top-k of the rest). CriticalKV's selectors::two_stage runs on the CPU backend only");
};
struct selector_impl_base : stage_impl_base {};

namespace detail {
/// The stand-in for a stage that has nothing to do in a policy (the scorer and the spatial
/// smoother of a policy without scores): never launched.
struct idle_stage : stage_impl_base {};
}  // namespace detail

}  // namespace cuda
}  // namespace kvevict
