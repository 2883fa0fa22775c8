// kvevict/schedule/decode.hpp: when to evict while generating, and with which budget.
//
// A decode_schedule is the per-request state of decode-time eviction (a cap on the KV cache while a
// model generates, re-evicted every `interval` generated tokens; the "beta" of decode-time compression
// in the eviction literature). It decides WHEN an eviction is due and WHAT per-head budget it has; the
// engine runs the evictor of any preset (evictor<Policy, Backend>::run, or LKV's lkv::decode_step)
// with that budget and compacts its cache as after a prefill eviction. Host code only; it holds no
// cache, no tensor and allocates nothing. Includes only core/.
//
// The engine's calls (one schedule per request; none shared across requests):
//
//   kvevict::decode_schedule sched;
//   KVEVICT_TRY(sched.init(opts));                         // at request start (checks opts)
//   kvevict::decode_action a;
//   KVEVICT_TRY(sched.after_prefill(prompt_len, &a));      // after the prompt is in the cache
//   if (a.evict) {                                         // every layer: params and budget from apply()
//     KVEVICT_TRY(sched.apply(a, params, window_rows, &budget)); run the evictor; compact;
//     KVEVICT_TRY(sched.evicted(a));
//   }
//   for each generated token:
//     KVEVICT_TRY(sched.after_decode(1, &a));              // after the token's K/V are appended
//     if (a.evict) { as above }
//   sched.reset();                                         // at request end (or init() again)
//
// An engine that cannot evict when an eviction falls due (a busy batch, a step that appended several
// tokens) simply does not call evicted(): the next after_decode() reports the eviction again, with the
// due periods coalesced (decode_action::periods > 1) and the budget of the tokens seen by then; one
// eviction then serves them all. after_decode(n) with n > 1 is the same for n tokens appended at once
// (speculative decoding, a multi-token step).
//
// Budget (per KV head, every layer; what budget_request means to the evictor):
//   keep_tokens B   the cache cap: every eviction brings each head to B tokens (uniform budgeters;
//                   head-wise budgeters redistribute: AdaKV shares H * B over a layer's H heads,
//                   LKV-H shares N * B over the model's N heads, PyramidKV's layers hold their pyramid
//                   of the tokens seen, b_l <= 2B, averaging at most B over the layers). A cap below the tokens a policy always keeps (its sinks and
//                   window, plus the protection below) is an error of apply(), as it is of the evictor.
//   keep_fraction r a fraction of the tokens seen t (prompt + generated so far): each eviction has the
//                   per-head budget max(1, floor(r * t)), raised to the tokens the policy always keeps
//                   (as the evictor raises a fraction), so the cache grows with the sequence.
//   With evict_after_prefill, between evictions a uniform-budget head holds at most its budget +
//   interval tokens (+ what the engine appended while it did not evict): the peak KV memory of a
//   request, docs/integration.md "Evicting while generating".
//
// Protection (optional; both 0 by default):
//   protect_prefix P  the first min(P, prompt tokens appended before the first generated token) tokens
//                     of the request are never evicted (a system prompt, attention sinks). Compaction
//                     keeps order, so they stay slots 0..P-1 of every head and are kept as the
//                     selector's sinks.
//   protect_recent R  the R most recent tokens are never evicted (kept as the selector's recent tokens).
// apply() applies them to a policy's params (any selector with the protection fields of
// selectors::topk::params: int32 num_sink, int32 num_recent, float recent_share) and raises a fraction
// budget to hold every protected token, so that every preset can run under one schedule.
//
// Papers: decode-time compression every beta steps as in the kvpress DecodingPress and the "evict while
// generating" settings of H2O (Zhang et al. 2023), TOVA (Oren et al. 2024) and StreamingLLM (Xiao et al.
// 2023); the spec's LKV decoding mode B (shared/spec/lkv.md) is this schedule with a fraction budget.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {

namespace detail {
/// Budgeters whose params carry the tokens seen (num_tokens: LKV-H's t when head lengths differ,
/// PyramidKV's common reference length).
template <class B, class = void>
struct has_num_tokens : std::false_type {};
template <class B>
struct has_num_tokens<B, std::void_t<decltype(std::declval<B&>().num_tokens)>> : std::true_type {};
/// ... and allocate over the whole model (num_layers x kv_heads: LKV-H).
template <class B, class = void>
struct has_model_shape : std::false_type {};
template <class B>
struct has_model_shape<B, std::void_t<decltype(std::declval<B&>().num_layers), decltype(std::declval<B&>().kv_heads)>>
    : std::true_type {};
}  // namespace detail

/// Options of a decode_schedule (see the file comment). All counts are tokens.
struct decode_schedule_options {
  /// Generated tokens between two evictions (the "beta" of decode-time compression), >= 1.
  /// 1 = after every token (the cache never exceeds budget + 1 per head).
  std::int32_t interval = 1;
  /// Per-head budget: exactly one of keep_tokens >= 1 (a cap) or keep_fraction in (0, 1] (of the
  /// tokens seen at each eviction).
  budget_request budget;
  /// First tokens of the request never evicted, >= 0 (counted in the prompt tokens appended before the
  /// first generated token).
  std::int32_t protect_prefix = 0;
  /// Most recent tokens never evicted, >= 0. protect_prefix + protect_recent <= 2^31 - 1.
  std::int32_t protect_recent = 0;
  /// Evict right after every prefill (after_prefill) as well: the prompt is compressed at once.
  /// false: the prompt stays whole until the first due decode-time eviction.
  bool evict_after_prefill = true;
};

/// What the schedule asks of the engine after a prefill or a decode step. Pass it back unchanged to
/// apply() and evicted().
struct decode_action {
  bool evict = false;              ///< run an eviction of every layer now (then call evicted())
  std::int64_t periods = 0;        ///< full decode intervals pending, served by this eviction (0: none, e.g.
                                   ///< an eviction only for a prompt just appended)
  std::int64_t tokens_seen = 0;    ///< t: tokens of the request so far (prompts + generated)
  std::int64_t generated = 0;      ///< generated tokens of the request so far
  std::uint64_t request = 0;       ///< the request (init() / reset() count) the action belongs to
  budget_request budget;           ///< per-head budget of this eviction, as keep_tokens (resolved at t)
};

/// Per-request state of decode-time eviction (see the file comment for the engine's calls).
/// Default-constructed it is unusable until init() succeeds. Copyable (plain integers).
class decode_schedule {
 public:
  /// Validates options. Errors (errc::invalid_argument, naming the field and value): interval < 1,
  /// protect_prefix / protect_recent < 0 or their sum above 2^31 - 1, a budget with neither or both of
  /// keep_tokens / keep_fraction, keep_tokens < 1, keep_fraction outside (0, 1] (NaN included),
  /// keep_tokens < protect_prefix + protect_recent (the cap could not hold the protected tokens).
  static status check(const decode_schedule_options& o) {
    if (o.interval < 1) return status::error(errc::invalid_argument, "decode_schedule: interval = %d must be >= 1", o.interval);
    if (o.protect_prefix < 0)
      return status::error(errc::invalid_argument, "decode_schedule: protect_prefix = %d must be >= 0", o.protect_prefix);
    if (o.protect_recent < 0)
      return status::error(errc::invalid_argument, "decode_schedule: protect_recent = %d must be >= 0", o.protect_recent);
    if (std::int64_t(o.protect_prefix) + o.protect_recent > std::numeric_limits<std::int32_t>::max())
      return status::error(errc::invalid_argument, "decode_schedule: protect_prefix + protect_recent = %d + %d exceeds 2^31 - 1",
                           o.protect_prefix, o.protect_recent);
    const bool tok = o.budget.keep_tokens != 0, frac = o.budget.keep_fraction != 0.0;
    if (tok == frac)
      return status::error(errc::invalid_argument, "decode_schedule: budget must set exactly one of keep_tokens (%d) and keep_fraction (%g)",
                           o.budget.keep_tokens, o.budget.keep_fraction);
    if (tok && o.budget.keep_tokens < 1)
      return status::error(errc::invalid_argument, "decode_schedule: budget.keep_tokens = %d must be >= 1", o.budget.keep_tokens);
    if (frac && !(o.budget.keep_fraction > 0.0 && o.budget.keep_fraction <= 1.0))
      return status::error(errc::invalid_argument, "decode_schedule: budget.keep_fraction = %g must be in (0, 1]", o.budget.keep_fraction);
    if (tok && std::int64_t(o.budget.keep_tokens) < std::int64_t(o.protect_prefix) + o.protect_recent)
      return status::error(errc::invalid_argument,
                           "decode_schedule: budget.keep_tokens = %d < protect_prefix + protect_recent = %d + %d (the cap must hold "
                           "the protected tokens)",
                           o.budget.keep_tokens, o.protect_prefix, o.protect_recent);
    return {};
  }

  /// Starts a request with options `o` (check() first; on error the schedule is left unchanged).
  status init(const decode_schedule_options& o) {
    KVEVICT_TRY(check(o));
    opt_ = o;
    ready_ = true;
    reset();
    return {};
  }

  /// Back to the start of a request (t = 0, nothing pending, counters 0); the options stay. Call at
  /// request end: a schedule carries nothing from one request to the next, and actions of the
  /// previous request are refused by evicted() and apply().
  void reset() {
    t_ = 0;
    gen_ = 0;
    since_ = 0;
    last_evict_t_ = 0;
    last_prefill_t_ = 0;
    prefix_ = 0;
    evictions_ = 0;
    pending_prefill_ = false;
    prefilled_ = false;
    ++request_;
  }

  /// The engine appended `tokens` prompt tokens (a prompt, a chunk of one, or the next turn of a
  /// multi-turn request). *out: evict when evict_after_prefill (with the budget at the new t), or when
  /// decode periods are pending (periods >= 1); else no eviction. Errors (state unchanged): not
  /// init()ed, tokens < 1, null out, t overflowing int32 (a cache position).
  status after_prefill(std::int64_t tokens, decode_action* out) {
    KVEVICT_TRY(check_step("after_prefill", tokens, out));
    t_ += tokens;
    if (gen_ == 0) prefix_ = t_ < opt_.protect_prefix ? t_ : opt_.protect_prefix;  // before the first generated token
    last_prefill_t_ = t_;
    prefilled_ = true;
    pending_prefill_ = pending_prefill_ || opt_.evict_after_prefill;
    *out = action();
    return {};
  }

  /// The engine appended `tokens` generated tokens (1 per decode step; more for a multi-token step).
  /// *out: evict when interval or more generated tokens are pending since the last eviction (periods =
  /// pending / interval, coalesced into one eviction), or when a prefill eviction is still pending.
  /// Errors (state unchanged): not init()ed, no prefill yet, tokens < 1, null out, t overflowing.
  status after_decode(std::int64_t tokens, decode_action* out) {
    KVEVICT_TRY(check_step("after_decode", tokens, out));
    if (!prefilled_) return status::error(errc::invalid_argument, "decode_schedule::after_decode: no prefill yet (call after_prefill first)");
    t_ += tokens;
    gen_ += tokens;
    since_ += tokens;
    *out = action();
    return {};
  }

  /// The engine ran the eviction `a` (returned by after_prefill / after_decode, with a.evict): the tokens
  /// generated after `a` stay pending (and a prefill eviction, when a prompt was appended after it).
  /// Errors (state unchanged): not init()ed, a.evict false, `a` of another request (before reset()),
  /// from the future (a.tokens_seen > tokens_seen()) or not after the last reported eviction.
  status evicted(const decode_action& a) {
    KVEVICT_TRY(check_action("evicted", a));
    if (last_prefill_t_ <= a.tokens_seen) pending_prefill_ = false;  // else a later prompt's eviction is still due
    since_ = gen_ - a.generated;
    last_evict_t_ = a.tokens_seen;
    ++evictions_;
    return {};
  }

  /// Applies the schedule to a policy's params `p` for the eviction `a` and returns in *budget the
  /// budget to run it with. `window` = the query rows (observation window) the engine passes to the
  /// evictor, 0..2^31-1 (a selector with num_recent = -1 protects that many recent tokens).
  ///  - Protection: num_sink = max(num_sink, the protected prefix); the recent tokens become
  ///    max(the policy's, protect_recent) (a recent_share policy, H2O / StreamingLLM, keeps its share
  ///    when it already covers protect_recent, else it protects exactly protect_recent).
  ///  - Budget: a.budget. A fraction budget (resolved in a.budget to floor(r * t)) is raised to the tokens
  ///    the policy always keeps (sinks + fixed recent tokens), as the evictor raises a fraction; a cap
  ///    below them is an error.
  ///  - A budgeter with a num_tokens field gets num_tokens = a.tokens_seen: PyramidKV
  ///    (budgeters::pyramid) then computes every layer's pyramid from the tokens seen, the length all
  ///    layers had before any eviction, so the model-wide average stays at most B after each eviction
  ///    (layers whose lengths diverged would each recompute a pyramid from their own length, and a
  ///    short layer would pass through whole). With num_layers / kv_heads fields too (LKV-H:
  ///    budgeters::headwise_learned, whose heads are ragged after the first eviction) num_tokens is
  ///    the t of its global budgets, and a budget B < t is given as keep_fraction (N B + 1/2) / (N t),
  ///    N = num_layers * kv_heads, whose B_total = floor(fraction * N t) is exactly N * B (a token
  ///    budget would let heads of at most B tokens pass through whole, above their learned budgets).
  /// `Params`: an eviction_policy's params (its .selector has the topk protection fields). Errors
  /// (p and *budget unchanged): null budget, window outside 0..2^31-1, not init()ed, no prefill yet,
  /// `a` not an eviction of this request (a.evict false, another request, a.tokens_seen outside
  /// (last eviction, tokens_seen()]), invalid selector protection fields (num_sink < 0, num_recent < -1,
  /// NaN recent_share), a cap below the protected tokens, protected tokens above 2^31 - 1.
  template <class Params>
  status apply(const decode_action& a, Params& p, std::int64_t window, budget_request* budget) const {
    if (!budget) return status::error(errc::null_pointer, "decode_schedule::apply: budget is null");
    if (window < 0 || window > std::numeric_limits<std::int32_t>::max())
      return status::error(errc::invalid_argument, "decode_schedule::apply: window = %lld must be in 0..2^31-1 (query rows)",
                           static_cast<long long>(window));
    KVEVICT_TRY(check_action("apply", a));
    const auto& sp = p.selector;
    if (sp.num_sink < 0) return status::error(errc::invalid_argument, "decode_schedule::apply: selector.num_sink = %d must be >= 0", int(sp.num_sink));
    if (sp.num_recent < -1)
      return status::error(errc::invalid_argument, "decode_schedule::apply: selector.num_recent = %d must be >= -1", int(sp.num_recent));
    if (std::isnan(sp.recent_share)) return status::error(errc::invalid_argument, "decode_schedule::apply: selector.recent_share is NaN");
    Params q = p;
    auto& s = q.selector;
    const std::int64_t R = opt_.protect_recent;
    std::int64_t B = a.budget.keep_tokens;
    if (prefix_ > s.num_sink) s.num_sink = static_cast<decltype(s.num_sink)>(prefix_);
    if (R > 0) {
      if (s.recent_share >= 0.0f) {
        const std::int64_t free = B - s.num_sink;
        const std::int64_t share = free > 0 ? static_cast<std::int64_t>(static_cast<double>(s.recent_share) * static_cast<double>(free)) : 0;
        if (share < R) {
          s.recent_share = -1.0f;
          s.num_recent = static_cast<decltype(s.num_recent)>(R);
        }
      } else {
        const std::int64_t own = s.num_recent >= 0 ? s.num_recent : window;
        s.num_recent = static_cast<decltype(s.num_recent)>(own > R ? own : R);
      }
    }
    const std::int64_t fixed = s.recent_share >= 0.0f ? 0 : (s.num_recent >= 0 ? s.num_recent : window);
    const std::int64_t need = static_cast<std::int64_t>(s.num_sink) + fixed;
    if (need > std::numeric_limits<std::int32_t>::max())
      return status::error(errc::invalid_argument, "decode_schedule::apply: protected tokens %lld (sinks %d + recent %lld) exceed 2^31 - 1",
                           static_cast<long long>(need), int(s.num_sink), static_cast<long long>(fixed));
    if (B < need) {
      if (opt_.budget.keep_tokens > 0)
        return status::error(errc::invalid_argument,
                             "decode_schedule::apply: budget.keep_tokens = %lld < the tokens always kept = %lld (sinks %d + recent %lld: "
                             "the policy's and protect_prefix / protect_recent); raise the cap",
                             static_cast<long long>(B), static_cast<long long>(need), int(s.num_sink), static_cast<long long>(fixed));
      B = need;
    }
    budget_request b = budget_request::tokens(static_cast<std::int32_t>(B));
    if constexpr (detail::has_num_tokens<decltype(q.budgeter)>::value)
      q.budgeter.num_tokens = static_cast<decltype(q.budgeter.num_tokens)>(a.tokens_seen);
    if constexpr (detail::has_num_tokens<decltype(q.budgeter)>::value && detail::has_model_shape<decltype(q.budgeter)>::value) {
      const std::int64_t n = static_cast<std::int64_t>(q.budgeter.num_layers) * q.budgeter.kv_heads;
      if (n > 0 && B < a.tokens_seen)
        b = budget_request::fraction((static_cast<double>(B) * static_cast<double>(n) + 0.5) /
                                     (static_cast<double>(n) * static_cast<double>(a.tokens_seen)));
    }
    p = q;
    *budget = b;
    return {};
  }

  const decode_schedule_options& options() const { return opt_; }
  bool initialized() const { return ready_; }
  /// t: tokens of the request so far (prompts + generated).
  std::int64_t tokens_seen() const { return t_; }
  /// Generated tokens since the last eviction the engine reported (evicted()).
  std::int64_t pending_tokens() const { return since_; }
  /// The protected prefix of this request (min(protect_prefix, prompt tokens before the first generated
  /// token); 0 before a prefill).
  std::int64_t protected_prefix() const { return prefix_; }
  /// Evictions reported since init() / reset().
  std::int64_t evictions() const { return evictions_; }
  /// Per-head budget at t >= 0 tokens seen: keep_tokens B, or max(1, floor(keep_fraction * t)) capped at
  /// 2^31 - 1 (before init(): the default options' budget, 0).
  std::int64_t budget_at(std::int64_t t) const {
    if (opt_.budget.keep_tokens > 0 || !(opt_.budget.keep_fraction > 0.0)) return opt_.budget.keep_tokens;
    double b = opt_.budget.keep_fraction * static_cast<double>(t);
    if (!(b < 2147483647.0)) b = 2147483647.0;
    const std::int64_t k = static_cast<std::int64_t>(b);
    return k < 1 ? 1 : k;
  }

 private:
  status check_step(const char* fn, std::int64_t tokens, const decode_action* out) const {
    if (!ready_) return status::error(errc::invalid_argument, "decode_schedule::%s: init() first", fn);
    if (!out) return status::error(errc::null_pointer, "decode_schedule::%s: out is null", fn);
    if (tokens < 1) return status::error(errc::invalid_argument, "decode_schedule::%s: tokens = %lld must be >= 1", fn, static_cast<long long>(tokens));
    if (tokens > std::numeric_limits<std::int32_t>::max() - t_)
      return status::error(errc::invalid_argument, "decode_schedule::%s: tokens_seen %lld + %lld exceeds int32 (a cache position)", fn,
                           static_cast<long long>(t_), static_cast<long long>(tokens));
    return {};
  }
  status check_action(const char* fn, const decode_action& a) const {
    if (!ready_) return status::error(errc::invalid_argument, "decode_schedule::%s: init() first", fn);
    if (!prefilled_) return status::error(errc::invalid_argument, "decode_schedule::%s: no prefill yet", fn);
    if (!a.evict) return status::error(errc::invalid_argument, "decode_schedule::%s: the action asked for no eviction", fn);
    if (a.request != request_)
      return status::error(errc::invalid_argument, "decode_schedule::%s: the action belongs to another request (before reset())", fn);
    if (a.tokens_seen > t_ || a.tokens_seen <= last_evict_t_ || a.generated > gen_ || a.generated < 0)
      return status::error(errc::invalid_argument,
                           "decode_schedule::%s: action.tokens_seen = %lld is not in (%lld, %lld] (after the last eviction, at most "
                           "the tokens seen)",
                           fn, static_cast<long long>(a.tokens_seen), static_cast<long long>(last_evict_t_), static_cast<long long>(t_));
    if (a.budget.keep_tokens < 1)
      return status::error(errc::invalid_argument, "decode_schedule::%s: action.budget.keep_tokens = %d is not a resolved budget", fn,
                           a.budget.keep_tokens);
    return {};
  }
  decode_action action() const {
    decode_action a;
    a.tokens_seen = t_;
    a.generated = gen_;
    a.request = request_;
    a.periods = since_ / opt_.interval;
    a.evict = pending_prefill_ || a.periods > 0;
    a.budget = budget_request::tokens(static_cast<std::int32_t>(budget_at(t_)));
    return a;
  }

  decode_schedule_options opt_{};
  bool ready_ = false, prefilled_ = false, pending_prefill_ = false;
  std::int64_t t_ = 0, gen_ = 0, since_ = 0, prefix_ = 0, evictions_ = 0, last_evict_t_ = 0, last_prefill_t_ = 0;
  std::uint64_t request_ = 0;
};

}  // namespace kvevict
