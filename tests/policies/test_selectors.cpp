// The built-in selectors (include/kvevict/policies/selectors.hpp, backends/cpu/selectors/):
//  - top-k with protected tokens (cpu::detail::select_head) vs the reference, under adversarial
//    scores;
//  - failure kind 2 of ../shared/spec/failure-kinds.md: protection is a selector rule, so the
//    sinks and the window are kept under equal, NaN, inf and FLT_MAX scores of a user scorer.
// The two-stage selector (CriticalKV) is tested in test_criticalkv.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "policies/policy_test_common.hpp"

// ---- top-k selector ----------------------------------------------------------------------

TEST_CASE("selector: top-k with protected tokens vs reference, including adversarial scores") {
  kvtest::rng r(31);
  const float big = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  for (int it = 0; it < 2000; ++it) {
    const std::int64_t L = r.integer(0, 40), W = r.integer(1, 6);
    const std::int64_t budget = r.integer(W + 2, 45);
    const auto pl = kvref::plan(L, budget, 0.0, 2, -1, -1.0, W);
    std::vector<float> s(static_cast<std::size_t>(std::max<std::int64_t>(L, 1)));
    const int mode = static_cast<int>(r.integer(0, 5));
    for (auto& x : s) {
      switch (mode) {
        case 0: x = static_cast<float>(r.normal()); break;
        case 1: x = 1.0f; break;  // all equal
        case 2: x = r.uniform() < 0.5 ? NAN : static_cast<float>(r.normal()); break;
        case 3: x = r.uniform() < 0.3 ? inf : (r.uniform() < 0.5 ? -inf : 0.0f); break;
        case 4: x = r.uniform() < 0.5 ? big : -big; break;
        default: x = static_cast<float>(r.integer(0, 2)); break;  // many ties
      }
    }
    // the protected slots get the most hostile values: -inf / NaN / lowest
    for (std::int64_t i = 0; i < L; ++i)
      if (i < 2 || i >= L - W) s[static_cast<std::size_t>(i)] = (i % 2) ? -inf : NAN;
    kvref::vec sd(s.begin(), s.begin() + L);
    const auto ref = kvref::topk_select(sd, L, pl.pass ? L : budget, pl.sinks, pl.recent);
    std::vector<std::int32_t> out(static_cast<std::size_t>(std::max<std::int64_t>(L, 1)), -1), idx(out.size());
    const auto n = kvevict::cpu::detail::select_head(lib_plan(pl), budget, s.data(), out.data(), idx.data());
    out.resize(static_cast<std::size_t>(n));
    CAPTURE(L);
    CAPTURE(W);
    CAPTURE(budget);
    CAPTURE(mode);
    CHECK(out == ref);
    CHECK(n == std::min(budget, L));
    for (std::int64_t i = 0; i < L; ++i)
      if (!pl.pass && (i < pl.sinks || i >= L - pl.recent))
        CHECK(std::binary_search(out.begin(), out.end(), static_cast<std::int32_t>(i)));
  }
}

// ---- failure kind 2: protected tokens under hostile scores ---------------------------------

namespace {
/// A user scorer that writes hostile values: mode 0 all equal, 1 NaN, 2 +inf, 3 FLT_MAX,
/// 4 -inf on protected slots and +inf on candidates, 5 NaN on protected and FLT_MAX elsewhere.
struct hostile_scorer {
  struct params {
    int mode = 0;
    int window = 4, sinks = 2;
  };
  static constexpr const char* name = "hostile";
  static constexpr bool needs_queries = false;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = false;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static kv::status check(const params&) { return {}; }
  static void score_kv_head(const params& p, const kv::cpu::head_inputs& hi, float* out) {
    const float inf = std::numeric_limits<float>::infinity();
    for (std::int64_t n = 0; n < hi.length; ++n) {
      const bool prot = n < p.sinks || n >= hi.length - p.window;
      float v = 0.0f;
      switch (p.mode) {
        case 0: v = 1.0f; break;
        case 1: v = std::numeric_limits<float>::quiet_NaN(); break;
        case 2: v = inf; break;
        case 3: v = FLT_MAX; break;
        case 4: v = prot ? -inf : inf; break;
        default: v = prot ? std::numeric_limits<float>::quiet_NaN() : FLT_MAX; break;
      }
      out[n] = v;
    }
  }
};
}  // namespace

TEST_CASE("failure kind 2: sinks and window kept under equal, NaN, inf and FLT_MAX scores; exact count") {
  using P = kv::eviction_policy<hostile_scorer, kv::temporal::last, kv::spatial::avg_pool>;
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 1, s.cap = 30, s.d = 8, s.window = 4;
  kvtest::problem pr = kvtest::make_problem(s, 3);
  kvtest::stored<float> st;
  kvtest::store(pr, layout::nhd, st);
  for (int mode = 0; mode < 6; ++mode) {
    CAPTURE(mode);
    auto p = P::defaults();
    p.scorer.mode = mode;
    p.selector.num_sink = 2;
    kv::evictor<P, kv::cpu::backend> ev(p);
    auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(10));
    REQUIRE(lib.st.ok());
    for (std::int64_t r = 0; r < 2; ++r) {
      const auto kept = lib.kept(r);
      CHECK(kept.size() == 10);
      for (std::int32_t i : {0, 1, 26, 27, 28, 29}) CHECK(std::binary_search(kept.begin(), kept.end(), i));
      for (std::int64_t n = 0; n < s.cap; ++n) CHECK(std::isfinite(lib.row_scores(r)[n]));
      if (mode == 0 || mode == 1) CHECK(kept == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 26, 27, 28, 29});  // ties: lower index
    }
  }
}
