// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over the decode-time eviction schedule (include/kvevict/schedule/decode.hpp):
// any options and any sequence of init / after_prefill / after_decode / apply / evicted / reset
// calls, with the actions the schedule issued, stale ones and forged ones, applied to the params of
// three presets (SnapKV: a fixed recent window; H2O: a recent share; LKV: LKV-H's num_tokens and
// fraction conversion) and PyramidKV (num_tokens).
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * an error names the schedule ("decode_schedule") and leaves its state unchanged (every getter);
//    apply() leaves params and budget unchanged on error, and refuses an action the schedule did
//    not issue, one already served and one of another request (evicted() too);
//  * a successful apply() protects every protected token: planned by the evictor's own rule
//    (detail::plan_row) at the head's length and at the tokens seen, the sinks cover
//    min(protected_prefix(), L) and the recent tokens min(protect_recent, L - sinks), or the head
//    passes through whole; a cap budget is returned unchanged (and holds the protected tokens), a
//    fraction budget is raised to the policy's protected tokens and to nothing else; LKV-H and
//    PyramidKV get num_tokens = tokens_seen;
//  * an eviction is due exactly when interval generated tokens are pending (periods = pending /
//    interval); after the engine serves the latest action nothing is pending, and while it serves
//    every due eviction the pending tokens are exactly those generated since: an engine that evicts
//    whenever asked holds what the eviction left plus fewer than interval generated tokens (plus the
//    prompt tokens appended since).
// Input format: one options block (see read_options), then ops of 2 bytes each until the input ends.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fuzz/fuzz_common.hpp"
#include <kvevict/kvevict.hpp>
#include <kvevict/schedule/decode.hpp>

namespace {

using kvevict_fuzz::reader;
using kvevict_fuzz::verbose;

/// Mostly small valid values; sometimes a raw int32 (negative, huge).
std::int32_t small_or_raw(reader& r, int span) {
  const std::uint8_t m = r.u8();
  if (m < 224) return static_cast<std::int32_t>(m % span);
  return r.i32();
}

kvevict::decode_schedule_options read_options(reader& r) {
  kvevict::decode_schedule_options o;
  o.interval = small_or_raw(r, 33);
  const std::uint8_t kind = r.u8();
  if (kind % 4 == 0) {
    o.budget = kvevict::budget_request::fraction(static_cast<double>(r.u8()) / 200.0);  // 0 .. 1.275
  } else if (kind % 4 == 3) {  // neither, or both
    o.budget.keep_tokens = r.u8() % 2 ? small_or_raw(r, 80) : 0;
    o.budget.keep_fraction = r.u8() % 2 ? 0.25 : 0.0;
  } else {
    o.budget = kvevict::budget_request::tokens(small_or_raw(r, 120));
  }
  o.protect_prefix = r.u8() % 4 == 0 ? small_or_raw(r, 40) : 0;
  o.protect_recent = r.u8() % 4 == 0 ? small_or_raw(r, 40) : 0;
  o.evict_after_prefill = r.u8() % 8 != 0;
  return o;
}

struct snapshot {
  bool init;
  std::int64_t t, pending, prefix, evictions;
  bool operator==(const snapshot& o) const {
    return init == o.init && t == o.t && pending == o.pending && prefix == o.prefix && evictions == o.evictions;
  }
};
snapshot snap(const kvevict::decode_schedule& s) {
  return {s.initialized(), s.tokens_seen(), s.pending_tokens(), s.protected_prefix(), s.evictions()};
}

void check_error(const kvevict::status& st, const kvevict::decode_schedule& before, const kvevict::decode_schedule& after) {
  FUZZ_ASSERT(!st.ok(), "");
  FUZZ_ASSERT(std::strstr(st.message(), "decode_schedule") != nullptr, st.message());
  FUZZ_ASSERT(snap(before) == snap(after), st.message());
}

/// The protection property of apply()'s output for a head of L tokens and `window` query rows,
/// planned by the evictor's own rule (detail::plan_row: PyramidKV plans from num_tokens).
template <class Policy>
void check_protection(const kvevict::decode_schedule& s, const kvevict::budget_request& b, const typename Policy::params& p,
                      std::int64_t window, std::int64_t L) {
  const kvevict::detail::head_plan h = kvevict::detail::plan_row<typename Policy::budgeter>(p.budgeter, b, p.selector, L, window, 0, 0, 4);
  if (h.pass_through) return;
  const std::int64_t want_sinks = s.protected_prefix() < L ? s.protected_prefix() : L;
  FUZZ_ASSERT(h.sinks >= want_sinks, "a protected prefix token is a candidate");
  const std::int64_t R = s.options().protect_recent, room = L - h.sinks;
  FUZZ_ASSERT(h.recent >= (R < room ? R : room), "a protected recent token is a candidate");
}

/// The fields apply() may change: the selector's protection and the budgeter's num_tokens.
template <class Params>
bool same_params(const Params& a, const Params& b) {
  bool same = a.selector.num_sink == b.selector.num_sink && a.selector.num_recent == b.selector.num_recent &&
              std::memcmp(&a.selector.recent_share, &b.selector.recent_share, sizeof(float)) == 0;
  if constexpr (kvevict::detail::has_num_tokens<decltype(a.budgeter)>::value) same = same && a.budgeter.num_tokens == b.budgeter.num_tokens;
  return same;
}

template <class Policy>
void apply_one(kvevict::decode_schedule& s, const kvevict::decode_action& a, typename Policy::params p, std::int64_t window, bool issued,
               std::int64_t length) {
  const typename Policy::params before = p;
  kvevict::budget_request b = kvevict::budget_request::tokens(-3);
  const kvevict::decode_schedule copy = s;
  const kvevict::status st = s.apply(a, p, window, &b);
  if (!st.ok()) {
    check_error(st, copy, s);
    FUZZ_ASSERT(same_params(before, p), "apply() changed params on error");
    FUZZ_ASSERT(b.keep_tokens == -3 && b.keep_fraction == 0.0, "apply() changed the budget on error");
    FUZZ_ASSERT(!issued || window < 0 || window > 0x7fffffff || std::strstr(st.message(), "selector") ||
                    std::strstr(st.message(), "tokens always kept") || std::strstr(st.message(), "exceed"),
                st.message());
    return;
  }
  FUZZ_ASSERT(issued, "apply() accepted an action the schedule did not issue");
  if constexpr (kvevict::detail::has_num_tokens<decltype(p.budgeter)>::value)
    FUZZ_ASSERT(p.budgeter.num_tokens == a.tokens_seen, "num_tokens is not the tokens seen");
  if (b.keep_fraction > 0.0) return;  // LKV-H: a cap as the fraction of the tokens seen (tested in test_schedule)
  // The budget: a cap is kept as it is; a fraction budget (resolved at t) is raised to the tokens the
  // policy always keeps, and to nothing else.
  const auto& sp = p.selector;
  const std::int64_t fixed = sp.recent_share >= 0.0f ? 0 : (sp.num_recent >= 0 ? sp.num_recent : window);
  const std::int64_t need = static_cast<std::int64_t>(sp.num_sink) + fixed;
  if (s.options().budget.keep_tokens > 0) {
    FUZZ_ASSERT(b.keep_tokens == a.budget.keep_tokens, "a cap changed");
    FUZZ_ASSERT(b.keep_tokens >= need, "a cap below the protected tokens was accepted");
  } else {
    FUZZ_ASSERT(b.keep_tokens == (a.budget.keep_tokens > need ? a.budget.keep_tokens : need), "a fraction budget raised to another value");
  }
  check_protection<Policy>(s, b, p, window, length);
  check_protection<Policy>(s, b, p, window, a.tokens_seen);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader r{data, size};
  kvevict::decode_schedule s;
  kvevict::decode_action last{};  // the last action the schedule issued
  bool have = false;
  std::int64_t len = 0, prompt = 0, window = 8;  // a uniform-budget head, as the engine holds it
  bool declined = false;  // the engine appended tokens while an eviction it was asked for was due
  std::int64_t gen_since = 0;  // generated tokens since the last eviction the engine ran
  {
    const kvevict::decode_schedule_options o = read_options(r);
    const kvevict::decode_schedule copy = s;
    const kvevict::status st = s.init(o);
    if (!st.ok()) {
      check_error(st, copy, s);
      if (verbose()) std::printf("init: %s\n", st.message());
      return 0;
    }
  }
  auto cap = [&]() { return s.options().budget.keep_tokens; };
  int ops = 0;
  while (!r.done() && ops < 512) {
    ++ops;
    const std::uint8_t op = r.u8(), arg = r.u8();
    const kvevict::decode_schedule copy = s;
    kvevict::decode_action a{};
    kvevict::status st;
    switch (op % 9) {
      case 0:
      case 1: {  // a prompt (or chunk) appended
        const std::int64_t n = arg % 64 == 63 ? -1 : arg % 64 + (arg >= 192 ? 200 : 0);
        st = s.after_prefill(n, &a);
        if (!st.ok()) { check_error(st, copy, s); break; }
        declined = declined || (have && last.evict);
        len += n, prompt += n;
        last = a, have = true;
        break;
      }
      case 2:
      case 3:
      case 4: {  // generated tokens
        const std::int64_t n = arg % 16 == 15 ? 0 : 1 + (arg % 4 == 0 ? arg % 7 : 0);
        st = s.after_decode(n, &a);
        if (!st.ok()) { check_error(st, copy, s); break; }
        declined = declined || (have && last.evict);
        len += n;
        gen_since += n;
        last = a, have = true;
        // the schedule's contract: an eviction is due iff interval generated tokens are pending (or a prompt's)
        FUZZ_ASSERT(a.periods == s.pending_tokens() / s.options().interval, "");
        FUZZ_ASSERT(a.evict || s.pending_tokens() < s.options().interval, "interval tokens pending without an eviction");
        break;
      }
      case 5: {  // the engine runs the due eviction: apply to every preset, then evicted()
        if (!have) break;
        window = arg % 40;
        apply_one<kvevict::presets::snapkv>(s, last, kvevict::presets::snapkv::defaults(), window, last.evict, len);
        apply_one<kvevict::presets::h2o>(s, last, kvevict::presets::h2o::defaults(), window, last.evict, len);
        apply_one<kvevict::presets::pyramidkv>(s, last, kvevict::presets::pyramidkv::defaults(), window, last.evict, len);
        auto l = kvevict::lkv::full::defaults();
        l.budgeter.num_layers = 2, l.budgeter.kv_heads = 2;
        apply_one<kvevict::lkv::full>(s, last, l, window, last.evict, len);
        st = s.evicted(last);
        if (!last.evict) { check_error(st, copy, s); break; }
        FUZZ_ASSERT(st.ok(), st.message());
        FUZZ_ASSERT(cap() <= 0 || last.budget.keep_tokens == cap(), "a cap resolved to another budget");
        len = len < last.budget.keep_tokens ? len : last.budget.keep_tokens;  // a uniform head after the eviction
        gen_since = 0;
        declined = false;  // the latest action is served: nothing is pending any more
        FUZZ_ASSERT(s.pending_tokens() == 0, "tokens pending after the latest action was served");
        // the same action again is refused, state unchanged
        const kvevict::decode_schedule again = s;
        check_error(s.evicted(last), again, s);
        kvevict::budget_request b;
        auto p = kvevict::presets::snapkv::defaults();
        check_error(s.apply(last, p, 8, &b), again, s);
        last.evict = false;
        break;
      }
      case 6: {  // a forged action: another request, the future, or no eviction
        kvevict::decode_action f = have ? last : kvevict::decode_action{};
        f.evict = true;
        if (arg % 3 == 0) f.request += 1 + arg;
        else if (arg % 3 == 1) f.tokens_seen = s.tokens_seen() + 1 + arg;
        else f.evict = false;
        apply_one<kvevict::presets::snapkv>(s, f, kvevict::presets::snapkv::defaults(), 8, false, len);
        check_error(s.evicted(f), copy, s);
        break;
      }
      case 7: {  // request end
        s.reset();
        len = prompt = gen_since = 0;
        have = false;
        declined = false;
        FUZZ_ASSERT(s.tokens_seen() == 0 && s.evictions() == 0 && s.pending_tokens() == 0, "");
        break;
      }
      default: {  // apply() with a bad window or null budget
        if (!have) break;
        auto p = kvevict::presets::snapkv::defaults();
        const auto before = p;
        kvevict::budget_request b;
        st = arg % 2 ? s.apply(last, p, 8, nullptr) : s.apply(last, p, -1 - static_cast<std::int64_t>(arg), &b);
        check_error(st, copy, s);
        FUZZ_ASSERT(same_params(before, p), "apply() changed params on error");
        break;
      }
    }
    // The cap bound while the engine evicts whenever asked: a head holds what the last eviction left
    // (<= B), the prompt tokens appended since and fewer than interval generated tokens.
    // With every due eviction served by the latest action, the pending tokens are exactly the tokens
    // generated since (so, by the contract above, fewer than interval once it is served).
    if (!declined && have) FUZZ_ASSERT(gen_since == s.pending_tokens(), "pending tokens differ from the tokens generated since the eviction");
  }
  if (verbose()) std::printf("ops %d, t %lld, evictions %lld, len %lld\n", ops, static_cast<long long>(s.tokens_seen()),
                             static_cast<long long>(s.evictions()), static_cast<long long>(len));
  return 0;
}
