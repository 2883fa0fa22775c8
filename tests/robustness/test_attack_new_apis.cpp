// SPDX-License-Identifier: Apache-2.0
// Bad-input attacks on the APIs added with CriticalKV and LKV decoding mode B
// (shared/spec/failure-kinds.md; docs/failure-kinds.md):
//  - presets::criticalkv / critical_adakv: layer_inputs::wo with null data, wrong extents,
//    negative / zero / overlapping strides, NaN and inf weights, weights and values near the
//    fp32 limit, hidden size 1; selectors::two_stage parameters at and beyond their ranges;
//    budgets that leave no candidates, seq_len 1, window > seq, empty and ragged heads. Every
//    successful run is checked against the selection contract (robust_common.hpp) and against
//    an independent two-stage reference (fp64 loops over the materialised W_O);
//  - lkv::decode_budgets / select_drops / decode_step / prepare_decode_scratch: t below the
//    lengths, t = 0, t so large that N * t overflows, budget requests at and beyond their
//    ranges, buffers one element too small, null pointers, non-finite utilities, negative
//    lengths, heads sharing one utility row, a budget scratch that was never prepared. Successful
//    steps are compared with a naive fp64 / sort-based rule.
// Every failure must be a kvevict::status naming the parameter and its value.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/backends/cpu/learned.hpp"
#include "robust_common.hpp"

namespace kv = kvevict;
using robust::problem;
using robust::shape;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
const float kFmax = std::numeric_limits<float>::max();

bool has(const kv::status& s, const std::string& text) { return std::string(s.message()).find(text) != std::string::npos; }

#define KVEVICT_CHECK_ERR(st, code_, text)                         \
  do {                                                             \
    const kv::status s_ = (st);                                    \
    INFO("message: ", std::string(s_.message()));                               \
    CHECK(s_.code() == (code_));                                   \
    CHECK_MESSAGE(has(s_, text), "expected text: ", (text));       \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Independent two-stage reference: given the primary scores the evictor returned (maybe_scores,
// the documented stage-1 ranking), recompute u = mean over the GQA group of ||v W_O^hq||_1 with
// fp64 loops over the W_O view (whatever its strides), and re-derive which candidates the two
// stages keep for the count the row holds. Returns "" when the row sets agree.
template <class P, class T>
std::string reference_two_stage(const kv::evictor<P, kv::cpu::backend>& ev, const problem<T>& pr, const robust::result& res,
                                kv::budget_request budget) {
  const auto& p = ev.params();
  const auto& in = pr.in;
  const std::int64_t Hkv = pr.sh.Hkv, G = pr.sh.G, D = pr.sh.D, C = in.wo.extent[0];
  const std::int64_t H = ev.out_heads(in);
  REQUIRE(H == Hkv);  // presets reduce the group (mean)
  const robust::contract c = robust::contract::of<P>(p, in.window(), H, Hkv, budget);
  for (std::int64_t r = 0; r < res.rows; ++r) {
    const std::int64_t b = r / H, h = r % H, L = pr.length(b, h);
    const std::int32_t a0 = res.indptr[static_cast<std::size_t>(r)], a1 = res.indptr[static_cast<std::size_t>(r + 1)];
    const std::int64_t n = a1 - a0;
    if (L <= c.base_budget(L)) continue;  // pass-through: the contract checks it
    const std::int64_t sinks = std::min<std::int64_t>(p.selector.num_sink, L), R = c.recent(L, c.base_budget(L));
    const std::int64_t k = n - sinks - R;
    const float* a = res.scores.data() + r * res.seq;
    std::vector<double> u(static_cast<std::size_t>(L), 0.0);
    for (std::int64_t t = 0; t < L; ++t) {
      double acc = 0.0;
      for (std::int64_t g = 0; g < G; ++g) {
        const std::int64_t hq = h * G + g;
        for (std::int64_t cc = 0; cc < C; ++cc) {
          double y = 0.0;
          for (std::int64_t i = 0; i < D; ++i)
            y += static_cast<double>(kv::to_float(in.wo(cc, hq * D + i))) * static_cast<double>(kv::to_float(in.values(b, h, t, i)));
          acc += std::fabs(y);
        }
      }
      u[static_cast<std::size_t>(t)] = std::min(acc / static_cast<double>(G), static_cast<double>(kFmax));
    }
    std::vector<std::int32_t> cand;
    for (std::int64_t t = sinks; t < L - R; ++t) cand.push_back(static_cast<std::int32_t>(t));
    auto before = [](float x, std::int32_t i, float y, std::int32_t j) {
      const bool nx = x != x, ny = y != y;
      if (nx != ny) return ny;
      if (!nx && x != y) return x > y;
      return i < j;
    };
    std::sort(cand.begin(), cand.end(), [&](std::int32_t x, std::int32_t y) { return before(a[x], x, a[y], y); });
    const std::int64_t k1 = static_cast<std::int64_t>(std::floor(static_cast<double>(p.selector.first_stage_ratio) * static_cast<double>(k)));
    std::vector<char> want(static_cast<std::size_t>(L), 0);
    for (std::int64_t t = 0; t < sinks; ++t) want[static_cast<std::size_t>(t)] = 1;
    for (std::int64_t t = L - R; t < L; ++t) want[static_cast<std::size_t>(t)] = 1;
    for (std::int64_t i = 0; i < k1; ++i) want[static_cast<std::size_t>(cand[static_cast<std::size_t>(i)])] = 1;
    std::vector<std::int32_t> rest(cand.begin() + k1, cand.end());
    std::vector<float> comb(static_cast<std::size_t>(L), 0.0f);
    for (std::int32_t t : rest) {
      double v = (static_cast<double>(a[t]) + static_cast<double>(p.selector.eps)) * u[static_cast<std::size_t>(t)];
      v = std::min(v, static_cast<double>(kFmax));
      comb[static_cast<std::size_t>(t)] = static_cast<float>(v);
    }
    std::sort(rest.begin(), rest.end(),
              [&](std::int32_t x, std::int32_t y) { return before(comb[static_cast<std::size_t>(x)], x, comb[static_cast<std::size_t>(y)], y); });
    for (std::int64_t i = 0; i < k - k1; ++i) want[static_cast<std::size_t>(rest[static_cast<std::size_t>(i)])] = 1;
    std::vector<std::int32_t> want_row;
    for (std::int64_t t = 0; t < L; ++t)
      if (want[static_cast<std::size_t>(t)]) want_row.push_back(static_cast<std::int32_t>(t));
    if (want_row != res.row(r)) return "row " + std::to_string(r) + " differs from the two-stage reference";
  }
  return "";
}

/// Runs `ev` on `pr` and checks status ok, the selection contract, the reference, and that
/// something was evicted (non-vacuity) when `expect_eviction`.
template <class P, class T>
robust::result run_checked(const kv::evictor<P, kv::cpu::backend>& ev, const problem<T>& pr, kv::budget_request budget,
                           bool expect_eviction = true) {
  robust::result res = robust::run_evictor(ev, pr.in, budget);
  INFO("status: ", std::string(res.st.message()));
  REQUIRE(res.st.ok());
  CHECK(robust::check_contract(ev, pr, res, budget) == "");
  CHECK(reference_two_stage(ev, pr, res, budget) == "");
  if (expect_eviction) {
    std::int64_t total = 0;
    for (std::int64_t b = 0; b < pr.sh.B; ++b)
      for (std::int64_t h = 0; h < pr.sh.Hkv; ++h) total += pr.length(b, h);
    CHECK(res.max_selected < total);
  }
  return res;
}

shape base_shape() {
  shape s;
  s.B = 2, s.Hkv = 2, s.G = 2, s.S = 24, s.W = 3, s.D = 4;
  return s;
}

}  // namespace

#define KVEVICT_CRITICAL_PRESETS kv::presets::criticalkv, kv::presets::critical_adakv

// ---------------------------------------------------------------------------------------------
// CriticalKV: layer_inputs::wo

TEST_CASE_TEMPLATE("attack CriticalKV: W_O null, wrong extents and negative strides are named errors", P, KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  problem<float> pr;
  pr.init(base_shape(), 101);
  kv::evictor<P, kv::cpu::backend> ev;
  const auto budget = kv::budget_request::tokens(8);
  REQUIRE(ev.can_implement(pr.in, budget).ok());
  const std::int64_t N = pr.sh.Hq() * pr.sh.D;  // 16
  auto with = [&](auto f) {
    auto in = pr.in;
    f(in);
    return robust::run_evictor(ev, in, budget).st;
  };
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.data = nullptr; }), kv::errc::null_pointer, "wo.data is null");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo = {}; }), kv::errc::null_pointer, "wo.data is null");
  KVEVICT_CHECK_ERR(with([&](auto& in) { in.wo.extent[1] = N + 1; }), kv::errc::shape_mismatch, "wo shape (7, 17)");
  KVEVICT_CHECK_ERR(with([&](auto& in) { in.wo.extent[1] = N - 4; }), kv::errc::shape_mismatch, "q_heads * head_dim = 16");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.extent[1] = 0; }), kv::errc::shape_mismatch, "wo shape (7, 0)");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.extent[0] = 0; }), kv::errc::shape_mismatch, "wo shape (0, 16)");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.extent[0] = -3; }), kv::errc::invalid_argument, "wo.extent[0] = -3");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.extent[1] = -16; }), kv::errc::invalid_argument, "wo.extent[1] = -16");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.stride[0] = -16; }), kv::errc::invalid_argument, "wo.stride[0] = -16");
  KVEVICT_CHECK_ERR(with([](auto& in) { in.wo.stride[1] = -1; }), kv::errc::invalid_argument, "wo.stride[1] = -1");
  // A hidden extent the workspace arithmetic cannot hold (here a legal broadcast view: stride 0,
  // so every row reads the same memory). workspace_size() used to wrap around to a few KiB while
  // the scorer carved 64 x hidden floats: a heap overflow instead of an error.
  for (std::int64_t C : {std::int64_t{1} << 31, std::int64_t{1} << 58, std::int64_t{1} << 62}) {
    CAPTURE(C);
    KVEVICT_CHECK_ERR(with([&](auto& in) {
                        in.wo.extent[0] = C;
                        in.wo.stride[0] = 0;
                      }),
                      kv::errc::invalid_argument, "wo.extent[0] = " + std::to_string(C));
  }
  // wo is irrelevant to presets that do not read it: a broken wo does not fail SnapKV.
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> snap;
  auto in = pr.in;
  in.wo.stride[0] = -1;
  CHECK(snap.can_implement(in, budget).ok());
}

TEST_CASE_TEMPLATE("attack CriticalKV: zero and overlapping W_O strides read what they describe", P, KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  problem<float> pr;
  pr.init(base_shape(), 202);
  kv::evictor<P, kv::cpu::backend> ev;
  const auto budget = kv::budget_request::tokens(9);
  const std::int64_t C = pr.hidden(), N = pr.sh.Hq() * pr.sh.D;  // base covers the furthest element, (C-1) + (N-1)
  std::vector<float> base(static_cast<std::size_t>(C + N + 4));
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = std::sin(0.7f * static_cast<float>(i) + 0.3f);
  struct layout_case {
    const char* name;
    std::int64_t s0, s1;
  };
  // {0, 1}: every hidden row is the same row; {1, 1}: a Hankel matrix (rows overlap by all but
  // one element); {1, 0}: each row constant; {0, 0}: one scalar everywhere.
  for (const layout_case lc : {layout_case{"rows aliased", 0, 1}, layout_case{"overlapping rows", 1, 1},
                               layout_case{"columns aliased", 1, 0}, layout_case{"one scalar", 0, 0}}) {
    INFO("layout: ", std::string(lc.name));
    problem<float> a;
    a.init(base_shape(), 202);
    a.in.wo = kv::strided_view<const float, 2>{base.data(), {C, N}, {lc.s0, lc.s1}};
    const robust::result ra = run_checked(ev, a, budget);
    // the same matrix materialised contiguously gives the same selection
    problem<float> m;
    m.init(base_shape(), 202);
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t i = 0; i < N; ++i) m.wo_mat[static_cast<std::size_t>(c * N + i)] = base[static_cast<std::size_t>(c * lc.s0 + i * lc.s1)];
    m.rebuild_views();
    const robust::result rm = run_checked(ev, m, budget);
    CHECK(ra.same_selection(rm));
  }
}

TEST_CASE_TEMPLATE("attack CriticalKV: non-finite W_O weights are named; with check_finite off nothing crashes", P,
                   KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  robust::for_each_storage_type([&](auto tag) {
    using T = typename decltype(tag)::type;
    CAPTURE(robust::type_name<T>());
    problem<T> pr;
    pr.init(base_shape(), 303);
    const std::int64_t N = pr.sh.Hq() * pr.sh.D;  // pr: only its shape is used
    const auto budget = kv::budget_request::tokens(8);
    for (float bad : {kNaN, kInf, -kInf}) {
      CAPTURE(bad);
      for (std::int64_t c : {std::int64_t{0}, pr.hidden() - 1}) {
        problem<T> q;
        q.init(base_shape(), 303);
        const std::int64_t i = (c * 5 + 3) % N;
        q.wo_mat[static_cast<std::size_t>(c * N + i)] = kv::from_float<T>(bad);
        q.rebuild_views();
        kv::evictor<P, kv::cpu::backend> ev;
        const robust::result res = robust::run_evictor(ev, q.in, budget);
        KVEVICT_CHECK_ERR(res.st, kv::errc::non_finite_input,
                          "wo(" + std::to_string(c) + ", " + std::to_string(i) + ") = " + (bad != bad ? "nan" : bad > 0 ? "inf" : "-inf"));
        // check_finite off: the caller vouched for the data; the run must still be well formed
        auto p = P::defaults();
        p.check_finite = false;
        kv::evictor<P, kv::cpu::backend> loose(p);
        const robust::result r2 = robust::run_evictor(loose, q.in, budget);
        REQUIRE_MESSAGE(r2.st.ok(), r2.st.message());
        CHECK(robust::check_contract(loose, q, r2, budget) == "");
      }
    }
  });
}

TEST_CASE_TEMPLATE("attack CriticalKV: fp32-limit weights and values, tiny weights, hidden size 1", P, KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  const auto budget = kv::budget_request::tokens(9);
  kv::evictor<P, kv::cpu::backend> ev;
  SUBCASE("W_O of magnitude 1e38 (every projected norm saturates near FLT_MAX)") {
    problem<float> pr;
    pr.init(base_shape(), 404);
    for (auto& w : pr.wo_mat) w = w >= 0.0f ? 1e38f : -1e38f;
    pr.rebuild_views();
    const robust::result res = run_checked(ev, pr, budget);
    for (float s : res.scores) CHECK(std::isfinite(s));
  }
  SUBCASE("values of magnitude 1e38 and W_O scaled by 2^100") {
    problem<float> pr;
    pr.init(base_shape(), 405);
    for (auto& v : pr.v.data)
      if (v == v) v *= 1e37f;
    for (auto& w : pr.wo_mat) w = std::ldexp(w, 100);
    pr.rebuild_views();
    run_checked(ev, pr, budget);
  }
  SUBCASE("W_O of magnitude 1e-38 (denormal products)") {
    problem<float> pr;
    pr.init(base_shape(), 406);
    for (auto& w : pr.wo_mat) w *= 1e-38f;
    pr.rebuild_views();
    run_checked(ev, pr, budget);
  }
  SUBCASE("hidden size 1") {
    problem<float> pr;
    pr.init(base_shape(), 407);
    const std::int64_t N = pr.sh.Hq() * pr.sh.D;
    pr.wo_mat.resize(static_cast<std::size_t>(N));  // the first row of the random W_O
    pr.in.wo = kv::strided_view<const float, 2>{pr.wo_mat.data(), {1, N}, {N, 1}};
    run_checked(ev, pr, budget);
  }
  SUBCASE("all-zero W_O (every u = 0: stage 2 ranks (a + eps) * 0, ties to the lower index)") {
    problem<float> pr;
    pr.init(base_shape(), 408);
    std::fill(pr.wo_mat.begin(), pr.wo_mat.end(), 0.0f);
    pr.rebuild_views();
    run_checked(ev, pr, budget);
  }
}

// ---------------------------------------------------------------------------------------------
// CriticalKV: selectors::two_stage parameters

TEST_CASE_TEMPLATE("attack CriticalKV: first_stage_ratio and eps outside their ranges", P, KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  problem<float> pr;
  pr.init(base_shape(), 505);
  const auto budget = kv::budget_request::tokens(10);
  int rejected = 0;
  for (float ratio : {kNaN, -kNaN, kInf, -kInf, -0.1f, 1.1f, std::nextafter(1.0f, 2.0f), -std::numeric_limits<float>::denorm_min()}) {
    CAPTURE(ratio);
    auto p = P::defaults();
    p.selector.first_stage_ratio = ratio;
    kv::evictor<P, kv::cpu::backend> ev(p);
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, budget).st, kv::errc::invalid_argument, "selector.first_stage_ratio = ");
    ++rejected;
  }
  for (float eps : {kNaN, kInf, -kInf, -1e-4f, -0.1f, -std::numeric_limits<float>::denorm_min()}) {
    CAPTURE(eps);
    auto p = P::defaults();
    p.selector.eps = eps;
    kv::evictor<P, kv::cpu::backend> ev(p);
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, budget).st, kv::errc::invalid_argument, "selector.eps = ");
    ++rejected;
  }
  CHECK(rejected == 14);
  // boundary values are accepted and behave as documented (reference-checked)
  robust::result r0, rneg0;
  for (float ratio : {0.0f, -0.0f, 1.0f, 0.5f}) {
    for (float eps : {0.0f, -0.0f, kFmax}) {
      CAPTURE(ratio);
      CAPTURE(eps);
      auto p = P::defaults();
      p.selector.first_stage_ratio = ratio;
      p.selector.eps = eps;
      kv::evictor<P, kv::cpu::backend> ev(p);
      const robust::result res = run_checked(ev, pr, budget);
      if (ratio == 0.0f && eps == 0.0f && !std::signbit(ratio)) r0 = res;
      if (ratio == 0.0f && eps == 0.0f && std::signbit(ratio)) rneg0 = res;
    }
  }
  CHECK(r0.same_selection(rneg0));
}

// ---------------------------------------------------------------------------------------------
// CriticalKV: budgets, degenerate sizes and ragged heads

TEST_CASE_TEMPLATE("attack CriticalKV: budgets that leave no candidates, seq_len 1, window > seq, empty and ragged heads", P,
                   KVEVICT_CRITICAL_PRESETS) {
  CAPTURE(robust::preset_name<P>());
  kv::evictor<P, kv::cpu::backend> ev;
  SUBCASE("budget = window: only the window survives, in order") {
    problem<float> pr;
    pr.init(base_shape(), 606);
    const auto budget = kv::budget_request::tokens(static_cast<std::int32_t>(pr.sh.W));
    const robust::result res = run_checked(ev, pr, budget);
    for (std::int64_t r = 0; r < res.rows; ++r) {
      const auto row = res.row(r);
      REQUIRE(row.size() == static_cast<std::size_t>(pr.sh.W));
      for (std::int64_t j = 0; j < pr.sh.W; ++j) CHECK(row[static_cast<std::size_t>(j)] == pr.sh.S - pr.sh.W + j);
    }
  }
  SUBCASE("budget = sinks + window with sinks: no candidate left") {
    problem<float> pr;
    pr.init(base_shape(), 607);
    auto p = P::defaults();
    p.selector.num_sink = 2;
    kv::evictor<P, kv::cpu::backend> ev2(p);
    run_checked(ev2, pr, kv::budget_request::tokens(static_cast<std::int32_t>(2 + pr.sh.W)));
    KVEVICT_CHECK_ERR(robust::run_evictor(ev2, pr.in, kv::budget_request::tokens(static_cast<std::int32_t>(1 + pr.sh.W))).st,
                      kv::errc::invalid_argument, "budget.keep_tokens = 4 < num_sink + protected recent tokens = 2 + 3");
  }
  SUBCASE("a fraction that rounds every head to its protected tokens") {
    problem<float> pr;
    pr.init(base_shape(), 608);
    run_checked(ev, pr, kv::budget_request::fraction(1e-9));
  }
  SUBCASE("budget below the window, zero, negative, NaN fraction") {
    problem<float> pr;
    pr.init(base_shape(), 609);
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::tokens(2)).st, kv::errc::invalid_argument,
                      "budget.keep_tokens = 2 < num_sink + protected recent tokens = 0 + 3");
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::tokens(-5)).st, kv::errc::invalid_argument,
                      "budget.keep_tokens = -5");
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::fraction(std::nan(""))).st, kv::errc::invalid_argument,
                      "budget.keep_fraction = nan");
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::fraction(-0.25)).st, kv::errc::invalid_argument,
                      "budget.keep_fraction = -0.25");
  }
  SUBCASE("seq_len 1 with window 1: pass-through") {
    shape s = base_shape();
    s.S = 1, s.W = 1;
    problem<float> pr;
    pr.init(s, 610);
    const robust::result res = run_checked(ev, pr, kv::budget_request::tokens(1), false);
    CHECK(res.max_selected == s.B * s.Hkv);
  }
  SUBCASE("window > seq_len") {
    shape s = base_shape();
    s.S = 2, s.W = 3;
    problem<float> pr;
    pr.init(s, 611);
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::tokens(3)).st, kv::errc::invalid_argument,
                      "window = 3 > seq_len = 2");
  }
  SUBCASE("every head empty (lengths 0)") {
    shape s = base_shape();
    s.lengths.assign(static_cast<std::size_t>(s.B * s.Hkv), 0);
    problem<float> pr;
    pr.init(s, 612);
    const robust::result res = run_checked(ev, pr, kv::budget_request::tokens(5), false);
    CHECK(res.max_selected == 0);
  }
  SUBCASE("ragged per-head lengths: 0, 1, < window, = budget, budget + 1, = seq") {
    shape s = base_shape();
    s.B = 3;
    s.lengths = {0, 1, 2, 6, 7, 24};
    problem<float> pr;
    pr.init(s, 613);
    const robust::result res = run_checked(ev, pr, kv::budget_request::tokens(6));
    CHECK(res.row(0).empty());
    CHECK(res.row(1) == std::vector<std::int32_t>{0});
  }
  SUBCASE("lengths negative or beyond seq") {
    shape s = base_shape();
    s.lengths = {5, -1, 24, 24};
    problem<float> pr;
    pr.init(s, 614);
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::tokens(5)).st, kv::errc::invalid_argument, "-1");
    pr.lens = {5, 25, 24, 24};
    pr.rebuild_views();
    KVEVICT_CHECK_ERR(robust::run_evictor(ev, pr.in, kv::budget_request::tokens(5)).st, kv::errc::invalid_argument, "25");
  }
}

// ---------------------------------------------------------------------------------------------
// LKV decoding mode B

namespace {

struct lkv_model {
  std::vector<float> z;
  kv::budgeters::headwise_learned::params bp;
  lkv_model(std::int32_t layers, std::int32_t heads, std::uint64_t seed) {
    kvtest::rng r(seed);
    z.resize(static_cast<std::size_t>(layers * heads));
    for (auto& v : z) v = static_cast<float>(r.normal());
    bp.logits = z.data();
    bp.num_layers = layers;
    bp.kv_heads = heads;
  }
  std::int64_t n() const { return static_cast<std::int64_t>(bp.num_layers) * bp.kv_heads; }
};

/// The dropped slots of one head by the documented rule, with a full sort (independent of
/// nth_element): rank by (u desc, slot asc), drop the last len - budget.
std::vector<std::int32_t> naive_drops(const float* u, std::int64_t len, std::int64_t budget) {
  std::vector<std::int32_t> s(static_cast<std::size_t>(len));
  for (std::int64_t i = 0; i < len; ++i) s[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
  std::sort(s.begin(), s.end(), [u](std::int32_t a, std::int32_t b) { return u[a] > u[b] || (u[a] == u[b] && a < b); });
  std::vector<std::int32_t> d;
  for (std::int64_t i = budget; i < len; ++i) d.push_back(s[static_cast<std::size_t>(i)]);
  std::sort(d.begin(), d.end());
  return d;
}

}  // namespace

TEST_CASE("attack LKV mode B: t so large that N * t overflows is a named error, not wrapped budgets") {
  lkv_model m(2, 2, 11);
  const std::int64_t N = m.n();
  std::vector<std::int64_t> b(static_cast<std::size_t>(N), -1);
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  // largest t accepted: N * t <= 2^53 (budget totals exact in fp64)
  const std::int64_t tmax = (std::int64_t{1} << 53) / N;
  for (std::int64_t t : {tmax + 1, std::int64_t{1} << 61, (std::int64_t{1} << 62) + 5, big}) {
    CAPTURE(t);
    for (const auto req : {kv::budget_request::fraction(1.0), kv::budget_request::fraction(0.25), kv::budget_request::tokens(5)}) {
      CAPTURE(req.keep_fraction);
      KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(m.bp, req, t, b.data()), kv::errc::invalid_argument, "t = " + std::to_string(t));
    }
    // decode_step on an almost empty cache at that t fails the same way
    std::vector<std::int32_t> lens(static_cast<std::size_t>(N), 1), ip(static_cast<std::size_t>(N + 1)), idx(8), scr(8);
    std::vector<float> u(static_cast<std::size_t>(N), 0.5f);
    kv::lkv::decode_cache_view cv{u.data(), 1, lens.data()};
    kv::lkv::decode_step_buffers o;
    o.budgets = b.data();
    o.drop_indptr = ip.data();
    o.drop_indices = idx.data();
    o.drop_capacity = 8;
    o.scratch = scr.data();
    o.scratch_size = 8;
    KVEVICT_CHECK_ERR(kv::lkv::decode_step(m.bp, kv::budget_request::fraction(0.5), t, cv, o), kv::errc::invalid_argument,
                      "t = " + std::to_string(t));
  }
  // at the limit the budgets are exact: sum = floor(R * N * t), each <= t
  for (const double R : {1.0, 0.25, 0.5}) {
    CAPTURE(R);
    REQUIRE(kv::lkv::decode_budgets(m.bp, kv::budget_request::fraction(R), tmax, b.data()).ok());
    std::int64_t sum = 0;
    for (std::int64_t x : b) {
      CHECK(x >= 0);
      CHECK(x <= tmax);
      sum += x;
    }
    CHECK(sum == static_cast<std::int64_t>(R * 4.0) * (N * tmax) / 4);
  }
  REQUIRE(kv::lkv::decode_budgets(m.bp, kv::budget_request::tokens(7), tmax, b.data()).ok());
  std::int64_t sum7 = 0;
  for (std::int64_t x : b) sum7 += x;
  CHECK(sum7 == N * 7);
}

TEST_CASE("attack LKV mode B: a budget scratch whose ratios were never prepared is refused") {
  lkv_model m(2, 3, 12);
  const std::int64_t N = m.n();
  std::vector<double> r(static_cast<std::size_t>(N)), sh(static_cast<std::size_t>(N));
  std::vector<std::int64_t> capv(static_cast<std::size_t>(N)), b(static_cast<std::size_t>(N)), b_ref(static_cast<std::size_t>(N));
  std::vector<unsigned char> cl(static_cast<std::size_t>(N));
  kv::lkv::decode_budget_scratch sc{r.data(), sh.data(), capv.data(), cl.data()};
  const auto req = kv::budget_request::fraction(0.3);
  REQUIRE(kv::lkv::decode_budgets(m.bp, req, 100, b_ref.data()).ok());
  // zeros (calloc'd, never prepared), NaN, a negative entry, a vector that does not sum to 1
  struct bad_case {
    const char* name;
    double fill, at2;
    const char* text;
  };
  for (const bad_case bc : {bad_case{"zeros", 0.0, 0.0, "sum to"}, bad_case{"nan", 1.0 / 6.0, std::nan(""), "ratios[2] = nan"},
                            bad_case{"negative", 1.0 / 6.0, -0.5, "ratios[2] = -0.5"},
                            bad_case{"inf", 1.0 / 6.0, HUGE_VAL, "ratios[2] = inf"}, bad_case{"sum 2", 2.0 / 6.0, 2.0 / 6.0, "sum to"}}) {
    INFO("case: ", std::string(bc.name));
    std::fill(r.begin(), r.end(), bc.fill);
    r[2] = bc.at2;
    std::fill(b.begin(), b.end(), -1);
    KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(m.bp, req, 100, b.data(), &sc), kv::errc::invalid_argument, bc.text);
    KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(m.bp, req, 100, b.data(), &sc), kv::errc::invalid_argument, "prepare_decode_scratch");
  }
  // prepared: the same budgets as without scratch
  REQUIRE(kv::lkv::prepare_decode_scratch(m.bp, sc).ok());
  REQUIRE(kv::lkv::decode_budgets(m.bp, req, 100, b.data(), &sc).ok());
  CHECK(b == b_ref);
  std::int64_t sum = 0;
  for (auto x : b) sum += x;
  CHECK(sum == 180);  // floor(0.3 * 6 * 100)
}

TEST_CASE("attack LKV mode B: requests, t and lengths at and beyond their ranges") {
  lkv_model m(2, 2, 13);
  const std::int64_t N = m.n();
  std::vector<std::int64_t> b(static_cast<std::size_t>(N));
  auto dec = [&](kv::budget_request req, std::int64_t t) { return kv::lkv::decode_budgets(m.bp, req, t, b.data()); };
  kv::budget_request none;
  KVEVICT_CHECK_ERR(dec(none, 10), kv::errc::invalid_argument, "exactly one");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(0.0), 10), kv::errc::invalid_argument, "exactly one");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(std::nan("")), 10), kv::errc::invalid_argument, "keep_fraction = nan");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(HUGE_VAL), 10), kv::errc::invalid_argument, "keep_fraction = inf");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(1.0000001), 10), kv::errc::invalid_argument, "keep_fraction = 1");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(-0.5), 10), kv::errc::invalid_argument, "keep_fraction = -0.5");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::tokens(-3), 10), kv::errc::invalid_argument, "keep_tokens = -3");
  KVEVICT_CHECK_ERR(dec(kv::budget_request::fraction(0.5), -1), kv::errc::invalid_argument, "t = -1");
  KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(m.bp, kv::budget_request::fraction(0.5), 10, nullptr), kv::errc::null_pointer, "budgets");
  // keep fraction 1: every head keeps all t; tiny fraction: sums exactly floor(R N t)
  REQUIRE(dec(kv::budget_request::fraction(1.0), 10).ok());
  for (auto x : b) CHECK(x == 10);
  REQUIRE(dec(kv::budget_request::fraction(1e-300), 10).ok());
  for (auto x : b) CHECK(x == 0);
  REQUIRE(dec(kv::budget_request::tokens(std::numeric_limits<std::int32_t>::max()), 10).ok());
  for (auto x : b) CHECK(x == 10);
  // t = 0: nothing seen, nothing held
  REQUIRE(dec(kv::budget_request::fraction(0.5), 0).ok());
  for (auto x : b) CHECK(x == 0);
  // bad budgeter tables
  auto bp = m.bp;
  bp.temperature = kNaN;
  KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(bp, kv::budget_request::fraction(0.5), 4, b.data()), kv::errc::invalid_argument,
                    "temperature = nan");
  bp = m.bp;
  bp.temperature = 1e-38f;  // z / temperature overflows fp64? no: 1e38 is finite; softmax is one-hot
  CHECK(kv::lkv::decode_budgets(bp, kv::budget_request::fraction(0.5), 4, b.data()).ok());
  bp = m.bp;
  bp.num_layers = -2;
  KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(bp, kv::budget_request::fraction(0.5), 4, b.data()), kv::errc::invalid_argument,
                    "num_layers = -2");
  bp = m.bp;
  std::vector<float> zbad = m.z;
  zbad[1] = -kInf;
  bp.logits = zbad.data();
  KVEVICT_CHECK_ERR(kv::lkv::decode_budgets(bp, kv::budget_request::fraction(0.5), 4, b.data()), kv::errc::non_finite_input,
                    "logits[1] = -inf");
}

TEST_CASE("attack LKV mode B: select_drops with bad utilities, sizes and pointers") {
  std::vector<float> u{0.5f, 0.1f, 0.5f, -2.0f, 3.0f, 0.1f};
  std::vector<std::int32_t> scr(6), drops(6);
  std::int64_t k = -1;
  for (float bad : {kNaN, kInf, -kInf}) {
    CAPTURE(bad);
    auto v = u;
    v[4] = bad;
    KVEVICT_CHECK_ERR(kv::lkv::select_drops(v.data(), 6, 2, scr.data(), drops.data(), &k), kv::errc::non_finite_input, "utilities[4] = ");
  }
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(u.data(), 6, -1, scr.data(), drops.data(), &k), kv::errc::invalid_argument, "budget = -1");
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(u.data(), -6, 1, scr.data(), drops.data(), &k), kv::errc::invalid_argument, "length = -6");
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(u.data(), std::int64_t{1} << 31, 1, scr.data(), drops.data(), &k), kv::errc::invalid_argument,
                    "length = 2147483648");
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(u.data(), 6, 1, scr.data(), drops.data(), nullptr), kv::errc::null_pointer, "num_drops");
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(u.data(), 6, 1, scr.data(), nullptr, &k), kv::errc::null_pointer, "drops");
  KVEVICT_CHECK_ERR(kv::lkv::select_drops(nullptr, 6, 1, scr.data(), drops.data(), &k), kv::errc::null_pointer, "utilities");
  // every budget 0..7 matches the naive sort, including scratch and drops aliased to one buffer
  for (std::int64_t budget = 0; budget <= 7; ++budget) {
    CAPTURE(budget);
    REQUIRE(kv::lkv::select_drops(u.data(), 6, budget, scr.data(), drops.data(), &k).ok());
    const auto want = naive_drops(u.data(), 6, budget);
    CHECK(k == static_cast<std::int64_t>(want.size()));
    CHECK(std::vector<std::int32_t>(drops.begin(), drops.begin() + k) == want);
    std::vector<std::int32_t> one(6);
    REQUIRE(kv::lkv::select_drops(u.data(), 6, budget, one.data(), one.data(), &k).ok());
    CHECK(std::vector<std::int32_t>(one.begin(), one.begin() + k) == want);
  }
  // FLT_MAX and -FLT_MAX and signed zeros are finite: ranked, not refused
  std::vector<float> e{kFmax, -kFmax, 0.0f, -0.0f, kFmax, -kFmax};
  REQUIRE(kv::lkv::select_drops(e.data(), 6, 3, scr.data(), drops.data(), &k).ok());
  CHECK(std::vector<std::int32_t>(drops.begin(), drops.begin() + k) == naive_drops(e.data(), 6, 3));
  CHECK(std::vector<std::int32_t>(drops.begin(), drops.begin() + k) == std::vector<std::int32_t>{1, 3, 5});
}

TEST_CASE("attack LKV mode B: decode_step with short buffers, bad lengths and shared utility rows") {
  lkv_model m(2, 2, 14);
  const std::int64_t N = m.n(), cap = 12, t = 12;
  kvtest::rng rg(99);
  std::vector<float> u(static_cast<std::size_t>(N * cap));
  for (auto& x : u) x = static_cast<float>(rg.normal());
  std::vector<std::int32_t> lens{12, 3, 0, 9};
  std::vector<std::int64_t> b(static_cast<std::size_t>(N));
  std::vector<std::int32_t> ip(static_cast<std::size_t>(N + 1)), idx(64), scr(64);
  kv::lkv::decode_cache_view cv{u.data(), cap, lens.data()};
  kv::lkv::decode_step_buffers o;
  o.budgets = b.data();
  o.drop_indptr = ip.data();
  o.drop_indices = idx.data();
  o.drop_capacity = 64;
  o.scratch = scr.data();
  o.scratch_size = 64;
  const auto req = kv::budget_request::fraction(0.25);
  auto step = [&]() { return kv::lkv::decode_step(m.bp, req, t, cv, o); };
  REQUIRE(step().ok());
  // reference: budgets from decode_budgets, drops from the naive sort
  std::vector<std::int64_t> bref(static_cast<std::size_t>(N));
  REQUIRE(kv::lkv::decode_budgets(m.bp, req, t, bref.data()).ok());
  CHECK(b == bref);
  std::int64_t need = 0, longest = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    const auto want = naive_drops(u.data() + n * cap, lens[static_cast<std::size_t>(n)], bref[static_cast<std::size_t>(n)]);
    CHECK(std::vector<std::int32_t>(idx.begin() + ip[static_cast<std::size_t>(n)], idx.begin() + ip[static_cast<std::size_t>(n + 1)]) == want);
    need += static_cast<std::int64_t>(want.size());
    if (!want.empty()) longest = std::max<std::int64_t>(longest, lens[static_cast<std::size_t>(n)]);
  }
  REQUIRE(need > 0);  // non-vacuous
  // buffers exactly the documented size pass; one less fails with the needed size
  o.drop_capacity = need;
  o.scratch_size = longest;
  CHECK(step().ok());
  o.drop_capacity = need - 1;
  KVEVICT_CHECK_ERR(step(), kv::errc::insufficient_capacity, "drop_capacity = " + std::to_string(need - 1) + " < " + std::to_string(need));
  o.drop_capacity = need;
  o.drop_indices = nullptr;
  KVEVICT_CHECK_ERR(step(), kv::errc::insufficient_capacity, "drop_indices null");
  o.drop_indices = idx.data();
  o.scratch_size = longest - 1;
  KVEVICT_CHECK_ERR(step(), kv::errc::insufficient_workspace, "scratch_size = " + std::to_string(longest - 1));
  o.scratch_size = longest;
  o.scratch = nullptr;
  KVEVICT_CHECK_ERR(step(), kv::errc::insufficient_workspace, "scratch null");
  o.scratch = scr.data();
  o.budgets = nullptr;
  KVEVICT_CHECK_ERR(step(), kv::errc::null_pointer, "out.budgets");
  o.budgets = b.data();
  o.drop_indptr = nullptr;
  KVEVICT_CHECK_ERR(step(), kv::errc::null_pointer, "drop_indptr");
  o.drop_indptr = ip.data();
  cv.utilities = nullptr;
  KVEVICT_CHECK_ERR(step(), kv::errc::null_pointer, "cache.utilities");
  cv.utilities = u.data();
  // negative length, a length above t, a negative stride
  lens[3] = -4;
  KVEVICT_CHECK_ERR(step(), kv::errc::invalid_argument, "cache.lengths[3] = -4 (layer 1, kv_head 1)");
  lens[3] = 9;
  KVEVICT_CHECK_ERR(kv::lkv::decode_step(m.bp, req, 11, cv, o), kv::errc::invalid_argument, "cache.lengths[0] = 12");
  KVEVICT_CHECK_ERR(kv::lkv::decode_step(m.bp, req, 0, cv, o), kv::errc::invalid_argument, "t = 0");
  cv.utility_stride = -12;
  KVEVICT_CHECK_ERR(step(), kv::errc::invalid_argument, "utility_stride = -12");
  // duplicated heads: every head reads the same utility row (stride 0) -- only empty heads may
  cv.utility_stride = 0;
  KVEVICT_CHECK_ERR(step(), kv::errc::invalid_argument, "utility_stride = 0");
  std::vector<std::int32_t> zero(static_cast<std::size_t>(N), 0);
  cv.lengths = zero.data();
  REQUIRE(step().ok());
  for (std::int64_t n = 0; n <= N; ++n) CHECK(ip[static_cast<std::size_t>(n)] == 0);
  // heads holding identical utilities (a stride equal to the length, rows copied) drop the same slots
  cv.lengths = lens.data();
  cv.utility_stride = cap;
  for (std::int64_t n = 1; n < N; ++n) std::copy(u.begin(), u.begin() + cap, u.begin() + n * cap);
  std::fill(lens.begin(), lens.end(), 12);
  o.drop_capacity = 64;
  o.scratch_size = 64;
  REQUIRE(step().ok());
  for (std::int64_t n = 0; n < N; ++n) {
    const auto want = naive_drops(u.data(), 12, b[static_cast<std::size_t>(n)]);
    CHECK(std::vector<std::int32_t>(idx.begin() + ip[static_cast<std::size_t>(n)], idx.begin() + ip[static_cast<std::size_t>(n + 1)]) == want);
  }
  // t = 0 on an empty cache: budgets 0, nothing to drop
  cv.lengths = zero.data();
  REQUIRE(kv::lkv::decode_step(m.bp, req, 0, cv, o).ok());
  for (auto x : b) CHECK(x == 0);
  CHECK(ip[static_cast<std::size_t>(N)] == 0);
}

TEST_CASE("attack LKV mode B: prepare_decode_scratch with bad tables and pointers") {
  lkv_model m(1, 3, 15);
  std::vector<double> r(3), sh(3);
  std::vector<std::int64_t> cv(3);
  std::vector<unsigned char> cl(3);
  kv::lkv::decode_budget_scratch sc{r.data(), sh.data(), cv.data(), cl.data()};
  for (int which = 0; which < 4; ++which) {
    CAPTURE(which);
    auto s = sc;
    if (which == 0) s.ratios = nullptr;
    if (which == 1) s.share = nullptr;
    if (which == 2) s.capv = nullptr;
    if (which == 3) s.clipped = nullptr;
    KVEVICT_CHECK_ERR(kv::lkv::prepare_decode_scratch(m.bp, s), kv::errc::null_pointer, "decode_budget_scratch");
  }
  auto bp = m.bp;
  bp.logits = nullptr;
  KVEVICT_CHECK_ERR(kv::lkv::prepare_decode_scratch(bp, sc), kv::errc::null_pointer, "logits");
  bp = m.bp;
  bp.temperature = -1.0f;
  KVEVICT_CHECK_ERR(kv::lkv::prepare_decode_scratch(bp, sc), kv::errc::invalid_argument, "temperature = -1");
  bp = m.bp;
  bp.on_device = true;
  bp.ratios = r.data();
  bp.ratios_temperature = bp.temperature;  // consistent device tables: refused only for being on the device
  KVEVICT_CHECK_ERR(kv::lkv::prepare_decode_scratch(bp, sc), kv::errc::invalid_argument, "on_device = true");
  REQUIRE(kv::lkv::prepare_decode_scratch(m.bp, sc).ok());
  double s = 0.0;
  for (double x : r) {
    CHECK(x > 0.0);
    s += x;
  }
  CHECK(s == doctest::Approx(1.0).epsilon(1e-12));
}

// ---------------------------------------------------------------------------------------------
// Found by the fuzz target (tests/fuzz): gqa_reduction::layer_mean summed the heads' rows in
// fp32, so scores near -FLT_MAX (key_norm of keys ~1e38, saturated) overflowed to -inf.

TEST_CASE("attack layer_mean: head rows near -FLT_MAX average to a finite score (key_norm, huge keys)") {
  robust::for_each_storage_type([&](auto tag) {
    using T = typename decltype(tag)::type;
    CAPTURE(robust::type_name<T>());
    shape s;
    s.B = 2, s.Hkv = 3, s.G = 1, s.S = 16, s.W = 2, s.D = 4;
    problem<T> pr;
    pr.init(s, 707);
    // the largest finite value of T in every coordinate of a few tokens of every head: each
    // head's score is -||k|| saturated to -FLT_MAX, and 3 x -FLT_MAX overflows fp32
    const float big = std::is_same<T, float>::value ? 3.0e38f : std::is_same<T, kv::half_t>::value ? 65504.0f : 3.0e38f;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hkv; ++h)
        for (std::int64_t t : {3, 4, 9})
          for (std::int64_t d = 0; d < s.D; ++d) pr.k.at(b, h, t, d) = kv::from_float<T>(big);
    pr.rebuild_views();
    auto p = kv::presets::key_norm::defaults();
    p.gqa = kv::gqa_reduction::layer_mean;
    kv::evictor<kv::presets::key_norm, kv::cpu::backend> ev(p);
    const auto budget = kv::budget_request::tokens(8);
    const robust::result res = robust::run_evictor(ev, pr.in, budget);
    REQUIRE_MESSAGE(res.st.ok(), res.st.message());
    CHECK(robust::check_contract(ev, pr, res, budget) == "");
    for (std::int64_t r = 0; r < res.rows; ++r) {
      const auto row = res.row(r);
      REQUIRE(row.size() == 8u);
      for (std::int32_t t : {3, 4, 9}) CHECK(std::find(row.begin(), row.end(), t) == row.end());  // largest norms evicted
      // every head of a sequence holds the same (layer) mean
      for (std::int64_t n = 0; n < s.S; ++n)
        CHECK(res.scores[static_cast<std::size_t>(r * s.S + n)] == res.scores[static_cast<std::size_t>((r / s.Hkv) * s.Hkv * s.S + n)]);
    }
  });
}
