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
// kvevict/cpu.hpp plus it, to use them with evictor<..., cpu::backend>).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {

/// Activation of the LKV-T MLP. Values are the artifact's codes (docs/lkv.md).
enum class lkv_activation : int { silu = 0, relu = 1 };

namespace detail {

/// LKV-H water-filling apportionment over n heads (spec lkv.md "Budgets").
///
/// logits     fp32 (n): the learned z_n, in (layer, KV head) row-major order
/// temperature > 0: r = softmax(z / temperature), computed in fp64 (max-subtracted, std::exp)
/// total      integer budget to distribute (B_total), 0 <= total <= n * cap
/// cap        per-head maximum (t, the head length)
/// floor_each per-head minimum, 0 <= floor_each <= cap (the protected tokens, or min_budget;
///            0 in the paper's setting). It is given first; the rest, total - n * floor_each,
///            is shared by r.
/// out        int64 (n): budgets with floor_each <= out <= cap and sum(out) == total.
/// Rule: beta_n = r_n * rest; heads with beta_n > cap - floor_each are clipped to it and their
/// excess handed to the unclipped heads in proportion to r (repeat until nothing clips); then
/// floor, and the remaining units go to the largest fractional parts, ties to the lower head
/// index (detail::apportion). Deterministic. Returns false (out untouched) when the arguments
/// violate the ranges above.
inline bool lkv_water_fill(const float* logits, std::int64_t n, double temperature, std::int64_t total, std::int64_t cap,
                           std::int64_t floor_each, std::int64_t* out) {
  if (n < 1 || !(temperature > 0.0) || cap < 0 || floor_each < 0 || floor_each > cap || total < n * floor_each ||
      total > n * cap)
    return false;
  std::vector<double> r(static_cast<std::size_t>(n)), share(static_cast<std::size_t>(n));
  std::vector<std::int64_t> capv(static_cast<std::size_t>(n), cap - floor_each);
  std::vector<unsigned char> clipped(static_cast<std::size_t>(n), 0);
  double zmax = -1e300;
  for (std::int64_t i = 0; i < n; ++i) {
    const double z = static_cast<double>(logits[i]) / temperature;
    if (!std::isfinite(z)) return false;
    if (z > zmax) zmax = z;
  }
  double zsum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) zsum += (r[static_cast<std::size_t>(i)] = std::exp(static_cast<double>(logits[i]) / temperature - zmax));
  for (std::int64_t i = 0; i < n; ++i) r[static_cast<std::size_t>(i)] /= zsum;
  const double room = static_cast<double>(cap - floor_each);
  double rest = static_cast<double>(total - n * floor_each);
  for (;;) {
    double rsum = 0.0;
    for (std::int64_t i = 0; i < n; ++i)
      if (!clipped[static_cast<std::size_t>(i)]) rsum += r[static_cast<std::size_t>(i)];
    bool any = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::size_t k = static_cast<std::size_t>(i);
      if (clipped[k]) continue;
      share[k] = rsum > 0.0 ? r[k] / rsum * rest : 0.0;
      if (share[k] > room) any = true;
    }
    if (!any) break;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::size_t k = static_cast<std::size_t>(i);
      if (!clipped[k] && share[k] > room) {
        clipped[k] = 1;
        share[k] = room;
        rest -= room;
      }
    }
  }
  apportion(share.data(), capv.data(), n, total - n * floor_each, out);
  for (std::int64_t i = 0; i < n; ++i) out[i] += floor_each;
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
/// Budget: R = budget_request::keep_fraction, B_total = floor(R * (N * t)) (fp64), N =
/// num_layers * kv_heads; with keep_tokens B instead, B_total = N * min(B, t). Each head first
/// gets its protected tokens (sinks + recent window of the selector; 0 with num_recent = 0 as
/// LKV uses) or min_budget, whichever is larger, then the rest is water-filled by r
/// (detail::lkv_water_fill). The evictor of layer l applies budgets[l * kv_heads + h] to KV head
/// h (and to every query-head row of its group in gqa_reduction::per_query_head mode).
/// Heads the plan marks pass-through (length <= base budget) keep everything.
/// When the protected tokens of all heads exceed B_total, every head keeps exactly its
/// protected tokens (as with the uniform budgeter).
/// Errors: null logits, non-positive shape, temperature <= 0 or not finite, non-finite logit,
/// shape different from the layer inputs, unequal head lengths with num_tokens = 0.
struct headwise_learned {
  struct params {
    const float* logits = nullptr;
    std::int32_t num_layers = 0;
    std::int32_t kv_heads = 0;
    float temperature = 1.0f;
    std::int32_t min_budget = 0;
    std::int64_t num_tokens = 0;
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
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p.logits[i]))
        return status::error(errc::non_finite_input, "budgeter.logits[%lld] = %g is not finite", static_cast<long long>(i),
                             static_cast<double>(p.logits[i]));
    return {};
  }

  /// B_total for N heads of t tokens (see the struct comment). fp64: floor(R * (N * t)).
  static std::int64_t total_budget(const budget_request& req, std::int64_t n_heads, std::int64_t t) {
    if (req.keep_tokens > 0) return n_heads * (req.keep_tokens < t ? static_cast<std::int64_t>(req.keep_tokens) : t);
    return static_cast<std::int64_t>(std::floor(req.keep_fraction * static_cast<double>(n_heads * t)));
  }

  /// The whole model's allocation: out (num_layers * kv_heads) budgets for t tokens per head,
  /// each head holding at least floor_each (protected tokens / min_budget).
  static status global_budgets(const params& p, const budget_request& req, std::int64_t t, std::int64_t floor_each,
                               std::int64_t* out) {
    KVEVICT_TRY(check(p));
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    if (t < 0) return status::error(errc::invalid_argument, "t = %lld must be >= 0", static_cast<long long>(t));
    std::int64_t fl = floor_each > p.min_budget ? floor_each : p.min_budget;
    if (fl > t) fl = t;
    std::int64_t total = total_budget(req, n, t);
    if (total < n * fl) total = n * fl;  // protected tokens are kept by rule
    if (!detail::lkv_water_fill(p.logits, n, static_cast<double>(p.temperature), total, t, fl, out))
      return status::error(errc::invalid_argument, "headwise_learned: cannot apportion total = %lld over %lld heads of t = %lld",
                           static_cast<long long>(total), static_cast<long long>(n), static_cast<long long>(t));
    return {};
  }

  /// Evictor hook (CPU): budgets of the `rows` out rows of one sequence of layer `layer`.
  /// plans: (rows) head plans (row h covers KV head h / (rows / kv_heads)).
  static status layer_budgets(const params& p, const budget_request& req, const detail::head_plan* plans,
                              std::int64_t rows, std::int64_t kv_heads, int layer, int num_layers, std::int64_t* budgets) {
    KVEVICT_TRY(check(p));
    if (num_layers != p.num_layers || kv_heads != p.kv_heads)
      return status::error(errc::shape_mismatch,
                           "budgeter table (num_layers = %d, kv_heads = %d) != layer inputs (num_layers = %d, kv_heads = %lld)",
                           p.num_layers, p.kv_heads, num_layers, static_cast<long long>(kv_heads));
    if (rows < 1 || rows % kv_heads != 0)
      return status::error(errc::invalid_argument, "rows = %lld is not a positive multiple of kv_heads = %lld",
                           static_cast<long long>(rows), static_cast<long long>(kv_heads));
    const std::int64_t G = rows / kv_heads;
    std::int64_t t = p.num_tokens;
    if (t == 0) {
      t = plans[0].length;
      for (std::int64_t h = 1; h < rows; ++h)
        if (plans[h].length != t)
          return status::error(errc::invalid_argument,
                               "headwise_learned: head lengths differ (%lld vs %lld) in layer %d; set budgeter.num_tokens",
                               static_cast<long long>(plans[h].length), static_cast<long long>(t), layer);
    }
    std::int64_t prot = 0;
    bool all_pass = true;
    for (std::int64_t h = 0; h < rows; ++h) {
      if (plans[h].protected_count() > prot) prot = plans[h].protected_count();
      all_pass = all_pass && plans[h].pass_through;
    }
    if (all_pass) {
      for (std::int64_t h = 0; h < rows; ++h) budgets[h] = plans[h].length;
      return {};
    }
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    KVEVICT_TRY(global_budgets(p, req, t, prot, all.data()));
    for (std::int64_t h = 0; h < rows; ++h) {
      const std::int64_t b = all[static_cast<std::size_t>(layer * p.kv_heads + h / G)];
      if (plans[h].pass_through) budgets[h] = plans[h].length;
      else budgets[h] = b < plans[h].length ? (b > plans[h].protected_count() ? b : plans[h].protected_count()) : plans[h].length;
    }
    return {};
  }
};

}  // namespace budgeters

namespace scorers {

/// LKV-T: learned, query-agnostic token utility (spec lkv.md "Token scorer").
/// For token i of KV head h in layer l, x = [k_i ; v_i] (2 * head_dim, keys as stored, RoPE
/// applied) and
///   u_i = w2 . act(W1 x + b1) + b2,   W1 (hidden, 2 * head_dim), b1, w2 (hidden), b2 scalar,
/// accumulated in fp64, stored as fp32. Higher u = keep. A token's score never changes, so it
/// can be stored beside the cache. Use it with selectors::topk num_recent = 0 (no window).
///
/// params (non-owning pointers into the artifact):
///   weights    fp32, (num_layers, kv_heads, block) with block = hidden * 2 * head_dim
///              (W1 row-major) + hidden (b1) + hidden (w2) + 1 (b2).
///   num_layers, kv_heads, head_dim, hidden: the table shape (head_dim must match the K/V).
///   activation silu (x * sigmoid(x)) or relu.
///   layer      which layer's MLPs to use; -1 (default): the layer_inputs' layer_idx.
/// Errors (check / check_layer): null weights, non-positive shape, layer out of range, a K/V
/// shape different from the table.
struct learned_mlp {
  struct params {
    const float* weights = nullptr;
    std::int32_t num_layers = 0;
    std::int32_t kv_heads = 0;
    std::int32_t head_dim = 0;
    std::int32_t hidden = 0;
    lkv_activation activation = lkv_activation::silu;
    std::int32_t layer = -1;
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

  /// Shape check against one layer's inputs (called by the CPU evictor's can_implement).
  static status check_layer(const params& p, std::int64_t kv_heads, std::int64_t head_dim, int layer_idx, int num_layers) {
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
  static float utility(const params& p, int layer, std::int64_t kv_head, const float* k, const float* v) {
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
      if (p.activation == lkv_activation::relu) a = a > 0.0 ? a : 0.0;
      else a = a / (1.0 + std::exp(-a));
      u += static_cast<double>(w2[j]) * a;
    }
    const double m = 3.4028234663852886e38;
    if (!(u == u)) return 0.0f;
    return static_cast<float>(u > m ? m : (u < -m ? -m : u));
  }

  /// CPU hook (backends/cpu/scorers.hpp): scores of the first hi.length tokens of one KV head.
  /// HeadInputs is cpu::head_inputs (a template so this header needs no backend).
  template <class HeadInputs>
  static void score_kv_head(const params& p, const HeadInputs& hi, float* out) {
    const int l = p.layer >= 0 ? p.layer : static_cast<int>(hi.layer_idx);
    const std::int64_t d = hi.head_dim;
    for (std::int64_t n = 0; n < hi.length; ++n) out[n] = utility(p, l, hi.kv_head, hi.keys + n * d, hi.values + n * d);
  }
};

}  // namespace scorers
}  // namespace kvevict
