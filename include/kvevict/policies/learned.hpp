// IWYU pragma: private, include "kvevict/backends/cpu/learned.hpp"
// LKV: learned head-wise budgets (LKV-H) and a learned, query-agnostic token scorer (LKV-T).
//
// Paper: Zhou, Hao, Wang et al., "LKV: End-to-End Learning of Head-wise Budgets and Token
// Selection for LLM KV Cache Eviction", arXiv 2605.06676. No official code or weights exist;
// the parametrisation below is this project's (spec: shared/spec/lkv.md, docs/lkv.md). The
// trained tables come from tools/lkv/train.py through the artifact read by
// kvevict/io/lkv_artifact.hpp.
//
//   budgeters::headwise_learned  per-(layer, KV head) logits z; r = softmax(z / temperature)
//                                over ALL layers' heads; integer budgets of the whole model that
//                                sum exactly to B_total = floor(R * n_layers * kv_heads * t);
//                                a layer's evictor call applies that layer's slice.
//   scorers::learned_mlp         per (layer, KV head) MLP on x = [k ; v]:
//                                u = w2 . act(W1 x + b1) + b2 (query-agnostic, O(t) per head).
//
// Both hold only plain parameters (non-owning pointers into the artifact) and backend-neutral
// math; the CPU loops live in kvevict/backends/cpu/learned.hpp (include that header, or
// kvevict/cpu.hpp plus it, to use them with evictor<..., cpu::backend>), the CUDA kernels in
// kvevict/backends/cuda/*.cuh (include kvevict/backends/cuda/learned.cuh; the tables must be
// device memory, params.on_device = true, see cuda::lkv_device_tables). The budget arithmetic
// after the softmax (lkv_water_fill_ratios, headwise_learned::layer_slice and its steps) is
// host-device code run by both backends; the softmax itself (lkv_ratios, std::exp) runs on the
// host only, so both backends water-fill the same doubles and get bit-identical budgets.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {

/// Activation of the LKV-T MLP. Values are the artifact's codes (docs/lkv.md).
enum class lkv_activation : int { silu = 0, relu = 1 };

namespace detail {

/// LKV-H ratios r = softmax(z / temperature) over n logits, fp64: z_i = double(logits[i]) /
/// temperature, max-subtracted, std::exp, then r_i = e_i / sum(e) (sum in index order).
/// HOST only (std::exp): the CUDA backend gets r precomputed by this function (see
/// cuda::lkv_device_tables), so every backend water-fills the very same doubles.
/// Returns false (r untouched after the first bad entry) when n < 1, temperature <= 0 or a
/// z_i is not finite.
inline bool lkv_ratios(const float* logits, std::int64_t n, double temperature, double* r) {
  if (n < 1 || !(temperature > 0.0)) return false;
  double zmax = -1e300;
  for (std::int64_t i = 0; i < n; ++i) {
    const double z = static_cast<double>(logits[i]) / temperature;
    if (!std::isfinite(z)) return false;
    if (z > zmax) zmax = z;
  }
  double zsum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) zsum += (r[i] = std::exp(static_cast<double>(logits[i]) / temperature - zmax));
  for (std::int64_t i = 0; i < n; ++i) r[i] /= zsum;
  return true;
}

/// Caller scratch of lkv_water_fill_ratios for n heads (no allocation; host or device memory).
struct lkv_fill_scratch {
  double* share = nullptr;           ///< n
  std::int64_t* capv = nullptr;      ///< n
  unsigned char* clipped = nullptr;  ///< n
};

/// LKV-H water-filling apportionment over n heads from given ratios (spec lkv.md "Budgets").
/// Host and device; only +, -, *, / and floor in fp64 (IEEE-exact on every backend, and no
/// multiply-add a compiler could contract), so the CPU and CUDA backends give bit-identical
/// budgets for the same r.
///
/// r          fp64 (n): ratios, r_i >= 0, sum 1 (lkv_ratios)
/// total      integer budget to distribute (B_total), n * floor_each <= total <= n * cap
/// cap        per-head maximum (t, the head length), >= 0
/// floor_each per-head minimum, 0 <= floor_each <= cap (the protected tokens, or min_budget;
///            0 in the paper's setting). It is given first; the rest, total - n * floor_each,
///            is shared by r.
/// out        int64 (n): budgets with floor_each <= out <= cap and sum(out) == total.
/// s          scratch for n heads.
/// Rule: beta_n = r_n * rest; heads with beta_n > cap - floor_each are clipped to it and their
/// excess handed to the unclipped heads in proportion to r (repeat until nothing clips; when
/// every unclipped head has r = 0, a softmax underflow, they share it equally); then
/// floor, and the remaining units go to the largest fractional parts, ties to the lower head
/// index (detail::apportion). Deterministic. Cost: O(n) per clipping round + apportion's
/// O(n^2) worst case. Returns false (out untouched) when the arguments violate the ranges.
KVEVICT_HOST_DEVICE inline bool lkv_water_fill_shares(const double* r, std::int64_t n, std::int64_t total, std::int64_t cap,
                                                      std::int64_t floor_each, const lkv_fill_scratch& s);

KVEVICT_HOST_DEVICE inline bool lkv_water_fill_ratios(const double* r, std::int64_t n, std::int64_t total, std::int64_t cap,
                                                      std::int64_t floor_each, std::int64_t* out, const lkv_fill_scratch& s) {
  if (!lkv_water_fill_shares(r, n, total, cap, floor_each, s)) return false;
  apportion(s.share, s.capv, n, total - n * floor_each, out);
  for (std::int64_t i = 0; i < n; ++i) out[i] += floor_each;
  return true;
}

/// The first part of lkv_water_fill_ratios: the real-valued shares (s.share) of the units
/// above the floor, total - n * floor_each, and the caps (s.capv = cap - floor_each); the
/// integer budgets are then floor_each + apportion(s.share, s.capv, n, total - n * floor_each).
/// A backend may run that apportionment its own way if it gives apportion's result bit for
/// bit (the CUDA plan kernel does it with a whole block). Returns false on bad ranges.
KVEVICT_HOST_DEVICE inline bool lkv_water_fill_shares(const double* r, std::int64_t n, std::int64_t total, std::int64_t cap,
                                                      std::int64_t floor_each, const lkv_fill_scratch& s) {
  if (n < 1 || cap < 0 || floor_each < 0 || floor_each > cap || total < n * floor_each || total > n * cap) return false;
  double* share = s.share;
  std::int64_t* capv = s.capv;
  unsigned char* clipped = s.clipped;
  for (std::int64_t i = 0; i < n; ++i) {
    capv[i] = cap - floor_each;
    clipped[i] = 0;
  }
  const double room = static_cast<double>(cap - floor_each);
  double rest = static_cast<double>(total - n * floor_each);
  for (;;) {
    double rsum = 0.0;
    std::int64_t open = 0;
    for (std::int64_t i = 0; i < n; ++i)
      if (!clipped[i]) rsum += r[i], ++open;
    bool any = false;
    for (std::int64_t i = 0; i < n; ++i) {
      if (clipped[i]) continue;
      // Every head left has ratio 0 (softmax underflow at a tiny temperature) while units remain:
      // they share the rest equally. (Shares of 0 left the whole rest to apportion's one-unit
      // loop: O(total) steps, hours for a 2^40-token reference; found by tests/fuzz/fuzz_evictor.)
      share[i] = rsum > 0.0 ? r[i] / rsum * rest : rest / static_cast<double>(open);
      if (share[i] > room) any = true;
    }
    if (!any) break;
    for (std::int64_t i = 0; i < n; ++i) {
      if (!clipped[i] && share[i] > room) {
        clipped[i] = 1;
        share[i] = room;
        rest -= room;
      }
    }
  }
  return true;
}

}  // namespace detail

namespace budgeters {

/// LKV-H: learned global head-wise budgets (spec lkv.md; paper arXiv 2605.06676).
///
/// params:
///   logits       fp32 (num_layers, kv_heads) row-major, non-owning (the artifact's table);
///                finite.
///   num_layers, kv_heads: the table shape; must equal layer_inputs::num_layers and kv_heads.
///   temperature  > 0; r = softmax(z / temperature) over all num_layers * kv_heads heads.
///   min_budget   >= 0, default 0 (the paper has none): every head keeps at least this many
///                tokens (a departure from the paper, off by default).
///   num_tokens   t used for B_total; 0 (default): the heads' current length, which must be
///                equal over the heads of a sequence (prefill). Set it (>= every length) for
///                decoding "mode B" where t counts all tokens seen; budgets are then capped by
///                each head's length at selection time.
///   on_device    false (default): logits is host memory (CPU backend). true: the tables are
///                DEVICE memory for the CUDA backend (cuda::lkv_device_tables sets this);
///                host code then never reads them, and the CPU backend refuses the params.
///   ratios       on_device only: fp64 (num_layers * kv_heads) device copy of
///                r = detail::lkv_ratios(logits, temperature), computed on the host, so the
///                device water-fills the same doubles as the CPU.
///   ratios_temperature  on_device only: the temperature `ratios` were computed with (set by
///                cuda::lkv_device_tables); check() refuses a `temperature` that differs from it
///                (the device cannot recompute the ratios: re-upload the tables instead).
/// Budget: R = budget_request::keep_fraction, B_total = floor(R * (N * t)) (fp64), N =
/// num_layers * kv_heads; with keep_tokens B instead, B_total = N * min(B, t). Each head first
/// gets its protected tokens (sinks + recent window of the selector; 0 with num_recent = 0 as
/// LKV uses) or min_budget, whichever is larger, then the rest is water-filled by r
/// (detail::lkv_water_fill_ratios). The evictor of layer l applies budgets[l * kv_heads + h] to KV head
/// h (and to every query-head row of its group in gqa_reduction::per_query_head mode).
/// Heads the plan marks pass-through (length <= base budget) keep everything.
/// When the protected tokens of all heads exceed B_total, every head keeps exactly its
/// protected tokens (as with the uniform budgeter).
/// Errors: null logits (or null ratios with on_device), non-positive shape, temperature <= 0
/// or not finite, non-finite logit (host tables), shape different from the layer inputs,
/// unequal head lengths with num_tokens = 0 (CUDA: device status word), device tables on the
/// CPU backend.
struct headwise_learned {
  struct params {
    const float* logits = nullptr;
    std::int32_t num_layers = 0;
    std::int32_t kv_heads = 0;
    float temperature = 1.0f;
    std::int32_t min_budget = 0;
    std::int64_t num_tokens = 0;
    bool on_device = false;
    const double* ratios = nullptr;
    float ratios_temperature = 0.0f;
  };
  static constexpr const char* name = "headwise_learned";
  static constexpr bool needs_scores = false;

  static status check(const params& p) {
    if (!p.logits) return status::error(errc::null_pointer, "budgeter.logits is null (load an LKV artifact)");
    if (p.num_layers < 1 || p.kv_heads < 1)
      return status::error(errc::invalid_argument, "budgeter shape (num_layers = %d, kv_heads = %d) must be >= 1",
                           p.num_layers, p.kv_heads);
    if (!(p.temperature > 0.0f) || !std::isfinite(p.temperature))
      return status::error(errc::invalid_argument, "budgeter.temperature = %g must be finite and > 0",
                           static_cast<double>(p.temperature));
    if (p.min_budget < 0) return status::error(errc::invalid_argument, "budgeter.min_budget = %d must be >= 0", p.min_budget);
    if (p.num_tokens < 0)
      return status::error(errc::invalid_argument, "budgeter.num_tokens = %lld must be >= 0", static_cast<long long>(p.num_tokens));
    // B_total = floor(R * N * t) is computed in fp64: N * t must stay exact (<= 2^53).
    if (p.num_tokens > (std::int64_t{1} << 53) / (static_cast<std::int64_t>(p.num_layers) * p.kv_heads))
      return status::error(errc::invalid_argument,
                           "budgeter.num_tokens = %lld is too large: num_layers * kv_heads * num_tokens must be <= 2^53",
                           static_cast<long long>(p.num_tokens));
    if (p.on_device) {  // device tables: not readable here (their values were checked on upload)
      if (!p.ratios)
        return status::error(errc::null_pointer, "budgeter.ratios is null with budgeter.on_device = true (use cuda::lkv_device_tables)");
      if (p.temperature != p.ratios_temperature)
        return status::error(errc::invalid_argument,
                             "budgeter.temperature = %g differs from %g, the temperature of the device ratios "
                             "(budgeter.ratios_temperature); upload tables for the new temperature",
                             static_cast<double>(p.temperature), static_cast<double>(p.ratios_temperature));
      return {};
    }
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p.logits[i]))
        return status::error(errc::non_finite_input, "budgeter.logits[%lld] = %g is not finite", static_cast<long long>(i),
                             static_cast<double>(p.logits[i]));
    return {};
  }

  /// Host-table check of the CPU entry points (check() plus: the tables are host memory).
  static status check_host(const params& p) {
    KVEVICT_TRY(check(p));
    if (p.on_device)
      return status::error(errc::invalid_argument,
                           "budgeter.on_device = true: the tables are device memory; the CPU needs host tables (io::budgeter_params)");
    return {};
  }

  /// B_total for N heads of t tokens (see the struct comment). fp64: floor(R * (N * t)).
  KVEVICT_HOST_DEVICE static std::int64_t total_budget(const budget_request& req, std::int64_t n_heads, std::int64_t t) {
    if (req.keep_tokens > 0) return n_heads * (req.keep_tokens < t ? static_cast<std::int64_t>(req.keep_tokens) : t);
    return static_cast<std::int64_t>(std::floor(req.keep_fraction * static_cast<double>(n_heads * t)));
  }

  /// The whole model's allocation from the ratios (host and device; the shared core of
  /// global_budgets and the per-layer hooks of both backends): out (n = num_layers * kv_heads)
  /// budgets for t >= 0 tokens per head, each at least min(max(floor_each, min_budget), t).
  /// Returns false when the water-filling arguments are out of range.
  KVEVICT_HOST_DEVICE static bool global_from_ratios(const params& p, const double* ratios, const budget_request& req, std::int64_t t,
                                                     std::int64_t floor_each, std::int64_t* out, const detail::lkv_fill_scratch& s) {
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    std::int64_t fl = floor_each > p.min_budget ? floor_each : p.min_budget;
    if (fl > t) fl = t;
    std::int64_t total = total_budget(req, n, t);
    if (total < n * fl) total = n * fl;  // protected tokens are kept by rule
    return detail::lkv_water_fill_ratios(ratios, n, total, t, fl, out, s);
  }

  /// Result codes of layer_slice().
  enum slice_result : int { slice_ok = 0, slice_unequal_lengths = 1, slice_cannot_apportion = 2 };

  /// What layer_slice() decides before the water-filling (host and device). Plain data (no
  /// initialisers: it may live in CUDA shared memory); slice_begin() sets every field.
  struct slice_state {
    int rc;
    bool all_pass;       ///< every row passes through: budgets = lengths, no allocation
    std::int64_t n;      ///< heads of the model, num_layers * kv_heads
    std::int64_t t;      ///< tokens per head the allocation is made for
    std::int64_t fl;     ///< per-head floor: min(max(protected, min_budget), t)
    std::int64_t total;  ///< B_total, raised to n * fl
  };

  /// Step 1 of layer_slice(): t, the floor, B_total, or an error code (bad as layer_slice()).
  KVEVICT_HOST_DEVICE static slice_state slice_begin(const params& p, const budget_request& req, const detail::head_plan* plans,
                                                     std::int64_t rows, std::int64_t* bad) {
    slice_state st;
    st.rc = slice_ok;
    st.all_pass = false;
    st.n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    st.t = 0;
    st.fl = 0;
    st.total = 0;
    std::int64_t t = p.num_tokens;
    if (t == 0) {
      t = plans[0].length;
      for (std::int64_t h = 1; h < rows; ++h)
        if (plans[h].length != t) {
          bad[0] = h;
          bad[1] = plans[h].length;
          bad[2] = t;
          st.rc = slice_unequal_lengths;
          return st;
        }
    }
    st.t = t;
    std::int64_t prot = 0;
    bool all_pass = true;
    for (std::int64_t h = 0; h < rows; ++h) {
      if (plans[h].protected_count() > prot) prot = plans[h].protected_count();
      all_pass = all_pass && plans[h].pass_through;
    }
    st.all_pass = all_pass;
    std::int64_t fl = prot > p.min_budget ? prot : p.min_budget;
    if (fl > t) fl = t;
    st.fl = fl;
    std::int64_t total = total_budget(req, st.n, t);
    if (total < st.n * fl) total = st.n * fl;  // protected tokens are kept by rule
    st.total = total;
    return st;
  }

  /// Step 2: the water-filled shares into s (detail::lkv_water_fill_shares); false (bad =
  /// {total, n, t}) when they cannot be formed. Step 3 is apportion(s.share, s.capv, n,
  /// total - n * fl, all) (or a backend's bit-identical equivalent).
  KVEVICT_HOST_DEVICE static bool slice_shares(const slice_state& st, const double* ratios, const detail::lkv_fill_scratch& s,
                                               std::int64_t* bad) {
    if (detail::lkv_water_fill_shares(ratios, st.n, st.total, st.t, st.fl, s)) return true;
    bad[0] = st.total;
    bad[1] = st.n;
    bad[2] = st.t;
    return false;
  }

  /// Step 4: the layer's rows from the apportioned units `all` (n, without the floor).
  KVEVICT_HOST_DEVICE static void slice_end(const params& p, const slice_state& st, const detail::head_plan* plans, std::int64_t rows,
                                            int layer, const std::int64_t* all, std::int64_t* budgets) {
    const std::int64_t G = rows / p.kv_heads;
    for (std::int64_t h = 0; h < rows; ++h) {
      const detail::head_plan& pl = plans[h];
      if (st.all_pass || pl.pass_through) {
        budgets[h] = pl.length;
        continue;
      }
      const std::int64_t b = all[static_cast<std::int64_t>(layer) * p.kv_heads + h / G] + st.fl;
      budgets[h] = b < pl.length ? (b > pl.protected_count() ? b : pl.protected_count()) : pl.length;
    }
  }

  /// Budgets of the `rows` out rows of one sequence of layer `layer` (host and device; the CPU
  /// hook layer_budgets runs it, the CUDA plan kernel runs its steps with a block-parallel
  /// step 3). plans: (rows) head plans, row h covering KV head h / G, G = rows / kv_heads;
  /// ratios: (N) as lkv_ratios; all: (N) scratch (the model's allocation above the floor); s:
  /// scratch for N heads. Shapes must have been checked (rows = G * p.kv_heads,
  /// 0 <= layer < p.num_layers).
  /// slice_unequal_lengths: num_tokens = 0 and plans[bad[0]].length = bad[1] != plans[0].length
  /// = bad[2]; slice_cannot_apportion: bad = {total, n, t}. budgets are then unspecified.
  KVEVICT_HOST_DEVICE static int layer_slice(const params& p, const double* ratios, const budget_request& req,
                                             const detail::head_plan* plans, std::int64_t rows, int layer, std::int64_t* budgets,
                                             std::int64_t* all, const detail::lkv_fill_scratch& s, std::int64_t* bad) {
    const slice_state st = slice_begin(p, req, plans, rows, bad);
    if (st.rc != slice_ok) return st.rc;
    if (!st.all_pass) {
      if (!slice_shares(st, ratios, s, bad)) return slice_cannot_apportion;
      detail::apportion(s.share, s.capv, st.n, st.total - st.n * st.fl, all);
    }
    slice_end(p, st, plans, rows, layer, all, budgets);
    return slice_ok;
  }

  /// Host scratch of layer_budgets: n = num_layers * kv_heads entries in each array (caller
  /// memory; carve_layer_scratch lays it out in a workspace).
  struct layer_scratch {
    double* ratios = nullptr;          ///< fp64 (n): r = softmax(z / temperature)
    double* share = nullptr;           ///< fp64 (n)
    std::int64_t* capv = nullptr;      ///< int64 (n)
    std::int64_t* all = nullptr;       ///< int64 (n): the model's allocation
    unsigned char* clipped = nullptr;  ///< uint8 (n)
  };
  /// Carve a layer_scratch for p's table (core/workspace.hpp's carver: counting or carving).
  template <class Carver>
  static layer_scratch carve_layer_scratch(Carver& c, const params& p) {
    const std::int64_t n0 = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    const std::size_t n = static_cast<std::size_t>(n0 > 0 ? n0 : 1);
    layer_scratch s;
    s.ratios = c.template carve<double>(n);
    s.share = c.template carve<double>(n);
    s.capv = c.template carve<std::int64_t>(n);
    s.all = c.template carve<std::int64_t>(n);
    s.clipped = c.template carve<unsigned char>(n);
    return s;
  }

  /// Whole-layer hook (the front-end, frontend/frontend.hpp): budgets of the `rows` out rows of
  /// one sequence of layer `layer`. plans: (rows) head plans (row h covers KV head
  /// h / (rows / kv_heads)). Host tables; no allocation (scratch: carve_layer_scratch).
  static status layer_budgets(const params& p, const budget_request& req, const detail::head_plan* plans,
                              std::int64_t rows, std::int64_t kv_heads, int layer, int num_layers, std::int64_t* budgets,
                              const layer_scratch& ls) {
    KVEVICT_TRY(check_host(p));
    if (num_layers != p.num_layers || kv_heads != p.kv_heads)
      return status::error(errc::shape_mismatch,
                           "budgeter table (num_layers = %d, kv_heads = %d) != layer inputs (num_layers = %d, kv_heads = %lld)",
                           p.num_layers, p.kv_heads, num_layers, static_cast<long long>(kv_heads));
    if (rows < 1 || rows % kv_heads != 0)
      return status::error(errc::invalid_argument, "rows = %lld is not a positive multiple of kv_heads = %lld",
                           static_cast<long long>(rows), static_cast<long long>(kv_heads));
    if (!ls.ratios || !ls.share || !ls.capv || !ls.all || !ls.clipped)
      return status::error(errc::null_pointer, "headwise_learned::layer_scratch has a null pointer");
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    if (!detail::lkv_ratios(p.logits, n, static_cast<double>(p.temperature), ls.ratios))
      return status::error(errc::invalid_argument, "headwise_learned: logits / temperature give no finite softmax");
    detail::lkv_fill_scratch s;
    s.share = ls.share;
    s.capv = ls.capv;
    s.clipped = ls.clipped;
    std::int64_t bad[3] = {0, 0, 0};
    const int rc = layer_slice(p, ls.ratios, req, plans, rows, layer, budgets, ls.all, s, bad);
    if (rc == slice_unequal_lengths)
      return status::error(errc::invalid_argument,
                           "headwise_learned: head lengths differ (%lld vs %lld) in layer %d; set budgeter.num_tokens",
                           static_cast<long long>(bad[1]), static_cast<long long>(bad[2]), layer);
    if (rc == slice_cannot_apportion)
      return status::error(errc::invalid_argument, "headwise_learned: cannot apportion total = %lld over %lld heads of t = %lld",
                           static_cast<long long>(bad[0]), static_cast<long long>(bad[1]), static_cast<long long>(bad[2]));
    return {};
  }
};

}  // namespace budgeters

namespace scorers {

/// LKV-T: learned, query-agnostic token utility (spec lkv.md "Token scorer").
/// For token i of KV head h in layer l, x = [k_i ; v_i] (2 * head_dim, keys as stored, RoPE
/// applied) and
///   u_i = w2 . act(W1 x + b1) + b2,   W1 (hidden, 2 * head_dim), b1, w2 (hidden), b2 scalar,
/// accumulated in fp64, stored as fp32 (utility() is the definition; the CPU scores blocks of
/// tokens with cpu::learned_mlp_rows, vectorised across tokens and bit-identical). Higher u = keep. A token's score never changes, so it
/// can be stored beside the cache. Use it with selectors::topk num_recent = 0 (no window).
///
/// params (non-owning pointers into the artifact):
///   weights    fp32, (num_layers, kv_heads, block) with block = hidden * 2 * head_dim
///              (W1 row-major) + hidden (b1) + hidden (w2) + 1 (b2).
///   num_layers, kv_heads, head_dim, hidden: the table shape (head_dim must match the K/V).
///   activation silu (x * sigmoid(x)) or relu.
///   layer      which layer's MLPs to use; -1 (default): the layer_inputs' layer_idx.
///   on_device  false (default): weights is host memory (CPU backend). true: weights is DEVICE
///              memory for the CUDA backend (cuda::lkv_device_tables sets this); the CPU
///              backend then refuses the params (check_layer).
/// Errors (check / check_layer): null weights, non-positive shape, layer out of range, a K/V
/// shape different from the table, device weights on the CPU backend.
struct learned_mlp {
  struct params {
    const float* weights = nullptr;
    std::int32_t num_layers = 0;
    std::int32_t kv_heads = 0;
    std::int32_t head_dim = 0;
    std::int32_t hidden = 0;
    lkv_activation activation = lkv_activation::silu;
    std::int32_t layer = -1;
    bool on_device = false;
  };
  static constexpr const char* name = "learned_mlp";
  static constexpr bool needs_queries = false;
  static constexpr bool needs_values = true;
  static constexpr bool window_attention = false;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }

  /// Floats per (layer, KV head) MLP.
  static std::int64_t block_floats(std::int64_t head_dim, std::int64_t hidden) { return hidden * 2 * head_dim + 2 * hidden + 1; }

  static status check(const params& p) {
    if (!p.weights) return status::error(errc::null_pointer, "scorer.weights is null (load an LKV artifact)");
    if (p.num_layers < 1 || p.kv_heads < 1 || p.head_dim < 1 || p.hidden < 1)
      return status::error(errc::invalid_argument,
                           "scorer shape (num_layers = %d, kv_heads = %d, head_dim = %d, hidden = %d) must be >= 1",
                           p.num_layers, p.kv_heads, p.head_dim, p.hidden);
    if (p.activation != lkv_activation::silu && p.activation != lkv_activation::relu)
      return status::error(errc::invalid_argument, "scorer.activation = %d is not an lkv_activation", static_cast<int>(p.activation));
    if (p.layer < -1 || p.layer >= p.num_layers)
      return status::error(errc::invalid_argument, "scorer.layer = %d must be in [-1, num_layers = %d)", p.layer, p.num_layers);
    return {};
  }

  /// Shape check against one layer's inputs (called at plan time by the CPU evictor (frontend make_plan's backend check); the
  /// CPU reads the weights on the host, so device weights are refused here).
  static status check_layer(const params& p, std::int64_t kv_heads, std::int64_t head_dim, int layer_idx, int num_layers) {
    if (p.on_device)
      return status::error(errc::invalid_argument,
                           "scorer.on_device = true: the weights are device memory; the CPU needs host weights (io::scorer_params)");
    return check_layer_shape(p, kv_heads, head_dim, layer_idx, num_layers);
  }

  /// The shape part of check_layer (both backends): table (kv_heads, head_dim) == K/V, the
  /// layer used is a table row.
  static status check_layer_shape(const params& p, std::int64_t kv_heads, std::int64_t head_dim, int layer_idx, int num_layers) {
    if (kv_heads != p.kv_heads || head_dim != p.head_dim)
      return status::error(errc::shape_mismatch, "scorer table (kv_heads = %d, head_dim = %d) != K/V (kv_heads = %lld, head_dim = %lld)",
                           p.kv_heads, p.head_dim, static_cast<long long>(kv_heads), static_cast<long long>(head_dim));
    const int l = p.layer >= 0 ? p.layer : layer_idx;
    if (l < 0 || l >= p.num_layers)
      return status::error(errc::invalid_argument, "scorer layer = %d (layer_idx %d of %d) outside the table's %d layers", l,
                           layer_idx, num_layers, p.num_layers);
    return {};
  }

  /// u for one token: k, v (head_dim floats each) with the MLP of (layer, kv_head).
  /// This is the DEFINITION of the score (host code): the CPU paths (cpu::learned_mlp_rows, cpu::scorer_impl,
  /// lkv::score_tokens) reproduce its floats bit for bit (the CUDA kernel sums in its own order).
  /// Order of the fp64 operations: for each hidden unit j = 0..hidden-1, a_j = b1_j, then
  /// a_j += W1[j][i] * x_i for i = 0..2d-1 (x = [k ; v]), then the activation; u = b2, then
  /// u += w2_j * a_j in j order; NaN -> 0, saturated to +-FLT_MAX, rounded to fp32.
  static float utility(const params& p, int layer, std::int64_t kv_head, const float* k, const float* v) {
    return to_score(utility_fp64(p, layer, kv_head, k, v));
  }

  /// utility() before its last step: the fp64 u (no NaN -> 0, no saturation, not rounded to
  /// fp32). utility() = to_score(utility_fp64()). For tests that compare the fp64 sums bit for
  /// bit (the fp32 rounding would hide most differences of order or contraction).
  static double utility_fp64(const params& p, int layer, std::int64_t kv_head, const float* k, const float* v) {
    const std::int64_t d = p.head_dim, hid = p.hidden, in = 2 * d;
    const float* W1 = p.weights + (static_cast<std::int64_t>(layer) * p.kv_heads + kv_head) * block_floats(d, hid);
    const float* b1 = W1 + hid * in;
    const float* w2 = b1 + hid;
    const float b2 = w2[hid];
    double u = static_cast<double>(b2);
    for (std::int64_t j = 0; j < hid; ++j) {
      double a = static_cast<double>(b1[j]);
      const float* row = W1 + j * in;
      for (std::int64_t i = 0; i < d; ++i) a += static_cast<double>(row[i]) * static_cast<double>(k[i]);
      for (std::int64_t i = 0; i < d; ++i) a += static_cast<double>(row[d + i]) * static_cast<double>(v[i]);
      u = add_unit(u, w2[j], a, p.activation == lkv_activation::relu);
    }
    return u;
  }


  /// u + w2_j * act(a): one hidden unit's step, shared by utility() and the backends' blockwise
  /// scorers (cpu::learned_mlp_rows; one source,
  /// so a compiler's multiply-add contraction treats both alike).
  static double add_unit(double u, float w2j, double a, bool relu) {
    if (relu) a = a > 0.0 ? a : 0.0;
    else a = a / (1.0 + std::exp(-a));
    u += static_cast<double>(w2j) * a;
    return u;
  }
  /// utility()'s last step: NaN -> 0, saturated to the fp32 range, rounded to fp32.
  static float to_score(double u) {
    const double m = 3.4028234663852886e38;
    if (!(u == u)) return 0.0f;
    return static_cast<float>(u > m ? m : (u < -m ? -m : u));
  }
};

}  // namespace scorers
}  // namespace kvevict
