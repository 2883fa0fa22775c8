// IWYU pragma: private, include "kvevict/kvevict.hpp"
// The backend-neutral front-end of evictor<Policy, Backend>: everything both evictors share.
//  - the composition's static checks (which stages work together), in one place;
//  - input validation (parameters, shapes, budget, lengths) with the documented messages;
//  - the budget rules: per-row head plans, the budgets that need no scores, the "needs scoring"
//    flags and the exact kept count (so max_selected is the same number on every backend where
//    the host can read the lengths and the protected prefix);
//  - the plan's bookkeeping (eviction_plan, frontend/plan.hpp).
// A backend driver (backends/<backend>/evictor*) adds only what its hardware needs: its
// implementation traits per stage (backends/<backend>/impl*), its workspace and its launches.
//
// Layering: frontend/ includes core/ and policies/; backends/ include frontend/; nothing here
// names a backend or a built-in policy type: capabilities are read from the policies' flags and
// optional hooks (detected below).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/frontend/plan.hpp"
#include "kvevict/policies/policy.hpp"

namespace kvevict {
namespace detail {

/// A budgeter that allocates a whole layer at once (budgeters::headwise_learned) declares its
/// host scratch type and
///   struct layer_scratch;  template <class Carver> static layer_scratch carve_layer_scratch(Carver&, const params&);
///   static status layer_budgets(const params&, const budget_request&, const head_plan* plans,
///                               int64 rows, int64 kv_heads, int layer, int num_layers, int64* budgets,
///                               const layer_scratch&);
template <class Bu, class = void>
struct has_layer_budgets : std::false_type {};
template <class Bu>
struct has_layer_budgets<Bu, std::void_t<decltype(Bu::layer_budgets(
                                 std::declval<const typename Bu::params&>(), std::declval<const budget_request&>(),
                                 std::declval<const head_plan*>(), std::int64_t{}, std::int64_t{}, int{}, int{},
                                 std::declval<std::int64_t*>(), std::declval<const typename Bu::layer_scratch&>()))>>
    : std::true_type {};

/// The whole-layer budgeter's scratch type; for the other budgeters an empty struct (they need none).
struct no_layer_scratch {};
template <class Bu, bool = has_layer_budgets<Bu>::value>
struct layer_scratch_of {
  using type = no_layer_scratch;
  template <class Carver>
  static type carve(Carver&, const typename Bu::params&) {
    return {};
  }
};
template <class Bu>
struct layer_scratch_of<Bu, true> {
  using type = typename Bu::layer_scratch;
  template <class Carver>
  static type carve(Carver& c, const typename Bu::params& p) {
    return Bu::carve_layer_scratch(c, p);
  }
};

/// A whole-layer budgeter's scratch in host memory it owns (plan time, tests).
template <class Bu>
struct host_layer_scratch {
  std::vector<unsigned char> bytes;
  typename layer_scratch_of<Bu>::type s{};
  explicit host_layer_scratch(const typename Bu::params& p) {
    workspace_carver count;
    layer_scratch_of<Bu>::carve(count, p);
    bytes.resize(count.bytes() + workspace_carver::alignment);
    workspace_carver c(workspace_carver::align_up(bytes.data()));
    s = layer_scratch_of<Bu>::carve(c, p);
  }
};

/// A selector that ranks a second score row declares `static constexpr bool reads_secondary_scores = true`.
template <class Sel, class = void>
struct selector_reads_secondary : std::false_type {};
template <class Sel>
struct selector_reads_secondary<Sel, std::void_t<decltype(Sel::reads_secondary_scores)>>
    : std::integral_constant<bool, Sel::reads_secondary_scores> {};

/// A budgeter whose budgets are caps (a head may keep fewer: budgeters::threshold) declares
/// `static constexpr bool budget_is_cap = true`; max_selected is then a bound.
template <class Bu, class = void>
struct budget_is_cap : std::false_type {};
template <class Bu>
struct budget_is_cap<Bu, std::void_t<decltype(Bu::budget_is_cap)>> : std::integral_constant<bool, Bu::budget_is_cap> {};

/// How a budgeter allocates; it decides which steps a driver runs.
///  - per_head:     Budgeter::head_budget(params, plan, layer, num_layers), before any scoring;
///  - score_driven: needs_scores (AdaKV): each head starts at its base budget, and the backend's
///                  budgeter implementation moves budget between heads after scoring (the
///                  layer's total is unchanged);
///  - whole_layer:  layer_budgets(...) (LKV-H): one call per sequence, before any scoring.
enum class budget_kind : int { per_head = 0, score_driven = 1, whole_layer = 2 };

template <class Bu>
inline constexpr budget_kind budget_kind_of =
    has_layer_budgets<Bu>::value ? budget_kind::whole_layer : (Bu::needs_scores ? budget_kind::score_driven : budget_kind::per_head);

/// The budget rule of one row before any scoring, host and device (frontend::sequence_budgets
/// and the CUDA plan kernel run it): per-head budgeters: head_budget; score-driven: the base
/// budget (the length when the head passes through), moved between heads after scoring;
/// whole-layer: the length until the layer's allocation (layer_budgets) sets it. need: the row
/// is scored (has_scores and it keeps fewer than its length; whole-layer: decided after the
/// allocation).
template <class Budgeter>
KVEVICT_HOST_DEVICE inline void initial_row_budget(const typename Budgeter::params& bp, const head_plan& pl, int layer,
                                                   int num_layers, bool has_scores, std::int64_t* budget, std::uint8_t* need) {
  constexpr budget_kind kind = budget_kind_of<Budgeter>;
  if constexpr (kind == budget_kind::whole_layer) {
    (void)bp;
    (void)layer;
    (void)num_layers;
    (void)has_scores;
    *budget = pl.length;
    *need = 0;
  } else if constexpr (kind == budget_kind::per_head) {
    const std::int64_t bud = Budgeter::head_budget(bp, pl, layer, num_layers);
    *budget = bud;
    *need = (has_scores && bud < pl.length) ? 1 : 0;
  } else {
    (void)bp;
    (void)layer;
    (void)num_layers;
    *budget = pl.pass_through ? pl.length : pl.base_budget;
    *need = (has_scores && !pl.pass_through) ? 1 : 0;
  }
}

/// A per-head budgeter whose rows are planned with a request of their own (budgeters::pyramid
/// with num_tokens: the layer's budget from a common reference length) declares
///   template <class Protection> static budget_request row_request(const params&, const budget_request& req,
///       const Protection&, int64 L, int64 window, int64 prefix, int layer, int num_layers);   // host and device
///   static int64 reference_length(const params&, int64 L);  // the length whose base budget row_request uses
/// plan_row then plans the row with that request instead of `req`; kept_upper_bound takes the base
/// budget at reference_length(capacity).
struct protection_probe {
  std::int32_t num_sink = 0;
  std::int32_t num_recent = 0;
  float recent_share = -1.0f;
};
template <class Bu, class = void>
struct has_row_request : std::false_type {};
template <class Bu>
struct has_row_request<Bu, std::void_t<decltype(Bu::row_request(std::declval<const typename Bu::params&>(),
                                                                 std::declval<const budget_request&>(),
                                                                 std::declval<const protection_probe&>(), std::int64_t{},
                                                                 std::int64_t{}, std::int64_t{}, int{}, int{}))>>
    : std::true_type {};

/// The head plan of a row of L tokens of layer `layer` (host and device; frontend::row_plan and the
/// CUDA plan kernel): plan_head_protected with the budgeter's row_request when it has one.
template <class Budgeter, class Protection>
KVEVICT_HOST_DEVICE inline head_plan plan_row(const typename Budgeter::params& bp, const budget_request& req, const Protection& sp,
                                              std::int64_t L, std::int64_t window, std::int64_t prefix, int layer, int num_layers) {
  if constexpr (has_row_request<Budgeter>::value) {
    return plan_head_protected(Budgeter::row_request(bp, req, sp, L, window, prefix, layer, num_layers), sp, L, window, prefix);
  } else {
    (void)bp;
    (void)layer;
    (void)num_layers;
    return plan_head_protected(req, sp, L, window, prefix);
  }
}

/// Kept tokens of a row: its budget, never more than its length (host and device).
KVEVICT_HOST_DEVICE inline std::int64_t kept_tokens(const head_plan& pl, std::int64_t budget) {
  return budget < pl.length ? budget : pl.length;
}

/// A layer's kept total against the selection's capacity and the int32 range of its indptr
/// (the drivers' check before any index is written).
inline status check_kept_total(std::int64_t total, std::int64_t capacity) {
  if (total > 0x7fffffff)
    return status::error(errc::not_supported, "kept tokens = %lld exceed the int32 range of selection.indptr",
                         static_cast<long long>(total));
  if (total > capacity)
    return status::error(errc::insufficient_capacity, "selection.capacity = %lld < kept tokens = %lld (use max_selected())",
                         static_cast<long long>(capacity), static_cast<long long>(total));
  return {};
}

/// The front-end of evictor<Policy, *>. Static functions only; the drivers call them.
template <class Policy>
struct frontend {
  using params_type = typename Policy::params;
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  using Spatial = typename Policy::spatial_smoother;
  using Budgeter = typename Policy::budgeter;
  using Selector = typename Policy::selector;

  /// The scorer writes a second row per query head (CriticalKV's ||v W_O^h||_1).
  static constexpr bool has_secondary = scorer_secondary<Scorer>::value;
  /// The selector ranks that second row (selectors::two_stage).
  static constexpr bool reads_secondary = selector_reads_secondary<Selector>::value;
  /// The scorer reads the layer's full output projection layer_inputs::wo.
  static constexpr bool needs_wo_matrix = scorer_needs_wo_matrix<Scorer>::value;
  static constexpr budget_kind kind = budget_kind_of<Budgeter>;

  // The composition rules, checked once for every backend.
  static_assert(!reads_secondary || has_secondary,
                "kvevict: this selector ranks a secondary score row (like selectors::two_stage, CriticalKV) that the "
                "scorer does not write; pair it with a scorer with secondary_scores (scorers::attention_value_norm, "
                "presets::criticalkv)");
  static_assert(!has_secondary || reads_secondary,
                "kvevict: this scorer writes a secondary row (like scorers::attention_value_norm's ||v W_O^h||_1) that "
                "only a selector with reads_secondary_scores ranks (selectors::two_stage); use them together "
                "(presets::criticalkv)");
  static_assert(!Spatial::needs_attention_drift || Scorer::window_attention,
                "kvevict: the adaptive-window smoother needs a scorer that computes the window attention");
  static_assert(!Budgeter::needs_scores || Scorer::has_scores,
                "kvevict: a score-driven budgeter (AdaKV) needs a scorer that produces scores");
  static_assert(!temporal_row_max<typename Policy::temporal_smoother>::value || Scorer::window_attention,
                "kvevict: temporal::maximum / temporal::defensive take the maximum over the window-attention rows: "
                "they need a scorer that computes the window attention");

  /// A driver writes `static_assert(frontend<Policy>::composition_ok, "")` in its class body, so
  /// the composition rules above fire as soon as the evictor type is named.
  static constexpr bool composition_ok = true;

  /// What the method reads from layer_inputs.
  static input_requirements requirements(const params_type& p) {
    input_requirements rq;
    rq.scorer_name = Scorer::name;
    rq.needs_queries = Scorer::needs_queries;
    rq.needs_values = Scorer::needs_values;
    rq.needs_wo_factor = Scorer::needs_wo_factor(p.scorer);
    rq.needs_wo_matrix = needs_wo_matrix;
    rq.per_query_head = p.gqa == gqa_reduction::per_query_head;
    return rq;
  }

  /// Selection rows per sequence: kv_heads, or q_heads for gqa_reduction::per_query_head.
  template <class T>
  static std::int64_t out_heads(const layer_inputs<T>& in, const params_type& p) {
    return p.gqa == gqa_reduction::per_query_head ? in.q_heads() : in.kv_heads();
  }

  /// Parameters (every stage), shapes, budget. The first error names the parameter and value.
  template <class T>
  static status validate(const layer_inputs<T>& in, const params_type& p, const budget_request& budget) {
    static_assert(is_storage_type_v<T>, "kvevict: T must be float, half_t or bfloat16_t");
    KVEVICT_TRY(Policy::check(p));
    KVEVICT_TRY(validate_layer_shapes(in, requirements(p)));
    KVEVICT_TRY(validate_budget(budget, p.selector, in.window()));
    return {};
  }

  /// Every head's length in [0, seq]. len(b, h) returns the int64 length of (sequence b, KV head h).
  template <class LenF>
  static status check_length_range(std::int64_t batch, std::int64_t kv_heads, std::int64_t seq, LenF len) {
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const std::int64_t L = len(b, h);
        if (L < 0 || L > seq)
          return status::error(errc::invalid_argument, "lengths(b=%lld, h=%lld) = %lld is outside [0, seq = %lld]",
                               static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(L),
                               static_cast<long long>(seq));
      }
    return {};
  }

  /// gqa_reduction::layer_mean keeps one token set per sequence: equal lengths across its heads.
  template <class LenF>
  static status check_layer_mean_lengths(const params_type& p, std::int64_t batch, std::int64_t kv_heads, LenF len) {
    if (p.gqa != gqa_reduction::layer_mean) return {};
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 1; h < kv_heads; ++h)
        if (len(b, h) != len(b, 0))
          return status::error(errc::invalid_argument,
                               "gqa = layer_mean needs equal lengths across heads; sequence %lld has %lld and %lld",
                               static_cast<long long>(b), static_cast<long long>(len(b, 0)), static_cast<long long>(len(b, h)));
    return {};
  }

  /// The head plan of a row of sequence b with L valid tokens (docs/semantics.md); a paged
  /// cache's pages.protected_prefix[b] tokens are protected as sinks (plan_head_protected; host
  /// memory: the CUDA driver plans on the device and never calls this with a prefix).
  template <class T>
  static head_plan row_plan(const layer_inputs<T>& in, const params_type& p, const budget_request& budget, std::int64_t L,
                            std::int64_t b) {
    const std::int64_t prefix = in.paged() ? in.pages.prefix(b) : 0;
    return plan_row<Budgeter>(p.budgeter, budget, p.selector, L, in.window(), prefix, in.layer_idx, in.num_layers);
  }

  /// The budget rules of one sequence b: for its H = out_heads rows (row h covers KV head
  /// h / (H / kv_heads)) the head plans, the budgets that need no scores (score-driven
  /// budgeters: each head's base budget, or its length when it passes through; the backend
  /// moves budget between heads after scoring, keeping the total) and the "needs scoring" flags
  /// (a head is scored when it keeps fewer than its length; layer_mean: all heads of a sequence
  /// or none). Host code; len(b, h) as above; ls: the whole-layer budgeter's scratch
  /// (layer_scratch_of; unused by the others). Errors: the whole-layer budgeter's.
  /// sharded: the layer's heads are split over ranks (run_sharded): the whole-layer allocation
  /// is left to the caller (it needs every rank's plans), which then calls need_flags.
  template <class T, class LenF>
  static status sequence_budgets(const layer_inputs<T>& in, const params_type& p, const budget_request& budget, std::int64_t b,
                                 std::int64_t H, LenF len, head_plan* plans, std::int64_t* budgets, std::uint8_t* need,
                                 const typename layer_scratch_of<Budgeter>::type& ls, bool sharded = false) {
    const std::int64_t Gout = H / in.kv_heads();
    for (std::int64_t h = 0; h < H; ++h) {
      plans[h] = row_plan(in, p, budget, len(b, h / Gout), b);
      initial_row_budget<Budgeter>(p.budgeter, plans[h], in.layer_idx, in.num_layers, Scorer::has_scores, budgets + h, need + h);
    }
    if constexpr (kind == budget_kind::whole_layer) {
      if (sharded) return {};
      KVEVICT_TRY(Budgeter::layer_budgets(p.budgeter, budget, plans, H, in.kv_heads(), in.layer_idx, in.num_layers, budgets, ls));
    }
    need_flags(p, plans, budgets, H, need);
    return {};
  }

  /// The "needs scoring" flags of a sequence's H rows once whole-layer budgets are set (other
  /// budgeters: initial_row_budget's), and layer_mean's all-or-none.
  static void need_flags(const params_type& p, const head_plan* plans, const std::int64_t* budgets, std::int64_t H, std::uint8_t* need) {
    if constexpr (kind == budget_kind::whole_layer)
      for (std::int64_t h = 0; h < H; ++h) need[h] = Scorer::has_scores && budgets[h] < plans[h].length ? 1 : 0;
    if (p.gqa == gqa_reduction::layer_mean) {
      std::uint8_t any = 0;
      for (std::int64_t h = 0; h < H; ++h) any |= need[h];
      for (std::int64_t h = 0; h < H; ++h) need[h] = any;
    }
  }

  /// Kept tokens of one row: its budget, never more than its length.
  KVEVICT_HOST_DEVICE static std::int64_t kept(const head_plan& pl, std::int64_t budget) { return kept_tokens(pl, budget); }

  /// The exact number of kept tokens of the layer (the same sum run() writes to indptr), from
  /// host lengths len(b, h). Allocates O(out_heads) host scratch, and the whole-layer
  /// budgeter's (plan time only).
  template <class T, class LenF>
  static status kept_total(const layer_inputs<T>& in, const params_type& p, const budget_request& budget, LenF len,
                           std::int64_t* total) {
    const std::int64_t H = out_heads(in, p);
    std::vector<head_plan> pl(static_cast<std::size_t>(H));
    std::vector<std::int64_t> bu(static_cast<std::size_t>(H));
    std::vector<std::uint8_t> nd(static_cast<std::size_t>(H));
    const host_layer_scratch<Budgeter> ls(p.budgeter);
    std::int64_t t = 0;
    for (std::int64_t b = 0; b < in.batch(); ++b) {
      KVEVICT_TRY(sequence_budgets(in, p, budget, b, H, len, pl.data(), bu.data(), nd.data(), ls.s));
      for (std::int64_t h = 0; h < H; ++h) t += kept(pl[static_cast<std::size_t>(h)], bu[static_cast<std::size_t>(h)]);
    }
    *total = t;
    return {};
  }

  /// An upper bound of the kept tokens from the shapes alone (lengths unknown to the host):
  /// batch * out_heads * min(seq, per-head bound), the bound being the base budget of a head of
  /// seq tokens for per-head and score-driven budgeters (a score-driven budgeter keeps each
  /// sequence's total; budgeters whose head_budget can exceed the base budget declare
  /// `max_head_budget(params, base_budget)`: PyramidKV 2B + 1), or seq for whole-layer ones.
  template <class T>
  static std::int64_t kept_upper_bound(const layer_inputs<T>& in, const params_type& p, const budget_request& budget) {
    const std::int64_t S = in.capacity();
    std::int64_t Sref = S;  // a row_request budgeter plans from its reference length (a fraction of it can exceed one of S)
    if constexpr (has_row_request<Budgeter>::value) Sref = Budgeter::reference_length(p.budgeter, S);
    std::int64_t B = plan_head(budget, p.selector, Sref, in.window()).base_budget;
    if (in.paged() && in.pages.protected_prefix) {  // a protected prefix raises budgets (unknown to the host)
      B = S;
    } else if constexpr (kind == budget_kind::whole_layer) {
      B = S;
    } else if constexpr (kind == budget_kind::per_head) {
      B = max_head_budget(p.budgeter, B);
    }
    return in.batch() * out_heads(in, p) * std::min(B, S);
  }

  /// What a backend driver tells make_plan about itself.
  struct plan_request {
    /// Host-readable lengths, batch x kv_heads row-major, or null. With lengths_known = true and
    /// lengths = null every head holds seq tokens (layer_inputs without lengths).
    const std::int32_t* lengths = nullptr;
    std::int64_t lengths_stride[2] = {0, 0};  ///< element strides of `lengths` (batch, head)
    bool lengths_known = true;  ///< false: the host cannot read the lengths (device memory, no host copy)
    bool host_budgets = true;   ///< false: the budgeter's tables are device-only (LKV-H on CUDA)
    int num_threads = 1;        ///< resolved thread count (CPU); stored in the plan
    const void* owner = nullptr;
    std::uint64_t generation = 0;
    bool sharded = false;  ///< plan_options::sharded (the driver supports it)
  };

  /// The plan of one layer, the one sequence of checks for every backend: parameters, shapes and
  /// budget (validate); the backend's own checks (backend_check(), a callable returning status);
  /// when the host knows the lengths, their range, the exact kept count (the whole-layer
  /// budgeter's allocation included) and layer_mean's equal lengths; else the kept count's upper
  /// bound. workspace(num_threads) returns the bytes run() needs. On error *out is untouched.
  template <class T, class BackendCheck, class Workspace>
  static status make_plan(const layer_inputs<T>& in, const params_type& p, const budget_request& budget, const plan_request& rq,
                          BackendCheck&& backend_check, Workspace&& workspace, eviction_plan* out) {
    if (!out) return status::error(errc::null_pointer, "plan is null");
    KVEVICT_TRY(validate(in, p, budget));
    const std::int64_t S = in.capacity();
    auto len = [&](std::int64_t b, std::int64_t h) -> std::int64_t {
      if (rq.lengths) return static_cast<std::int64_t>(rq.lengths[b * rq.lengths_stride[0] + h * rq.lengths_stride[1]]);
      return in.paged() ? in.length(b, h) : S;  // a paged cache's table gives them (host tables)
    };
    KVEVICT_TRY(backend_check());  // first: it validates a paged cache's table, which len() reads
    if (rq.lengths_known) KVEVICT_TRY(check_length_range(in.batch(), in.kv_heads(), S, len));
    eviction_plan pl;
    pl.out_heads = out_heads(in, p);
    pl.rows = in.batch() * pl.out_heads;
    pl.budget = budget;
    pl.signature = layer_signature::of(in);
    pl.owner = rq.owner;
    pl.generation = rq.generation;
    pl.params_fingerprint = bytes_fingerprint(p);
    pl.num_threads = rq.num_threads;
    pl.sharded = rq.sharded;
    if (rq.sharded) {
      if (p.gqa == gqa_reduction::layer_mean)
        return status::error(errc::not_supported, "gqa = layer_mean averages over all heads of the layer; a sharded layer cannot");
    }
    if (rq.sharded && kind != budget_kind::per_head) {
      // budget moves between ranks: every local row may keep up to its length
      std::int64_t t = 0;
      for (std::int64_t b = 0; b < in.batch(); ++b)
        for (std::int64_t h = 0; h < in.kv_heads(); ++h) t += rq.lengths_known ? len(b, h) : S;
      pl.max_selected = t * (pl.out_heads / in.kv_heads());
      pl.max_selected_exact = false;
    } else if (rq.lengths_known && rq.host_budgets) {
      KVEVICT_TRY(kept_total(in, p, budget, len, &pl.max_selected));
      pl.max_selected_exact = true;
    } else {
      pl.max_selected = kept_upper_bound(in, p, budget);
      pl.max_selected_exact = false;
    }
    if constexpr (budget_is_cap<Budgeter>::value) pl.max_selected_exact = false;  // heads may keep less (budgeters::threshold)
    if (const std::int64_t slack = total_slack(p.budgeter, pl.out_heads); slack > 0) {
      // a score-driven budgeter that does not keep each sequence's total (AdaKV's reference rounding)
      pl.max_selected += in.batch() * slack;
      pl.max_selected_exact = false;
    }
    if (rq.lengths_known) KVEVICT_TRY(check_layer_mean_lengths(p, in.batch(), in.kv_heads(), len));
    pl.workspace_bytes = workspace(rq.num_threads);
    pl.valid = true;
    *out = pl;
    return {};
  }

  /// run(plan, ...): the plan belongs to this evictor, is current (same parameter generation
  /// and the same parameter bytes: a params_type& held across plan() and written after it is
  /// caught), was made for these shapes, and its budget and rows are valid for the current
  /// parameters (O(1) checks of the plan's own fields: a plan is plain data the caller can
  /// write; none of the plan's data checks is repeated).
  template <class T>
  static status check_plan(const eviction_plan& pl, const layer_inputs<T>& in, const params_type& p, const void* owner,
                           std::uint64_t generation) {
    if (!pl.valid) return status::error(errc::invalid_argument, "plan is not valid (plan() did not succeed)");
    if (pl.owner != owner)
      return status::error(errc::invalid_argument, "plan was made by another evictor object (plan with this one)");
    if (pl.generation != generation || pl.params_fingerprint != bytes_fingerprint(p))
      return status::error(errc::invalid_argument,
                           "plan is stale: params() changed since plan(), or the plan was not made by plan() (plan again)");
    if (pl.signature != layer_signature::of(in))
      return status::error(errc::invalid_argument,
                           "layer_inputs do not match the plan (shapes, strides, set views, layer_idx or storage type differ; "
                           "plan again)");
    const std::int64_t H = out_heads(in, p);
    if (pl.out_heads != H || pl.rows != in.batch() * H)
      return status::error(errc::invalid_argument, "plan.rows = %lld, plan.out_heads = %lld != %lld rows of %lld heads for these inputs",
                           static_cast<long long>(pl.rows), static_cast<long long>(pl.out_heads),
                           static_cast<long long>(in.batch() * H), static_cast<long long>(H));
    KVEVICT_TRY(validate_budget(pl.budget, p.selector, in.window()));
    return {};
  }

  /// run(plan, ...)'s argument checks, the same on every backend: the plan (check_plan), the
  /// selection's buffers and the workspace: at least `need` bytes (the larger of the plan's
  /// size and the size the current parameters give), non-null when need > 0.
  template <class T>
  static status check_run_args(const eviction_plan& pl, const layer_inputs<T>& in, const params_type& p, const void* owner,
                               std::uint64_t generation, const selection_view& out, const void* workspace,
                               std::size_t workspace_bytes, std::size_t need) {
    KVEVICT_TRY(check_plan(pl, in, p, owner, generation));
    if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "selection.indptr or selection.indices is null");
    if (!workspace && need > 0)
      return status::error(errc::insufficient_workspace, "workspace is null (plan.workspace_bytes = %zu)", pl.workspace_bytes);
    if (workspace_bytes < need)
      return status::error(errc::insufficient_workspace, "workspace_bytes = %zu < %zu needed (plan.workspace_bytes = %zu)",
                           workspace_bytes, need, pl.workspace_bytes);
    return {};
  }

 private:
  template <class Bu, class = void>
  struct has_max_head_budget : std::false_type {};
  template <class Bu>
  struct has_max_head_budget<Bu, std::void_t<decltype(Bu::max_head_budget(std::declval<const typename Bu::params&>(),
                                                                         std::int64_t{}))>> : std::true_type {};
  static std::int64_t max_head_budget(const typename Budgeter::params& bp, std::int64_t B) {
    if constexpr (has_max_head_budget<Budgeter>::value) return Budgeter::max_head_budget(bp, B);
    (void)bp;
    return B;
  }
  /// Tokens a sequence of `heads` rows can keep beyond the score-driven total (budgeters that declare
  /// `total_slack(params, heads)`; 0 otherwise).
  template <class Bu, class = void>
  struct has_total_slack : std::false_type {};
  template <class Bu>
  struct has_total_slack<Bu, std::void_t<decltype(Bu::total_slack(std::declval<const typename Bu::params&>(), std::int64_t{}))>>
      : std::true_type {};
  static std::int64_t total_slack(const typename Budgeter::params& bp, std::int64_t heads) {
    if constexpr (has_total_slack<Budgeter>::value) return Budgeter::total_slack(bp, heads);
    (void)bp;
    (void)heads;
    return 0;
  }
};

/// The public calls every evictor shares, written once over its driver's plan() and
/// run(plan, ...) (CRTP): the policy's types, out_heads, and the thin wrappers can_implement,
/// max_selected and run(inputs, budget, ...). Derived is evictor<Policy, Backend>; it provides
///   status plan(const layer_inputs<T>&, const budget_request&, eviction_plan*, const plan_options& = {}) const;
///   status run(const eviction_plan&, const layer_inputs<T>&, selection_view, void*, std::size_t, float*) const;
///   const params_type& params() const;
/// and says `using evictor_base<...>::run;` next to its own run overloads.
template <class Derived, class Policy>
class evictor_base {
 public:
  using policy = Policy;
  using params_type = typename Policy::params;
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  using Spatial = typename Policy::spatial_smoother;
  using Budgeter = typename Policy::budgeter;
  using Selector = typename Policy::selector;

  explicit evictor_base(params_type p) : p_(p), generation_(next_plan_generation()) {}

  const params_type& params() const { return p_; }
  /// Mutable parameters: every call makes the plans made so far stale (run(plan) rejects them).
  params_type& params() {
    generation_ = next_plan_generation();
    return p_;
  }

  /// Selection rows per sequence: kv_heads, or q_heads for gqa_reduction::per_query_head.
  template <class T>
  std::int64_t out_heads(const layer_inputs<T>& in) const {
    return frontend<Policy>::out_heads(in, p_);
  }

  /// plan() into a temporary: every check the plan makes (on CUDA the host-side ones; the
  /// device checks the lengths when no host copy is given). No output is touched.
  template <class T>
  status can_implement(const layer_inputs<T>& in, const budget_request& budget) const {
    eviction_plan pl;
    return self().plan(in, budget, &pl);
  }

  /// plan()'s max_selected: the size selection.indices must have (exact where
  /// eviction_plan::max_selected_exact says so); -1 when plan() fails.
  template <class T>
  std::int64_t max_selected(const layer_inputs<T>& in, const budget_request& budget) const {
    eviction_plan pl;
    return self().plan(in, budget, &pl).ok() ? pl.max_selected : -1;
  }

  /// plan() then run(plan, ...): the selection of one layer in one call.
  template <class T>
  status run(const layer_inputs<T>& in, const budget_request& budget, selection_view out, void* workspace,
             std::size_t workspace_bytes, float* maybe_scores = nullptr) const {
    eviction_plan pl;
    KVEVICT_TRY(self().plan(in, budget, &pl));
    return self().run(pl, in, out, workspace, workspace_bytes, maybe_scores);
  }

 protected:
  /// A plan_request owned by this evictor at its current generation (the driver adds lengths,
  /// host_budgets and threads).
  typename frontend<Policy>::plan_request owned_request() const {
    typename frontend<Policy>::plan_request rq;
    rq.owner = static_cast<const void*>(&self());
    rq.generation = generation_;
    return rq;
  }
  /// run(plan, ...)'s argument checks (frontend::check_run_args) for this evictor.
  template <class T>
  status check_run_args(const eviction_plan& pl, const layer_inputs<T>& in, const selection_view& out, const void* workspace,
                        std::size_t workspace_bytes, std::size_t need) const {
    return frontend<Policy>::check_run_args(pl, in, p_, static_cast<const void*>(&self()), generation_, out, workspace,
                                            workspace_bytes, need);
  }

  params_type p_;
  /// Process-wide unique per construction and per call of the mutable params() (and copied by
  /// an assignment): a plan carries it, so a plan made before params() changed, or before this
  /// object was assigned another evictor's state, is stale. Plain data: the evictor stays
  /// trivially copyable.
  std::uint64_t generation_;

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace detail
}  // namespace kvevict
