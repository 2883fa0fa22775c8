// LKV on the CPU backend: the learned budgeter and scorer (kvevict/policies/learned.hpp) with
// evictor<..., cpu::backend>, named compositions, and the artifact reader.
//
//   kvevict::io::lkv_artifact art;                                    // tools/lkv/train.py output
//   KVEVICT_TRY(kvevict::io::read_lkv_artifact(path, &art));
//   kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(kvevict::lkv::full_params(art));
//   ev.run(layer_inputs, kvevict::budget_request::fraction(0.1), selection);   // layer by layer
//
// How the pieces plug into the CPU evictor (backends/cpu/evictor.hpp):
//  - scorers::learned_mlp has the user-scorer hook `score_kv_head(params, cpu::head_inputs,
//    float*)`; the evictor stages the head's K and V as fp32 rows and calls it. It reads the
//    layer from params.layer, or from head_inputs::layer_idx when params.layer = -1.
//    `check_layer` is called by can_implement() (kv_heads / head_dim must match the table).
//  - budgeters::headwise_learned has the whole-layer hook `layer_budgets(...)`: the evictor
//    calls it once per sequence with the plans of the layer's rows; it returns the layer's
//    slice of the global allocation over all layers' KV heads.
//
// Decoding (spec lkv.md "Decoding"; docs/lkv.md "Decoding: mode A vs mode B"): mode A needs
// nothing beyond the prefill eviction. Mode B (the budget tracks the tokens seen, t) is
// lkv::decode_budgets / lkv::select_drops / lkv::decode_step at the end of this file: stored
// per-token utilities (lkv::score_tokens, once per token), caller buffers, ragged head lengths.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/cpu.hpp"
#include "kvevict/io/lkv_artifact.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {

namespace detail {
/// LKV-H water-filling from the logits (host): lkv_ratios, then lkv_water_fill_ratios
/// (policies/learned.hpp).
///
/// logits     fp32 (n): the learned z_n, in (layer, KV head) row-major order
/// temperature > 0: r = softmax(z / temperature), computed in fp64 (max-subtracted, std::exp)
/// total, cap, floor_each, out: as lkv_water_fill_ratios.
/// Allocates four O(n) vectors. Returns false (out untouched) when the arguments violate the
/// ranges above or a logit is not finite.
inline bool lkv_water_fill(const float* logits, std::int64_t n, double temperature, std::int64_t total, std::int64_t cap,
                           std::int64_t floor_each, std::int64_t* out) {
  if (n < 1 || !(temperature > 0.0) || cap < 0 || floor_each < 0 || floor_each > cap || total < n * floor_each ||
      total > n * cap)
    return false;
  std::vector<double> r(static_cast<std::size_t>(n)), share(static_cast<std::size_t>(n));
  std::vector<std::int64_t> capv(static_cast<std::size_t>(n));
  std::vector<unsigned char> clipped(static_cast<std::size_t>(n));
  if (!lkv_ratios(logits, n, temperature, r.data())) return false;
  lkv_fill_scratch s;
  s.share = share.data();
  s.capv = capv.data();
  s.clipped = clipped.data();
  return lkv_water_fill_ratios(r.data(), n, total, cap, floor_each, out, s);
}
}  // namespace detail

namespace lkv {

/// LKV-H: the whole model's allocation: out (num_layers * kv_heads) budgets for t tokens per
/// head, each head holding at least floor_each (protected tokens / min_budget). Host tables only.
/// Allocates four O(n) vectors (decode_budgets with a decode_budget_scratch does not).
inline status global_budgets(const budgeters::headwise_learned::params& p, const budget_request& req, std::int64_t t,
                             std::int64_t floor_each, std::int64_t* out) {
  using budgeters::headwise_learned;
  KVEVICT_TRY(headwise_learned::check_host(p));
  const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
  if (t < 0) return status::error(errc::invalid_argument, "t = %lld must be >= 0", static_cast<long long>(t));
  std::vector<double> r(static_cast<std::size_t>(n)), share(static_cast<std::size_t>(n));
  std::vector<std::int64_t> capv(static_cast<std::size_t>(n));
  std::vector<unsigned char> clipped(static_cast<std::size_t>(n));
  detail::lkv_fill_scratch s;
  s.share = share.data();
  s.capv = capv.data();
  s.clipped = clipped.data();
  if (!detail::lkv_ratios(p.logits, n, static_cast<double>(p.temperature), r.data()) ||
      !headwise_learned::global_from_ratios(p, r.data(), req, t, floor_each, out, s)) {
    std::int64_t fl = floor_each > p.min_budget ? floor_each : p.min_budget;
    if (fl > t) fl = t;
    std::int64_t total = headwise_learned::total_budget(req, n, t);
    if (total < n * fl) total = n * fl;
    return status::error(errc::invalid_argument, "headwise_learned: cannot apportion total = %lld over %lld heads of t = %lld",
                         static_cast<long long>(total), static_cast<long long>(n), static_cast<long long>(t));
  }
  return {};
}

/// Parameters of `full` pointing into the artifact (which must outlive them).
inline full::params full_params(const io::lkv_artifact& a) {
  full::params p = full::defaults();
  p.scorer = io::scorer_params(a);
  p.budgeter = io::budgeter_params(a);
  return p;
}
inline uniform_budgets::params uniform_budgets_params(const io::lkv_artifact& a) {
  uniform_budgets::params p = uniform_budgets::defaults();
  p.scorer = io::scorer_params(a);
  return p;
}
inline budgets_restkv::params budgets_restkv_params(const io::lkv_artifact& a) {
  budgets_restkv::params p = budgets_restkv::defaults();
  p.budgeter = io::budgeter_params(a);
  return p;
}
inline budgets_attention::params budgets_attention_params(const io::lkv_artifact& a) {
  budgets_attention::params p = budgets_attention::defaults();
  p.budgeter = io::budgeter_params(a);
  return p;
}

/// Learned utilities of the first `length` tokens of one KV head, without an evictor (e.g. to
/// store them beside the cache for decoding "mode B"). keys/values: (length, head_dim) fp32,
/// row stride `row_stride` elements. out: length floats. Errors as learned_mlp::check /
/// check_layer (layer must be a valid table row; kv_head < kv_heads). out[n] is bit-identical to
/// learned_mlp::utility of token n (cpu::learned_mlp_rows::score_rows: blocks of 8 tokens vectorised
/// across tokens, same fp64 operations in the same order; no allocation).
inline status score_tokens(const scorers::learned_mlp::params& p, int layer, std::int64_t kv_head, const float* keys,
                           const float* values, std::int64_t length, std::int64_t row_stride, float* out) {
  KVEVICT_TRY(scorers::learned_mlp::check(p));
  if (p.on_device)
    return status::error(errc::invalid_argument,
                         "scorer.on_device = true: the weights are device memory; lkv::score_tokens needs host tables "
                         "(io::scorer_params)");
  if (layer < 0 || layer >= p.num_layers)
    return status::error(errc::invalid_argument, "layer = %d outside [0, %d)", layer, p.num_layers);
  if (kv_head < 0 || kv_head >= p.kv_heads)
    return status::error(errc::invalid_argument, "kv_head = %lld outside [0, %d)", static_cast<long long>(kv_head), p.kv_heads);
  if (length < 0 || row_stride < p.head_dim)
    return status::error(errc::invalid_argument, "length = %lld must be >= 0 and row_stride = %lld >= head_dim = %d",
                         static_cast<long long>(length), static_cast<long long>(row_stride), p.head_dim);
  if (length > 0 && (!keys || !values || !out)) return status::error(errc::null_pointer, "keys, values or out is null");
  cpu::learned_mlp_rows::score_rows(p, layer, kv_head, keys, values, length, row_stride, out);
  return {};
}

// ---------------------------------------------------------------------------------------------
// Decoding "mode B" (spec lkv.md "Decoding"): the budget tracks t, the tokens seen so far.
//
// Mode A keeps the budgets of the prefill and appends every generated token (nothing to compute
// here). Mode B recomputes the global budgets for the current t and makes every head that holds
// more than its budget drop its lowest-utility tokens. A token's LKV-T utility depends only on
// its own cached k and v, so an engine scores each token ONCE, when it is appended, and stores
// the float beside its cache slot (moving it with the slot when the cache is compacted); a step
// then never re-scores old tokens. The functions below are that step:
//
//   lkv::decode_budgets(bp, req, t, budgets)       global budgets b_n(t), n = layer * kv_heads + h
//   lkv::select_drops(u, length, budget, ...)      one head: which slots to drop (ascending)
//   lkv::decode_step(bp, req, t, cache, out, ...)  both, for every (layer, KV head) of the model
//
// Rule of a step at t tokens seen (deterministic):
//   b = lkv::global_budgets(bp, req, t, floor_each = 0): sum b = floor(R * N * t)
//       (keep_tokens B: N * min(B, t)), 0 <= b_n <= t, N = num_layers * kv_heads;
//   head n holding len_n tokens keeps min(len_n, b_n) of them: the top b_n by utility, equal
//   utilities ranked by slot (the lower slot = the older token ranks higher), i.e. it drops
//   its max(0, len_n - b_n) lowest-utility tokens, among equal utilities the higher slot first.
//   A head under its budget keeps everything (evicted tokens never come back). This is the
//   same order as the prefill top-k (selectors::topk, ties to the lower index), so a step on an
//   uncompressed cache (every len_n = t) keeps exactly what evictor<lkv::full> keeps.
//
// "Every s steps": the step is stateless, so the schedule is the caller's. The engine in
// examples/engine/lkv_decode.hpp scores every appended token at once and calls decode_step
// with t = prompt + decoded tokens after the prefill and after every s-th decoded token;
// budgets are always those of the CURRENT t (not of the previous call), so sum b =
// floor(R * N * t) holds at every call, and between two calls a head holds at most its budget
// at the last call + s tokens. s = 1 is the spec's "every step".
//
// Allocation: none, when the caller passes a decode_budget_scratch (prepared once with
// prepare_decode_scratch: the softmax ratios r and the water-filling scratch, all caller
// memory); the budgets then come from headwise_learned::global_from_ratios, the same code
// global_budgets runs, so the budgets are identical. Without it, decode_budgets calls
// lkv::global_budgets, which allocates four O(N) vectors per call.
// Cost per step: O(N^2) worst case for the budgets (N heads, apportionment) + O(len_n) per head
// that drops (nth_element on the scratch).

/// Caller memory that makes decode_budgets / decode_step allocation-free (optional). N =
/// bp.num_layers * bp.kv_heads; every pointer holds N elements. Fill `ratios` with
/// prepare_decode_scratch from the SAME budgeter parameters the steps use (r = softmax(z /
/// temperature), fp64; detail::lkv_ratios); the other three are clobbered by every call.
struct decode_budget_scratch {
  double* ratios = nullptr;           ///< fp64 (N): set by prepare_decode_scratch
  double* share = nullptr;            ///< fp64 (N): water-filling shares
  std::int64_t* capv = nullptr;       ///< int64 (N): per-head caps
  unsigned char* clipped = nullptr;   ///< uint8 (N): clipped flags
};

/// Computes s.ratios for the budgeter `bp` (once per model / artifact). Errors: bp invalid
/// (headwise_learned::check_host), a null pointer in s.
inline status prepare_decode_scratch(const budgeters::headwise_learned::params& bp, const decode_budget_scratch& s) {
  KVEVICT_TRY(budgeters::headwise_learned::check_host(bp));
  if (!s.ratios || !s.share || !s.capv || !s.clipped)
    return status::error(errc::null_pointer, "decode_budget_scratch: ratios, share, capv or clipped is null");
  const std::int64_t n = static_cast<std::int64_t>(bp.num_layers) * bp.kv_heads;
  if (!detail::lkv_ratios(bp.logits, n, static_cast<double>(bp.temperature), s.ratios))
    return status::error(errc::invalid_argument, "budgeter: cannot compute softmax ratios (temperature = %g)", static_cast<double>(bp.temperature));
  return {};
}

/// Global LKV-H budgets for t tokens seen: budgets[n] for n = layer * kv_heads + kv_head,
/// N = bp.num_layers * bp.kv_heads entries (int64, caller-allocated), floor_each = 0 (plus
/// bp.min_budget when set). req: exactly one of keep_fraction in (0, 1] or keep_tokens >= 1.
/// bp.num_tokens is ignored (t is explicit). scratch (optional, see decode_budget_scratch):
/// no allocation; the budgets are the same either way. Errors: bp invalid
/// (headwise_learned::check_host), bad req, t < 0 or N * t > 2^53, null budgets, a scratch with a
/// null pointer or ratios that are not a probability vector (outside [0, 1], or a sum off 1 by
/// more than 1e-6: never prepared).
inline status decode_budgets(const budgeters::headwise_learned::params& bp, const budget_request& req, std::int64_t t,
                             std::int64_t* budgets, const decode_budget_scratch* scratch = nullptr) {
  KVEVICT_TRY(budgeters::headwise_learned::check_host(bp));
  const bool tok = req.keep_tokens != 0, frac = req.keep_fraction != 0.0;
  if (tok == frac)
    return status::error(errc::invalid_argument, "budget: set exactly one of keep_tokens (= %d) and keep_fraction (= %g)",
                         req.keep_tokens, req.keep_fraction);
  if (tok && req.keep_tokens < 1) return status::error(errc::invalid_argument, "budget.keep_tokens = %d must be >= 1", req.keep_tokens);
  if (frac && !(req.keep_fraction > 0.0 && req.keep_fraction <= 1.0))
    return status::error(errc::invalid_argument, "budget.keep_fraction = %g must be in (0, 1]", req.keep_fraction);
  if (t < 0) return status::error(errc::invalid_argument, "t = %lld (tokens seen) must be >= 0", static_cast<long long>(t));
  const std::int64_t n_heads = static_cast<std::int64_t>(bp.num_layers) * bp.kv_heads;
  if (t > (std::int64_t{1} << 53) / n_heads)  // N * t (and R * N * t) must be exact in int64 and fp64
    return status::error(errc::invalid_argument, "t = %lld (tokens seen) is too large: N * t = %lld * t must be <= 2^53",
                         static_cast<long long>(t), static_cast<long long>(n_heads));
  if (!budgets) return status::error(errc::null_pointer, "budgets is null");
  budgeters::headwise_learned::params p = bp;
  p.num_tokens = 0;
  if (!scratch) return lkv::global_budgets(p, req, t, 0, budgets);
  if (!scratch->ratios || !scratch->share || !scratch->capv || !scratch->clipped)
    return status::error(errc::null_pointer, "decode_budget_scratch: ratios, share, capv or clipped is null");
  double rsum = 0.0;  // O(N): unprepared ratios (zeros, NaN) would give silently wrong budgets
  for (std::int64_t i = 0; i < n_heads; ++i) {
    const double r = scratch->ratios[i];
    if (!(r >= 0.0 && r <= 1.0))
      return status::error(errc::invalid_argument, "decode_budget_scratch.ratios[%lld] = %g is not a softmax ratio (fill them with prepare_decode_scratch)",
                           static_cast<long long>(i), r);
    rsum += r;
  }
  if (!(std::fabs(rsum - 1.0) <= 1e-6))
    return status::error(errc::invalid_argument, "decode_budget_scratch.ratios sum to %g, not 1 (fill them with prepare_decode_scratch)", rsum);
  detail::lkv_fill_scratch fs;
  fs.share = scratch->share;
  fs.capv = scratch->capv;
  fs.clipped = scratch->clipped;
  if (!budgeters::headwise_learned::global_from_ratios(p, scratch->ratios, req, t, 0, budgets, fs))
    return status::error(errc::invalid_argument, "headwise_learned: cannot apportion the budget over %d x %d heads at t = %lld",
                         p.num_layers, p.kv_heads, static_cast<long long>(t));
  return {};
}

/// One head of a mode-B step: the slots to drop so that the head keeps min(length, budget).
///
/// utilities  fp32 (length): the stored LKV-T utility of slot s of the head (finite; NaN/inf is
///            an error, never reordered silently).
/// length     >= 0 tokens the head holds; budget >= 0.
/// scratch    int32 (length) when length > budget (may be null otherwise); contents clobbered.
/// drops      int32 (max(0, length - budget)) out: the dropped slots, strictly ascending.
/// num_drops  out: max(0, length - budget).
/// Order: slot a ranks above slot b when u_a > u_b, or u_a == u_b and a < b; the lowest-ranked
/// slots are dropped. O(length) (std::nth_element) + O(k log k) for k drops. No allocation.
/// Errors: length < 0, budget < 0, null pointers, a non-finite utility (names the slot).
inline status select_drops(const float* utilities, std::int64_t length, std::int64_t budget, std::int32_t* scratch,
                           std::int32_t* drops, std::int64_t* num_drops) {
  if (length < 0 || budget < 0)
    return status::error(errc::invalid_argument, "length = %lld and budget = %lld must be >= 0", static_cast<long long>(length),
                         static_cast<long long>(budget));
  if (length > 2147483647)
    return status::error(errc::invalid_argument, "length = %lld does not fit int32 slot indices", static_cast<long long>(length));
  if (!num_drops) return status::error(errc::null_pointer, "num_drops is null");
  const std::int64_t k = length > budget ? length - budget : 0;
  *num_drops = 0;
  if (k == 0) return {};
  if (!utilities || !scratch || !drops) return status::error(errc::null_pointer, "utilities, scratch or drops is null (%lld drops)", static_cast<long long>(k));
  for (std::int64_t s = 0; s < length; ++s) {
    if (!std::isfinite(utilities[s]))
      return status::error(errc::non_finite_input, "utilities[%lld] = %g is not finite", static_cast<long long>(s),
                           static_cast<double>(utilities[s]));
    scratch[s] = static_cast<std::int32_t>(s);
  }
  // "a ranks below b": the k lowest-ranked go to the front.
  const auto below = [utilities](std::int32_t a, std::int32_t b) {
    return utilities[a] < utilities[b] || (utilities[a] == utilities[b] && a > b);
  };
  if (k < length) std::nth_element(scratch, scratch + k, scratch + length, below);
  std::sort(scratch, scratch + k);
  for (std::int64_t i = 0; i < k; ++i) drops[i] = scratch[i];
  *num_drops = k;
  return {};
}

/// The stored utilities and lengths of every (layer, KV head) of a cache, for decode_step.
/// Head n = layer * kv_heads + kv_head holds lengths[n] tokens in slots 0..lengths[n]-1 (ragged:
/// heads differ after mode-B steps); utilities[n * utility_stride + s] is the utility of its slot s.
struct decode_cache_view {
  const float* utilities = nullptr;       ///< fp32 (N, utility_stride), slot-aligned with the cache
  std::int64_t utility_stride = 0;        ///< elements between heads, >= every length (e.g. capacity)
  const std::int32_t* lengths = nullptr;  ///< int32 (N): tokens each head holds now
};

/// Caller-owned outputs and scratch of decode_step (nothing is allocated by the step).
struct decode_step_buffers {
  std::int64_t* budgets = nullptr;       ///< int64 (N) out: b_n(t)
  std::int32_t* drop_indptr = nullptr;   ///< int32 (N + 1) out: CSR, drops of head n in [indptr[n], indptr[n+1])
  std::int32_t* drop_indices = nullptr;  ///< int32 (drop_capacity) out: dropped slots, ascending per head
  std::int64_t drop_capacity = 0;        ///< >= sum_n max(0, lengths[n] - b_n); sum_n lengths[n] always suffices
  std::int32_t* scratch = nullptr;       ///< int32 (scratch_size), clobbered
  std::int64_t scratch_size = 0;         ///< >= the longest head that drops; max_n lengths[n] always suffices
  const decode_budget_scratch* budget_scratch = nullptr;  ///< optional: no allocation at all (see above)
};

/// A mode-B step over the whole model at t tokens seen (see the rule above): budgets for t, then
/// for every head the slots to drop. The caller removes the dropped slots from its cache (and
/// its stored utilities) itself, e.g. by moving the kept rows down in order (slots of a head
/// stay in increasing position, as the prefill selection leaves them).
/// Errors (outputs unspecified): bp / req / t as decode_budgets; null cache pointers; a length
/// < 0, > t (a head cannot hold more tokens than were seen) or > utility_stride (named by head);
/// drop_capacity or scratch_size too small (insufficient_capacity / insufficient_workspace,
/// naming the needed size); a non-finite utility in a head that drops (named by head and slot).
inline status decode_step(const budgeters::headwise_learned::params& bp, const budget_request& req, std::int64_t t,
                          const decode_cache_view& cache, const decode_step_buffers& out) {
  KVEVICT_TRY(budgeters::headwise_learned::check_host(bp));
  const std::int64_t H = bp.kv_heads, N = static_cast<std::int64_t>(bp.num_layers) * H;
  if (!cache.lengths) return status::error(errc::null_pointer, "cache.lengths is null");
  if (!out.budgets || !out.drop_indptr) return status::error(errc::null_pointer, "out.budgets or out.drop_indptr is null");
  if (cache.utility_stride < 0)
    return status::error(errc::invalid_argument, "cache.utility_stride = %lld must be >= 0", static_cast<long long>(cache.utility_stride));
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t len = cache.lengths[n];
    if (len < 0 || len > t || len > cache.utility_stride)
      return status::error(errc::invalid_argument,
                           "cache.lengths[%lld] = %lld (layer %lld, kv_head %lld) must be in [0, min(t = %lld, utility_stride = %lld)]",
                           static_cast<long long>(n), static_cast<long long>(len), static_cast<long long>(n / H),
                           static_cast<long long>(n % H), static_cast<long long>(t), static_cast<long long>(cache.utility_stride));
  }
  KVEVICT_TRY(decode_budgets(bp, req, t, out.budgets, out.budget_scratch));
  std::int64_t need = 0, longest = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t len = cache.lengths[n];
    if (len > out.budgets[n]) {
      need += len - out.budgets[n];
      if (len > longest) longest = len;
    }
  }
  if (need > 2147483647)
    return status::error(errc::invalid_argument, "%lld drops do not fit int32 drop_indptr", static_cast<long long>(need));
  if (need > 0 && !cache.utilities) return status::error(errc::null_pointer, "cache.utilities is null (%lld drops)", static_cast<long long>(need));
  if (need > 0 && (!out.drop_indices || out.drop_capacity < need))
    return status::error(errc::insufficient_capacity, "out.drop_capacity = %lld < %lld drops at t = %lld (drop_indices %s)",
                         static_cast<long long>(out.drop_capacity), static_cast<long long>(need), static_cast<long long>(t),
                         out.drop_indices ? "set" : "null");
  if (longest > 0 && (!out.scratch || out.scratch_size < longest))
    return status::error(errc::insufficient_workspace, "out.scratch_size = %lld < %lld (the longest head that drops; scratch %s)",
                         static_cast<long long>(out.scratch_size), static_cast<long long>(longest), out.scratch ? "set" : "null");
  std::int64_t at = 0;
  out.drop_indptr[0] = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    std::int64_t k = 0;
    const status s = select_drops(cache.utilities + n * cache.utility_stride, cache.lengths[n], out.budgets[n], out.scratch,
                                  out.drop_indices ? out.drop_indices + at : nullptr, &k);
    if (!s.ok()) {
      const char* m = std::strstr(s.message(), ": ");  // drop the repeated category prefix
      return status::error(s.code(), "layer %lld, kv_head %lld: %s", static_cast<long long>(n / H), static_cast<long long>(n % H),
                           m ? m + 2 : s.message());
    }
    at += k;
    out.drop_indptr[n + 1] = static_cast<std::int32_t>(at);
  }
  return {};
}

}  // namespace lkv
}  // namespace kvevict
