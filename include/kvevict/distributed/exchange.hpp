// IWYU pragma: private, include "kvevict/distributed.hpp"
// The per-layer budget protocol of sharded eviction (docs/distributed.md), host code shared by
// the drivers: every rank of a layer's group holds some of its KV heads, scores and smooths them
// locally, and the head-wise budgeters' global allocation is found by a few small collectives.
//
//   round 1  all_gather, 7 + layer_terms::count int64 per rank: each rank's local status and what
//            it believes the layer is (global heads, batch, rows per head, layer) and the terms of
//            the call (layer_terms: GQA group, head_dim, window, storage dtype, budget, GQA
//            reduction, protection, the policy's stages, the budgeter's parameters). Any error, or
//            any disagreement, ends the call on every rank with the same verdict, naming the field.
//   round 2  all_reduce_sum, batch * global_kv_heads * (1 + 5 G) int64: the head plans of every
//            global row (length, base budget, sinks, recent, pass-through) and how many ranks
//            hold each head (must be exactly 1: overlapping or missing heads are an error).
//   AdaKV    rounds 3-6 all_reduce_sum, batch * 256 int64 each: a radix select of the layer's
//            T-th largest candidate score (8 bits per round, over order-preserving uint32 keys);
//            round 7 all_reduce_sum, batch * global rows * 2 int64: each row's candidates above
//            the threshold and at it. Ties at the threshold go to the lower global row, then the
//            lower slot, as on one device, so every rank computes the same winners per row.
//            Skipped (rounds 3-7) when no sequence needs a choice (T = 0 or all candidates win).
//   LKV-H    nothing more: the whole-model allocation runs on the gathered plans.
// Every rank then runs the single-device budget code on the global rows and keeps its slice.
//   last     all_gather, 1 int64 per rank: each rank's status after its budgets (its selection
//            capacity, the int32 range), so that every rank writes its selection or none does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/distributed/communicator.hpp"

namespace kvevict {
namespace distributed {
namespace detail {

/// Order-preserving key of a smoothed score for the radix select, matching the single-device
/// order (cpu::detail::adakv_budgets): larger score = larger key, -0 == +0, NaN below everything.
inline std::uint32_t score_key(float s) {
  if (!(s == s)) return 0u;
  if (s == 0.0f) s = 0.0f;  // -0 and +0 tie, as `a.s != b.s` says on one device
  std::uint32_t u;
  std::memcpy(&u, &s, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf -> 0x007fffff > 0 (NaN's key)
}

/// FNV-1a over bytes, folded into h.
inline std::uint64_t fnv1a(std::uint64_t h, const void* p, std::size_t n) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= c[i];
    h *= 1099511628211ull;
  }
  return h;
}

/// Fields of a head plan in round 2.
constexpr std::int64_t plan_fields = 5;

/// What every rank of a layer's group must agree on besides its shard (round 1), so that the
/// sharded selection equals one process's: compared field by field, a mismatch is refused on every
/// rank with the field's name and both values. Built by distributed::detail::layer_terms_of
/// (fingerprint.hpp) from the policy, the budget and the layer inputs.
struct layer_terms {
  std::int64_t group = 1;        ///< G: query heads per KV head (q_heads / kv_heads)
  std::int64_t head_dim = 0;     ///< d
  std::int64_t window = 0;       ///< observation-window query rows
  std::int64_t dtype = 0;        ///< K/V storage type: 0 fp32, 1 fp16, 2 bf16
  std::int64_t keep_tokens = 0;  ///< budget_request::keep_tokens
  double keep_fraction = 0.0;    ///< budget_request::keep_fraction
  std::int64_t gqa = 0;          ///< gqa_reduction
  std::int64_t num_sink = 0;     ///< selector protection (0 when the selector has none)
  std::int64_t num_recent = 0;
  float recent_share = 0.0f;
  std::uint64_t policy = 0;    ///< FNV-1a of the policy's stage names (scorer, smoothers, budgeter, selector; not their parameters)
  std::uint64_t budgeter = 0;  ///< FNV-1a of the budgeter's parameters (LKV-H: its table's content)
  static constexpr int count = 12;
  /// Field i as an int64 (doubles and floats by their bits: equal values compare equal, as no NaN
  /// passes the checks before round 1).
  std::int64_t field(int i) const {
    switch (i) {
      case 0: return group;
      case 1: return head_dim;
      case 2: return window;
      case 3: return dtype;
      case 4: return keep_tokens;
      case 5: { std::int64_t b; std::memcpy(&b, &keep_fraction, sizeof b); return b; }
      case 6: return gqa;
      case 7: return num_sink;
      case 8: return num_recent;
      case 9: { std::int32_t b; std::memcpy(&b, &recent_share, sizeof b); return b; }
      case 10: return static_cast<std::int64_t>(policy);
      default: return static_cast<std::int64_t>(budgeter);
    }
  }
  static const char* name(int i) {
    static const char* const n[count] = {"the GQA group size (q_heads / kv_heads)",
                                         "head_dim",
                                         "the observation window (query rows)",
                                         "the K/V storage dtype",
                                         "budget.keep_tokens",
                                         "budget.keep_fraction",
                                         "params.gqa",
                                         "selector.num_sink",
                                         "selector.num_recent",
                                         "selector.recent_share",
                                         "the policy's stages (the names of its scorer, smoothers, budgeter and selector)",
                                         "the budgeter's parameters"};
    return n[i];
  }
  /// Field i's value as a user reads it, into buf.
  static void format(int i, std::int64_t v, char* buf, std::size_t n) {
    if (i == 3) {
      std::snprintf(buf, n, "%s", v == 0 ? "fp32" : v == 1 ? "fp16" : v == 2 ? "bf16" : "?");
    } else if (i == 5) {
      double d;
      std::memcpy(&d, &v, sizeof d);
      std::snprintf(buf, n, "%g", d);
    } else if (i == 9) {
      const std::int32_t b = static_cast<std::int32_t>(v);
      float f;
      std::memcpy(&f, &b, sizeof f);
      std::snprintf(buf, n, "%g", static_cast<double>(f));
    } else if (i == 6) {
      static const char* const g[4] = {"mean", "max", "per_query_head", "layer_mean"};
      std::snprintf(buf, n, "%s", v >= 0 && v < 4 ? g[v] : "?");
    } else if (i >= 10) {
      std::snprintf(buf, n, "hash %016llx", static_cast<unsigned long long>(v));
    } else {
      std::snprintf(buf, n, "%lld", static_cast<long long>(v));
    }
  }
};

/// One layer's exchange on one rank. Construct, then agree() (rounds 1-2), then for AdaKV
/// winners() (rounds 3-7). Allocates O(batch * global rows) host memory.
class layer_exchange {
 public:
  layer_exchange(communicator* comm, const shard& sh, exchange_stats* stats) : comm_(comm), sh_(sh), stats_(stats) {
    if (stats_) *stats_ = exchange_stats{};
  }

  /// The communicator itself: not null, a valid rank and size, host buffers. A property of the
  /// whole group (every rank passes the same kind of communicator), so its error is returned
  /// before any collective, on every rank that has it.
  static status check_group(const communicator* comm) {
    if (!comm) return status::error(errc::null_pointer, "communicator is null");
    if (comm->size() < 1 || comm->rank() < 0 || comm->rank() >= comm->size())
      return status::error(errc::invalid_argument, "communicator rank() = %d, size() = %d", comm->rank(), comm->size());
    if (comm->space() != memory_space::host)
      return status::error(errc::not_supported, "communicator.space() = device: this backend exchanges host buffers");
    return {};
  }

  /// This rank's shard against its layer: global_kv_heads >= 1, num_heads = the layer's local KV
  /// heads, heads in [0, global_kv_heads) and distinct. Its error becomes this rank's round-1
  /// status (every rank learns it).
  static status check_local(const shard& sh, std::int64_t local_kv_heads) {
    if (sh.global_kv_heads < 1)
      return status::error(errc::invalid_argument, "shard.global_kv_heads = %d must be >= 1", sh.global_kv_heads);
    if (sh.num_heads != local_kv_heads)
      return status::error(errc::shape_mismatch, "shard.num_heads = %d != the layer's local kv_heads = %lld", sh.num_heads,
                           static_cast<long long>(local_kv_heads));
    if (sh.num_heads > 0 && !sh.heads) return status::error(errc::null_pointer, "shard.heads is null");
    for (std::int32_t h = 0; h < sh.num_heads; ++h) {
      if (sh.heads[h] < 0 || sh.heads[h] >= sh.global_kv_heads)
        return status::error(errc::invalid_argument, "shard.heads[%d] = %d is outside [0, global_kv_heads = %d)", h, sh.heads[h],
                             sh.global_kv_heads);
      for (std::int32_t j = 0; j < h; ++j)
        if (sh.heads[j] == sh.heads[h])
          return status::error(errc::invalid_argument, "shard.heads[%d] = shard.heads[%d] = %d (a head held twice)", j, h, sh.heads[h]);
    }
    return {};
  }

  /// Rounds 1-2. local: this rank's status so far (its error is reported on every rank);
  /// plans: (batch, num_heads * gout) local head plans (read only when local is ok).
  /// terms: what must agree across ranks (layer_terms). On success global_plans() holds
  /// (batch, global_kv_heads * gout) plans. A disagreement: errc::invalid_argument on every rank,
  /// "ranks disagree on <field>: rank 0 has <value>, rank r has <value>" (the first field, the
  /// lowest rank that differs from rank 0).
  status agree(status local, std::int64_t batch, std::int64_t gout, int layer_idx, int num_layers, const layer_terms& terms,
               const kvevict::detail::head_plan* plans) {
    KVEVICT_TRY(check_group(comm_));  // nobody can be told: a property of the whole group
    if (local.ok()) local = check_local(sh_, sh_.num_heads);
    const int P = comm_->size(), me = comm_->rank();
    constexpr int base = 7, N = base + layer_terms::count;
    std::int64_t mine[N] = {local.ok() ? 0 : static_cast<std::int64_t>(local.code()), sh_.global_kv_heads, sh_.num_heads, batch,
                            gout, layer_idx, num_layers};
    for (int i = 0; i < layer_terms::count; ++i) mine[base + i] = terms.field(i);
    std::vector<std::int64_t> all(static_cast<std::size_t>(P) * N);
    KVEVICT_TRY(collective(comm_->all_gather(mine, N, all.data()), N));
    // The lowest failing rank's error is every rank's: the same category on every rank, also when
    // several ranks fail for different reasons (each names its own as well).
    for (int r = 0; r < P; ++r)
      if (all[r * N] != 0) {
        if (r == me) return local;
        const errc code = static_cast<errc>(all[r * N]);
        if (local.ok())
          return status::error(code, "rank %d of %d failed (%s); rank %d did not run the layer", r, P, to_string(code), me);
        return status::error(code, "rank %d of %d failed (%s); rank %d did not run the layer either: %s", r, P, to_string(code), me,
                             local.message());
      }
    static const char* field[base] = {"status", "shard.global_kv_heads", "", "batch", "out rows per KV head", "layer_idx", "num_layers"};
    std::int64_t held = 0;
    for (int f = 1; f < N; ++f)
      for (int r = 1; r < P; ++r) {
        const std::int64_t a = all[f], v = all[static_cast<std::size_t>(r) * N + f];
        if (f == 2 || v == a) continue;
        if (f < base)
          return status::error(errc::invalid_argument, "ranks disagree on %s: rank 0 has %lld, rank %d has %lld", field[f],
                               static_cast<long long>(a), r, static_cast<long long>(v));
        char x[64], y[64];
        layer_terms::format(f - base, a, x, sizeof x);
        layer_terms::format(f - base, v, y, sizeof y);
        return status::error(errc::invalid_argument, "ranks disagree on %s: rank 0 has %s, rank %d has %s", layer_terms::name(f - base),
                             x, r, y);
      }
    for (int r = 0; r < P; ++r) held += all[static_cast<std::size_t>(r) * N + 2];
    if (held != sh_.global_kv_heads)
      return status::error(errc::invalid_argument, "the ranks hold %lld KV heads in all, shard.global_kv_heads = %d (overlap or gap)",
                           static_cast<long long>(held), sh_.global_kv_heads);
    batch_ = batch;
    gout_ = gout;
    const std::int64_t Hk = sh_.global_kv_heads, rec = 1 + plan_fields * gout;
    std::vector<std::int64_t> buf(static_cast<std::size_t>(batch * Hk * rec), 0);
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < sh_.num_heads; ++h) {
        std::int64_t* o = buf.data() + (b * Hk + sh_.heads[h]) * rec;
        o[0] = 1;
        for (std::int64_t g = 0; g < gout; ++g) {
          const auto& pl = plans[b * sh_.num_heads * gout + h * gout + g];
          std::int64_t* f = o + 1 + g * plan_fields;
          f[0] = pl.length;
          f[1] = pl.base_budget;
          f[2] = pl.sinks;
          f[3] = pl.recent;
          f[4] = pl.pass_through ? 1 : 0;
        }
      }
    KVEVICT_TRY(collective(comm_->all_reduce_sum(buf.data(), static_cast<std::int64_t>(buf.size())), static_cast<std::int64_t>(buf.size())));
    for (std::int64_t h = 0; h < Hk; ++h)
      if (buf[static_cast<std::size_t>(h * rec)] != 1)
        return status::error(errc::invalid_argument, "global KV head %lld is held by %lld ranks (shard.heads must cover each head once)",
                             static_cast<long long>(h), static_cast<long long>(buf[static_cast<std::size_t>(h * rec)]));
    gplans_.assign(static_cast<std::size_t>(batch * Hk * gout), kvevict::detail::head_plan{});
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < Hk; ++h)
        for (std::int64_t g = 0; g < gout; ++g) {
          const std::int64_t* f = buf.data() + (b * Hk + h) * rec + 1 + g * plan_fields;
          auto& pl = gplans_[static_cast<std::size_t>((b * Hk + h) * gout + g)];
          pl.length = f[0];
          pl.base_budget = f[1];
          pl.sinks = f[2];
          pl.recent = f[3];
          pl.pass_through = f[4] != 0;
        }
    return {};
  }

  /// The last round (all_gather, 1 int64 per rank), before any output is written: each rank's
  /// status after its budgets (capacity, int32 range). Any error is returned on every rank, so
  /// either every rank writes its selection or none does.
  status finish(status local) {
    const int P = comm_->size(), me = comm_->rank();
    const std::int64_t mine = local.ok() ? 0 : static_cast<std::int64_t>(local.code());
    std::vector<std::int64_t> all(static_cast<std::size_t>(P));
    KVEVICT_TRY(collective(comm_->all_gather(&mine, 1, all.data()), 1));
    // As in agree(): the lowest failing rank's category on every rank.
    for (int r = 0; r < P; ++r)
      if (all[static_cast<std::size_t>(r)] != 0) {
        if (r == me) return local;
        const errc code = static_cast<errc>(all[static_cast<std::size_t>(r)]);
        if (local.ok())
          return status::error(code, "rank %d of %d failed after the budgets (%s); rank %d wrote nothing", r, P, to_string(code), me);
        return status::error(code, "rank %d of %d failed after the budgets (%s); rank %d wrote nothing, failing too: %s", r, P,
                             to_string(code), me, local.message());
      }
    return {};
  }

  communicator* comm() const { return comm_; }
  /// Out rows of one sequence over the whole layer.
  std::int64_t global_rows() const { return static_cast<std::int64_t>(sh_.global_kv_heads) * gout_; }
  /// (batch, global_rows()) head plans after agree().
  const kvevict::detail::head_plan* global_plans() const { return gplans_.data(); }
  /// The global row of local out row h (of a sequence).
  std::int64_t global_row(std::int64_t h) const { return static_cast<std::int64_t>(sh_.heads[h / gout_]) * gout_ + h % gout_; }

  /// AdaKV's share of each global row in the layer's top-T candidates (rounds 3-7).
  /// rows: (batch * local rows) pointers to the local smoothed score rows (row b * H + h; null
  /// for pass-through rows). winners: out, (batch, global_rows()); T: out, (batch) the layer's
  /// candidate total per sequence, min(sum of B_h - protected_h, candidates), as on one device.
  status winners(const float* const* rows, std::int64_t* winners, std::int64_t* T) {
    const std::int64_t Hg = global_rows(), H = static_cast<std::int64_t>(sh_.num_heads) * gout_;
    std::vector<std::int64_t> k(static_cast<std::size_t>(batch_), 0);
    bool any = false;
    for (std::int64_t b = 0; b < batch_; ++b) {
      std::int64_t t = 0, c = 0;
      for (std::int64_t h = 0; h < Hg; ++h) {
        const auto& pl = gplans_[static_cast<std::size_t>(b * Hg + h)];
        if (pl.pass_through) continue;
        t += pl.base_budget - pl.protected_count();
        c += pl.candidates();
      }
      if (t > c) t = c;
      T[b] = t;
      for (std::int64_t h = 0; h < Hg; ++h) {  // the two cases without a choice
        const auto& pl = gplans_[static_cast<std::size_t>(b * Hg + h)];
        winners[b * Hg + h] = (t == c && !pl.pass_through) ? pl.candidates() : 0;
      }
      if (t > 0 && t < c) {
        k[static_cast<std::size_t>(b)] = t;
        any = true;
      }
    }
    if (!any) return {};
    // radix select of the k-th largest key per sequence, 8 bits a round from the top
    std::vector<std::uint32_t> prefix(static_cast<std::size_t>(batch_), 0u);
    std::vector<std::int64_t> hist(static_cast<std::size_t>(batch_ * 256));
    for (int round = 0; round < 4; ++round) {
      const int shift = 24 - 8 * round;
      std::fill(hist.begin(), hist.end(), 0);
      for (std::int64_t b = 0; b < batch_; ++b) {
        if (k[static_cast<std::size_t>(b)] == 0) continue;
        const std::uint32_t pre = prefix[static_cast<std::size_t>(b)];
        std::int64_t* hb = hist.data() + b * 256;
        for_candidates(rows, b, H, [&](std::int64_t, std::uint32_t key) {
          if (round == 0 || (key >> (shift + 8)) == (pre >> (shift + 8))) ++hb[(key >> shift) & 255u];
        });
      }
      KVEVICT_TRY(collective(comm_->all_reduce_sum(hist.data(), static_cast<std::int64_t>(hist.size())),
                             static_cast<std::int64_t>(hist.size())));
      if (stats_) ++stats_->radix_rounds;
      for (std::int64_t b = 0; b < batch_; ++b) {
        std::int64_t& kb = k[static_cast<std::size_t>(b)];
        if (kb == 0) continue;
        const std::int64_t* hb = hist.data() + b * 256;
        int d = 255;
        for (; d > 0 && hb[d] < kb; --d) kb -= hb[d];
        prefix[static_cast<std::size_t>(b)] |= static_cast<std::uint32_t>(d) << shift;
      }
    }
    // each global row's candidates above the threshold key and at it; ties in row order
    std::vector<std::int64_t> counts(static_cast<std::size_t>(batch_ * Hg * 2), 0);
    for (std::int64_t b = 0; b < batch_; ++b) {
      if (k[static_cast<std::size_t>(b)] == 0) continue;
      const std::uint32_t K = prefix[static_cast<std::size_t>(b)];
      for_candidates(rows, b, H, [&](std::int64_t h, std::uint32_t key) {
        std::int64_t* c = counts.data() + (b * Hg + global_row(h)) * 2;
        if (key > K) ++c[0];
        else if (key == K) ++c[1];
      });
    }
    KVEVICT_TRY(collective(comm_->all_reduce_sum(counts.data(), static_cast<std::int64_t>(counts.size())),
                           static_cast<std::int64_t>(counts.size())));
    for (std::int64_t b = 0; b < batch_; ++b) {
      std::int64_t rem = k[static_cast<std::size_t>(b)];  // ties still to take
      if (rem == 0) continue;
      for (std::int64_t h = 0; h < Hg; ++h) {
        const std::int64_t* c = counts.data() + (b * Hg + h) * 2;
        const std::int64_t tie = c[1] < rem ? c[1] : rem;
        winners[b * Hg + h] = c[0] + tie;
        rem -= tie;
      }
    }
    return {};
  }

 private:
  template <class F>
  void for_candidates(const float* const* rows, std::int64_t b, std::int64_t H, F f) const {
    const std::int64_t Hg = global_rows();
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& pl = gplans_[static_cast<std::size_t>(b * Hg + global_row(h))];
      const float* row = rows[b * H + h];
      if (pl.pass_through || !row) continue;
      for (std::int64_t i = pl.sinks; i < pl.length - pl.recent; ++i) f(h, score_key(row[i]));
    }
  }

  status collective(status st, std::int64_t count) {
    if (stats_) {
      ++stats_->rounds;
      stats_->bytes += count * static_cast<std::int64_t>(sizeof(std::int64_t));
    }
    if (st.ok()) return st;
    return status::error(st.code(), "rank %d: collective failed: %s", comm_->rank(), st.message());
  }

  communicator* comm_;
  shard sh_;
  exchange_stats* stats_;
  std::int64_t batch_ = 0, gout_ = 1;
  std::vector<kvevict::detail::head_plan> gplans_;
};

/// This rank's whole-layer budgets (LKV-H) after agree(): `layer(b, plans, rows, budgets)`
/// computes sequence b's allocation over its `rows` = global_rows() global rows (the single-device
/// code on the global plans; the same on every rank) into `budgets`; this rank keeps its local
/// rows' entries: budgets[b * H + h] (H = local rows per sequence). Host memory: one sequence.
/// Shared by the CPU and CUDA drivers.
template <class LayerBudgets>
status local_layer_budgets(const layer_exchange& ex, std::int64_t batch, std::int64_t H, LayerBudgets&& layer, std::int64_t* budgets) {
  const std::int64_t Hg = ex.global_rows();
  std::vector<std::int64_t> gb(static_cast<std::size_t>(Hg));
  for (std::int64_t b = 0; b < batch; ++b) {
    KVEVICT_TRY(layer(b, ex.global_plans() + b * Hg, Hg, gb.data()));
    for (std::int64_t h = 0; h < H; ++h) budgets[b * H + h] = gb[static_cast<std::size_t>(ex.global_row(h))];
  }
  return {};
}

/// Whether a score-driven budgeter can allocate over a sharded layer: it has the host-device
/// apportion_budgets that local_score_budgets runs over the global rows.
template <class Bu, class = void>
struct has_apportion_budgets : std::false_type {};
template <class Bu>
struct has_apportion_budgets<Bu, std::void_t<decltype(&Bu::template apportion_budgets<std::int64_t>)>> : std::true_type {};

/// This rank's score-driven budgets (AdaKV, CriticalAdaKV) after agree(): the global winners
/// (winners(), rounds 3-7), Budgeter::apportion_budgets over the global rows (the single-device
/// host-device code, the same on every rank), this rank's slice into budgets[b * H + h].
/// rows: (batch * H) local smoothed score rows (null where a row is not scored). Every rank
/// calls it (it holds collectives). Shared by the CPU and CUDA drivers.
template <class Budgeter>
status local_score_budgets(layer_exchange& ex, const typename Budgeter::params& bp, const float* const* rows, std::int64_t batch,
                           std::int64_t H, std::int64_t* budgets) {
  const std::int64_t Hg = ex.global_rows();
  std::vector<std::int64_t> win(static_cast<std::size_t>(batch * Hg)), T(static_cast<std::size_t>(batch)),
      cap(static_cast<std::size_t>(Hg)), extra(static_cast<std::size_t>(Hg)), gb(static_cast<std::size_t>(Hg));
  std::vector<double> share(static_cast<std::size_t>(Hg));
  KVEVICT_TRY(ex.winners(rows, win.data(), T.data()));
  for (std::int64_t b = 0; b < batch; ++b) {
    Budgeter::apportion_budgets(bp, ex.global_plans() + b * Hg, win.data() + b * Hg, Hg, T[static_cast<std::size_t>(b)], share.data(),
                                cap.data(), extra.data(), gb.data());
    for (std::int64_t h = 0; h < H; ++h) budgets[b * H + h] = gb[static_cast<std::size_t>(ex.global_row(h))];
  }
  return {};
}

}  // namespace detail
}  // namespace distributed
}  // namespace kvevict
