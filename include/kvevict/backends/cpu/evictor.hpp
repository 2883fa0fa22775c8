// IWYU pragma: private, include "kvevict/cpu.hpp"
// evictor<Policy, cpu::backend>: the CPU driver. The backend-neutral front-end
// (frontend/frontend.hpp) validates, plans and applies the budget rules; the driver runs each
// stage through its CPU implementation trait (backends/cpu/impl.hpp) over OpenMP threads:
// scoring per (sequence, KV head), GQA reduction, smoothing per row, score-driven budgets per
// sequence, selection per row. It names no policy type and includes no policy's implementation:
// the stage lists (kvevict/cpu.hpp) do, and the traits are looked up where the evictor is used.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/gqa_reduce.hpp"
#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/scorers/common.hpp"
#include "kvevict/backends/cpu/scorers/head_scorer.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/distributed/exchange.hpp"
#include "kvevict/distributed/fingerprint.hpp"
#include "kvevict/evictor.hpp"
#include "kvevict/frontend/frontend.hpp"
#include "kvevict/frontend/plan.hpp"

namespace kvevict {

namespace cpu {
namespace detail {


/// Whether the valid region of a (batch, heads, seq, dim) view holds a NaN or inf. Slot-major when
/// a slot's heads lie closer together than a head's slots (NHD: each token's heads side by side,
/// read as one stream, the slots every head holds as one block), else head by head, row by row,
/// as scan_finite walks (HND: already one stream per head). rows_valid as in scan_finite. Only a
/// yes/no: scan_finite names the first bad element in (b, h, s, d) order.
template <class V, class F>
inline bool any_nonfinite(const V& v, F rows_valid) {
  const std::int64_t H = v.extent[1], d = v.extent[3];
  auto bad_row = [&](const auto* row) {
    if (v.stride[3] == 1) return !row_finite(row, d);
    for (std::int64_t c = 0; c < d; ++c)
      if (!is_finite_value(row[c * v.stride[3]])) return true;
    return false;
  };
  const bool slot_major = H > 1 && v.stride[2] > v.stride[1];
  for (std::int64_t b = 0; b < v.extent[0]; ++b) {
    if (!slot_major) {
      for (std::int64_t h = 0; h < H; ++h) {
        std::int64_t r0, r1;
        rows_valid(b, h, &r0, &r1);
        for (std::int64_t s = r0; s < r1; ++s)
          if (bad_row(&v(b, h, s, 0))) return true;
      }
      continue;
    }
    std::int64_t lo = 0, hi = 0;  // the union of the heads' valid slots
    std::int64_t all_lo = 0, all_hi = std::numeric_limits<std::int64_t>::max();  // the slots every head holds
    for (std::int64_t h = 0; h < H; ++h) {
      std::int64_t r0, r1;
      rows_valid(b, h, &r0, &r1);
      all_lo = std::max(all_lo, r0), all_hi = std::min(all_hi, r1);
      if (r0 >= r1) continue;
      if (lo >= hi) {
        lo = r0, hi = r1;
      } else {
        lo = std::min(lo, r0), hi = std::max(hi, r1);
      }
    }
    const bool dense = v.stride[3] == 1 && v.stride[1] == d && v.stride[2] == H * d;  // a slot's heads are one block
    for (std::int64_t s = lo; s < hi; ++s) {
      if (dense && s >= all_lo && s < all_hi) {  // slots [s, all_hi) of every head: one block
        if (!row_finite(&v(b, 0, s, 0), (all_hi - s) * H * d)) return true;
        s = all_hi - 1;
        continue;
      }
      for (std::int64_t h = 0; h < H; ++h) {
        std::int64_t r0, r1;
        rows_valid(b, h, &r0, &r1);
        if (s >= r0 && s < r1 && bad_row(&v(b, h, s, 0))) return true;
      }
    }
  }
  return false;
}

/// Scan the valid region of an (batch, heads, seq, dim) view for NaN/inf. rows_valid(b, h)
/// gives the valid [first, last) slots. any_nonfinite first (one pass in memory order); the
/// ordered walk that names the first bad element in (b, h, s, d) order runs only when it finds one.
template <class V, class F>
inline status scan_finite(const V& v, const char* name, F rows_valid) {
  if (!any_nonfinite(v, rows_valid)) return {};
  for (std::int64_t b = 0; b < v.extent[0]; ++b)
    for (std::int64_t h = 0; h < v.extent[1]; ++h) {
      std::int64_t r0, r1;
      rows_valid(b, h, &r0, &r1);
      for (std::int64_t s = r0; s < r1; ++s) {
        if (v.stride[3] == 1 && v.extent[3] > 0 && row_finite(&v(b, h, s, 0), v.extent[3])) continue;
        for (std::int64_t c = 0; c < v.extent[3]; ++c)
          if (!is_finite_value(v(b, h, s, c)))
            return status::error(errc::non_finite_input, "%s(b=%lld, h=%lld, s=%lld, d=%lld) = %g is not finite", name,
                                 static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(s),
                                 static_cast<long long>(c), static_cast<double>(to_float(v(b, h, s, c))));
      }
    }
  return {};
}

/// Whether any valid row of a paged cache's K or V (`v`) holds a NaN or inf, read in the order
/// that suits the pool rather than the order errors are named in: with one table per sequence,
/// page by page, and within a page the heads' runs in memory order (HND: head-major, one run of
/// rows after another; NHD: slot-major, the heads of a slot side by side), so each page is read
/// as one stream instead of kv_heads separate pieces (shuffled pages defeat the hardware
/// prefetcher at every piece). Per-head tables are read head by head (each head owns its pages).
/// Only a yes/no: scan_finite_paged names the first bad element in (b, h, s, d) order.
/// Every (sequence, KV head): the default head filter of any_nonfinite_paged and scan_finite_paged.
struct all_heads {
  bool operator()(std::int64_t, std::int64_t) const { return true; }
};

/// `want(b, h)` filters the (sequence, KV head) pairs read (all_heads: every one); a sequence
/// whose table the heads share and of which some heads are left out is read head by head.
template <class T, class W = all_heads>
inline bool any_nonfinite_paged(const layer_inputs<T>& in, const kv_view<const T>& v, W want = W{}) {
  const std::int64_t H = in.kv_heads(), d = v.extent[3];
  auto bad_rows = [&](const T* first, std::int64_t n, std::int64_t row_stride, std::int64_t col_stride) {
    if (col_stride == 1 && row_stride == d) return !row_finite(first, n * d);  // one block
    for (std::int64_t i = 0; i < n; ++i) {
      const T* row = first + i * row_stride;
      if (col_stride == 1) {
        if (!row_finite(row, d)) return true;
        continue;
      }
      for (std::int64_t c = 0; c < d; ++c)
        if (!is_finite_value(row[c * col_stride])) return true;
    }
    return false;
  };
  const bool slot_major = v.stride[2] > v.stride[1];  // NHD-like: a slot's heads lie closer than a head's slots
  for (std::int64_t b = 0; b < in.batch(); ++b) {
    bool every_head = true;
    for (std::int64_t h = 0; h < H; ++h) every_head = every_head && want(b, h);
    if (in.pages.per_head || !every_head) {
      for (std::int64_t h = 0; h < H; ++h) {
        if (!want(b, h)) continue;
        const row_source<T> rs = head_rows(in, v, b, h);
        for (std::int64_t s0 = 0, L = in.length(b, h); s0 < L;) {
          const std::int64_t run = std::min(L - s0, rs.page_size - (s0 + rs.page_offset) % rs.page_size);
          if (bad_rows(rs.row_ptr(s0), run, rs.row_stride, rs.col_stride)) return true;
          s0 += run;
        }
      }
      continue;
    }
    std::int64_t Lmax = 0, Lmin = std::numeric_limits<std::int64_t>::max();
    for (std::int64_t h = 0; h < H; ++h) Lmax = std::max(Lmax, in.length(b, h)), Lmin = std::min(Lmin, in.length(b, h));
    const row_source<T> rs0 = head_rows(in, v, b, 0);  // the heads share the table: head h is rs0 + h * stride[1]
    for (std::int64_t s0 = 0; s0 < Lmax;) {
      const std::int64_t run = std::min(Lmax - s0, rs0.page_size - (s0 + rs0.page_offset) % rs0.page_size);
      const T* page_first = rs0.row_ptr(s0);
      if (slot_major) {
        if (s0 + run <= Lmin && rs0.col_stride == 1 && v.stride[1] == d && rs0.row_stride == H * d) {  // one dense block
          if (!row_finite(page_first, run * H * d)) return true;
          s0 += run;
          continue;
        }
        for (std::int64_t i = 0; i < run; ++i)
          for (std::int64_t h = 0; h < H; ++h)
            if (s0 + i < in.length(b, h) && bad_rows(page_first + i * rs0.row_stride + h * v.stride[1], 1, rs0.row_stride, rs0.col_stride))
              return true;
      } else {
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t n = std::min(run, in.length(b, h) - s0);
          if (n > 0 && bad_rows(page_first + h * v.stride[1], n, rs0.row_stride, rs0.col_stride)) return true;
        }
      }
      s0 += run;
    }
  }
  return false;
}

/// scan_finite over a paged cache: the rows of every (sequence, KV head) through its page table,
/// named by logical coordinates (sequence, head, slot, dim) and the page that holds the slot.
/// any_nonfinite_paged first (the fast pass, in pool order); the ordered walk that names the
/// first bad element runs only when it finds one. `want(b, h)`: the (sequence, KV head) pairs
/// scanned (all_heads: every one).
template <class T, class W = all_heads>
inline status scan_finite_paged(const layer_inputs<T>& in, const kv_view<const T>& v, const char* name, W want = W{}) {
  if (!any_nonfinite_paged(in, v, want)) return {};
  for (std::int64_t b = 0; b < in.batch(); ++b)
    for (std::int64_t h = 0; h < in.kv_heads(); ++h) {
      if (!want(b, h)) continue;
      const row_source<T> rs = head_rows(in, v, b, h);
      // page by page: one page lookup per run of rows, not one division per row
      for (std::int64_t s0 = 0, L = in.length(b, h); s0 < L;) {
        const std::int64_t run = std::min(L - s0, rs.page_size - (s0 + rs.page_offset) % rs.page_size);
        const T* first = rs.row_ptr(s0);
        for (std::int64_t i = 0; i < run; ++i) {
          const T* row = first + i * rs.row_stride;
          if (rs.col_stride == 1 && row_finite(row, v.extent[3])) continue;
          const std::int64_t s = s0 + i;
          for (std::int64_t c = 0; c < v.extent[3]; ++c)
            if (!is_finite_value(row[c * rs.col_stride]))
              return status::error(errc::non_finite_input, "%s(b=%lld, h=%lld, s=%lld, d=%lld) = %g (page %d) is not finite", name,
                                   static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(s),
                                   static_cast<long long>(c), static_cast<double>(to_float(row[c * rs.col_stride])),
                                   rs.pages[(s + rs.page_offset) / rs.page_size]);
        }
        s0 += run;
      }
    }
  return {};
}

/// A paged cache's page table against its pool and lengths (its shape, then
/// kvevict::detail::check_page_table with its duplicate check in `seen`:
/// page_table_check_bytes(in) bytes, from the plan's host scratch or run()'s workspace).
template <class T>
inline status check_pages(const layer_inputs<T>& in, unsigned char* seen) {
  if (!in.paged()) return {};
  KVEVICT_TRY(kvevict::detail::validate_page_table_shape(in));
  return kvevict::detail::check_page_table(in, seen, kvevict::detail::page_table_check_bytes(in));
}

}  // namespace detail
}  // namespace cpu

/// CPU evictor. Thread-safe for concurrent run() calls with separate workspaces and outputs.
/// See kvevict/evictor.hpp for the lifecycle, frontend/plan.hpp for plan / run, and
/// docs/semantics.md for the rules.
template <class Policy>
class evictor<Policy, cpu::backend> : public kvevict::detail::evictor_base<evictor<Policy, cpu::backend>, Policy> {
  using FE = kvevict::detail::frontend<Policy>;
  using api_base = kvevict::detail::evictor_base<evictor<Policy, cpu::backend>, Policy>;
  static_assert(FE::composition_ok, "kvevict: the stages of this policy do not compose (see the message above)");

 public:
  using typename api_base::params_type;
  using typename api_base::Scorer;
  using typename api_base::Spatial;
  using typename api_base::Budgeter;
  using typename api_base::Selector;
  using api_base::out_heads;
  using api_base::params;
  using api_base::run;
  /// CriticalKV: the scorer writes a secondary row (||v W_O^h||_1) that the selector reads.
  static constexpr bool has_secondary = FE::has_secondary;
  /// The scorer computes a secondary row on its own (scorer_impl::secondary_row): the evictor
  /// computes it per row where the selector reads it, and holds no secondary row per head.
  static constexpr bool lazy_secondary = cpu::detail::lazy_secondary<has_secondary, Scorer>::value;
  /// DefensiveKV: the scorer's rows are finished by one pass over the KV heads of each sequence
  /// (scorer_impl::combine_heads), which reads the aux rows the scorer wrote beside them.
  static constexpr bool combines_heads = kvevict::detail::scorer_combines_heads<Scorer>::value;
  static_assert(!combines_heads || std::is_same<Spatial, spatial::none>::value,
                "kvevict: a scorer that combines the heads of a sequence (combines_heads, e.g. scorers::defensive_attention) "
                "finishes its rows itself: use spatial::none (a smoother would re-pool the final scores)");

  explicit evictor(params_type p = Policy::defaults(), cpu::backend be = {}) : api_base(p), be_(be) {}

  /// Plan one layer (CUTLASS initialize / FlashInfer plan): validates parameters, shapes, budget
  /// and lengths, the scorer's tables (check_layer) and the whole-layer budgets; fixes the thread
  /// count, the workspace size and the exact kept count (frontend/plan.hpp). On error *out is
  /// untouched.
  template <class T>
  status plan(const layer_inputs<T>& in, const budget_request& budget, eviction_plan* out, const plan_options& opt = {}) const;

  /// Bytes of workspace run() needs for these shapes (independent of the data and the budget)
  /// with the threads plan_options gives (default: the backend's, or OpenMP's at this call).
  template <class T>
  std::size_t workspace_size(const layer_inputs<T>& in, const plan_options& opt = {}) const {
    return workspace_bytes(in, resolve_threads(opt));
  }

  /// Select the tokens to keep for one layer with a plan of this evictor for these shapes.
  /// Repeats none of plan()'s checks; reads the data: the lengths' range (O(batch * kv_heads):
  /// a plan may be reused with new lengths) and, with check_finite, the NaN/inf scan.
  /// @param out        caller-allocated CSR (rows = batch * out_heads(in)); capacity >= the kept count
  /// @param workspace  at least plan.workspace_bytes bytes, any alignment is fixed up internally
  /// @param maybe_scores optional fp32 (batch, out_heads, seq): the final (reduced, smoothed)
  ///                   scores; entries of pass-through heads and protected slots are 0. With
  ///                   selectors::two_stage these are the primary (attention) scores, the ones
  ///                   stage 1 and the budgeter rank.
  /// On error nothing is written to out or maybe_scores.
  template <class T>
  status run(const eviction_plan& pl, const layer_inputs<T>& in, selection_view out, void* workspace, std::size_t workspace_bytes,
             float* maybe_scores = nullptr) const {
    return run_impl(pl, in, out, workspace, workspace_bytes, maybe_scores, nullptr, nullptr);
  }

  /// run() for a layer whose KV heads are split over the ranks of `comm` (tensor parallelism;
  /// docs/distributed.md). Every rank of the group calls it for the same layer, with a plan made
  /// with plan_options::sharded, its own heads (in: this rank's kv_heads = shard.num_heads
  /// heads; its queries, if any, those heads' query heads) and the same budget and policy
  /// parameters. Each rank scores and smooths its own heads; the head-wise budgeters allocate
  /// over the whole layer by a few collectives (AdaKV / CriticalAdaKV: 8 rounds, LKV-H and the
  /// per-head budgeters: 3; kvevict/distributed/exchange.hpp), so every rank's selection equals
  /// the single-process selection of its heads, bit for bit. out: this rank's rows
  /// (batch * shard.num_heads * G, row b * H + h). stats (optional): the rounds and bytes.
  /// Errors: any rank's error (bad inputs, a shard outside [0, global_kv_heads) or holding a head
  /// twice, ranks that disagree on the layer, budget or budgeter parameters, heads held by no
  /// rank or by two, a selection capacity too small on one rank) is returned on every rank, none
  /// left waiting in a collective, and then no rank writes its selection. Errors of the
  /// communicator itself (null, device buffers, a bad rank or size) are returned at once: they
  /// hold for the whole group. A failed collective is returned with this rank's number. On error
  /// out is untouched. Host memory: O(batch * global rows) beside the workspace.
  template <class T>
  status run_sharded(const eviction_plan& pl, const layer_inputs<T>& in, distributed::communicator* comm, const distributed::shard& sh,
                     selection_view out, void* workspace, std::size_t workspace_bytes, float* maybe_scores = nullptr,
                     distributed::exchange_stats* stats = nullptr) const {
    distributed::detail::layer_exchange ex(comm, sh, stats);
    return run_impl(pl, in, out, workspace, workspace_bytes, maybe_scores, &ex, &sh);
  }

  /// Convenience overload that allocates its own workspace (std::vector).
  template <class T>
  status run(const layer_inputs<T>& in, const budget_request& budget, selection_view out, float* maybe_scores = nullptr) const {
    eviction_plan pl;
    KVEVICT_TRY(plan(in, budget, &pl));
    std::vector<unsigned char> ws(pl.workspace_bytes + kvevict::detail::workspace_carver::alignment);
    void* aligned = kvevict::detail::workspace_carver::align_up(ws.data());
    return run(pl, in, out, aligned, ws.size() - static_cast<std::size_t>(static_cast<unsigned char*>(aligned) - ws.data()),
               maybe_scores);
  }

 private:
  template <class Bu>
  using has_apportion = distributed::detail::has_apportion_budgets<Bu>;

  template <class T>
  status run_impl(const eviction_plan& pl, const layer_inputs<T>& in, selection_view out, void* workspace, std::size_t workspace_bytes,
                  float* maybe_scores, distributed::detail::layer_exchange* ex, const distributed::shard* sh) const;

  struct buffers;
  /// Sharded score-driven budgets: the global winners (exchange rounds 3-7), the budgeter's
  /// apportioning over the global rows (the single-device code), this rank's slice.
  status sharded_score_budgets(distributed::detail::layer_exchange& ex, buffers& buf, std::int64_t B, std::int64_t H,
                               std::int64_t S) const {
    std::vector<const float*> rowptr(static_cast<std::size_t>(B * H));
    for (std::int64_t r = 0; r < B * H; ++r) rowptr[static_cast<std::size_t>(r)] = buf.need[r] ? buf.scores + r * S : nullptr;
    return distributed::detail::local_score_budgets<Budgeter>(ex, p_.budgeter, rowptr.data(), B, H, buf.budgets);
  }

  struct buffers {
    int nt = 1;  ///< threads of this run
    kvevict::detail::head_plan* plans;
    std::int64_t* budgets;
    std::int64_t* offsets;
    std::uint8_t* need;
    double* drift;
    float* scores;
    float* grows;
    double* gdrift;
    float* aux;        ///< combines_heads: per out row, aux_kept rows of stride S (reduced over the group)
    double* aux_stat;  ///< combines_heads: per out row, the scorer's statistic (mean over the group)
    float* gaux;       ///< combines_heads: per thread, aux_rows x G rows of L floats (head_job::aux)
    double* gaux_stat; ///< combines_heads: per thread, G statistics
    float* tmp;
    double* pre;
    std::int64_t* dq;
    std::int32_t* idx;
    float* scores2;  ///< secondary rows (B * out_heads, S), scorers with secondary_scores only;
                     ///< lazy_secondary: one row per sequence (B, S), gqa = layer_mean only
    float* grows2;   ///< per-thread secondary rows of one GQA group (G, S)
    float* u_row;    ///< lazy_secondary: per-thread secondary row of the row being selected (S)
    float* u_g;      ///< lazy_secondary: per-thread secondary rows of its GQA group (G, S)
    double* u_acc;   ///< lazy_secondary with layer_mean: the fp64 sum over heads (S)
    float* u_v;      ///< lazy_secondary: per-thread value tile (value_norm_token_block x d)
    float* u_w;      ///< lazy_secondary: per-thread W_O slice (C x d)
    float* u_p;      ///< lazy_secondary: per-thread projected values (value_norm_token_block x C)
    std::int64_t u_vn, u_wn, u_pn;  ///< their floats per thread
    /// The scratch secondary_row needs on thread tid (head_scratch's vbuf, wbuf, pbuf).
    cpu::detail::head_scratch u_scratch(int tid) const {
      cpu::detail::head_scratch s;
      s.vbuf = u_v + tid * u_vn;
      s.wbuf = u_w + tid * u_wn;
      s.pbuf = u_p + tid * u_pn;
      return s;
    }
    typename kvevict::detail::layer_scratch_of<Budgeter>::type layer;  ///< whole-layer budgeter's scratch
    /// nt per-thread scratch descriptors, in the workspace (an array of max_scratch_threads here
    /// made every run zero and copy 40 KB, three times: half of a small call's time in C++)
    cpu::detail::head_scratch* scratch;
  };

  /// lazy_secondary: the secondary row of out row ho of sequence b (L tokens), tokens [t0, t1), into
  /// u[t0, t1): the query head's own row (Gout == Gq), or the group's rows (ug: Gq rows of
  /// t1 - t0) reduced as reduce_group_secondary.
  template <class T>
  void secondary_of_row(const layer_inputs<T>& in, std::int64_t b, std::int64_t ho, std::int64_t Gq, std::int64_t Gout, std::int64_t L,
                        std::int64_t t0, std::int64_t t1, float* ug, cpu::detail::head_scratch& s, float* u) const {
    if (Gout == Gq) {
      cpu::scorer_impl<Scorer>::secondary_row(in, b, ho, L, t0, t1, s, u + t0);
      return;
    }
    const std::int64_t hk = ho / Gout, n = t1 - t0;
    for (std::int64_t g = 0; g < Gq; ++g) cpu::scorer_impl<Scorer>::secondary_row(in, b, hk * Gq + g, L, t0, t1, s, ug + g * n);
    cpu::detail::reduce_group_secondary(p_.gqa == gqa_reduction::layer_mean ? gqa_reduction::mean : p_.gqa, ug, Gq, 1, n, n, u + t0);
  }

  /// plan_options::num_threads resolved: the option, else the backend's, else OpenMP's; at most
  /// max_scratch_threads (the per-thread scratch of the workspace); 1 without OpenMP.
  int resolve_threads(const plan_options& opt) const {
    cpu::backend be = be_;
    if (opt.num_threads > 0) be.num_threads = opt.num_threads;
    return cpu::detail::max_threads(be);
  }

  template <class T>
  std::size_t workspace_bytes(const layer_inputs<T>& in, int nt) const;

  template <class T, class Carver>
  buffers carve_all(Carver& c, const layer_inputs<T>& in, int nt) const {
    buffers buf{};
    const std::int64_t B = in.batch(), H = out_heads(in), S = in.capacity();
    const std::int64_t rows = B * H;
    const std::int64_t Gq = in.queries.data ? in.group_size() : 1;
    buf.plans = c.template carve<kvevict::detail::head_plan>(static_cast<std::size_t>(rows));
    buf.budgets = c.template carve<std::int64_t>(static_cast<std::size_t>(rows));
    buf.offsets = c.template carve<std::int64_t>(static_cast<std::size_t>(rows));
    buf.need = c.template carve<std::uint8_t>(static_cast<std::size_t>(rows));
    buf.drift = c.template carve<double>(static_cast<std::size_t>(rows));
    buf.layer = kvevict::detail::layer_scratch_of<Budgeter>::carve(c, p_.budgeter);
    buf.scratch = c.template carve<cpu::detail::head_scratch>(static_cast<std::size_t>(nt));
    if (buf.scratch) std::uninitialized_default_construct_n(buf.scratch, nt);  // (null while counting bytes)
    if constexpr (Scorer::has_scores) {
      cpu::detail::head_scratch counting;  // what the descriptors carve while counting bytes
      auto scratch_of = [&](std::int64_t t) -> cpu::detail::head_scratch& { return buf.scratch ? buf.scratch[t] : counting; };
      buf.scores = c.template carve<float>(static_cast<std::size_t>(rows * S));
      if constexpr (lazy_secondary) {
        // one row per sequence (layer_mean) and its fp64 sum; the per-row rows are per thread below
        const bool lm = p_.gqa == gqa_reduction::layer_mean;
        buf.scores2 = c.template carve<float>(lm ? static_cast<std::size_t>(B * S) : 0);
        buf.u_acc = c.template carve<double>(lm ? static_cast<std::size_t>(S) : 0);
      } else if constexpr (has_secondary) {
        buf.scores2 = c.template carve<float>(static_cast<std::size_t>(rows * S));
      }
      buf.gdrift = c.template carve<double>(static_cast<std::size_t>(nt * Gq));
      if constexpr (combines_heads) {
        buf.aux = c.template carve<float>(static_cast<std::size_t>(rows * cpu::scorer_impl<Scorer>::aux_kept * S));
        buf.aux_stat = c.template carve<double>(static_cast<std::size_t>(rows));
        buf.gaux_stat = c.template carve<double>(static_cast<std::size_t>(nt * Gq));
      }
      // The per-thread scratch of the three phases shares the same bytes (run() never uses two
      // phases at once): scoring (the query-head rows of one GQA group and the per-head scratch,
      // head_scratch, whose logits block is bounded by the backend's score_block_bytes), then
      // smoothing (tmp, pre, dq), then selection (idx, tmp).
      const std::size_t start = c.mark();
      // The per-head scratch only for the threads the scoring loop can use: it runs over
      // B * kv_heads tasks, so at most that many threads exist there.
      const std::int64_t nt_heads = std::min<std::int64_t>(nt, std::max<std::int64_t>(B * in.kv_heads(), 1));
      buf.grows = c.template carve<float>(static_cast<std::size_t>(nt_heads * Gq * S));
      if constexpr (combines_heads)
        buf.gaux = c.template carve<float>(static_cast<std::size_t>(nt_heads * cpu::scorer_impl<Scorer>::aux_rows * Gq * S));
      if constexpr (has_secondary && !lazy_secondary) buf.grows2 = c.template carve<float>(static_cast<std::size_t>(nt_heads * Gq * S));
      const bool full_y = cpu::scorer_impl<Scorer>::full_projection(p_.scorer);
      cpu::detail::head_scratch::options so;
      so.full_y = full_y;
      so.block_bytes = be_.score_block_bytes;
      so.full_kv = cpu::scorer_impl<Scorer>::full_kv();
      so.all_queries = cpu::scorer_impl<Scorer>::all_queries();
      so.rows_max = cpu::scorer_impl<Scorer>::block_rows_max(in.window());
      so.drift_row = Spatial::needs_attention_drift;
      for (std::int64_t t = 0; t < nt_heads; ++t) scratch_of(t).carve(c, S, in.window(), in.head_dim(), Gq, so);
      if constexpr (cpu::scorer_impl<Scorer>::hidden_projection && !lazy_secondary) {
        const std::int64_t C = in.wo.data ? in.wo.extent[0] : 0;
        for (std::int64_t t = 0; t < nt_heads; ++t) scratch_of(t).carve_projection(c, C, in.head_dim());
      }
      const std::size_t scoring_end = c.mark();
      c.rewind(start);
      buf.tmp = c.template carve<float>(static_cast<std::size_t>(nt * S));
      buf.pre = c.template carve<double>(static_cast<std::size_t>(nt * (S + 1)));
      buf.dq = c.template carve<std::int64_t>(static_cast<std::size_t>(nt * S));
      buf.idx = c.template carve<std::int32_t>(static_cast<std::size_t>(nt * S));
      if constexpr (lazy_secondary) {
        // selection computes each row's secondary row: its group's rows, value tiles, W_O slice
        buf.u_row = c.template carve<float>(static_cast<std::size_t>(nt * S));
        const bool grouped = out_heads(in) != in.kv_heads() * Gq;  // the group's rows are reduced to one
        buf.u_g = c.template carve<float>(grouped ? static_cast<std::size_t>(nt * Gq * S) : 0);
        const std::int64_t C = std::max<std::int64_t>(in.wo.data ? in.wo.extent[0] : 0, 1), d = std::max<std::int64_t>(in.head_dim(), 1);
        buf.u_vn = cpu::detail::value_norm_token_block * d;
        buf.u_wn = C * d;
        buf.u_pn = cpu::detail::value_norm_token_block * C;
        buf.u_v = c.template carve<float>(static_cast<std::size_t>(nt * buf.u_vn));
        buf.u_w = c.template carve<float>(static_cast<std::size_t>(nt * buf.u_wn));
        buf.u_p = c.template carve<float>(static_cast<std::size_t>(nt * buf.u_pn));
      }
      c.resume(scoring_end);
    } else {
      buf.idx = c.template carve<std::int32_t>(static_cast<std::size_t>(nt * S));
    }
    return buf;
  }

  template <class T>
  bool shapes_ok(const layer_inputs<T>& in) const {
    if (in.paged() && !kvevict::detail::validate_page_table_shape(in).ok()) return false;
    if (!in.keys.data || in.keys.extent[0] < 1 || in.keys.extent[1] < 1 || in.keys.extent[2] < 0 || in.keys.extent[3] < 1)
      return false;
    if (in.queries.data && (in.queries.extent[1] < 1 || in.queries.extent[1] % in.keys.extent[1] != 0 ||
                            in.queries.extent[2] < 0 || in.queries.extent[2] > in.capacity()))
      return false;
    return true;
  }

  /// True when run() leaves K's scan to the scorer's own pass: a CPU implementation with
  /// detects_nonfinite_keys (key norm; the window-attention scorers, whose newest window row sees
  /// every valid key: they need a window of at least one row), not sharded (a sharded rank must
  /// know its status before the exchange's first round). Contiguous or paged alike.
  template <class T>
  static bool keys_checked_by_scorer(const layer_inputs<T>& in, bool sharded) {
    if constexpr (Scorer::has_scores) {
      if constexpr (cpu::detail::impl_detects_nonfinite_keys<cpu::scorer_impl<Scorer>>::value) {
        if (Scorer::window_attention && !(in.queries.data && in.window() >= 1)) return false;
        return !sharded;
      }
    }
    return false;
  }

  /// check_finite before scoring: without K when the scorer's pass checks it. An error there
  /// is reported as the whole scan would report it (K is named before V and the queries), so the
  /// message never depends on which pass found the element.
  template <class T>
  status check_finite_before_scoring(const layer_inputs<T>& in, bool sharded) const {
    if (!keys_checked_by_scorer(in, sharded)) return check_finite(in);
    const status s = check_finite(in, false);
    return s.ok() ? s : check_finite(in);
  }

  /// The NaN/inf scan of what the scorer reads (check_finite). scan_keys = false leaves K out
  /// (keys_checked_by_scorer).
  template <class T>
  status check_finite(const layer_inputs<T>& in, bool scan_keys = true) const {
    auto kv_rows = [&](std::int64_t b, std::int64_t h, std::int64_t* r0, std::int64_t* r1) {
      *r0 = 0;
      *r1 = in.length(b, h);
    };
    // Only what the scorer reads: a position-only scorer (scorers::none, StreamingLLM) reads no
    // key, so a non-finite key cannot change its selection and K is not scanned.
    if (Scorer::has_scores && scan_keys)
      KVEVICT_TRY(in.paged() ? cpu::detail::scan_finite_paged(in, in.keys, "keys") : cpu::detail::scan_finite(in.keys, "keys", kv_rows));
    if (Scorer::has_scores && in.values.data && Scorer::needs_values)
      KVEVICT_TRY(in.paged() ? cpu::detail::scan_finite_paged(in, in.values, "values")
                             : cpu::detail::scan_finite(in.values, "values", kv_rows));
    if (in.queries.data && Scorer::needs_queries) {
      const std::int64_t G = in.group_size(), W = in.window();
      KVEVICT_TRY(cpu::detail::scan_finite(in.queries, "queries", [&](std::int64_t b, std::int64_t hq, std::int64_t* r0, std::int64_t* r1) {
        *r0 = W - std::min<std::int64_t>(W, in.length(b, hq / G));
        *r1 = W;
      }));
    }
    if constexpr (FE::needs_wo_matrix) {
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

  using api_base::p_;
  cpu::backend be_;
};

// The three members that instantiate the stages, defined outside the class: not inline, so that
// an explicit instantiation declaration (kvevict/backends/cpu/compiled.hpp, the compiled mode) keeps a
// user translation unit from instantiating them (a compiler may instantiate an inline function
// for inlining even when it is declared extern).
template <class Policy>
template <class T>
status evictor<Policy, cpu::backend>::plan(const layer_inputs<T>& in, const budget_request& budget, eviction_plan* out, const plan_options& opt) const {
  typename FE::plan_request rq = this->owned_request();
  rq.lengths = in.lengths.data;
  rq.lengths_stride[0] = in.lengths.stride[0];
  rq.lengths_stride[1] = in.lengths.stride[1];
  rq.num_threads = resolve_threads(opt);
  rq.sharded = opt.sharded;
  auto backend_check = [&]() -> status {
    if constexpr (FE::kind == kvevict::detail::budget_kind::score_driven && !has_apportion<Budgeter>::value) {
      if (opt.sharded)
        return status::error(errc::not_supported, "budgeter %s has no apportion_budgets: it cannot allocate over a sharded layer",
                             Budgeter::name);
    }
    if (opt.num_threads < 0)
      return status::error(errc::invalid_argument, "plan_options.num_threads = %d must be >= 0 (0: the backend's default)",
                           opt.num_threads);
    if constexpr (combines_heads) {
      if (p_.gqa != gqa_reduction::mean)
        return status::error(errc::invalid_argument, "gqa = %s: scorer %s aggregates the GQA group itself; use gqa_reduction::mean",
                             to_string(p_.gqa), Scorer::name);
      if (opt.sharded)
        return status::error(errc::not_supported, "scorer %s combines the KV heads of a sequence: it cannot run over a sharded layer",
                             Scorer::name);
    }
    if (in.paged()) {  // plan time: host scratch, as kept_total's
      std::vector<unsigned char> seen(static_cast<std::size_t>(kvevict::detail::page_table_check_bytes(in)));
      KVEVICT_TRY(cpu::detail::check_pages(in, seen.data()));
    }
    if constexpr (Scorer::has_scores) {
      // The policy's own table check (check_layer(params, kv_heads, head_dim, layer, num_layers),
      // e.g. LKV-T's host tables), then the CPU implementation's.
      if constexpr (cpu::detail::has_check_layer<Scorer>::value)
        KVEVICT_TRY(Scorer::check_layer(p_.scorer, in.kv_heads(), in.head_dim(), in.layer_idx, in.num_layers));
      return cpu::scorer_impl<Scorer>::check_layer(p_.scorer, in);
    }
    return {};
  };
  return FE::make_plan(in, p_, budget, rq, backend_check, [&](int nt) { return workspace_bytes(in, nt); }, out);
}

template <class Policy>
template <class T>
status evictor<Policy, cpu::backend>::run_impl(const eviction_plan& pl, const layer_inputs<T>& in, selection_view out, void* workspace,
                                              std::size_t workspace_bytes, float* maybe_scores,
                                              distributed::detail::layer_exchange* ex, const distributed::shard* sh) const {
  const cpu::detail::thread_scope threads_of_the_plan(pl.num_threads);  // no nested parallelism (Eigen) inside
  const std::int64_t B = in.batch(), Hkv = in.kv_heads(), H = out_heads(in), S = in.capacity();
  const std::int64_t Gq = in.queries.data ? in.group_size() : 1;  // query heads per KV head
  const std::int64_t Gout = Hkv > 0 ? H / Hkv : 1;                 // out rows per KV head (Hkv = 0: refused below)
  const std::int64_t rows = B * H;
  const budget_request& budget = pl.budget;
  auto len = [&](std::int64_t b, std::int64_t h) { return in.length(b, h); };
  buffers buf{};
  // Checks and step 1. Sharded, an error here is this rank's status in the exchange's first
  // round (every rank learns it there), so nothing returns before the exchange.
  const status local = [&]() -> status {
    if (pl.sharded != (ex != nullptr))
      return status::error(errc::invalid_argument, pl.sharded ? "plan was made with plan_options::sharded: call run_sharded()"
                                                              : "run_sharded() needs a plan made with plan_options::sharded");
    // The plan's thread count, within the per-thread scratch the workspace can hold; the
    // workspace those threads and the current parameters need (O(threads) to count), never less
    // than the plan's: a plan cannot make run() write past the caller's memory.
    const int nt = std::max(1, std::min(pl.num_threads, cpu::detail::max_scratch_threads));
    KVEVICT_TRY(this->check_run_args(pl, in, out, workspace, workspace_bytes, std::max(pl.workspace_bytes, this->workspace_bytes(in, nt))));
    if (ex) KVEVICT_TRY(distributed::detail::layer_exchange::check_local(*sh, Hkv));
    kvevict::detail::workspace_carver c(kvevict::detail::workspace_carver::align_up(workspace));
    // The page table's duplicate check first, in the workspace (a plan may be reused with a new
    // table of the same shape); its bytes are free again for the buffers.
    const auto table_mark = c.mark();
    KVEVICT_TRY(cpu::detail::check_pages(in, c.template carve<unsigned char>(static_cast<std::size_t>(kvevict::detail::page_table_check_bytes(in)))));
    c.rewind(table_mark);
    if (in.lengths.data || in.paged()) KVEVICT_TRY(FE::check_length_range(in.batch(), in.kv_heads(), in.capacity(), len));
    KVEVICT_TRY(FE::check_layer_mean_lengths(p_, in.batch(), in.kv_heads(), len));
    if (p_.check_finite) KVEVICT_TRY(check_finite_before_scoring(in, ex != nullptr));
    buf = carve_all(c, in, nt);
    buf.nt = nt;
    // 1. plans, the budgets that need no scores, the "needs scoring" flags (front-end rules;
    // sharded, the whole-layer allocation waits for every rank's plans)
    for (std::int64_t b = 0; b < B; ++b) {
      const status s = FE::sequence_budgets(in, p_, budget, b, H, len, buf.plans + b * H, buf.budgets + b * H, buf.need + b * H,
                                            buf.layer, ex != nullptr);
      if (!s.ok()) {  // K left to the scorer: a non-finite key is still reported first, as by the scan before
        if (p_.check_finite && keys_checked_by_scorer(in, ex != nullptr)) KVEVICT_TRY(check_finite(in));
        return s;
      }
    }
    return {};
  }();
  if (ex) {
    KVEVICT_TRY(ex->agree(local, B, Gout, in.layer_idx, in.num_layers, distributed::detail::layer_terms_of<Policy>(p_, budget, in),
                          buf.plans));
    if constexpr (FE::kind == kvevict::detail::budget_kind::whole_layer) {
      // the whole-layer allocation over every rank's rows (the same on every rank); this rank's slice
      KVEVICT_TRY(distributed::detail::local_layer_budgets(
          *ex, B, H,
          [&](std::int64_t, const kvevict::detail::head_plan* gp, std::int64_t Hg, std::int64_t* gb) {
            return Budgeter::layer_budgets(p_.budgeter, budget, gp, Hg, sh->global_kv_heads, in.layer_idx, in.num_layers, gb, buf.layer);
          },
          buf.budgets));
      for (std::int64_t b = 0; b < B; ++b) FE::need_flags(p_, buf.plans + b * H, buf.budgets + b * H, H, buf.need + b * H);
    }
  } else {
    KVEVICT_TRY(local);
  }
  const int nt = buf.nt;
  bool any_scoring = false;
  for (std::int64_t r = 0; r < rows; ++r) any_scoring = any_scoring || buf.need[r];
  // K checked by the scorer's own pass (keys_checked_by_scorer): the flags start clear, and after
  // scoring a set flag or a head the scorer did not read sends run() to the K scan.
  const bool fused_key_check = p_.check_finite && keys_checked_by_scorer(in, ex != nullptr);
  for (int t = 0; t < nt; ++t) buf.scratch[t].nonfinite_keys = false;

  // 2. scoring + GQA reduction (per (sequence, KV head)), then smoothing (per row)
  if constexpr (Scorer::has_scores) {
    if (any_scoring) {
      cpu::detail::parallel_for_threads(nt, B * Hkv, [&](std::int64_t task, int tid) {
        const std::int64_t b = task / Hkv, h = task % Hkv;
        bool any_row = false;
        for (std::int64_t g = 0; g < Gout; ++g) any_row = any_row || buf.need[b * H + h * Gout + g];
        if (!any_row) return;
        const std::int64_t L = in.length(b, h);
        cpu::detail::head_job<Policy, T> job{&in, &p_, b, h, L, std::min<std::int64_t>(in.window(), L), 0};
        job.rows_per_block = cpu::detail::block_rows(be_.score_block_bytes, Gq, L, job.w);
        if constexpr (Spatial::needs_attention_drift) {
          const auto& hp = buf.plans[b * H + h * Gout];
          job.drift_topk = std::max<std::int64_t>(1, hp.base_budget - job.w);
        }
        float* grows = buf.grows + static_cast<std::int64_t>(tid) * Gq * S;
        double* gdrift = buf.gdrift + static_cast<std::int64_t>(tid) * Gq;
        float* grows2 = (has_secondary && !lazy_secondary) ? buf.grows2 + static_cast<std::int64_t>(tid) * Gq * S : nullptr;
        std::fill(gdrift, gdrift + Gq, 0.0);  // a scorer that computes no drift leaves 0 (adaptive-window reads it)
        if constexpr (combines_heads) {
          job.aux = buf.gaux + static_cast<std::int64_t>(tid) * cpu::scorer_impl<Scorer>::aux_rows * Gq * S;
          job.aux_stat = buf.gaux_stat + static_cast<std::int64_t>(tid) * Gq;
        }
        cpu::scorer_impl<Scorer>::template score<Policy, T>(job, buf.scratch[tid], grows, gdrift, grows2);
        const std::int64_t r0 = b * H + h * Gout;  // the KV head's first out row
        if constexpr (combines_heads) {
          // the scorer wrote its group's row to every query head (plan() requires gqa mean, Gout = 1):
          // row 0 as is (no fp32 re-averaging); the aux blocks and statistics reduced over the group
          std::copy(grows, grows + L, buf.scores + r0 * S);
          buf.drift[r0] = 0.0;
          double st = 0.0;
          for (std::int64_t g = 0; g < Gq; ++g) st += job.aux_stat[g];
          buf.aux_stat[r0] = st / static_cast<double>(Gq);
          for (int k = 0; k < cpu::scorer_impl<Scorer>::aux_kept; ++k)
            cpu::detail::reduce_group_secondary(gqa_reduction::mean, job.aux + k * Gq * L, Gq, 1, L, S,
                                                buf.aux + (r0 * cpu::scorer_impl<Scorer>::aux_kept + k) * S);
          return;
        }
        if constexpr (has_secondary && !lazy_secondary)
          cpu::detail::reduce_group_secondary(p_.gqa, grows2, Gq, Gout, L, S, buf.scores2 + r0 * S);
        cpu::detail::reduce_group(p_.gqa, grows, gdrift, Gq, Gout, L, S, buf.scores + r0 * S, buf.drift + r0);
      });
      if (fused_key_check) {
        bool bad = false;
        for (int t = 0; t < nt; ++t) bad = bad || buf.scratch[t].nonfinite_keys;
        if (bad) {  // the scan names the element, exactly as before scoring; nothing written yet
          KVEVICT_TRY(check_finite(in));
          return status::error(errc::non_finite_input, "keys: a non-finite key (the scorer's pass)");  // not reached
        }
      }
      if constexpr (combines_heads) {
        // once per sequence, over its heads (per-thread scratch of the smoothing phase: pre, idx)
        cpu::detail::parallel_for_threads(nt, B, [&](std::int64_t b, int tid) {
          cpu::scorer_impl<Scorer>::combine_heads(p_.scorer, buf.plans + b * H, buf.need + b * H, in.window(), H, S,
                                                  buf.scores + b * H * S, buf.aux + b * H * cpu::scorer_impl<Scorer>::aux_kept * S,
                                                  buf.aux_stat + b * H, buf.pre + static_cast<std::int64_t>(tid) * (S + 1),
                                                  buf.idx + static_cast<std::int64_t>(tid) * S);
        });
      }
      if (p_.gqa == gqa_reduction::layer_mean) {
        for (std::int64_t b = 0; b < B; ++b) {
          if (!buf.need[b * H]) continue;
          cpu::detail::layer_mean_rows(buf.scores + b * H * S, buf.drift + b * H,
                                       (has_secondary && !lazy_secondary) ? buf.scores2 + b * H * S : nullptr, H, in.length(b, 0), S);
        }
      }
      cpu::detail::parallel_for_threads(nt, rows, [&](std::int64_t r, int tid) {
        if (!buf.need[r]) return;
        if constexpr (kvevict::detail::temporal_floor_at_mean<typename Policy::temporal_smoother>::value) {
          // temporal::defensive: the reduced row floored at its mean over the candidates n < L - w
          const std::int64_t L = buf.plans[r].length, Lc = L - std::min<std::int64_t>(in.window(), L);
          cpu::detail::floor_at_mean(buf.scores + r * S, Lc);
        }
        cpu::spatial_impl<Spatial>::smooth(p_.spatial, buf.scores + r * S, buf.plans[r].evictable_end(), buf.drift[r],
                                           buf.tmp + static_cast<std::int64_t>(tid) * S,
                                           buf.pre + static_cast<std::int64_t>(tid) * (S + 1),
                                           buf.dq + static_cast<std::int64_t>(tid) * S);
      });
    }
  }

  if (fused_key_check) {  // the heads whose keys the scorer did not read (kept whole): the K scan
    auto scored = [&](std::int64_t b, std::int64_t h) {
      bool any = false;
      for (std::int64_t g = 0; g < Gout; ++g) any = any || buf.need[b * H + h * Gout + g];
      return any_scoring && any;
    };
    if (in.paged()) {
      KVEVICT_TRY(cpu::detail::scan_finite_paged(in, in.keys, "keys", [&](std::int64_t b, std::int64_t h) { return !scored(b, h); }));
    } else {
      KVEVICT_TRY(cpu::detail::scan_finite(in.keys, "keys", [&](std::int64_t b, std::int64_t h, std::int64_t* r0, std::int64_t* r1) {
        *r0 = 0;
        *r1 = scored(b, h) ? 0 : in.length(b, h);
      }));
    }
  }

  // 3. score-driven budgets (the budgeter's CPU implementation moves budget between heads)
  if constexpr (FE::kind == kvevict::detail::budget_kind::score_driven) {
    if (ex) {
      if constexpr (has_apportion<Budgeter>::value) {
        KVEVICT_TRY(sharded_score_budgets(*ex, buf, B, H, S));
      } else {  // plan() refuses such a plan; a hand-made one is refused here (on every rank alike)
        return status::error(errc::not_supported, "budgeter %s has no apportion_budgets: it cannot allocate over a sharded layer",
                             Budgeter::name);
      }
    } else {
    std::vector<const float*> rowptr(static_cast<std::size_t>(H));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < H; ++h) rowptr[static_cast<std::size_t>(h)] = buf.scores + (b * H + h) * S;
      cpu::budgeter_impl<Budgeter>::score_budgets(p_.budgeter, buf.plans + b * H, rowptr.data(), H, buf.budgets + b * H);
    }
    }
  }

  // 4. capacity, then selection
  std::int64_t total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    buf.offsets[r] = total;
    total += FE::kept(buf.plans[r], buf.budgets[r]);
  }
  const status fits = kvevict::detail::check_kept_total(total, out.capacity);
  if (ex) KVEVICT_TRY(ex->finish(fits));  // sharded: every rank writes, or none
  KVEVICT_TRY(fits);
  if constexpr (lazy_secondary) {
    // layer_mean: one secondary row per sequence, the fp64 mean of its heads' rows in head order,
    // computed in parallel over token ranges (aligned to the value-norm blocks)
    if (p_.gqa == gqa_reduction::layer_mean) {
      for (std::int64_t b = 0; b < B; ++b) {
        if (!buf.need[b * H]) continue;
        const std::int64_t L = in.length(b, 0);
        constexpr std::int64_t blk = cpu::detail::value_norm_token_block;
        const std::int64_t chunk = std::max<std::int64_t>(blk, (L + nt * blk - 1) / (nt * blk) * blk);
        const std::int64_t nchunks = (L + chunk - 1) / chunk;
        cpu::detail::parallel_for_threads(nt, nchunks, [&](std::int64_t ci, int tid) {
          const std::int64_t t0 = ci * chunk, t1 = std::min(L, t0 + chunk);
          double* acc = buf.u_acc;
          float* u = buf.u_row + static_cast<std::int64_t>(tid) * S;
          cpu::detail::head_scratch us = buf.u_scratch(tid);
          std::fill(acc + t0, acc + t1, 0.0);
          for (std::int64_t ho = 0; ho < H; ++ho) {
            secondary_of_row(in, b, ho, Gq, Gout, L, t0, t1, Gout == Gq ? nullptr : buf.u_g + static_cast<std::int64_t>(tid) * Gq * S, us, u);
            for (std::int64_t n = t0; n < t1; ++n) acc[n] += u[n];
          }
          float* u0 = buf.scores2 + b * S;
          for (std::int64_t n = t0; n < t1; ++n) u0[n] = static_cast<float>(acc[n] / static_cast<double>(H));
        });
      }
    }
  }
  // Rows without scores (StreamingLLM, heads kept whole) write their kept slots in O(kept): up
  // to 64k slots in all on the calling thread, where waking a team would cost more than the
  // rows (tens of microseconds with OMP_WAIT_POLICY=passive). The result does not depend on the
  // threads.
  const int select_threads = ((Scorer::has_scores && any_scoring) || total > (std::int64_t{1} << 16)) ? nt : 1;
  cpu::detail::parallel_for_threads(select_threads, rows, [&](std::int64_t r, int tid) {
    const std::int64_t b = r / H, hk = (r % H) / Gout;
    std::int32_t* dst = out.indices + buf.offsets[r];
    const float* sc = (Scorer::has_scores && buf.need[r]) ? buf.scores + r * S : nullptr;
    const float* sc2 = nullptr;
    if constexpr (lazy_secondary) {
      if (sc && p_.gqa == gqa_reduction::layer_mean) {
        sc2 = buf.scores2 + b * S;
      } else if (sc) {
        float* u = buf.u_row + static_cast<std::int64_t>(tid) * S;
        cpu::detail::head_scratch us = buf.u_scratch(tid);
        const std::int64_t L = in.length(b, hk);
        secondary_of_row(in, b, r % H, Gq, Gout, L, 0, L, Gout == Gq ? nullptr : buf.u_g + static_cast<std::int64_t>(tid) * Gq * S, us,
                         u);
        sc2 = u;
      }
    } else if constexpr (has_secondary) {
      sc2 = buf.scores2 + r * S;
    }
    const std::int64_t n = cpu::selector_impl<Selector>::select(
        p_.selector, buf.plans[r], buf.budgets[r], sc, sc2, dst,
        buf.idx + static_cast<std::int64_t>(tid) * S, has_secondary ? buf.tmp + static_cast<std::int64_t>(tid) * S : nullptr);
    if (out.positions) {
      for (std::int64_t i = 0; i < n; ++i)
        out.positions[buf.offsets[r] + i] = in.positions.data ? in.positions(b, hk, dst[i]) : dst[i];
    }
  });
  out.indptr[0] = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    out.indptr[r + 1] = static_cast<std::int32_t>(buf.offsets[r] + FE::kept(buf.plans[r], buf.budgets[r]));
  if (maybe_scores) {
    for (std::int64_t r = 0; r < rows; ++r) {
      float* o = maybe_scores + r * S;
      std::fill(o, o + S, 0.0f);
      if (!(Scorer::has_scores && buf.need[r])) continue;
      const auto& hp = buf.plans[r];
      for (std::int64_t n = hp.sinks; n < hp.evictable_end(); ++n) o[n] = buf.scores[r * S + n];
    }
  }
  return {};
}

template <class Policy>
template <class T>
std::size_t evictor<Policy, cpu::backend>::workspace_bytes(const layer_inputs<T>& in, int nt) const {
  // Shapes that fail validation need no workspace (run() reports the error); this also keeps
  // the sizing arithmetic away from zero or negative extents.
  if (!shapes_ok(in)) return 0;
  kvevict::detail::workspace_carver c;
  carve_all(c, in, nt);
  // run() checks a paged cache's table in the same bytes first (one byte per page)
  if (c.bytes() < static_cast<std::size_t>(kvevict::detail::page_table_check_bytes(in))) {
    kvevict::detail::workspace_carver t;
    (void)t.template carve<unsigned char>(static_cast<std::size_t>(kvevict::detail::page_table_check_bytes(in)));
    return t.bytes() + kvevict::detail::workspace_carver::alignment;
  }
  // + alignment: run() aligns the caller's pointer itself, so any address works (and gives
  // the same results: Eigen's vectorised loops peel by address).
  return c.bytes() + kvevict::detail::workspace_carver::alignment;
}

}  // namespace kvevict
