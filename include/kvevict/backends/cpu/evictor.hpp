// IWYU pragma: private, include "kvevict/cpu.hpp"
// evictor<Policy, cpu::backend>: validation, scoring, GQA reduction, smoothing, budgeting and
// selection of one layer on the CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/scorers.hpp"
#include "kvevict/backends/cpu/select.hpp"
#include "kvevict/backends/cpu/smoothers.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/evictor.hpp"

namespace kvevict {

namespace cpu {
namespace detail {

/// Scan the valid region of an (batch, heads, seq, dim) view for NaN/inf. rows_valid(b, h)
/// gives the valid [first, last) slots.
template <class V, class F>
inline status scan_finite(const V& v, const char* name, F rows_valid) {
  for (std::int64_t b = 0; b < v.extent[0]; ++b)
    for (std::int64_t h = 0; h < v.extent[1]; ++h) {
      std::int64_t r0, r1;
      rows_valid(b, h, &r0, &r1);
      for (std::int64_t s = r0; s < r1; ++s)
        for (std::int64_t c = 0; c < v.extent[3]; ++c)
          if (!is_finite_value(v(b, h, s, c)))
            return status::error(errc::non_finite_input, "%s(b=%lld, h=%lld, s=%lld, d=%lld) = %g is not finite", name,
                                 static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(s),
                                 static_cast<long long>(c), static_cast<double>(to_float(v(b, h, s, c))));
    }
  return {};
}

/// Detects a budgeter that allocates a whole layer at once (budgeters::headwise_learned):
///   static status layer_budgets(const params&, const budget_request&, const head_plan* plans,
///                               int64 rows, int64 kv_heads, int layer, int num_layers, int64* budgets);
template <class Bu, class = void>
struct has_layer_budgets : std::false_type {};
template <class Bu>
struct has_layer_budgets<Bu, std::void_t<decltype(Bu::layer_budgets(
                                 std::declval<const typename Bu::params&>(), std::declval<const budget_request&>(),
                                 std::declval<const kvevict::detail::head_plan*>(), std::int64_t{}, std::int64_t{}, int{},
                                 int{}, std::declval<std::int64_t*>()))>> : std::true_type {};

/// Detects a scorer that checks its tables against a layer's shape:
///   static status check_layer(const params&, int64 kv_heads, int64 head_dim, int layer_idx, int num_layers);
template <class S, class = void>
struct has_check_layer : std::false_type {};
template <class S>
struct has_check_layer<S, std::void_t<decltype(S::check_layer(std::declval<const typename S::params&>(), std::int64_t{},
                                                               std::int64_t{}, int{}, int{}))>> : std::true_type {};

}  // namespace detail
}  // namespace cpu

/// CPU evictor. Thread-safe for concurrent run() calls with separate workspaces and outputs.
/// See the file kvevict/evictor.hpp for the lifecycle and docs/semantics.md for the rules.
template <class Policy>
class evictor<Policy, cpu::backend> {
 public:
  using policy = Policy;
  using params_type = typename Policy::params;
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  using Spatial = typename Policy::spatial_smoother;
  using Budgeter = typename Policy::budgeter;
  using Selector = typename Policy::selector;
  /// CriticalKV: the scorer writes a secondary row (||v W_O^h||_1) that selectors::two_stage reads.
  static constexpr bool has_secondary = kvevict::detail::scorer_secondary<Scorer>::value;
  static constexpr bool needs_wo_matrix = kvevict::detail::scorer_needs_wo_matrix<Scorer>::value;
  static constexpr bool is_two_stage = std::is_same<Selector, selectors::two_stage>::value;

  static_assert(has_secondary == is_two_stage,
                "kvevict: selectors::two_stage and scorers::attention_value_norm (CriticalKV) only work together: the "
                "selector's second stage reads the scorer's secondary row (use presets::criticalkv)");
  static_assert(!Spatial::needs_attention_drift || Scorer::window_attention,
                "kvevict: the adaptive-window smoother needs a scorer that computes the window attention");
  static_assert(!Budgeter::needs_scores || Scorer::has_scores,
                "kvevict: a score-driven budgeter (AdaKV) needs a scorer that produces scores");

  explicit evictor(params_type p = Policy::defaults(), cpu::backend be = {}) : p_(p), be_(be) {}

  const params_type& params() const { return p_; }
  params_type& params() { return p_; }

  /// Selection rows per sequence: kv_heads, or q_heads for gqa_reduction::per_query_head.
  template <class T>
  std::int64_t out_heads(const layer_inputs<T>& in) const {
    return p_.gqa == gqa_reduction::per_query_head ? in.q_heads() : in.kv_heads();
  }

  /// Shape, parameter, budget and length checks (reads the lengths). No output is touched.
  template <class T>
  status can_implement(const layer_inputs<T>& in, const budget_request& budget) const {
    KVEVICT_TRY((kvevict::detail::validate_layer_inputs<Policy, T>(in, p_, budget)));
    if (in.lengths.data) {
      for (std::int64_t b = 0; b < in.batch(); ++b)
        for (std::int64_t h = 0; h < in.kv_heads(); ++h) {
          const std::int64_t L = in.lengths(b, h);
          if (L < 0 || L > in.capacity())
            return status::error(errc::invalid_argument, "lengths(b=%lld, h=%lld) = %lld is outside [0, seq = %lld]",
                                 static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(L),
                                 static_cast<long long>(in.capacity()));
        }
    }
    if constexpr (cpu::detail::has_check_layer<Scorer>::value)
      KVEVICT_TRY(Scorer::check_layer(p_.scorer, in.kv_heads(), in.head_dim(), in.layer_idx, in.num_layers));
    if constexpr (cpu::detail::has_layer_budgets<Budgeter>::value) {
      const std::int64_t H = out_heads(in), G = H / in.kv_heads();
      std::vector<kvevict::detail::head_plan> pl(static_cast<std::size_t>(H));
      std::vector<std::int64_t> bu(static_cast<std::size_t>(H));
      for (std::int64_t b = 0; b < in.batch(); ++b) {
        for (std::int64_t h = 0; h < H; ++h) pl[static_cast<std::size_t>(h)] = plan(in, budget, b, h / G);
        KVEVICT_TRY(Budgeter::layer_budgets(p_.budgeter, budget, pl.data(), H, in.kv_heads(), in.layer_idx, in.num_layers, bu.data()));
      }
    }
    if (p_.gqa == gqa_reduction::layer_mean) {
      for (std::int64_t b = 0; b < in.batch(); ++b)
        for (std::int64_t h = 1; h < in.kv_heads(); ++h)
          if (in.length(b, h) != in.length(b, 0))
            return status::error(errc::invalid_argument,
                                 "gqa = layer_mean needs equal lengths across heads; sequence %lld has %lld and %lld",
                                 static_cast<long long>(b), static_cast<long long>(in.length(b, 0)),
                                 static_cast<long long>(in.length(b, h)));
    }
    return {};
  }

  /// Bytes of workspace run() needs for these shapes (independent of the data).
  template <class T>
  std::size_t workspace_size(const layer_inputs<T>& in) const {
    // Shapes that fail validation need no workspace (run() reports the error); this also keeps
    // the sizing arithmetic away from zero or negative extents.
    if (!shapes_ok(in)) return 0;
    kvevict::detail::workspace_carver c;
    carve_all(c, in);
    // + alignment: run() aligns the caller's pointer itself, so any address works (and gives
    // the same results: Eigen's vectorised loops peel by address).
    return c.bytes() + kvevict::detail::workspace_carver::alignment;
  }

  /// Exact number of kept tokens (the size selection.indices must have). Requires
  /// can_implement(in, budget) to succeed; returns -1 otherwise.
  template <class T>
  std::int64_t max_selected(const layer_inputs<T>& in, const budget_request& budget) const {
    if (!can_implement(in, budget).ok()) return -1;
    std::int64_t total = 0;
    const std::int64_t H = out_heads(in), G = H / in.kv_heads();
    if constexpr (cpu::detail::has_layer_budgets<Budgeter>::value) {
      std::vector<kvevict::detail::head_plan> pl(static_cast<std::size_t>(H));
      std::vector<std::int64_t> bu(static_cast<std::size_t>(H));
      for (std::int64_t b = 0; b < in.batch(); ++b) {
        for (std::int64_t h = 0; h < H; ++h) pl[static_cast<std::size_t>(h)] = plan(in, budget, b, h / G);
        if (!Budgeter::layer_budgets(p_.budgeter, budget, pl.data(), H, in.kv_heads(), in.layer_idx, in.num_layers, bu.data()).ok())
          return -1;
        for (std::int64_t h = 0; h < H; ++h) total += std::min(bu[static_cast<std::size_t>(h)], pl[static_cast<std::size_t>(h)].length);
      }
      return total;
    }
    for (std::int64_t b = 0; b < in.batch(); ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const auto pl = plan(in, budget, b, h / G);
        if constexpr (Budgeter::needs_scores) total += pl.pass_through ? pl.length : pl.base_budget;
        else if constexpr (!cpu::detail::has_layer_budgets<Budgeter>::value)
          total += Budgeter::head_budget(p_.budgeter, pl, in.layer_idx, in.num_layers);
      }
    return total;
  }

  /// Select the tokens to keep for one layer.
  /// @param out        caller-allocated CSR (rows = batch * out_heads(in)); capacity >= max_selected()
  /// @param workspace  at least workspace_size(in) bytes, any alignment is fixed up internally
  /// @param maybe_scores optional fp32 (batch, out_heads, seq): the final (reduced, smoothed)
  ///                   scores; entries of pass-through heads and protected slots are 0. With
  ///                   selectors::two_stage these are the primary (attention) scores, the ones
  ///                   stage 1 and the budgeter rank.
  /// On error nothing is written to out or maybe_scores.
  template <class T>
  status run(const layer_inputs<T>& in, const budget_request& budget, selection_view out, void* workspace,
             std::size_t workspace_bytes, float* maybe_scores = nullptr) const {
    KVEVICT_TRY(can_implement(in, budget));
    if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "selection.indptr or selection.indices is null");
    const std::size_t need = workspace_size(in);
    if (workspace_bytes < need || (!workspace && need > 0))
      return status::error(errc::insufficient_workspace, "workspace_bytes = %zu < workspace_size() = %zu", workspace_bytes, need);
    if (p_.check_finite) KVEVICT_TRY(check_finite(in));

    const std::int64_t B = in.batch(), Hkv = in.kv_heads(), H = out_heads(in), S = in.capacity();
    const std::int64_t Gq = in.queries.data ? in.group_size() : 1;  // query heads per KV head
    const std::int64_t Gout = H / Hkv;                               // out rows per KV head
    const std::int64_t rows = B * H;
    const std::uintptr_t wsa = reinterpret_cast<std::uintptr_t>(workspace), wal = kvevict::detail::workspace_carver::alignment;
    kvevict::detail::workspace_carver c(reinterpret_cast<void*>((wsa + wal - 1) / wal * wal));
    buffers buf = carve_all(c, in);

    // 1. plans and score-free budgets
    bool any_scoring = false;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t r = b * H + h;
        buf.plans[r] = plan(in, budget, b, h / Gout);
        if constexpr (cpu::detail::has_layer_budgets<Budgeter>::value) {
          buf.need[r] = 0;  // set below, once the sequence's plans are known
        } else if constexpr (!Budgeter::needs_scores) {
          buf.budgets[r] = Budgeter::head_budget(p_.budgeter, buf.plans[r], in.layer_idx, in.num_layers);
          buf.need[r] = Scorer::has_scores && buf.budgets[r] < buf.plans[r].length ? 1 : 0;
        } else {
          buf.need[r] = Scorer::has_scores && !buf.plans[r].pass_through ? 1 : 0;
        }
        any_scoring = any_scoring || buf.need[r];
      }
    if constexpr (cpu::detail::has_layer_budgets<Budgeter>::value) {  // whole-layer allocation
      for (std::int64_t b = 0; b < B; ++b) {
        KVEVICT_TRY(Budgeter::layer_budgets(p_.budgeter, budget, buf.plans + b * H, H, Hkv, in.layer_idx, in.num_layers,
                                            buf.budgets + b * H));
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t r = b * H + h;
          buf.need[r] = Scorer::has_scores && buf.budgets[r] < buf.plans[r].length ? 1 : 0;
          any_scoring = any_scoring || buf.need[r];
        }
      }
    }
    if (p_.gqa == gqa_reduction::layer_mean) {  // one decision per sequence
      for (std::int64_t b = 0; b < B; ++b) {
        std::uint8_t any = 0;
        for (std::int64_t h = 0; h < H; ++h) any |= buf.need[b * H + h];
        for (std::int64_t h = 0; h < H; ++h) buf.need[b * H + h] = any;
      }
    }

    // 2. scoring + GQA reduction (per (sequence, KV head)), then smoothing (per row)
    if constexpr (Scorer::has_scores) {
      if (any_scoring) {
        cpu::detail::parallel_for(be_, B * Hkv, [&](std::int64_t task, int tid) {
          const std::int64_t b = task / Hkv, h = task % Hkv;
          bool any_row = false;
          for (std::int64_t g = 0; g < Gout; ++g) any_row = any_row || buf.need[b * H + h * Gout + g];
          if (!any_row) return;
          const std::int64_t L = in.length(b, h);
          cpu::detail::head_job<Policy, T> job{&in, &p_, b, h, L, std::min<std::int64_t>(in.window(), L), 0};
          if constexpr (Spatial::needs_attention_drift) {
            const auto& pl = buf.plans[b * H + h * Gout];
            job.drift_topk = std::max<std::int64_t>(1, pl.base_budget - job.w);
          }
          float* grows = buf.grows + static_cast<std::int64_t>(tid) * Gq * S;
          double* gdrift = buf.gdrift + static_cast<std::int64_t>(tid) * Gq;
          float* grows2 = has_secondary ? buf.grows2 + static_cast<std::int64_t>(tid) * Gq * S : nullptr;
          cpu::detail::score_kv_head<Scorer, Temporal>(job, buf.scratch[tid], grows, gdrift, grows2);
          if constexpr (has_secondary) {  // the secondary rows, reduced by the same GQA rule (never smoothed)
            if (Gout == Gq) {
              for (std::int64_t g = 0; g < Gq; ++g)
                std::copy(grows2 + g * L, grows2 + (g + 1) * L, buf.scores2 + (b * H + h * Gout + g) * S);
            } else {
              float* o = buf.scores2 + (b * H + h) * S;
              for (std::int64_t n = 0; n < L; ++n) {
                if (p_.gqa == gqa_reduction::max) {
                  float m = grows2[n];
                  for (std::int64_t g = 1; g < Gq; ++g) m = std::max(m, grows2[g * L + n]);
                  o[n] = m;
                } else {
                  double sum = 0.0;
                  for (std::int64_t g = 0; g < Gq; ++g) sum += grows2[g * L + n];
                  o[n] = static_cast<float>(sum / static_cast<double>(Gq));
                }
              }
            }
          }
          // GQA reduction into the out rows.
          if (Gout == Gq) {  // per query head (or G == 1)
            for (std::int64_t g = 0; g < Gq; ++g) {
              const std::int64_t r = b * H + h * Gout + g;
              std::copy(grows + g * L, grows + (g + 1) * L, buf.scores + r * S);
              buf.drift[r] = gdrift[g];
            }
          } else {
            const std::int64_t r = b * H + h;
            float* o = buf.scores + r * S;
            double dsum = 0.0;
            for (std::int64_t g = 0; g < Gq; ++g) dsum += gdrift[g];
            buf.drift[r] = dsum / static_cast<double>(Gq);
            if (p_.gqa == gqa_reduction::max) {
              for (std::int64_t n = 0; n < L; ++n) {
                float m = grows[n];
                for (std::int64_t g = 1; g < Gq; ++g) m = std::max(m, grows[g * L + n]);
                o[n] = m;
              }
            } else {
              const double inv = 1.0 / static_cast<double>(Gq);
              for (std::int64_t n = 0; n < L; ++n) {
                double s = 0.0;
                for (std::int64_t g = 0; g < Gq; ++g) s += grows[g * L + n];
                o[n] = static_cast<float>(s * inv);
              }
            }
          }
        });
        if (p_.gqa == gqa_reduction::layer_mean) {
          for (std::int64_t b = 0; b < B; ++b) {
            if (!buf.need[b * H]) continue;
            const std::int64_t L = in.length(b, 0);
            float* o0 = buf.scores + (b * H) * S;
            double dsum = buf.drift[b * H];
            for (std::int64_t h = 1; h < H; ++h) dsum += buf.drift[b * H + h];
            for (std::int64_t n = 0; n < L; ++n) {  // fp32 sum in head order (as CUDA); fp64 where it overflows
              float acc = o0[n];
              double dacc = o0[n];
              for (std::int64_t h = 1; h < H; ++h) {
                acc += buf.scores[(b * H + h) * S + n];
                dacc += buf.scores[(b * H + h) * S + n];
              }
              acc /= static_cast<float>(H);
              o0[n] = std::isfinite(acc) ? acc : static_cast<float>(dacc / static_cast<double>(H));
            }
            for (std::int64_t h = 1; h < H; ++h) {
              std::copy(o0, o0 + L, buf.scores + (b * H + h) * S);
              buf.drift[b * H + h] = dsum / static_cast<double>(H);
            }
            buf.drift[b * H] = dsum / static_cast<double>(H);
            if constexpr (has_secondary) {  // the group means of the secondary rows, averaged the same way
              float* u0 = buf.scores2 + (b * H) * S;
              for (std::int64_t n = 0; n < L; ++n) {
                double sum = 0.0;
                for (std::int64_t h = 0; h < H; ++h) sum += buf.scores2[(b * H + h) * S + n];
                u0[n] = static_cast<float>(sum / static_cast<double>(H));
              }
              for (std::int64_t h = 1; h < H; ++h) std::copy(u0, u0 + L, buf.scores2 + (b * H + h) * S);
            }
          }
        }
        cpu::detail::parallel_for(be_, rows, [&](std::int64_t r, int tid) {
          if (!buf.need[r]) return;
          const auto& pl = buf.plans[r];
          cpu::detail::smooth_row<Spatial>(p_.spatial, buf.scores + r * S, pl.evictable_end(), buf.drift[r],
                                           buf.tmp + static_cast<std::int64_t>(tid) * S,
                                           buf.pre + static_cast<std::int64_t>(tid) * (S + 1),
                                           buf.dq + static_cast<std::int64_t>(tid) * S);
        });
      }
    }

    // 3. score-dependent budgets
    if constexpr (Budgeter::needs_scores) {
      std::vector<const float*> rowptr(static_cast<std::size_t>(H));
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t h = 0; h < H; ++h) rowptr[static_cast<std::size_t>(h)] = buf.scores + (b * H + h) * S;
        cpu::detail::adakv_budgets(p_.budgeter, buf.plans + b * H, rowptr.data(), H, buf.budgets + b * H);
      }
    }

    // 4. capacity, then selection
    std::int64_t total = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      buf.offsets[r] = total;
      total += std::min<std::int64_t>(buf.budgets[r], buf.plans[r].length);
    }
    if (total > 0x7fffffff)
      return status::error(errc::not_supported, "kept tokens = %lld exceed the int32 range of selection.indptr",
                           static_cast<long long>(total));
    if (total > out.capacity)
      return status::error(errc::insufficient_capacity, "selection.capacity = %lld < kept tokens = %lld (use max_selected())",
                           static_cast<long long>(out.capacity), static_cast<long long>(total));
    cpu::detail::parallel_for(be_, rows, [&](std::int64_t r, int tid) {
      const std::int64_t b = r / H, hk = (r % H) / Gout;
      std::int32_t* dst = out.indices + buf.offsets[r];
      const float* sc = (Scorer::has_scores && buf.need[r]) ? buf.scores + r * S : nullptr;
      std::int64_t n;
      if constexpr (is_two_stage) {
        n = sc ? cpu::detail::select_head_two_stage(buf.plans[r], buf.budgets[r], sc, buf.scores2 + r * S, p_.selector, dst,
                                                    buf.idx + static_cast<std::int64_t>(tid) * S,
                                                    buf.tmp + static_cast<std::int64_t>(tid) * S)
               : cpu::detail::select_head(buf.plans[r], buf.budgets[r], nullptr, dst, buf.idx + static_cast<std::int64_t>(tid) * S);
      } else {
        n = cpu::detail::select_head(buf.plans[r], buf.budgets[r], sc, dst, buf.idx + static_cast<std::int64_t>(tid) * S);
      }
      (void)n;
      if (out.positions) {
        for (std::int64_t i = 0; i < n; ++i)
          out.positions[buf.offsets[r] + i] = in.positions.data ? in.positions(b, hk, dst[i]) : dst[i];
      }
    });
    out.indptr[0] = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      out.indptr[r + 1] = static_cast<std::int32_t>(buf.offsets[r] + std::min<std::int64_t>(buf.budgets[r], buf.plans[r].length));
    if (maybe_scores) {
      for (std::int64_t r = 0; r < rows; ++r) {
        float* o = maybe_scores + r * S;
        std::fill(o, o + S, 0.0f);
        if (!(Scorer::has_scores && buf.need[r])) continue;
        const auto& pl = buf.plans[r];
        for (std::int64_t n = pl.sinks; n < pl.evictable_end(); ++n) o[n] = buf.scores[r * S + n];
      }
    }
    return {};
  }

  /// Convenience overload that allocates its own workspace (std::vector).
  template <class T>
  status run(const layer_inputs<T>& in, const budget_request& budget, selection_view out, float* maybe_scores = nullptr) const {
    std::vector<unsigned char> ws(workspace_size(in) + kvevict::detail::workspace_carver::alignment);
    void* base = ws.data();
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(base);
    const std::uintptr_t al = (a + kvevict::detail::workspace_carver::alignment - 1) / kvevict::detail::workspace_carver::alignment *
                              kvevict::detail::workspace_carver::alignment;
    return run(in, budget, out, reinterpret_cast<void*>(al), ws.size() - (al - a), maybe_scores);
  }

 private:
  struct buffers {
    kvevict::detail::head_plan* plans;
    std::int64_t* budgets;
    std::int64_t* offsets;
    std::uint8_t* need;
    double* drift;
    float* scores;
    float* grows;
    double* gdrift;
    float* tmp;
    double* pre;
    std::int64_t* dq;
    std::int32_t* idx;
    float* scores2;  ///< secondary rows (B * out_heads, S), scorers with secondary_scores only
    float* grows2;   ///< per-thread secondary rows of one GQA group (G, S)
    cpu::detail::head_scratch scratch[256];
  };

  template <class T>
  kvevict::detail::head_plan plan(const layer_inputs<T>& in, const budget_request& budget, std::int64_t b,
                                  std::int64_t hkv) const {
    return kvevict::detail::plan_head(budget, p_.selector, in.length(b, hkv), in.window());
  }

  template <class T, class Carver>
  buffers carve_all(Carver& c, const layer_inputs<T>& in) const {
    buffers buf{};
    const std::int64_t B = in.batch(), H = out_heads(in), S = in.capacity();
    const std::int64_t rows = B * H;
    const std::int64_t Gq = in.queries.data ? in.group_size() : 1;
    const int nt = std::min(cpu::detail::max_threads(be_), 256);
    buf.plans = c.template carve<kvevict::detail::head_plan>(static_cast<std::size_t>(rows));
    buf.budgets = c.template carve<std::int64_t>(static_cast<std::size_t>(rows));
    buf.offsets = c.template carve<std::int64_t>(static_cast<std::size_t>(rows));
    buf.need = c.template carve<std::uint8_t>(static_cast<std::size_t>(rows));
    buf.drift = c.template carve<double>(static_cast<std::size_t>(rows));
    buf.idx = c.template carve<std::int32_t>(static_cast<std::size_t>(nt * S));
    if constexpr (Scorer::has_scores) {
      buf.scores = c.template carve<float>(static_cast<std::size_t>(rows * S));
      buf.grows = c.template carve<float>(static_cast<std::size_t>(nt * Gq * S));
      buf.gdrift = c.template carve<double>(static_cast<std::size_t>(nt * Gq));
      buf.tmp = c.template carve<float>(static_cast<std::size_t>(nt * S));
      buf.pre = c.template carve<double>(static_cast<std::size_t>(nt * (S + 1)));
      buf.dq = c.template carve<std::int64_t>(static_cast<std::size_t>(nt * S));
      // The per-head scratch (O(S d G) floats) only for the threads the scoring loop can use:
      // it runs over B * kv_heads tasks, so at most that many threads exist there.
      const std::int64_t nt_heads = std::min<std::int64_t>(nt, std::max<std::int64_t>(B * in.kv_heads(), 1));
      const bool full_y = cpu::detail::needs_full_projection<Scorer>(p_.scorer);
      for (std::int64_t t = 0; t < nt_heads; ++t) buf.scratch[t].carve(c, S, in.window(), in.head_dim(), Gq, full_y);
      if constexpr (has_secondary) {
        buf.scores2 = c.template carve<float>(static_cast<std::size_t>(rows * S));
        buf.grows2 = c.template carve<float>(static_cast<std::size_t>(nt * Gq * S));
      }
      if constexpr (needs_wo_matrix) {
        const std::int64_t C = in.wo.data ? in.wo.extent[0] : 0;
        for (std::int64_t t = 0; t < nt_heads; ++t) buf.scratch[t].carve_projection(c, C, in.head_dim());
      }
    }
    return buf;
  }

  template <class T>
  bool shapes_ok(const layer_inputs<T>& in) const {
    if (!in.keys.data || in.keys.extent[0] < 1 || in.keys.extent[1] < 1 || in.keys.extent[2] < 0 || in.keys.extent[3] < 1)
      return false;
    if (in.queries.data && (in.queries.extent[1] < 1 || in.queries.extent[1] % in.keys.extent[1] != 0 ||
                            in.queries.extent[2] < 0 || in.queries.extent[2] > in.keys.extent[2]))
      return false;
    return true;
  }

  template <class T>
  status check_finite(const layer_inputs<T>& in) const {
    auto kv_rows = [&](std::int64_t b, std::int64_t h, std::int64_t* r0, std::int64_t* r1) {
      *r0 = 0;
      *r1 = in.length(b, h);
    };
    KVEVICT_TRY(cpu::detail::scan_finite(in.keys, "keys", kv_rows));
    if (in.values.data && Scorer::needs_values) KVEVICT_TRY(cpu::detail::scan_finite(in.values, "values", kv_rows));
    if (in.queries.data && Scorer::needs_queries) {
      const std::int64_t G = in.group_size(), W = in.window();
      KVEVICT_TRY(cpu::detail::scan_finite(in.queries, "queries", [&](std::int64_t b, std::int64_t hq, std::int64_t* r0, std::int64_t* r1) {
        *r0 = W - std::min<std::int64_t>(W, in.length(b, hq / G));
        *r1 = W;
      }));
    }
    if constexpr (needs_wo_matrix) {
      const auto& wo = in.wo;
      for (std::int64_t c = 0; c < wo.extent[0]; ++c)
        for (std::int64_t i = 0; i < wo.extent[1]; ++i)
          if (!is_finite_value(wo(c, i)))
            return status::error(errc::non_finite_input, "wo(%lld, %lld) = %g is not finite", static_cast<long long>(c),
                                 static_cast<long long>(i), static_cast<double>(to_float(wo(c, i))));
    }
    if (Scorer::needs_wo_factor(p_.scorer)) {
      const auto& f = in.wo_factor;
      for (std::int64_t a = 0; a < f.extent[0]; ++a)
        for (std::int64_t i = 0; i < f.extent[1]; ++i)
          for (std::int64_t j = 0; j < f.extent[2]; ++j)
            if (!is_finite_value(f(a, i, j)))
              return status::error(errc::non_finite_input, "wo_factor(%lld, %lld, %lld) is not finite", static_cast<long long>(a),
                                   static_cast<long long>(i), static_cast<long long>(j));
    }
    return {};
  }

  params_type p_;
  cpu::backend be_;
};

}  // namespace kvevict
