// Tests of include/kvevict/schedule/decode.hpp (decode_schedule): hand-computed action sequences,
// coalescing of late evictions, fraction budgets, protection applied to every preset's params,
// errors (named field, state unchanged), reset, and a randomized engine simulation checked against a
// naive per-token model of the schedule (the cap bound budget + interval, the eviction count).
// The schedule driving real evictions on stories260K is tested in tests/engine/test_evict.cpp.
#include <doctest/doctest.h>

#include <kvevict/kvevict.hpp>
#include <kvevict/schedule/decode.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

using kvevict::budget_request;
using kvevict::decode_action;
using kvevict::decode_schedule;
using kvevict::decode_schedule_options;

namespace {

decode_schedule_options opts(int interval, budget_request b, int prefix = 0, int recent = 0) {
  decode_schedule_options o;
  o.interval = interval;
  o.budget = b;
  o.protect_prefix = prefix;
  o.protect_recent = recent;
  return o;
}

bool has(const kvevict::status& s, const std::string& text) { return std::string(s.message()).find(text) != std::string::npos; }

}  // namespace

TEST_CASE("decode_schedule: hand-computed sequence, interval 4, cap 10") {
  decode_schedule s;
  REQUIRE(s.init(opts(4, budget_request::tokens(10))).ok());
  decode_action a;
  REQUIRE(s.after_prefill(6, &a).ok());
  CHECK(a.evict);
  CHECK(a.periods == 0);
  CHECK(a.tokens_seen == 6);
  CHECK(a.budget.keep_tokens == 10);
  CHECK(a.budget.keep_fraction == 0.0);
  REQUIRE(s.evicted(a).ok());
  CHECK(s.evictions() == 1);
  // tokens 7, 8, 9: nothing due; token 10: one period
  for (int i = 0; i < 3; ++i) {
    REQUIRE(s.after_decode(1, &a).ok());
    CHECK_FALSE(a.evict);
    CHECK(a.periods == 0);
  }
  CHECK(s.pending_tokens() == 3);
  REQUIRE(s.after_decode(1, &a).ok());
  CHECK(a.evict);
  CHECK(a.periods == 1);
  CHECK(a.tokens_seen == 10);
  REQUIRE(s.evicted(a).ok());
  CHECK(s.pending_tokens() == 0);
  CHECK(s.evictions() == 2);
  CHECK(s.tokens_seen() == 10);
}

TEST_CASE("decode_schedule: a late engine gets the due periods coalesced into one eviction") {
  decode_schedule s;
  REQUIRE(s.init(opts(4, budget_request::tokens(8))).ok());
  decode_action a;
  REQUIRE(s.after_prefill(5, &a).ok());
  REQUIRE(s.evicted(a).ok());
  // the engine ignores the due eviction at 4 and 8 tokens
  for (int i = 1; i <= 9; ++i) {
    REQUIRE(s.after_decode(1, &a).ok());
    CHECK(a.evict == (i >= 4));
    CHECK(a.periods == i / 4);
  }
  CHECK(a.periods == 2);
  CHECK(a.tokens_seen == 14);
  const decode_action late = a;
  // two more tokens arrive before the engine gets to evict with `late`
  REQUIRE(s.after_decode(2, &a).ok());
  CHECK(a.periods == 2);  // 11 pending
  REQUIRE(s.evicted(late).ok());
  CHECK(s.pending_tokens() == 2);  // appended after the action
  REQUIRE(s.after_decode(1, &a).ok());
  CHECK_FALSE(a.evict);
  REQUIRE(s.after_decode(1, &a).ok());
  CHECK(a.evict);
  CHECK(a.periods == 1);
  // a multi-token step: 9 tokens at once = 2 periods
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_decode(9, &a).ok());
  CHECK(a.evict);
  CHECK(a.periods == 2);
  CHECK(a.tokens_seen == 14 + 2 + 2 + 9);
}

TEST_CASE("decode_schedule: fraction budget of the tokens seen; no eviction after prefill when asked") {
  decode_schedule s;
  auto o = opts(16, budget_request::fraction(0.25));
  o.evict_after_prefill = false;
  REQUIRE(s.init(o).ok());
  decode_action a;
  REQUIRE(s.after_prefill(3, &a).ok());
  CHECK_FALSE(a.evict);
  CHECK(a.budget.keep_tokens == 1);  // max(1, floor(0.75))
  for (int i = 0; i < 16; ++i) REQUIRE(s.after_decode(1, &a).ok());
  CHECK(a.evict);
  CHECK(a.tokens_seen == 19);
  CHECK(a.budget.keep_tokens == 4);  // floor(0.25 * 19)
  CHECK(s.budget_at(100) == 25);
  CHECK(s.budget_at(0) == 1);
  CHECK(s.budget_at(std::int64_t(1) << 40) == 2147483647);
  decode_schedule f;
  REQUIRE(f.init(opts(1, budget_request::fraction(1.0))).ok());
  CHECK(f.budget_at(512) == 512);
}

TEST_CASE("decode_schedule: multi-turn: a new prompt makes a prefill eviction due again") {
  decode_schedule s;
  REQUIRE(s.init(opts(8, budget_request::tokens(20), 3)).ok());
  decode_action a;
  REQUIRE(s.after_prefill(2, &a).ok());
  CHECK(s.protected_prefix() == 2);  // min(protect_prefix, first prompt)
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_decode(5, &a).ok());
  CHECK_FALSE(a.evict);
  const decode_action before = a;  // not an eviction: refused
  CHECK_FALSE(s.evicted(before).ok());
  REQUIRE(s.after_prefill(10, &a).ok());  // next turn
  CHECK(a.evict);
  CHECK(a.tokens_seen == 17);
  CHECK(s.protected_prefix() == 2);  // the next turn does not move the prefix
  REQUIRE(s.evicted(a).ok());
  CHECK(s.pending_tokens() == 0);
}

TEST_CASE("decode_schedule: an eviction reported for an action taken before a later prompt leaves that prompt's eviction due") {
  decode_schedule s;
  REQUIRE(s.init(opts(2, budget_request::tokens(6))).ok());
  decode_action a;
  REQUIRE(s.after_prefill(4, &a).ok());
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_decode(2, &a).ok());
  REQUIRE(a.evict);
  const decode_action old = a;  // t = 6
  REQUIRE(s.after_prefill(5, &a).ok());
  REQUIRE(s.after_decode(1, &a).ok());
  REQUIRE(s.evicted(old).ok());
  CHECK(s.pending_tokens() == 1);  // the decode token after the new prompt
  REQUIRE(s.after_decode(0 + 1, &a).ok());
  CHECK(a.evict);  // the prompt's eviction is still due
  CHECK(a.periods == 1);
  CHECK_FALSE(s.evicted(old).ok());  // not after the last eviction
}

TEST_CASE("decode_schedule: apply() applies prefix and recent protection to every preset's params") {
  decode_schedule s;
  REQUIRE(s.init(opts(4, budget_request::tokens(40), 4, 8)).ok());
  decode_action a;
  REQUIRE(s.after_prefill(100, &a).ok());
  budget_request b;
  {  // SnapKV: the window (num_recent = -1) protects W = 32 >= 8 recent tokens
    auto p = kvevict::presets::snapkv::defaults();
    REQUIRE(s.apply(a, p, 32, &b).ok());
    CHECK(p.selector.num_sink == 4);
    CHECK(p.selector.num_recent == 32);
    CHECK(b.keep_tokens == 40);
    REQUIRE(s.apply(a, p = kvevict::presets::snapkv::defaults(), 2, &b).ok());
    CHECK(p.selector.num_recent == 8);  // a 2-query window protects fewer than protect_recent
  }
  {  // StreamingLLM: 4 sinks, recent_share 1 covers 8
    auto p = kvevict::presets::streaming_llm::defaults();
    REQUIRE(s.apply(a, p, 0, &b).ok());
    CHECK(p.selector.num_sink == 4);
    CHECK(p.selector.recent_share == 1.0f);
    CHECK(b.keep_tokens == 40);
  }
  {  // H2O: half of (40 - 4) = 18 recent >= 8: unchanged share
    auto p = kvevict::presets::h2o::defaults();
    REQUIRE(s.apply(a, p, 100, &b).ok());
    CHECK(p.selector.recent_share == 0.5f);
    CHECK(p.selector.num_sink == 4);
  }
  {  // TOVA: num_recent 0 -> 8
    auto p = kvevict::presets::tova::defaults();
    REQUIRE(s.apply(a, p, 32, &b).ok());
    CHECK(p.selector.num_recent == 8);
    CHECK(p.selector.num_sink == 4);
  }
  {  // CriticalKV (two_stage selector inherits the topk fields), KeyNorm, ReST-KV, AdaKV, PyramidKV, LKV
    auto c = kvevict::presets::criticalkv::defaults();
    REQUIRE(s.apply(a, c, 16, &b).ok());
    CHECK(c.selector.num_recent == 16);
    auto k = kvevict::presets::key_norm::defaults();
    REQUIRE(s.apply(a, k, 0, &b).ok());
    CHECK(k.selector.num_recent == 8);
    auto r = kvevict::presets::restkv::defaults();
    REQUIRE(s.apply(a, r, 32, &b).ok());
    CHECK(r.selector.num_sink == 4);
    auto d = kvevict::presets::adakv::defaults();
    REQUIRE(s.apply(a, d, 32, &b).ok());
    auto y = kvevict::presets::pyramidkv::defaults();
    REQUIRE(s.apply(a, y, 32, &b).ok());
    CHECK(y.budgeter.num_tokens == 100);  // PyramidKV's pyramid: of the tokens seen, the layers' common length
    auto l = kvevict::lkv::full::defaults();
    REQUIRE(s.apply(a, l, 0, &b).ok());
    CHECK(l.selector.num_recent == 8);
    CHECK(l.selector.num_sink == 4);
    CHECK(l.budgeter.num_tokens == 100);  // LKV-H's t: the tokens seen, not the (ragged) head lengths
  }
  {  // H2O with a small cap: half of (12 - 4) = 4 < 8 -> exactly 8 recent tokens
    decode_schedule t;
    REQUIRE(t.init(opts(4, budget_request::tokens(12), 4, 8)).ok());
    REQUIRE(t.after_prefill(100, &a).ok());
    auto p = kvevict::presets::h2o::defaults();
    REQUIRE(t.apply(a, p, 100, &b).ok());
    CHECK(p.selector.recent_share < 0.0f);
    CHECK(p.selector.num_recent == 8);
    CHECK(b.keep_tokens == 12);
  }
  {  // a fraction budget is raised to the protected tokens (sinks + the window)
    decode_schedule t;
    REQUIRE(t.init(opts(4, budget_request::fraction(0.1), 4, 8)).ok());
    REQUIRE(t.after_prefill(50, &a).ok());
    CHECK(a.budget.keep_tokens == 5);
    auto p = kvevict::presets::snapkv::defaults();
    REQUIRE(t.apply(a, p, 32, &b).ok());
    CHECK(b.keep_tokens == 4 + 32);
    CHECK(kvevict::presets::snapkv::check(p).ok());
  }
  {  // no protection: params and budget untouched
    decode_schedule t;
    REQUIRE(t.init(opts(4, budget_request::tokens(12))).ok());
    REQUIRE(t.after_prefill(100, &a).ok());
    auto p = kvevict::presets::h2o::defaults();
    REQUIRE(t.apply(a, p, 100, &b).ok());
    CHECK(p.selector.recent_share == 0.5f);
    CHECK(p.selector.num_sink == 0);
    CHECK(b.keep_tokens == 12);
    auto l = kvevict::lkv::full::defaults();
    REQUIRE(t.apply(a, l, 0, &b).ok());
    CHECK(l.budgeter.num_tokens == 100);  // set with or without protection
    CHECK_FALSE(t.apply(a, p, -1, &b).ok());
    CHECK(t.apply(a, p, 0, nullptr).code() == kvevict::errc::null_pointer);
  }
}

TEST_CASE("decode_schedule: apply() gives LKV-H a cap as the fraction of the tokens seen with total exactly N * B") {
  std::mt19937 rng(11);
  int checked = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int layers = 1 + int(rng() % 80), heads = 1 + int(rng() % 64);
    const std::int64_t t = 2 + std::int64_t(rng() % 2000000), B = 1 + std::int64_t(rng() % std::uint64_t(t - 1));  // B < t
    decode_schedule s;
    REQUIRE(s.init(opts(1, budget_request::tokens(int(B)))).ok());
    decode_action a;
    REQUIRE(s.after_prefill(t, &a).ok());
    auto p = kvevict::lkv::full::defaults();
    p.budgeter.num_layers = layers;
    p.budgeter.kv_heads = heads;
    budget_request b;
    REQUIRE(s.apply(a, p, 0, &b).ok());
    CHECK(p.budgeter.num_tokens == t);
    REQUIRE(b.keep_tokens == 0);
    REQUIRE(b.keep_fraction > 0.0);
    REQUIRE(b.keep_fraction < 1.0);
    const std::int64_t n = std::int64_t(layers) * heads;
    CHECK(kvevict::budgeters::headwise_learned::total_budget(b, n, t) == n * B);
    ++checked;
  }
  CHECK(checked == 20000);
  // B >= t: every token is kept, the cap stays a token count
  decode_schedule s;
  REQUIRE(s.init(opts(1, budget_request::tokens(50))).ok());
  decode_action a;
  REQUIRE(s.after_prefill(30, &a).ok());
  auto p = kvevict::lkv::full::defaults();
  p.budgeter.num_layers = 5;
  p.budgeter.kv_heads = 4;
  budget_request b;
  REQUIRE(s.apply(a, p, 0, &b).ok());
  CHECK(b.keep_tokens == 50);
  CHECK(b.keep_fraction == 0.0);
}

TEST_CASE("decode_schedule: apply() raises a fraction budget to the policy's protected tokens and refuses a cap below them") {
  decode_schedule s;
  REQUIRE(s.init(opts(4, budget_request::fraction(0.1))).ok());
  decode_action a;
  REQUIRE(s.after_prefill(100, &a).ok());
  CHECK(a.budget.keep_tokens == 10);
  budget_request b;
  auto p = kvevict::presets::snapkv::defaults();
  REQUIRE(s.apply(a, p, 32, &b).ok());  // no protection: still raised to the 32-query window, as plan_head raises a fraction
  CHECK(b.keep_tokens == 32);
  CHECK(p.selector.num_recent == -1);  // params untouched
  auto st = kvevict::presets::streaming_llm::defaults();
  REQUIRE(s.apply(a, st, 0, &b).ok());
  CHECK(b.keep_tokens == 10);  // recent_share: only the 4 sinks are fixed
  // a cap below what the policy always keeps is an error naming the cap (the evictor refuses it too)
  decode_schedule c;
  REQUIRE(c.init(opts(4, budget_request::tokens(8), 0, 6)).ok());
  REQUIRE(c.after_prefill(100, &a).ok());
  auto q = kvevict::presets::snapkv::defaults();
  const auto before = q;
  const kvevict::status e = c.apply(a, q, 32, &b);
  CHECK(has(e, "budget.keep_tokens = 8 < the tokens always kept = 32"));
  CHECK(q.selector.num_recent == before.selector.num_recent);  // unchanged on error
  CHECK(q.selector.num_sink == before.selector.num_sink);
  auto sl = kvevict::presets::streaming_llm::defaults();
  CHECK(has(c.apply(a, sl, 0, &b), "keep_tokens = 8 < the tokens always kept = 10"));  // 4 sinks + 6 recent
}

TEST_CASE("decode_schedule: apply() refuses actions it did not issue and bad params, changing nothing") {
  decode_schedule s;
  decode_action a;
  budget_request b = budget_request::tokens(77);
  auto p = kvevict::presets::snapkv::defaults();
  CHECK(has(s.apply(a, p, 0, &b), "init() first"));
  REQUIRE(s.init(opts(2, budget_request::tokens(40), 3, 4)).ok());
  CHECK(has(s.apply(a, p, 0, &b), "no prefill yet"));
  REQUIRE(s.after_prefill(50, &a).ok());
  decode_action none = a;
  none.evict = false;
  CHECK(has(s.apply(none, p, 0, &b), "asked for no eviction"));
  CHECK(has(s.apply(a, p, (std::int64_t(1) << 32) + 5, &b), "window = 4294967301"));
  CHECK(has(s.apply(a, p, -1, &b), "window = -1"));
  auto bad = p;
  bad.selector.num_sink = -3;
  CHECK(has(s.apply(a, bad, 0, &b), "selector.num_sink = -3"));
  CHECK(bad.selector.num_sink == -3);
  bad = p;
  bad.selector.num_recent = -7;
  CHECK(has(s.apply(a, bad, 0, &b), "selector.num_recent = -7"));
  bad = p;
  bad.selector.recent_share = std::nanf("");
  CHECK(has(s.apply(a, bad, 0, &b), "recent_share is NaN"));
  CHECK(b.keep_tokens == 77);  // untouched by every refusal
  // an action of the previous request is refused after reset()
  const decode_action old = a;
  s.reset();
  REQUIRE(s.after_prefill(60, &a).ok());
  CHECK(has(s.evicted(old), "another request"));
  CHECK(has(s.apply(old, p, 0, &b), "another request"));
  CHECK(s.evictions() == 0);
  // protected tokens above int32 are refused by check()
  CHECK(has(decode_schedule::check(opts(1, budget_request::fraction(0.5), 1, 2147483647)), "exceeds 2^31 - 1"));
}

TEST_CASE("decode_schedule: a stale eviction keeps the tokens generated after it pending, across a later prompt") {
  decode_schedule s;
  auto o = opts(4, budget_request::tokens(20));
  o.evict_after_prefill = false;
  REQUIRE(s.init(o).ok());
  decode_action a;
  REQUIRE(s.after_prefill(10, &a).ok());
  CHECK_FALSE(a.evict);
  for (int i = 0; i < 4; ++i) REQUIRE(s.after_decode(1, &a).ok());
  REQUIRE(a.evict);
  const decode_action a1 = a;  // t = 14, 4 generated
  for (int i = 0; i < 3; ++i) REQUIRE(s.after_decode(1, &a).ok());
  REQUIRE(s.after_prefill(5, &a).ok());
  REQUIRE(s.after_decode(1, &a).ok());
  REQUIRE(s.evicted(a1).ok());
  CHECK(s.pending_tokens() == 4);  // the 3 + 1 generated after a1
  REQUIRE(s.after_decode(1, &a).ok());
  CHECK(a.evict);  // 5 pending: one period due
  CHECK(a.periods == 1);
}

TEST_CASE("decode_schedule: a prompt in chunks protects its first tokens up to protect_prefix") {
  decode_schedule s;
  REQUIRE(s.init(opts(4, budget_request::tokens(40), 10, 0)).ok());
  decode_action a;
  REQUIRE(s.after_prefill(4, &a).ok());
  CHECK(s.protected_prefix() == 4);
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_prefill(4, &a).ok());
  CHECK(s.protected_prefix() == 8);
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_prefill(4, &a).ok());
  CHECK(s.protected_prefix() == 10);
  REQUIRE(s.evicted(a).ok());
  REQUIRE(s.after_decode(1, &a).ok());
  REQUIRE(s.after_prefill(4, &a).ok());  // a turn after a generated token does not move it
  CHECK(s.protected_prefix() == 10);
}

TEST_CASE("decode_schedule: errors name the field and leave the state unchanged") {
  decode_schedule s;
  decode_action a;
  CHECK(has(s.after_prefill(4, &a), "init() first"));
  CHECK(has(s.evicted(a), "init() first"));
  CHECK(has(decode_schedule::check(opts(0, budget_request::tokens(4))), "interval = 0"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::tokens(4), -1)), "protect_prefix = -1"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::tokens(4), 0, -2)), "protect_recent = -2"));
  CHECK(has(decode_schedule::check(opts(1, budget_request{})), "exactly one"));
  budget_request both;
  both.keep_tokens = 3;
  both.keep_fraction = 0.5;
  CHECK(has(decode_schedule::check(opts(1, both)), "exactly one"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::tokens(-3))), "keep_tokens = -3"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::fraction(1.5))), "keep_fraction = 1.5"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::fraction(-0.0 - 1e-9))), "keep_fraction"));
  CHECK(has(decode_schedule::check(opts(1, budget_request::tokens(10), 6, 5)), "6 + 5"));
  CHECK(decode_schedule::check(opts(1, budget_request::tokens(11), 6, 5)).ok());

  REQUIRE(s.init(opts(3, budget_request::tokens(10))).ok());
  CHECK_FALSE(s.init(opts(0, budget_request::tokens(10))).ok());  // refused: options kept
  CHECK(s.options().interval == 3);
  CHECK(has(s.after_decode(1, &a), "no prefill yet"));
  CHECK(has(s.after_prefill(0, &a), "tokens = 0"));
  CHECK(s.after_prefill(1, nullptr).code() == kvevict::errc::null_pointer);
  CHECK(s.tokens_seen() == 0);
  REQUIRE(s.after_prefill(7, &a).ok());
  CHECK(has(s.after_prefill(std::int64_t(1) << 31, &a), "exceeds int32"));
  CHECK(s.tokens_seen() == 7);
  decode_action future = a;
  future.tokens_seen = 8;
  CHECK(has(s.evicted(future), "tokens_seen = 8"));
  CHECK(s.evictions() == 0);
  REQUIRE(s.evicted(a).ok());
  CHECK_FALSE(s.evicted(a).ok());  // twice: not after the last eviction
  CHECK(s.evictions() == 1);
}

TEST_CASE("decode_schedule: reset() gives the same actions for the same request") {
  decode_schedule s;
  REQUIRE(s.init(opts(3, budget_request::fraction(0.3), 2, 1)).ok());
  auto run = [&](std::vector<long long>& log) {
    decode_action a;
    REQUIRE(s.after_prefill(9, &a).ok());
    log.push_back(a.evict * 1000000 + a.budget.keep_tokens);
    if (a.evict) REQUIRE(s.evicted(a).ok());
    for (int i = 0; i < 20; ++i) {
      REQUIRE(s.after_decode(1 + i % 2, &a).ok());
      log.push_back(a.evict * 1000000 + a.periods * 1000 + a.budget.keep_tokens);
      if (a.evict && i % 3 != 0) REQUIRE(s.evicted(a).ok());
    }
  };
  std::vector<long long> x, y;
  run(x);
  CHECK(s.tokens_seen() > 0);
  s.reset();
  CHECK(s.tokens_seen() == 0);
  CHECK(s.pending_tokens() == 0);
  CHECK(s.evictions() == 0);
  CHECK(s.protected_prefix() == 0);
  run(y);
  CHECK(x == y);
}

TEST_CASE("decode_schedule: randomized engine vs a per-token model; the cap holds budget + interval") {
  std::mt19937 rng(7);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int interval = 1 + int(rng() % 20), cap = 1 + int(rng() % 50), prompt = 1 + int(rng() % 80);
    const bool late_engine = rng() % 2 == 0;
    decode_schedule s;
    REQUIRE(s.init(opts(interval, budget_request::tokens(cap))).ok());
    decode_action a;
    REQUIRE(s.after_prefill(prompt, &a).ok());
    REQUIRE(a.evict);
    REQUIRE(s.evicted(a).ok());
    std::int64_t len = std::min(prompt, cap);  // a head's length under a uniform cap
    std::int64_t model_pending = 0, evictions = 1, peak = len;
    for (int step = 0; step < 300; ++step) {
      const int n = late_engine ? 1 + int(rng() % 3) : 1;
      REQUIRE(s.after_decode(n, &a).ok());
      len += n;
      model_pending += n;
      peak = std::max(peak, len);
      CHECK(a.evict == (model_pending >= interval));
      CHECK(a.periods == model_pending / interval);
      CHECK(a.budget.keep_tokens == cap);
      const bool engine_busy = late_engine && rng() % 4 == 0;
      if (a.evict && !engine_busy) {
        REQUIRE(s.evicted(a).ok());
        len = std::min<std::int64_t>(len, cap);
        model_pending = 0;
        ++evictions;
      }
      ++checked;
    }
    CHECK(s.evictions() == evictions);
    if (!late_engine) CHECK(peak <= std::max<std::int64_t>(prompt, cap + interval));
  }
  CHECK(checked == 60000);
}
