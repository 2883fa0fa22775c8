// SPDX-License-Identifier: Apache-2.0
// Failure kinds 1 (degenerate sizes), 2 (protected tokens lost to ties), 4 (GQA accounting),
// 5 (positions after eviction), 9 (memory and accounting) and 10 (sinks and ordering) of
// /shared/spec/failure-kinds.md, at the public API, for every preset (registry-style).
// Every successful run is checked by robust::contract, an independent re-derivation of the
// documented selection rule (docs/semantics.md).
#include <doctest/doctest.h>

#include "robustness/robust_common.hpp"

using namespace robust;

namespace {

shape small_shape(std::int64_t S, std::int64_t W) {
  shape s;
  s.B = 2;
  s.Hkv = 2;
  s.G = 2;
  s.S = S;
  s.W = W;
  s.D = 4;
  s.layout = kvevict::kv_layout::hnd;
  return s;
}

template <class P>
std::int32_t tokens_for(std::int64_t W, std::int32_t want) {
  return std::max(min_tokens_budget<P>(P::defaults(), W), want);
}

template <class P, class T>
result run_checked(const problem<T>& pr, kvevict::budget_request budget,
                   const typename P::params& params = P::defaults()) {
  kvevict::evictor<P, kvevict::cpu::backend> ev(params);
  result r = run_evictor(ev, pr.in, budget);
  REQUIRE_MESSAGE(r.st.ok(), r.st.message());
  const std::string bad = check_contract(ev, pr, r, budget);
  CHECK_MESSAGE(bad.empty(), bad);
  return r;
}

bool message_has(const kvevict::status& s, const char* what) { return std::string(s.message()).find(what) != std::string::npos; }

}  // namespace

// ------------------------------------------------------------------------------------ kind 1

TEST_CASE_TEMPLATE("kind 1: zero or one cached token, prompt <= window, budget >= length", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  const bool eq = P::defaults().gqa == kvevict::gqa_reduction::layer_mean;
  // Heads of length 0 and 1 (per-sequence lengths for TOVA, per-head otherwise), W = 3.
  {
    problem<float> pr;
    shape s = small_shape(12, 3);
    s.lengths = eq ? std::vector<std::int32_t>{0, 0, 1, 1} : std::vector<std::int32_t>{0, 1, 12, 2};
    pr.init(s, 1);
    set_layer<P>(pr);
    for (auto budget : {kvevict::budget_request::tokens(tokens_for<P>(3, 5)), kvevict::budget_request::fraction(0.5),
                        kvevict::budget_request::fraction(1e-9)}) {
      const result r = run_checked<P>(pr, budget);
      CHECK(r.row(0).empty());  // the zero-length head keeps nothing, and is not an error
      const std::int64_t H = r.rows / s.B;
      if (!eq) CHECK(r.row(1 * H / s.Hkv) == std::vector<std::int32_t>{0});  // one token: kept
    }
  }
  // The whole cache is one or zero tokens (seq extent 1 / 0).
  for (std::int64_t S : {1, 0}) {
    CAPTURE(S);
    problem<float> pr;
    shape s = small_shape(S, 1);
    if (S == 0) s.with_queries = false;  // no window can be cached in an empty cache
    pr.init(s, 2);
    set_layer<P>(pr);
    kvevict::evictor<P, kvevict::cpu::backend> ev;
    const auto budget = kvevict::budget_request::tokens(tokens_for<P>(s.with_queries ? 1 : 0, 4));
    if (S == 0 && traits<P>::needs_queries) {
      const auto st = ev.can_implement(pr.in, budget);
      CHECK(st.code() == kvevict::errc::null_pointer);
      CHECK(message_has(st, "queries"));
      continue;
    }
    const result r = run_checked<P>(pr, budget);
    CHECK(r.max_selected == S * r.rows);
  }
  // Prompt equal to the window, and prompt shorter than the window (through lengths: the head
  // uses its last L window rows and is passed through).
  {
    problem<float> pr;
    shape s = small_shape(8, 8);
    s.lengths = eq ? std::vector<std::int32_t>{8, 8, 5, 5} : std::vector<std::int32_t>{8, 5, 3, 8};
    pr.init(s, 3);
    set_layer<P>(pr);
    for (auto budget : {kvevict::budget_request::tokens(tokens_for<P>(8, 8)), kvevict::budget_request::fraction(0.25)}) {
      const result r = run_checked<P>(pr, budget);
      // Window-protecting presets keep everything; others may evict inside the window.
      if (P::defaults().selector.num_recent < 0 && P::defaults().selector.recent_share < 0.0f)
        CHECK(r.max_selected == (eq ? 8 + 8 + 5 + 5 : 8 + 5 + 3 + 8) * (r.rows / (s.B * s.Hkv)));
    }
  }
  // Prompt shorter than the window as shapes (the window queries' keys are not cached): error.
  {
    problem<float> pr;
    shape s = small_shape(4, 6);
    s.with_queries = true;
    pr.init(s, 4);
    kvevict::evictor<P, kvevict::cpu::backend> ev;
    const auto st = ev.can_implement(pr.in, kvevict::budget_request::tokens(8));
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK(message_has(st, "window = 6 > seq_len = 4"));
  }
  // Budget >= length: pass-through, every slot in order, no scoring (scores 0).
  {
    problem<half_t> pr;
    pr.init(small_shape(9, 2), 5);
    set_layer<P>(pr);
    for (auto budget : {kvevict::budget_request::tokens(9), kvevict::budget_request::tokens(1000000),
                        kvevict::budget_request::fraction(1.0)}) {
      const result r = run_checked<P>(pr, budget);
      for (std::int64_t row = 0; row < r.rows; ++row)
        CHECK(r.row(row) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
      for (float x : r.scores) CHECK(x == 0.0f);
    }
  }
}

TEST_CASE_TEMPLATE("kind 1: contradictory budgets are clear errors, fractions never empty a head", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  problem<float> pr;
  pr.init(small_shape(30, 6), 6);
  set_layer<P>(pr);
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  struct bad_case {
    kvevict::budget_request b;
    const char* text;
  };
  kvevict::budget_request both;
  both.keep_tokens = 5;
  both.keep_fraction = 0.5;
  const bad_case bad[] = {
      {kvevict::budget_request::tokens(0), "neither keep_tokens nor keep_fraction"},  // budget 0
      {kvevict::budget_request::tokens(-3), "budget.keep_tokens = -3"},
      {kvevict::budget_request::fraction(0.0), "neither keep_tokens nor keep_fraction"},
      {kvevict::budget_request::fraction(-0.1), "budget.keep_fraction = -0.1"},
      {kvevict::budget_request::fraction(1.5), "budget.keep_fraction = 1.5"},
      {kvevict::budget_request::fraction(std::numeric_limits<double>::quiet_NaN()), "budget.keep_fraction = nan"},
      {kvevict::budget_request::fraction(std::numeric_limits<double>::infinity()), "budget.keep_fraction = inf"},
      {both, "both set"},
  };
  for (const auto& c : bad) {
    CAPTURE(c.text);
    const auto st = ev.can_implement(pr.in, c.b);
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK_MESSAGE(message_has(st, c.text), st.message());
    // run() refuses identically and writes nothing.
    std::vector<std::int32_t> indptr(9, -5), idx(64, -5);
    std::vector<unsigned char> ws(ev.workspace_size(pr.in));
    const auto st2 = ev.run(pr.in, c.b, kvevict::selection_view{indptr.data(), idx.data(), nullptr, 64}, ws.data(), ws.size());
    CHECK(st2.code() == st.code());
    CHECK(indptr == std::vector<std::int32_t>(9, -5));
    CHECK(idx == std::vector<std::int32_t>(64, -5));
    CHECK(ev.max_selected(pr.in, c.b) == -1);
  }
  // Window >= budget (the window is protected by rule, so the budget cannot hold it).
  const std::int32_t need = min_tokens_budget<P>(P::defaults(), 6);
  if (need > 1) {
    const auto st = ev.can_implement(pr.in, kvevict::budget_request::tokens(need - 1));
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK_MESSAGE(message_has(st, "budget.keep_tokens"), st.message());
    // Exactly the protected count is fine: only protected tokens are kept.
    const result r = run_checked<P>(pr, kvevict::budget_request::tokens(need));
    CHECK(r.max_selected == need * r.rows);
  }
  // Fractions that round a head's budget to 0 are raised (to the protected count and to 1).
  for (double f : {1e-300, 1e-6, 0.01}) {
    CAPTURE(f);
    const result r = run_checked<P>(pr, kvevict::budget_request::fraction(f));
    for (std::int64_t row = 0; row < r.rows; ++row) CHECK(!r.row(row).empty());
  }
}

TEST_CASE_TEMPLATE("kind 1: nothing protected and ~1 token per head never empties a head (head-wise budgeters, every GQA rule)", P,
                   kvevict::presets::pyramidkv, kvevict::presets::adakv, kvevict::presets::critical_adakv) {
  // CI's fuzz run found AdaKV giving a head 0 tokens with num_recent = 0 and no sinks; the
  // budgeters now keep >= 1 token in a head with nothing protected. Ragged lengths (0, 1, 2, 3
  // and full heads), sinks 0 (floored), 1 and 3 (>= some lengths: protected, not floored),
  // layers 0..3 of 4, the contract checker on every run, plus the totals the contract cannot see:
  // AdaKV keeps exactly sum_h B_h per sequence (pass-through: L), PyramidKV sum_l = 4 B per head.
  CAPTURE(preset_name<P>());
  constexpr bool is_pyramid = std::is_same<typename P::budgeter, kvevict::budgeters::pyramid>::value;
  int floored = 0;
  for_each_storage_type([&](auto tag) {
    using T = typename decltype(tag)::type;
    CAPTURE(type_name<T>());
    for (kvevict::gqa_reduction g : {kvevict::gqa_reduction::mean, kvevict::gqa_reduction::per_query_head, kvevict::gqa_reduction::max})
      for (std::int32_t sinks : {0, 1, 3}) {
        shape s;
        s.B = 3, s.Hkv = 3, s.G = 2, s.S = 20, s.W = 3, s.D = 4;
        s.lengths = std::vector<std::int32_t>{20, 0, 2, 1, 20, 3, 5, 17, 20};  // move-assigned: no GCC 12 -Wnonnull false positive
        problem<T> pr;
        pr.init(s, 900 + static_cast<std::uint64_t>(sinks));
        auto p = P::defaults();
        p.selector.num_recent = 0;
        p.selector.num_sink = sinks;
        p.gqa = g;
        kvevict::evictor<P, kvevict::cpu::backend> ev(p);
        for (const kvevict::budget_request budget : {kvevict::budget_request::tokens(sinks + 1), kvevict::budget_request::tokens(sinks + 2),
                                                     kvevict::budget_request::fraction(1e-300), kvevict::budget_request::fraction(0.004)}) {
          CAPTURE(kvevict::to_string(g));
          CAPTURE(sinks);
          CAPTURE(budget.keep_tokens);
          CAPTURE(budget.keep_fraction);
          const contract c = contract::of<P>(p, s.W, ev.out_heads(pr.in), s.Hkv, budget);
          std::vector<std::int64_t> over_layers;
          for (int layer = 0; layer < 4; ++layer) {
            CAPTURE(layer);
            pr.in.layer_idx = layer;
            pr.in.num_layers = 4;
            const result r = run_checked<P>(pr, budget, p);
            const std::int64_t H = ev.out_heads(pr.in), Gr = H / s.Hkv;
            over_layers.resize(static_cast<std::size_t>(r.rows), 0);
            for (std::int64_t b = 0; b < s.B; ++b) {
              std::int64_t kept = 0, want = 0;
              for (std::int64_t h = 0; h < H; ++h) {
                const std::int64_t row = b * H + h, L = pr.length(b, h / Gr), n = static_cast<std::int64_t>(r.row(row).size());
                CHECK((L == 0 || n >= 1));
                floored += sinks == 0 && L > 1 && n == 1;
                kept += n;
                want += std::min(L, c.base_budget(L));
                over_layers[static_cast<std::size_t>(row)] += n;
              }
              if (!is_pyramid) CHECK(kept == want);
            }
          }
          if (is_pyramid)
            for (std::int64_t row = 0; row < static_cast<std::int64_t>(over_layers.size()); ++row) {
              const std::int64_t H = ev.out_heads(pr.in), L = pr.length(row / H, (row % H) / (H / s.Hkv));
              CHECK(over_layers[static_cast<std::size_t>(row)] == 4 * std::min(L, c.base_budget(L)));
            }
        }
      }
  });
  CHECK(floored > 20);
}

TEST_CASE_TEMPLATE("kind 1: invalid parameters are clear errors naming the parameter", P, kvevict::presets::restkv) {
  problem<float> pr;
  pr.init(small_shape(30, 6), 7);
  struct param_case {
    void (*set)(typename P::params&);
    const char* text;
  };
  const param_case cases[] = {
      {[](typename P::params& p) { p.temporal.alpha = 0.0f; }, "temporal.alpha = 0"},
      {[](typename P::params& p) { p.temporal.alpha = std::numeric_limits<float>::quiet_NaN(); }, "temporal.alpha = nan"},
      {[](typename P::params& p) { p.spatial.beta = -1.0f; }, "spatial.beta = -1"},
      {[](typename P::params& p) { p.spatial.beta = std::numeric_limits<float>::infinity(); }, "spatial.beta = inf"},
      {[](typename P::params& p) { p.spatial.k_min = 4; }, "spatial.k_min = 4"},
      {[](typename P::params& p) { p.scorer.tau = 0.0f; }, "scorer.tau = 0"},
      {[](typename P::params& p) { p.selector.num_sink = -1; }, "selector.num_sink = -1"},
      {[](typename P::params& p) { p.selector.num_recent = -2; }, "selector.num_recent = -2"},
      {[](typename P::params& p) { p.selector.recent_share = 1.5f; }, "selector.recent_share = 1.5"},
      {[](typename P::params& p) { p.gqa = static_cast<kvevict::gqa_reduction>(9); }, "gqa = 9"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    auto p = P::defaults();
    c.set(p);
    kvevict::evictor<P, kvevict::cpu::backend> ev(p);
    const auto st = ev.can_implement(pr.in, kvevict::budget_request::tokens(10));
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK_MESSAGE(message_has(st, c.text), st.message());
  }
}

TEST_CASE_TEMPLATE("kind 1: invalid shapes and buffers are clear errors", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(tokens_for<P>(6, 10));
  problem<float> pr;
  pr.init(small_shape(30, 6), 8);
  set_layer<P>(pr);
  {
    auto in = pr.in;
    in.keys.data = nullptr;
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::null_pointer);
  }
  {
    auto in = pr.in;
    in.keys.stride[2] = -1;
    const auto st = ev.can_implement(in, budget);
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK(message_has(st, "keys.stride[2] = -1"));
  }
  {
    auto in = pr.in;
    in.keys.extent[3] = 0;
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::invalid_argument);
  }
  if (traits<P>::needs_values) {
    auto in = pr.in;
    in.values.extent[2] = 29;
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::shape_mismatch);
    in = pr.in;
    in.values.data = nullptr;
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::null_pointer);
  }
  if (traits<P>::needs_queries) {
    auto in = pr.in;
    in.queries.extent[1] = 3;  // not a multiple of kv_heads = 2
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::invalid_argument);
    in = pr.in;
    in.queries.extent[3] = 5;
    CHECK(ev.can_implement(in, budget).code() == kvevict::errc::shape_mismatch);
  }
  {
    auto in = pr.in;
    in.layer_idx = 4;  // num_layers = 4
    const auto st = ev.can_implement(in, budget);
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK(message_has(st, "layer_idx = 4"));
  }
  // Null outputs are refused before anything is written.
  std::vector<unsigned char> ws(ev.workspace_size(pr.in));
  std::vector<std::int32_t> idx(256);
  CHECK(ev.run(pr.in, budget, kvevict::selection_view{nullptr, idx.data(), nullptr, 256}, ws.data(), ws.size()).code() ==
        kvevict::errc::null_pointer);
}

// ------------------------------------------------------------------------------------ kind 2

TEST_CASE_TEMPLATE("kind 2: protected tokens survive ties, NaN, +-inf and FLT_MAX", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  auto params = P::defaults();
  params.selector.num_sink = std::max(params.selector.num_sink, 2);  // also protect sinks
  const std::int64_t W = 5;
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(params, W), 12));
  struct fill_case {
    const char* name;
    float key, query;
    bool check_finite;
  };
  const fill_case cases[] = {
      {"all equal (ties everywhere)", 0.5f, 0.25f, true},
      {"huge equal keys", 1.0e19f, 1.0e19f, true},
      {"FLT_MAX keys", std::numeric_limits<float>::max(), 1.0f, true},
      {"NaN keys, check off", std::numeric_limits<float>::quiet_NaN(), 1.0f, false},
      {"+inf keys, check off", std::numeric_limits<float>::infinity(), 1.0f, false},
      {"-inf queries, check off", 1.0f, -std::numeric_limits<float>::infinity(), false},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    problem<float> pr;
    pr.init(small_shape(31, W), 9);
    pr.k.fill_all(c.key);
    if (pr.sh.with_queries) pr.q.fill_all(c.query);
    pr.v.fill_all(2.0f);
    set_layer<P>(pr);
    auto p = params;
    p.check_finite = c.check_finite;
    const result r = run_checked<P>(pr, budget, p);
    // Equal scores: ties go to the lower index, so the kept candidates are the first ones.
    if (std::string(c.name) == "all equal (ties everywhere)" && std::is_same<typename P::budgeter, kvevict::budgeters::uniform>::value &&
        P::scorer::has_scores) {
      const contract k = contract::of<P>(p, W, r.rows / 2, 2, budget);
      const std::int64_t L = 31, B = k.base_budget(L), R = k.recent(L, B), sinks = p.selector.num_sink;
      std::vector<std::int32_t> want;
      for (std::int64_t t = 0; t < B - R; ++t) want.push_back(static_cast<std::int32_t>(t));
      for (std::int64_t t = L - R; t < L; ++t) want.push_back(static_cast<std::int32_t>(t));
      (void)sinks;
      for (std::int64_t row = 0; row < r.rows; ++row) CHECK(r.row(row) == want);
    }
  }
  // NaN with check_finite on: a clear error with the coordinates, nothing written.
  problem<float> pr;
  pr.init(small_shape(31, W), 10);
  pr.k.at(1, 1, 17, 2) = std::numeric_limits<float>::quiet_NaN();
  kvevict::evictor<P, kvevict::cpu::backend> ev(params);
  set_layer<P>(pr);
  std::vector<std::int32_t> indptr(9, -5), idx(512, -5);
  std::vector<unsigned char> ws(ev.workspace_size(pr.in));
  const auto st = ev.run(pr.in, budget, kvevict::selection_view{indptr.data(), idx.data(), nullptr, 512}, ws.data(), ws.size());
  if constexpr (P::scorer::has_scores) {
    CHECK(st.code() == kvevict::errc::non_finite_input);
    CHECK_MESSAGE(message_has(st, "keys(b=1, h=1, s=17, d=2) = nan"), st.message());
    CHECK(indptr == std::vector<std::int32_t>(9, -5));
  } else {  // a position-only scorer (StreamingLLM) reads no key: the NaN cannot change its selection
    CHECK_MESSAGE(st.ok(), st.message());
    const std::int64_t rows = pr.in.batch() * ev.out_heads(pr.in);
    CHECK(indptr[0] == 0);
    for (std::int64_t r = 0; r < rows; ++r) CHECK(indptr[static_cast<std::size_t>(r) + 1] > indptr[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE("kind 2: the selector keeps the protected tokens and ranks NaN last (brute force)") {
  // Direct test of the selector against a brute-force reference over adversarial score rows.
  kvtest::rng g(77);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(), 0.0f, -0.0f, 1.0f, std::numeric_limits<float>::denorm_min()};
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    const std::int64_t L = g.integer(1, 40);
    kvevict::selectors::topk::params sp;
    sp.num_sink = static_cast<std::int32_t>(g.integer(0, 5));
    sp.num_recent = static_cast<std::int32_t>(g.integer(-1, 6));
    const std::int64_t W = g.integer(0, 6);
    const std::int32_t budget = static_cast<std::int32_t>(g.integer(1, 45));
    if (sp.num_sink + (sp.num_recent >= 0 ? sp.num_recent : W) > budget) continue;
    const auto plan = kvevict::detail::plan_head(kvevict::budget_request::tokens(budget), sp, L, W);
    std::vector<float> sc(static_cast<std::size_t>(L));
    for (auto& x : sc) x = specials[g.integer(0, 8)];
    std::vector<std::int32_t> out(static_cast<std::size_t>(L)), scratch(static_cast<std::size_t>(L));
    const std::int64_t n = kvevict::cpu::detail::select_head(plan, budget, sc.data(), out.data(), scratch.data());
    out.resize(static_cast<std::size_t>(n));
    // brute force: protected + best candidates by (non-NaN first, value desc, index asc)
    std::vector<std::int32_t> want;
    if (L <= budget) {
      for (std::int64_t t = 0; t < L; ++t) want.push_back(static_cast<std::int32_t>(t));
    } else {
      const std::int64_t sinks = std::min<std::int64_t>(sp.num_sink, L);
      const std::int64_t R = std::min<std::int64_t>(sp.num_recent >= 0 ? sp.num_recent : W, L - sinks);
      std::vector<std::int32_t> cand;
      for (std::int64_t t = sinks; t < L - R; ++t) cand.push_back(static_cast<std::int32_t>(t));
      std::stable_sort(cand.begin(), cand.end(), [&](std::int32_t a, std::int32_t b) {
        const bool na = std::isnan(sc[static_cast<std::size_t>(a)]), nb = std::isnan(sc[static_cast<std::size_t>(b)]);
        if (na != nb) return nb;
        return !na && sc[static_cast<std::size_t>(a)] > sc[static_cast<std::size_t>(b)];
      });
      const std::int64_t k = budget - sinks - R;
      for (std::int64_t t = 0; t < sinks; ++t) want.push_back(static_cast<std::int32_t>(t));
      for (std::int64_t i = 0; i < k; ++i) want.push_back(cand[static_cast<std::size_t>(i)]);
      for (std::int64_t t = L - R; t < L; ++t) want.push_back(static_cast<std::int32_t>(t));
      std::sort(want.begin(), want.end());
      CHECK(n == budget);  // exact count
    }
    CHECK(out == want);
  }
}

// ------------------------------------------------------------------------------------ kind 4

TEST_CASE_TEMPLATE("kind 4: GQA selections have kv_heads rows; memory = kept x H_kv x d x 2 x bytes", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  problem<half_t> pr;
  shape s = small_shape(40, 6);
  s.G = 4;
  pr.init(s, 12);
  set_layer<P>(pr);
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(tokens_for<P>(6, 12));
  const result r = run_checked<P>(pr, budget);
  CHECK(r.rows == s.B * s.Hkv);  // not B * Hq
  // Compact K and V into a ragged buffer sized by the selection: that IS the memory after eviction.
  const std::int64_t kept = r.indptr.back();
  std::vector<half_t> kc(static_cast<std::size_t>(kept * s.D)), vc(kc.size());
  const kvevict::const_selection_view sel(r.indptr.data(), r.indices.data(), r.rows);
  REQUIRE(kvevict::cpu::compact_ragged<half_t>(pr.k.view, sel, kc.data(), static_cast<std::int64_t>(kc.size())).ok());
  REQUIRE(kvevict::cpu::compact_ragged<half_t>(pr.v.view, sel, vc.data(), static_cast<std::int64_t>(vc.size())).ok());
  const std::size_t bytes = (kc.size() + vc.size()) * sizeof(half_t);
  CHECK(bytes == static_cast<std::size_t>(kept) * 2 * s.D * sizeof(half_t));
  CHECK(kept < s.B * s.Hkv * s.S);  // something was evicted
  // per_query_head (reference-code mode) is explicit: q_heads rows (a scorer that aggregates the group
  // itself, DefensiveKV, refuses it at plan time instead).
  if (P::defaults().gqa == kvevict::gqa_reduction::mean && traits<P>::needs_queries &&
      !kvevict::detail::scorer_combines_heads<typename P::scorer>::value) {
    auto p = P::defaults();
    p.gqa = kvevict::gqa_reduction::per_query_head;
    const result rq = run_checked<P>(pr, budget, p);
    CHECK(rq.rows == s.B * s.Hq());
  }
}

// ------------------------------------------------------------------------------ kinds 9, 10, 5

TEST_CASE_TEMPLATE("kind 9: workspace and capacity are queried, checked and exact", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  problem<bfloat16_t> pr;
  shape s = small_shape(37, 5);
  s.lengths = P::defaults().gqa == kvevict::gqa_reduction::layer_mean ? std::vector<std::int32_t>{37, 37, 20, 20}
                                                                       : std::vector<std::int32_t>{37, 3, 20, 36};
  pr.init(s, 13);
  set_layer<P>(pr);
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::fraction(0.35);
  const std::size_t ws = ev.workspace_size(pr.in);
  const std::int64_t cap = ev.max_selected(pr.in, budget);
  REQUIRE(cap > 0);
  // The workspace size depends on shapes only: not on values, lengths or the budget.
  problem<bfloat16_t> other;
  shape s2 = s;
  s2.lengths = {};
  other.init(s2, 14, 100.0f);
  CHECK(ev.workspace_size(other.in) == ws);
  // Bounded: linear in the capacity (doubling S at most doubles it, plus alignment slack).
  shape s3 = s2;
  s3.S = 2 * s.S;
  problem<bfloat16_t> big;
  big.init(s3, 15);
  CHECK(ev.workspace_size(big.in) <= 2 * ws + 4096);
  std::vector<unsigned char> wsb(ws + 1);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(s.B * s.Hkv + 1), -5), idx(static_cast<std::size_t>(cap), -5);
  // One byte too little workspace, one slot too little capacity: errors, outputs untouched.
  auto st = ev.run(pr.in, budget, kvevict::selection_view{indptr.data(), idx.data(), nullptr, cap}, wsb.data(), ws - 1);
  CHECK(st.code() == kvevict::errc::insufficient_workspace);
  if (ws > 0) {
    st = ev.run(pr.in, budget, kvevict::selection_view{indptr.data(), idx.data(), nullptr, cap}, nullptr, ws);
    CHECK(st.code() == kvevict::errc::insufficient_workspace);
  }
  st = ev.run(pr.in, budget, kvevict::selection_view{indptr.data(), idx.data(), nullptr, cap - 1}, wsb.data(), ws);
  CHECK(st.code() == kvevict::errc::insufficient_capacity);
  CHECK(indptr == std::vector<std::int32_t>(indptr.size(), -5));
  CHECK(idx == std::vector<std::int32_t>(idx.size(), -5));
  // Exact: the kept count equals max_selected, and the keep fraction is kept / valid tokens.
  st = ev.run(pr.in, budget, kvevict::selection_view{indptr.data(), idx.data(), nullptr, cap}, wsb.data(), ws);
  REQUIRE(st.ok());
  CHECK(indptr.back() == cap);
  std::int64_t valid = 0;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hkv; ++h) valid += pr.length(b, h);
  const double keep_fraction = static_cast<double>(cap) / static_cast<double>(valid);
  CAPTURE(keep_fraction);
  CHECK(keep_fraction < 1.0);
  CHECK(keep_fraction > 0.0);
}

TEST_CASE_TEMPLATE("kinds 10 and 5: order, slot bookkeeping and logical positions survive compaction", P, KVEVICT_ROBUST_PRESETS) {
  CAPTURE(preset_name<P>());
  problem<float> pr;
  shape s = small_shape(33, 4);
  s.layout = kvevict::kv_layout::nhd;
  s.pad = 2;
  pr.init(s, 16);
  // Logical positions with gaps (an earlier eviction): 5 * slot + head.
  pr.pos.assign(static_cast<std::size_t>(s.B * s.Hkv * s.S), 0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hkv; ++h)
      for (std::int64_t t = 0; t < s.S; ++t)
        pr.pos[static_cast<std::size_t>((b * s.Hkv + h) * s.S + t)] = static_cast<std::int32_t>(5 * t + h + 1000 * b);
  pr.rebuild_views();
  set_layer<P>(pr);
  auto params = P::defaults();
  params.selector.num_sink = std::max(params.selector.num_sink, 1);
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(params, 4), 11));
  const result r = run_checked<P>(pr, budget, params);  // checks ascending order and positions
  // Positions never change the selection (they are bookkeeping, not a score or a length).
  problem<float> nopos = pr;
  nopos.pos.clear();
  nopos.rebuild_views();
  set_layer<P>(nopos);
  kvevict::evictor<P, kvevict::cpu::backend> ev(params);
  const result r2 = run_evictor(ev, nopos.in, budget);
  CHECK(r2.indices == r.indices);
  // Dense and in-place compaction keep the original order: row i of the compacted cache is
  // the source row indices[i]; the sink stays first.
  buffer4<float> dst;
  const std::int64_t H = r.rows / s.B;
  std::int64_t maxk = 0;
  for (std::int64_t row = 0; row < r.rows; ++row) maxk = std::max<std::int64_t>(maxk, r.row(row).size());
  dst.allocate(s.B, H, maxk, s.D, kvevict::kv_layout::hnd, 0);
  const kvevict::const_selection_view sel(r.indptr.data(), r.indices.data(), r.rows);
  REQUIRE(kvevict::cpu::compact<float>(pr.k.view, sel, dst.view).ok());
  buffer4<float> inplace = pr.k;
  inplace.view.data = inplace.data.data();
  REQUIRE(kvevict::cpu::compact<float>(inplace.view, sel, inplace.view).ok());
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const auto row = r.row(b * H + h);
      CHECK(row.front() == 0);  // the sink
      for (std::size_t i = 0; i < row.size(); ++i)
        for (std::int64_t d = 0; d < s.D; ++d) {
          CHECK(dst.at(b, h, static_cast<std::int64_t>(i), d) == pr.k.at(b, h, row[i], d));
          CHECK(inplace.at(b, h, static_cast<std::int64_t>(i), d) == pr.k.at(b, h, row[i], d));
        }
    }
  // A second eviction on the compacted cache (multi-turn): positions follow the slots.
  problem<float> turn2;
  turn2.sh = s;
  turn2.sh.layout = kvevict::kv_layout::hnd;
  turn2.sh.pad = 0;
  turn2.k = dst;
  turn2.k.view.data = turn2.k.data.data();
  turn2.v.allocate(s.B, H, maxk, s.D, kvevict::kv_layout::hnd, 0);
  REQUIRE(kvevict::cpu::compact<float>(pr.v.view, sel, turn2.v.view).ok());
  turn2.q = pr.q;
  turn2.q.view.data = turn2.q.data.data();
  turn2.wo = pr.wo;
  turn2.wo_mat = pr.wo_mat;
  turn2.sh.S = maxk;
  turn2.lens.clear();
  turn2.pos.assign(static_cast<std::size_t>(s.B * H * maxk), -1);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      turn2.lens.push_back(r.indptr[static_cast<std::size_t>(b * H + h + 1)] - r.indptr[static_cast<std::size_t>(b * H + h)]);
      for (std::int32_t i = r.indptr[static_cast<std::size_t>(b * H + h)]; i < r.indptr[static_cast<std::size_t>(b * H + h + 1)]; ++i)
        turn2.pos[static_cast<std::size_t>((b * H + h) * maxk + i - r.indptr[static_cast<std::size_t>(b * H + h)])] =
            r.positions[static_cast<std::size_t>(i)];
    }
  if (H != s.Hkv) return;  // per-query-head rows cannot be re-fed as KV heads
  bool equal = true;
  for (std::size_t i = 1; i < turn2.lens.size(); ++i) equal = equal && turn2.lens[i] == turn2.lens[0];
  if (!equal && P::defaults().gqa == kvevict::gqa_reduction::layer_mean) return;
  turn2.rebuild_views();
  set_layer<P>(turn2);
  const auto budget2 = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(params, 4), 7));
  const result r3 = run_checked<P>(turn2, budget2, params);
  for (std::int64_t row = 0; row < r3.rows; ++row)
    for (std::int32_t i = r3.indptr[static_cast<std::size_t>(row)]; i < r3.indptr[static_cast<std::size_t>(row + 1)]; ++i) {
      // the logical position of the kept slot is the ORIGINAL token's position
      const std::int32_t slot = r3.indices[static_cast<std::size_t>(i)];
      const std::int32_t orig = r.indices[static_cast<std::size_t>(r.indptr[static_cast<std::size_t>(row)] + slot)];
      const std::int64_t b = row / H, h = row % H;
      CHECK(r3.positions[static_cast<std::size_t>(i)] == static_cast<std::int32_t>(5 * orig + h + 1000 * b));
    }
}
