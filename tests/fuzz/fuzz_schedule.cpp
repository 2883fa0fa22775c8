// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over the decode-time eviction schedule (include/kvevict/schedule/decode.hpp):
// any options and any sequence of init / after_prefill / after_decode / apply / evicted / reset
// calls, with the actions the schedule issued, stale ones and forged ones, applied to the params of
// three presets (SnapKV: a fixed recent window; H2O: a recent share; LKV: LKV-H's num_tokens and
// fraction conversion) and PyramidKV (num_tokens).
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * an error names the schedule ("decode_schedule") and leaves its state unchanged (every getter,
//    and the next action it issues); apply() leaves params and budget unchanged on error;
//  * a successful apply() protects every protected token: planned by the evictor's own rule
//    (detail::plan_head) for any head length L, the sinks cover min(protected_prefix(), L) and the
//    recent tokens min(protect_recent, L - sinks), or the head passes through whole; a cap budget is
//    never changed, a fraction budget is raised only to the protected tokens; LKV-H and PyramidKV
//    get num_tokens = tokens_seen;
//  * an eviction is due exactly when interval generated tokens are pending (periods = pending /
//    interval), and the cap bound: an engine that evicts a uniform-budget head whenever asked holds at
//    most max(prompt tokens, B) + interval tokens, and min(its length, B) after each eviction;
//  * evicted() and apply() refuse an action twice and an action of another request.
// Input format: one options block (see read_options), then ops of 2 bytes each until the input ends.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <kvevict/kvevict.hpp>
#include <kvevict/schedule/decode.hpp>

namespace {

struct reader {
  const std::uint8_t* p;
  std::size_t n, i = 0;
  bool done() const { return i >= n; }
  std::uint8_t u8() { return i < n ? p[i++] : 0; }
  std::int32_t i32() {
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= static_cast<std::uint32_t>(u8()) << (8 * k);
    return static_cast<std::int32_t>(v);
  }
};

[[noreturn]] void die(const char* what, const char* detail) {
  std::fprintf(stderr, "kvevict fuzz_schedule invariant violated: %s %s\n", what, detail ? detail : "");
  std::abort();
}
#define FUZZ_ASSERT(cond, detail) \
  do {                            \
    if (!(cond)) die(#cond, detail); \
  } while (0)

bool verbose() {
  static const bool v = std::getenv("KVEVICT_FUZZ_VERBOSE") != nullptr;
  return v;
}

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

/// The protection property of apply()'s output for a head of L tokens and `window` query rows.
template <class Params>
void check_protection(const kvevict::decode_schedule& s, const kvevict::budget_request& b, const Params& p, std::int64_t window,
                      std::int64_t L) {
  const kvevict::detail::head_plan h = kvevict::detail::plan_head(b, p.selector, L, window);
  if (h.pass_through) return;
  const std::int64_t want_sinks = s.protected_prefix() < L ? s.protected_prefix() : L;
  FUZZ_ASSERT(h.sinks >= want_sinks, "a protected prefix token is a candidate");
  const std::int64_t R = s.options().protect_recent, room = L - h.sinks;
  FUZZ_ASSERT(h.recent >= (R < room ? R : room), "a protected recent token is a candidate");
}

template <class Params>
void apply_one(kvevict::decode_schedule& s, const kvevict::decode_action& a, Params p, std::int64_t window, bool issued,
               std::int64_t length) {
  const Params before = p;
  kvevict::budget_request b = kvevict::budget_request::tokens(-3);
  const kvevict::decode_schedule copy = s;
  const kvevict::status st = s.apply(a, p, window, &b);
  if (!st.ok()) {
    check_error(st, copy, s);
    FUZZ_ASSERT(std::memcmp(&before, &p, sizeof p) == 0, "apply() changed params on error");
    FUZZ_ASSERT(b.keep_tokens == -3, "apply() changed the budget on error");
    FUZZ_ASSERT(!issued || window < 0 || window > 0x7fffffff || std::strstr(st.message(), "selector") ||
                    std::strstr(st.message(), "tokens always kept") || std::strstr(st.message(), "exceed"),
                st.message());
    return;
  }
  FUZZ_ASSERT(issued, "apply() accepted an action the schedule did not issue");
  if (s.options().budget.keep_tokens > 0) FUZZ_ASSERT(b.keep_tokens == a.budget.keep_tokens || b.keep_fraction > 0.0, "a cap changed");
  if constexpr (kvevict::detail::has_num_tokens<decltype(p.budgeter)>::value)
    FUZZ_ASSERT(p.budgeter.num_tokens == a.tokens_seen, "num_tokens is not the tokens seen");
  if (b.keep_tokens > 0) {
    check_protection(s, b, p, window, length);
    check_protection(s, b, p, window, a.tokens_seen);
  }
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
        apply_one(s, last, kvevict::presets::snapkv::defaults(), window, last.evict, len);
        apply_one(s, last, kvevict::presets::h2o::defaults(), window, last.evict, len);
        apply_one(s, last, kvevict::presets::pyramidkv::defaults(), window, last.evict, len);
        auto l = kvevict::lkv::full::defaults();
        l.budgeter.num_layers = 2, l.budgeter.kv_heads = 2;
        apply_one(s, last, l, window, last.evict, len);
        st = s.evicted(last);
        if (!last.evict) { check_error(st, copy, s); break; }
        FUZZ_ASSERT(st.ok(), st.message());
        FUZZ_ASSERT(cap() <= 0 || last.budget.keep_tokens == cap(), "a cap resolved to another budget");
        len = len < last.budget.keep_tokens ? len : last.budget.keep_tokens;  // a uniform head after the eviction
        gen_since = 0;
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
        apply_one(s, f, kvevict::presets::snapkv::defaults(), 8, false, len);
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
        FUZZ_ASSERT(std::memcmp(&before, &p, sizeof p) == 0, "");
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
