// The built-in budgeters (include/kvevict/policies/budgeters.hpp, backends/cpu/budgeters/):
//  - PyramidKV (budgeters::pyramid): layer_candidates vs PyramidKV's integer code and the exact
//    schedule, head_budget, its floor of 1 candidate for unprotected heads (attack), row_request
//    (num_tokens: a common reference length, hand-computed budgets of short and long heads);
//  - AdaKV (budgeters::adakv, cpu::detail::adakv_budgets): the head-wise allocation vs the
//    documented formula, its floor (attack: adversarial plans vs the fp64 reference and the
//    CUDA kernel's apportion_budgets call);
//  - both through the evictor on the CPU backend vs the fp64 reference: layers, exact totals,
//    tiny budgets, GQA reductions, ragged batches, sinks >= L, CriticalAdaKV's counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "policies/policy_test_common.hpp"

// ---- PyramidKV and AdaKV budgets, stage functions --------------------------------------------

TEST_CASE("budget: pyramid with num_tokens plans every row from the pyramid of the common length (hand-computed)") {
  using kvevict::budgeters::pyramid;
  pyramid::params p;  // beta 20, exact
  kvevict::selectors::topk::params sel;  // num_recent = -1: the window (8) is protected
  const auto B = kvevict::budget_request::tokens(64);
  // t = 300: P = 56, min = 2, max = 110, candidates 110, 74, 38, 2 -> budgets 118, 82, 46, 10.
  auto budget = [&](std::int64_t L, int layer, std::int64_t* base = nullptr) {
    const auto h = kvevict::detail::plan_row<pyramid>(p, B, sel, L, 8, 0, layer, 4);
    if (base) *base = h.pass_through ? -1 : h.base_budget;
    return kvevict::detail::kept_tokens(h, pyramid::head_budget(p, h, layer, 4));
  };
  p.num_tokens = 300;
  std::int64_t base = 0;
  CHECK(budget(26, 3, &base) == 10);  // shorter than B: evicted to its layer's budget, not passed through
  CHECK(base == 10);
  CHECK(budget(10, 3, &base) == 10);  // at its budget: whole
  CHECK(base == -1);
  CHECK(budget(134, 0) == 118);
  CHECK(budget(100, 0, &base) == 100);  // below its layer's budget 118: whole
  CHECK(base == -1);
  CHECK(budget(300, 1) == 82);
  CHECK(budget(90, 2) == 46);
  // The layers' own lengths (num_tokens = 0): a short deep layer passes through whole.
  p.num_tokens = 0;
  CHECK(budget(26, 3) == 26);
  CHECK(budget(300, 3) == 10);
  // t below the budget: every row shorter than B passes through, as without num_tokens.
  p.num_tokens = 50;
  CHECK(budget(26, 3) == 26);
  // t below a row's length: the row's own length is the reference.
  p.num_tokens = 200;
  for (int l = 0; l < 4; ++l) {
    const std::int64_t with_t = budget(400, l);
    p.num_tokens = 0;
    CHECK(budget(400, l) == with_t);
    p.num_tokens = 200;
  }
  p.num_tokens = -1;
  CHECK_FALSE(pyramid::check(p).ok());
  CHECK(std::string(pyramid::check(p).message()).find("budgeter.num_tokens = -1") != std::string::npos);
  p.num_tokens = std::int64_t{1} << 31;
  CHECK_FALSE(pyramid::check(p).ok());
  // A layer budget beyond int32 (a fraction of 2^31 - 1 tokens seen) keeps the row whole, never a
  // truncated budget.
  p.num_tokens = 0x7fffffff;
  CHECK(pyramid::check(p).ok());
  const auto frac = kvevict::budget_request::fraction(0.9);
  const auto h0 = kvevict::detail::plan_row<pyramid>(p, frac, sel, 100000, 8, 0, 0, 4);
  CHECK(kvevict::detail::kept_tokens(h0, pyramid::head_budget(p, h0, 0, 4)) == 100000);
}

TEST_CASE("budget: max_selected's shape-only bound holds for PyramidKV with num_tokens above the capacity (fraction budget)") {
  // What a CUDA engine gets when the host cannot read the lengths: kept_upper_bound. A fraction of
  // the tokens seen (5000) exceeds one of the capacity (1000): B = 500, P = 500 - 32 (the window) = 468,
  // min = 468 // 20 = 23, max = 2P - min = 913: layer 0 keeps 913 + 32 = 945 per row (the bound of a
  // 1000-token head, 2 * 100 + 1, was 201).
  namespace kv = kvevict;
  auto p = kv::presets::pyramidkv::defaults();
  p.budgeter.num_tokens = 5000;
  const auto frac = kv::budget_request::fraction(0.1);
  kv::layer_inputs<float> in;
  in.keys = kv::make_kv_view<const float>(nullptr, 1, 2, 1000, 8, kv::kv_layout::hnd);
  in.values = in.keys;
  in.queries = kv::make_query_view<const float>(nullptr, 1, 2, 32, 8, kv::kv_layout::hnd);
  for (int layer = 0; layer < 4; ++layer) {
    CAPTURE(layer);
    in.layer_idx = layer;
    in.num_layers = 4;
    const auto h = kv::detail::plan_row<kv::budgeters::pyramid>(p.budgeter, frac, p.selector, 1000, 32, 0, layer, 4);
    const std::int64_t kept = kv::detail::kept_tokens(h, kv::budgeters::pyramid::head_budget(p.budgeter, h, layer, 4));
    if (layer == 0) CHECK(kept == 945);
    CHECK(kv::detail::frontend<kv::presets::pyramidkv>::kept_upper_bound(in, p, frac) >= 2 * kept);
  }
}

TEST_CASE("budget: pyramid matches PyramidKV's integer code (exact_total = false) and sums exactly otherwise") {
  kvtest::rng r(17);
  int nonuniform = 0;
  long exact_match = 0, layers = 0;
  for (int it = 0; it < 1500; ++it) {
    kvevict::budgeters::pyramid::params p;
    p.beta = static_cast<float>(r.uniform() < 0.5 ? 20.0 : static_cast<double>(r.integer(1, 40)));
    const std::int64_t P = r.integer(1, 300), C = P + r.integer(1, 600);
    const int n = static_cast<int>(r.integer(1, 40));
    CAPTURE(P);
    CAPTURE(C);
    CAPTURE(n);
    CAPTURE(p.beta);
    std::int64_t sum = 0;
    std::vector<std::int64_t> a(static_cast<std::size_t>(n));
    layers += n;
    for (int l = 0; l < n; ++l) {
      p.exact_total = false;
      CHECK(kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n) == kvref::pyramid_integer(P, C, p.beta, l, n));
      p.exact_total = true;
      const auto v = kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n);
      // Equal to the exact-rational reference (integer arithmetic: ties go to the lower layer).
      if (v == kvref::pyramid_exact(P, C, p.beta, l, n)) ++exact_match;
      CHECK(v == kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n));  // deterministic
      CHECK(v >= 0);
      CHECK(v <= C);
      a[static_cast<std::size_t>(l)] = v;
      sum += v;
    }
    CHECK(sum == static_cast<std::int64_t>(n) * P);
    if (n > 1 && 2 * P - static_cast<std::int64_t>(std::floor(static_cast<double>(P) / p.beta)) < C) {
      // Largest-remainder property with exact fractional parts: every layer gets floor or
      // floor + 1 of its share, and no layer left at the floor has a larger remainder than a
      // layer that got the extra unit.
      std::vector<std::int64_t> rem;
      (void)kvref::pyramid_exact(P, C, p.beta, 0, n, &rem);
      const std::int64_t mn = static_cast<std::int64_t>(std::floor(static_cast<double>(P) / p.beta)), mx = 2 * P - mn;
      std::int64_t min_up = n, max_down = -1;
      for (int l = 0; l < n; ++l) {
        const std::int64_t fl = (mx * (n - 1) - l * (mx - mn)) / (n - 1);
        const std::int64_t extra = a[static_cast<std::size_t>(l)] - fl;
        CHECK((extra == 0 || extra == 1));
        if (extra == 1) min_up = std::min(min_up, rem[static_cast<std::size_t>(l)]);
        else max_down = std::max(max_down, rem[static_cast<std::size_t>(l)]);
      }
      CHECK(max_down <= min_up);
    }
    for (int l = 1; l < n; ++l) CHECK(a[static_cast<std::size_t>(l)] <= a[static_cast<std::size_t>(l - 1)]);
    if (n > 1 && a[0] != a[static_cast<std::size_t>(n - 1)]) ++nonuniform;
  }
  CHECK(nonuniform > 100);
  CHECK(exact_match == layers);
  // head_budget adds the protected tokens; pass-through keeps L.
  kvevict::detail::head_plan h;
  h.length = 100;
  h.base_budget = 40;
  h.sinks = 2;
  h.recent = 8;
  CHECK(kvevict::budgeters::pyramid::head_budget({}, h, 0, 4) ==
        10 + kvref::pyramid_exact(30, 90, 20.0, 0, 4));
  h.pass_through = true;
  CHECK(kvevict::budgeters::pyramid::head_budget({}, h, 0, 4) == 100);
  CHECK(!kvevict::budgeters::pyramid::check({0.5f, true}).ok());
  CHECK(std::string(kvevict::budgeters::pyramid::check({NAN, true}).message()).find("beta") != std::string::npos);
}

TEST_CASE("budget: AdaKV head-wise allocation matches the documented formula") {
  kvtest::rng r(23);
  int uneven = 0;
  for (int it = 0; it < 300; ++it) {
    const std::int64_t H = r.integer(1, 6);
    std::vector<kvref::head_plan> plans;
    std::vector<kvref::vec> sc;
    std::vector<std::vector<float>> scf(static_cast<std::size_t>(H));
    std::vector<const float*> ptr;
    std::vector<kvevict::detail::head_plan> lp;
    const std::int64_t B = it % 3 == 0 ? r.integer(1, 6) : r.integer(4, 20);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = r.integer(1, 50);
      // a third of the cases protect nothing (the floor of 1 candidate per evicting head)
      plans.push_back(it % 3 == 0 ? kvref::plan(L, B, 0.0, 0, 0, -1.0, 3) : kvref::plan(L, B, 0.0, 1, 3, -1.0, 3));
      kvref::vec s(static_cast<std::size_t>(L));
      const double scale = r.uniform(0.1, 10.0);  // heads of different score scales
      for (auto& x : s) x = static_cast<float>(scale * r.uniform());
      if (r.uniform() < 0.2) std::fill(s.begin(), s.end(), 0.5);  // ties across heads
      scf[static_cast<std::size_t>(h)].assign(s.begin(), s.end());
      sc.push_back(s);
      lp.push_back(lib_plan(plans.back()));
    }
    for (auto& v : scf) ptr.push_back(v.data());
    const float alpha = r.uniform() < 0.5 ? 0.2f : static_cast<float>(r.uniform());
    std::vector<std::int64_t> got(static_cast<std::size_t>(H)), again(got.size());
    kvevict::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, got.data());
    kvevict::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, again.data());
    const auto ref = kvref::adakv_budgets(plans, sc, static_cast<double>(alpha));
    std::int64_t sum = 0, want = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& pl = plans[static_cast<std::size_t>(h)];
      CAPTURE(h);
      CHECK(got[static_cast<std::size_t>(h)] == ref[static_cast<std::size_t>(h)]);
      CHECK(got[static_cast<std::size_t>(h)] == again[static_cast<std::size_t>(h)]);
      CHECK(got[static_cast<std::size_t>(h)] <= pl.L);
      CHECK(got[static_cast<std::size_t>(h)] >= std::min(pl.L, pl.prot()));
      CHECK(got[static_cast<std::size_t>(h)] >= 1);  // never an empty head (L >= 1 here)
      sum += got[static_cast<std::size_t>(h)];
      want += pl.pass ? pl.L : pl.base;
      if (!pl.pass && got[static_cast<std::size_t>(h)] != pl.base) ++uneven;
    }
    CHECK(sum == want);
  }
  CHECK(uneven > 50);
  CHECK(!kvevict::budgeters::adakv::check({1.5f}).ok());
  CHECK(std::string(kvevict::budgeters::adakv::check({-0.5f}).message()).find("alpha") != std::string::npos);
}

TEST_CASE("budget: AdaKV with exact_total = false is the reference code's per-head rounding (hand-computed, fp64 reference)") {
  // Hand-computed: 3 heads of 40 tokens, nothing protected, B = 10, alpha 0.2: T = 30, F = floor(0.2 * 10) = 2.
  // Winners of the top 30 (13, 13, 4): round(0.8 * 13 + 2) = round(12.4) = 12, 12, round(5.2) = 5: 29 kept, not 30.
  // The largest-remainder rule keeps exactly 30 (12.4, 12.4, 5.2 -> 13, 12, 5: the tied remainders go to the lower head).
  {
    std::vector<std::vector<float>> sc(3, std::vector<float>(40, 0.01f));
    for (int i = 0; i < 13; ++i) sc[0][static_cast<std::size_t>(2 * i)] = 0.9f, sc[1][static_cast<std::size_t>(3 * i)] = 0.8f;
    for (int i = 0; i < 4; ++i) sc[2][static_cast<std::size_t>(5 + i)] = 0.7f;
    std::vector<const float*> ptr{sc[0].data(), sc[1].data(), sc[2].data()};
    std::vector<kvevict::detail::head_plan> lp(3, lib_plan(kvref::plan(40, 10, 0.0, 0, 0, -1.0, 0)));
    std::vector<std::int64_t> pub(3), exact(3);
    kvevict::budgeters::adakv::params p;
    p.alpha = 0.2f;
    p.exact_total = false;
    kvevict::cpu::detail::adakv_budgets(p, lp.data(), ptr.data(), 3, pub.data());
    CHECK(pub == std::vector<std::int64_t>{12, 12, 5});
    p.exact_total = true;
    kvevict::cpu::detail::adakv_budgets(p, lp.data(), ptr.data(), 3, exact.data());
    CHECK(exact == std::vector<std::int64_t>{13, 12, 5});
    CHECK(kvevict::budgeters::adakv::total_slack(p, 3) == 0);
    p.exact_total = false;
    CHECK(kvevict::budgeters::adakv::total_slack(p, 3) == 3);
  }
  // Half to even, as torch.round: 0.8 * 5 + F never ends in .5, alpha 0.5 does: 0.5 * 5 + 2 = 4.5 -> 4, 0.5 * 7 + 2 = 5.5 -> 6.
  {
    std::vector<std::vector<float>> sc(2, std::vector<float>(30, 0.01f));
    for (int i = 0; i < 5; ++i) sc[0][static_cast<std::size_t>(i)] = 0.9f;
    for (int i = 0; i < 3; ++i) sc[1][static_cast<std::size_t>(i)] = 0.8f;
    std::vector<const float*> ptr{sc[0].data(), sc[1].data()};
    std::vector<kvevict::detail::head_plan> lp(2, lib_plan(kvref::plan(30, 4, 0.0, 0, 0, -1.0, 0)));
    kvevict::budgeters::adakv::params p;
    p.alpha = 0.5f;
    p.exact_total = false;
    std::vector<std::int64_t> got(2);
    kvevict::cpu::detail::adakv_budgets(p, lp.data(), ptr.data(), 2, got.data());  // T = 8: winners (5, 3), F = 2
    CHECK(got == std::vector<std::int64_t>{4, 4});  // round(4.5) = 4, round(3.5) = 4
  }
  // alpha as the decimal it stands for: 0.7f * 10 = 6.99999..., the reference's int(10 * 0.7) = 7.
  {
    std::vector<std::vector<float>> sc(2, std::vector<float>(40, 0.01f));
    for (int i = 0; i < 10; ++i) sc[0][static_cast<std::size_t>(i)] = 0.9f, sc[1][static_cast<std::size_t>(i)] = 0.8f;
    std::vector<const float*> ptr{sc[0].data(), sc[1].data()};
    std::vector<kvevict::detail::head_plan> lp(2, lib_plan(kvref::plan(40, 10, 0.0, 0, 0, -1.0, 0)));
    kvevict::budgeters::adakv::params p;
    p.alpha = 0.7f;
    p.exact_total = false;
    std::vector<std::int64_t> got(2);
    kvevict::cpu::detail::adakv_budgets(p, lp.data(), ptr.data(), 2, got.data());  // winners (10, 10): round(0.3 * 10 + 7) = 10
    CHECK(got == std::vector<std::int64_t>{10, 10});
  }
  // Random plans and scores against the fp64 reference's rule (tests/reference/reference.hpp), and the slack bound.
  kvtest::rng r(29);
  int off = 0;
  for (int it = 0; it < 300; ++it) {
    const std::int64_t H = r.integer(1, 8);
    std::vector<kvref::head_plan> plans;
    std::vector<kvref::vec> sc;
    std::vector<std::vector<float>> scf(static_cast<std::size_t>(H));
    std::vector<const float*> ptr;
    std::vector<kvevict::detail::head_plan> lp;
    const std::int64_t B = it % 3 == 0 ? r.integer(1, 24) : r.integer(5, 24);  // a budget holds the protected tokens
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = r.integer(1, 60);
      plans.push_back(it % 3 == 0 ? kvref::plan(L, B, 0.0, 0, 0, -1.0, 3) : kvref::plan(L, B, 0.0, 1, 3, -1.0, 3));
      kvref::vec v(static_cast<std::size_t>(L));
      const double scale = r.uniform(0.1, 10.0);
      for (auto& x : v) x = static_cast<float>(scale * r.uniform());
      scf[static_cast<std::size_t>(h)].assign(v.begin(), v.end());
      sc.push_back(v);
      lp.push_back(lib_plan(plans.back()));
    }
    for (auto& v : scf) ptr.push_back(v.data());
    kvevict::budgeters::adakv::params p;
    p.alpha = r.uniform() < 0.5 ? 0.2f : static_cast<float>(r.uniform());
    p.exact_total = false;
    std::vector<std::int64_t> got(static_cast<std::size_t>(H));
    kvevict::cpu::detail::adakv_budgets(p, lp.data(), ptr.data(), H, got.data());
    const auto ref = kvref::adakv_budgets(plans, sc, static_cast<double>(p.alpha), false);
    std::int64_t sum = 0, exact = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& pl = plans[static_cast<std::size_t>(h)];
      CAPTURE(h);
      CHECK(got[static_cast<std::size_t>(h)] == ref[static_cast<std::size_t>(h)]);
      CHECK(got[static_cast<std::size_t>(h)] <= pl.L);
      CHECK(got[static_cast<std::size_t>(h)] >= std::min(pl.L, pl.prot()));
      sum += got[static_cast<std::size_t>(h)];
      exact += pl.pass ? pl.L : pl.base;
    }
    CHECK(sum <= exact + kvevict::budgeters::adakv::total_slack(p, H));
    off += sum != exact;
  }
  CHECK(off > 30);  // the rule does move the total
}

// ---- PyramidKV and AdaKV through the evictor -------------------------------------------------

TEST_CASE("budgeters through the evictor: PyramidKV (integer and exact) and AdaKV") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 4, s.group = 1, s.cap = 80, s.d = 16, s.window = 8;
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  c.spatial = spatial_kind::avg_pool;
  c.keep_tokens = 24;
  for (int layer : {0, 3, 7}) {
    CAPTURE(layer);
    auto p = kv::presets::pyramidkv::defaults();
    auto cc = c;
    cc.budgeter = kvtest::budget_kind::pyramid;
    cc.layer = layer, cc.num_layers = 8;
    for (bool exact : {false, true}) {
      CAPTURE(exact);
      p.budgeter.exact_total = exact;
      cc.pyramid_exact = exact;
      kvtest::problem pr = kvtest::make_problem(s, 1000 + static_cast<std::uint64_t>(layer));
      kvtest::stored<float> st;
      kvtest::store(pr, layout::nhd, st);
      st.in.layer_idx = layer;
      st.in.num_layers = 8;
      kv::evictor<kv::presets::pyramidkv, kv::cpu::backend> ev(p);
      auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(24));
      const std::string diff = kvtest::compare(lib, kvtest::reference_run(pr, cc));
      CHECK_MESSAGE(diff.empty(), diff);
      CHECK(lib.indptr.back() == ev.max_selected(st.in, kv::budget_request::tokens(24)));
      // num_tokens = the heads' common length (a decode schedule's prefill eviction): the same selection
      auto pt = p;
      pt.budgeter.num_tokens = s.cap;
      kv::evictor<kv::presets::pyramidkv, kv::cpu::backend> evt(pt);
      const auto same = kvtest::run_lib(evt, st.in, kv::budget_request::tokens(24));
      CHECK(same.st.ok());
      CHECK(same.indptr == lib.indptr);
      CHECK(same.indices == lib.indices);
      CHECK(std::memcmp(same.scores.data(), lib.scores.data(), lib.scores.size() * sizeof(float)) == 0);
    }
  }
  {
    auto cc = c;
    cc.budgeter = kvtest::budget_kind::adakv;
    cc.adakv_alpha = static_cast<double>(0.2f);
    int uneven = 0;
    for (std::uint64_t seed = 1100; seed < 1104; ++seed) {
      kvtest::problem pr = kvtest::make_problem(s, seed);
      // heads with very different attention sharpness, so AdaKV moves budget between them
      for (std::int64_t b = 0; b < s.batch; ++b)
        for (std::int64_t hq = 0; hq < s.q_heads(); ++hq)
          for (std::int64_t j = 0; j < s.window; ++j)
            for (std::int64_t d = 0; d < s.d; ++d) pr.Q[pr.q_idx(b, hq, j, d)] *= 0.3 + 1.2 * static_cast<double>(hq);
      kvtest::stored<float> st;
      kvtest::store(pr, layout::nhd, st);
      kv::evictor<kv::presets::adakv, kv::cpu::backend> ev;
      auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(24));
      CAPTURE(seed);
      const std::string diff = kvtest::compare(lib, kvtest::reference_run(pr, cc));
      CHECK_MESSAGE(diff.empty(), diff);
      for (std::int64_t r = 0; r < lib.rows; ++r) uneven += lib.indptr[static_cast<std::size_t>(r + 1)] - lib.indptr[static_cast<std::size_t>(r)] != 24;
      CHECK(lib.indptr.back() == 24 * lib.rows);  // the layer total is exact
    }
    CHECK(uneven > 0);
  }
}

TEST_CASE("budgeters through the evictor: presets::adakv_published (max-pool 7, reference rounding) vs the fp64 reference") {
  // On K/V the reference code would have repeated (G = 1): every query head its own cache head.
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 8, s.group = 1, s.cap = 80, s.d = 16, s.window = 8;
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  c.spatial = spatial_kind::max_pool;
  c.kernel = 7;
  c.budgeter = kvtest::budget_kind::adakv;
  c.adakv_alpha = static_cast<double>(0.2f);
  c.adakv_exact_total = false;
  int off = 0;
  for (std::int32_t keep : {12, 24, 40}) {
    c.keep_tokens = keep;
    for (std::uint64_t seed = 1200; seed < 1206; ++seed) {
      CAPTURE(keep);
      CAPTURE(seed);
      kvtest::problem pr = kvtest::make_problem(s, seed);
      for (std::int64_t b = 0; b < s.batch; ++b)  // heads of different sharpness
        for (std::int64_t hq = 0; hq < s.q_heads(); ++hq)
          for (std::int64_t j = 0; j < s.window; ++j)
            for (std::int64_t d = 0; d < s.d; ++d) pr.Q[pr.q_idx(b, hq, j, d)] *= 0.3 + 0.7 * static_cast<double>(hq);
      kvtest::stored<float> st;
      kvtest::store(pr, layout::hnd, st);
      kv::evictor<kv::presets::adakv_published, kv::cpu::backend> ev;
      const kv::budget_request req = kv::budget_request::tokens(keep);
      auto lib = kvtest::run_lib(ev, st.in, req);
      REQUIRE(lib.st.ok());
      const std::string diff = kvtest::compare(lib, kvtest::reference_run(pr, c));
      CHECK_MESSAGE(diff.empty(), diff);
      kv::eviction_plan pl;
      REQUIRE(ev.plan(st.in, req, &pl).ok());
      CHECK(!pl.max_selected_exact);
      CHECK(lib.indptr.back() <= pl.max_selected);
      CHECK(pl.max_selected == keep * lib.rows + s.batch * s.q_heads());  // + total_slack = 8 per sequence
      off += lib.indptr.back() != keep * lib.rows;
    }
  }
  CHECK(off > 0);  // the layer total moved somewhere
}

TEST_CASE("budgeters never empty a non-empty head when nothing is protected (AdaKV, PyramidKV; tiny budgets)") {
  // CI's fuzzer found AdaKV giving one of two heads both tokens of a 1-token-per-head budget and
  // the other none (num_recent = 0, keep fraction 0.004); PyramidKV's min = P // beta is 0 for
  // P < beta, which emptied the deepest layers. Both now keep >= 1 token per evicting head.
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 4, s.group = 2, s.cap = 40, s.d = 8, s.window = 4;
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  c.spatial = spatial_kind::avg_pool;
  c.num_recent = 0;
  int floored = 0;
  for (std::uint64_t seed = 1200; seed < 1206; ++seed) {
    // one head with much sharper attention, so a plain top-T gives it every winner
    kvtest::problem pr = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, {40, 7, 2, 33, 40, 40, 1, 26});
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t j = 0; j < s.window; ++j)
        for (std::int64_t d = 0; d < s.d; ++d)
          for (std::int64_t g = 0; g < s.group; ++g) pr.Q[pr.q_idx(b, g, j, d)] *= 8.0;
    kvtest::stored<float> st;
    kvtest::store(pr, layout::nhd, st);
    for (const kv::budget_request req : {kv::budget_request::fraction(0.004), kv::budget_request::tokens(1),
                                         kv::budget_request::tokens(2), kv::budget_request::fraction(0.1)}) {
      CAPTURE(seed);
      CAPTURE(req.keep_tokens);
      CAPTURE(req.keep_fraction);
      auto cc = c;
      cc.keep_tokens = req.keep_tokens;
      cc.keep_fraction = req.keep_fraction;
      auto check_rows = [&](const kvtest::lib_result& lib) {
        REQUIRE(lib.st.ok());
        for (std::int64_t r = 0; r < lib.rows; ++r) {
          const std::int64_t L = pr.length(r / s.kv_heads, r % s.kv_heads);
          CAPTURE(r);
          CHECK((L == 0 || !lib.kept(r).empty()));
          floored += L > 1 && lib.kept(r).size() == 1;
        }
      };
      {
        auto p = kv::presets::adakv::defaults();
        p.selector.num_recent = 0;
        for (float alpha : {0.0f, 0.2f}) {
          p.budgeter.alpha = alpha;
          cc.budgeter = kvtest::budget_kind::adakv;
          cc.adakv_alpha = static_cast<double>(alpha);
          kv::evictor<kv::presets::adakv, kv::cpu::backend> ev(p);
          auto lib = kvtest::run_lib(ev, st.in, req);
          check_rows(lib);
          const std::string diff = kvtest::compare(lib, kvtest::reference_run(pr, cc));
          CHECK_MESSAGE(diff.empty(), diff);
        }
      }
      for (bool exact : {false, true})
        for (int layer : {0, 5, 11}) {
          auto p = kv::presets::pyramidkv::defaults();
          p.selector.num_recent = 0;
          p.budgeter.exact_total = exact;
          cc.budgeter = kvtest::budget_kind::pyramid;
          cc.pyramid_exact = exact;
          cc.layer = layer, cc.num_layers = 12;
          st.in.layer_idx = layer;
          st.in.num_layers = 12;
          kv::evictor<kv::presets::pyramidkv, kv::cpu::backend> ev(p);
          auto lib = kvtest::run_lib(ev, st.in, req);
          check_rows(lib);
          const std::string diff = kvtest::compare(lib, kvtest::reference_run(pr, cc));
          CHECK_MESSAGE(diff.empty(), diff);
        }
      st.in.layer_idx = 0;
      st.in.num_layers = 1;
      cc.layer = 0, cc.num_layers = 1;
    }
  }
  CHECK(floored > 0);
  // PyramidKV alone: for P < beta the deepest layer used to get 0 candidates.
  kv::budgeters::pyramid::params pp;
  for (bool exact : {false, true}) {
    pp.exact_total = exact;
    std::int64_t sum = 0;
    for (int l = 0; l < 32; ++l) {
      const auto v = kv::budgeters::pyramid::layer_candidates(pp, 3, 500, l, 32, 1);
      CHECK(v >= 1);
      sum += v;
    }
    if (exact) CHECK(sum == 32 * 3);
    // PyramidKV's own rule: min = 3 // 20 = 0 reaches the last layer in the exact schedule (the
    // integer one keeps max for every layer here: step = (6 - 0) // 31 = 0).
    CHECK(kv::budgeters::pyramid::layer_candidates(pp, 3, 500, 31, 32, 0) == (exact ? 0 : 6));
  }
}

// ---- Attack on the floor of the head-wise budgeters (review of 5454e27) -------------------
// The AdaKV floor's donor argument: every evicting head has 0 <= P = B - prot < C (validated
// budgets hold the protected tokens; L > B otherwise pass-through), so T = sum P is never
// clamped and a floored head (prot = 0) adds P = B >= 1 to T and 1 to sum(m); a donor with
// extra - m >= 1 therefore exists whenever a floored head is empty. These cases try to break
// it with every plan shape: pass-through heads, L = 0 / 1, sinks (also num_sink >= L), recent
// 0 / window 0..3 / recent share, tokens and fractions, alpha 0 / 0.2 / 0.5 / 1 / random,
// tied, NaN, +-inf and +-0 scores.

namespace {

/// The global top-T of the candidate slots of the evicting heads (NaN last, then higher score,
/// ties to the lower head, then the lower slot): winners per head, by a full sort.
std::vector<unsigned long long> brute_winners(const std::vector<kv::detail::head_plan>& pl,
                                              const std::vector<std::vector<float>>& sc, std::int64_t* T_out) {
  struct c {
    float s;
    std::int64_t h, i;
  };
  std::vector<c> all;
  std::int64_t T = 0;
  for (std::size_t h = 0; h < pl.size(); ++h) {
    if (pl[h].pass_through) continue;
    T += pl[h].base_budget - pl[h].protected_count();
    for (std::int64_t i = pl[h].sinks; i < pl[h].length - pl[h].recent; ++i)
      all.push_back({sc[h][static_cast<std::size_t>(i)], static_cast<std::int64_t>(h), i});
  }
  T = std::min<std::int64_t>(T, static_cast<std::int64_t>(all.size()));
  std::sort(all.begin(), all.end(), [](const c& a, const c& b) {
    const bool na = std::isnan(a.s), nb = std::isnan(b.s);
    if (na != nb) return nb;
    if (!na && a.s != b.s) return a.s > b.s;
    if (a.h != b.h) return a.h < b.h;
    return a.i < b.i;
  });
  std::vector<unsigned long long> w(pl.size(), 0ull);
  for (std::int64_t t = 0; t < T; ++t) ++w[static_cast<std::size_t>(all[static_cast<std::size_t>(t)].h)];
  *T_out = T;
  return w;
}

}  // namespace

TEST_CASE("AdaKV floor (attack): adversarial plans vs the fp64 reference; exact totals, bounds, CUDA's winner type") {
  kvtest::rng r(5150);
  int moved = 0, mixed = 0, with_pass = 0, with_zero = 0, sinks_ge_L = 0, share_unprotected = 0;
  for (int it = 0; it < 6000; ++it) {
    const std::int64_t H = r.integer(1, 9);
    kv::selectors::topk::params sp;
    sp.num_sink = r.uniform() < 0.6 ? 0 : static_cast<std::int32_t>(r.integer(1, 3));
    const int rk = static_cast<int>(r.integer(0, 3));  // 0, 1: num_recent 0; 2: the window; 3: a recent share
    sp.num_recent = rk <= 1 ? 0 : -1;
    sp.recent_share = rk == 3 ? static_cast<float>(r.uniform()) : -1.0f;
    const std::int64_t W = r.integer(0, 3);
    const std::int64_t fixed = sp.num_sink + (rk == 2 ? W : 0);
    kv::budget_request req;
    const int bk = static_cast<int>(r.integer(0, 3));
    if (bk == 0) req = kv::budget_request::tokens(static_cast<std::int32_t>(std::max<std::int64_t>(1, fixed + r.integer(0, 2))));
    else if (bk == 1) req = kv::budget_request::fraction(0.004);
    else if (bk == 2) req = kv::budget_request::fraction(r.uniform(0.01, 0.4));
    else req = kv::budget_request::fraction(r.uniform(0.4, 1.0));
    REQUIRE(kv::detail::validate_budget(req, sp, W).ok());
    const bool same_len = r.uniform() < 0.3;
    const std::int64_t L0 = r.integer(0, 14);
    std::vector<kv::detail::head_plan> lp;
    std::vector<kvref::head_plan> rp;
    std::vector<std::vector<float>> scf(static_cast<std::size_t>(H));
    std::vector<kvref::vec> sc;
    std::vector<const float*> ptr;
    const int kind = static_cast<int>(r.integer(0, 4));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = same_len ? L0 : r.integer(0, 14);
      lp.push_back(kv::detail::plan_head(req, sp, L, W));
      rp.push_back(kvref::plan(L, req.keep_tokens, req.keep_fraction, sp.num_sink, sp.num_recent, sp.recent_share, W));
      const auto& a = lp.back();
      const auto& b = rp.back();
      CHECK(a.length == b.L);
      CHECK(a.base_budget == b.base);
      CHECK(a.pass_through == b.pass);
      if (!a.pass_through) {
        CHECK(a.sinks == b.sinks);
        CHECK(a.recent == b.recent);
        // the premises of the donor argument
        CHECK(a.base_budget - a.protected_count() >= 0);
        CHECK(a.base_budget - a.protected_count() < a.candidates());
      }
      sinks_ge_L += sp.num_sink >= L && L > 0;
      auto& s = scf[static_cast<std::size_t>(h)];
      s.resize(static_cast<std::size_t>(L));
      const double scale = std::pow(10.0, r.uniform(-3.0, 3.0));
      for (auto& x : s) {
        const double u = r.uniform();
        switch (kind) {
          case 0: x = static_cast<float>(scale * u); break;
          case 1: x = 0.5f; break;  // ties within and across heads
          case 2: x = u < 0.3 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(scale * r.uniform()); break;
          case 3: x = u < 0.2 ? INFINITY : (u < 0.4 ? -INFINITY : (u < 0.6 ? -0.0f : static_cast<float>(scale * r.uniform()))); break;
          default: x = u < 0.5 ? 0.0f : -0.0f; break;
        }
      }
      sc.push_back(kvref::vec(s.begin(), s.end()));
      ptr.push_back(s.data());
    }
    const float alphas[] = {0.0f, 0.2f, 0.5f, 1.0f, static_cast<float>(r.uniform())};
    const float alpha = alphas[r.integer(0, 4)];
    CAPTURE(it);
    CAPTURE(H);
    CAPTURE(alpha);
    CAPTURE(sp.num_sink);
    CAPTURE(sp.num_recent);
    CAPTURE(sp.recent_share);
    CAPTURE(W);
    CAPTURE(req.keep_tokens);
    CAPTURE(req.keep_fraction);
    std::vector<std::int64_t> got(static_cast<std::size_t>(H), -1), again(got.size(), -2), dev(got.size(), -3);
    kv::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, got.data());
    kv::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, again.data());
    std::vector<std::int64_t> ref;
    REQUIRE_NOTHROW(ref = kvref::adakv_budgets(rp, sc, static_cast<double>(alpha)));  // throws when no donor
    // The CUDA kernel's call: the same function with unsigned long long winners (brute force here).
    std::int64_t T = 0;
    const auto win = brute_winners(lp, scf, &T);
    std::vector<double> share(static_cast<std::size_t>(H));
    std::vector<std::int64_t> cap(static_cast<std::size_t>(H)), extra(static_cast<std::size_t>(H));
    kv::budgeters::adakv::apportion_budgets(kv::budgeters::adakv::params{alpha}, lp.data(), win.data(), H, T, share.data(),
                                            cap.data(), extra.data(), dev.data());
    // The rounding alone (the rule before the floor): differs only where the floor moved tokens.
    kv::detail::apportion(share.data(), cap.data(), H, T, extra.data());
    std::int64_t sum = 0, want = 0, emptied = 0, moved_abs = 0;
    bool any_floored = false, any_protected_evicting = false, any_pass = false;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::size_t i = static_cast<std::size_t>(h);
      const auto& pl = lp[i];
      CAPTURE(h);
      CAPTURE(pl.length);
      CHECK(got[i] == ref[i]);
      CHECK(got[i] == again[i]);
      CHECK(got[i] == dev[i]);
      CHECK(got[i] <= pl.length);
      if (pl.pass_through) {
        CHECK(got[i] == pl.length);
        any_pass = true;
      } else {
        CHECK(got[i] >= pl.protected_count());
        const std::int64_t plain = pl.protected_count() + extra[i];
        moved_abs += std::llabs(got[i] - plain);
        if (pl.protected_count() == 0) {
          any_floored = true;
          emptied += extra[i] == 0;
        } else {
          any_protected_evicting = true;
        }
      }
      if (pl.length > 0) CHECK(got[i] >= 1);  // never an empty non-empty head
      sum += got[i];
      want += pl.pass_through ? pl.length : pl.base_budget;
      with_zero += pl.length == 0;
    }
    CHECK(sum == want);                // the layer total: every evicting head's B, pass-through L
    CHECK(moved_abs == 2 * emptied);   // nothing moves unless a head was emptied, one token each
    moved += emptied > 0;
    mixed += emptied > 0 && any_protected_evicting;
    with_pass += emptied > 0 && any_pass;
    share_unprotected += emptied > 0 && rk == 3;
    (void)any_floored;
  }
  MESSAGE("floor moves " << moved << ", with protected heads " << mixed << ", with pass-through " << with_pass
                         << ", recent share " << share_unprotected << ", L = 0 heads " << with_zero << ", num_sink >= L "
                         << sinks_ge_L);
  CHECK(moved > 300);
  CHECK(mixed > 10);
  CHECK(with_pass > 10);
  CHECK(share_unprotected > 10);
  CHECK(with_zero > 100);
  CHECK(sinks_ge_L > 100);
}

TEST_CASE("PyramidKV floor (attack): min 1 for unprotected heads vs the fp64 reference; sums, bounds, head_budget") {
  int raised = 0;
  for (bool exact : {false, true})
    for (double beta : {1.0, 1.5, 2.0, 20.0, 1e9})
      for (int n : {1, 2, 3, 7, 32})
        for (std::int64_t P = 1; P <= 24; ++P)
          for (std::int64_t C : {P + 1, P + 2, 2 * P - 1, 2 * P, 2 * P + 1, 3 * P + 5, 500 * P}) {
            if (C <= P) continue;
            kv::budgeters::pyramid::params pp;
            pp.beta = static_cast<float>(beta);
            pp.exact_total = exact;
            CAPTURE(exact);
            CAPTURE(beta);
            CAPTURE(n);
            CAPTURE(P);
            CAPTURE(C);
            std::int64_t sum = 0;
            bool differs = false;
            for (int l = 0; l < n; ++l) {
              CAPTURE(l);
              const std::int64_t v = kv::budgeters::pyramid::layer_candidates(pp, P, C, l, n, 1);
              const std::int64_t want = exact ? kvref::pyramid_exact(P, C, static_cast<double>(pp.beta), l, n, nullptr, 1)
                                              : kvref::pyramid_integer(P, C, static_cast<double>(pp.beta), l, n, 1);
              CHECK(v == want);
              CHECK(v >= 1);
              CHECK(v <= C);
              CHECK(v <= 2 * P);  // CUDA's max_selected bound per head: 2B + 1
              differs = differs || v != kv::budgeters::pyramid::layer_candidates(pp, P, C, l, n, 0);
              // head_budget: a head with nothing protected (L = C, B = P) takes the raised min...
              kv::detail::head_plan h;
              h.length = C;
              h.base_budget = P;
              CHECK(kv::budgeters::pyramid::head_budget(pp, h, l, n) == v);
              // ... a head with a sink keeps PyramidKV's min (its sink keeps it non-empty).
              h.length = C + 1;
              h.base_budget = P + 1;
              h.sinks = 1;
              const std::int64_t hv = kv::budgeters::pyramid::head_budget(pp, h, l, n);
              CHECK(hv == 1 + kv::budgeters::pyramid::layer_candidates(pp, P, C, l, n, 0));
              CHECK(hv >= 1);
              sum += v;
            }
            if (exact) CHECK(sum == static_cast<std::int64_t>(n) * P);
            raised += differs;
          }
  CHECK(raised > 100);
}

TEST_CASE("budgeter floors through the evictor (attack): GQA per query head / max / layer mean, ragged batches, sinks >= L, "
          "CriticalAdaKV; max_selected == kept") {
  kvtest::shape s;
  s.batch = 3, s.kv_heads = 3, s.group = 2, s.cap = 24, s.d = 8, s.window = 3, s.hidden = 10;
  // ragged: empty heads, 1- and 2-token heads (pass-through or not, by the budget), long heads
  const std::vector<std::int32_t> lens = {24, 0, 2, 1, 24, 3, 5, 17, 24};
  const std::vector<std::int32_t> equal_lens = {24, 24, 24, 3, 3, 3, 11, 11, 11};  // layer_mean needs equal lengths
  int floored = 0, runs = 0;
  struct gq {
    kv::gqa_reduction lib;
    kvref::gqa_kind ref;
  };
  for (const gq g : {gq{kv::gqa_reduction::per_query_head, kvref::gqa_kind::per_query_head}, gq{kv::gqa_reduction::max, kvref::gqa_kind::max},
                     gq{kv::gqa_reduction::mean, kvref::gqa_kind::mean}, gq{kv::gqa_reduction::layer_mean, kvref::gqa_kind::layer_mean}})
    for (std::int32_t sinks : {0, 2})
      for (std::uint64_t seed = 7300; seed < 7302; ++seed) {
        const auto& ln = g.lib == kv::gqa_reduction::layer_mean ? equal_lens : lens;
        kvtest::problem pr = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, ln);
        kvtest::quantize_wo<float>(pr);
        kvtest::stored<float> st;
        kvtest::store(pr, layout::nhd, st);
        for (const kv::budget_request req : {kv::budget_request::tokens(sinks + 1), kv::budget_request::tokens(sinks + 2),
                                             kv::budget_request::fraction(0.004), kv::budget_request::fraction(0.15)}) {
          ref_config c;
          c.scorer = scorer_kind::attention_weight;
          c.spatial = spatial_kind::avg_pool;
          c.gqa = g.ref;
          c.num_recent = 0;
          c.num_sink = sinks;
          c.keep_tokens = req.keep_tokens;
          c.keep_fraction = req.keep_fraction;
          CAPTURE(kv::to_string(g.lib));
          CAPTURE(sinks);
          CAPTURE(seed);
          CAPTURE(req.keep_tokens);
          CAPTURE(req.keep_fraction);
          auto rows_ok = [&](const kvtest::lib_result& lib, std::int64_t max_sel, const std::vector<kvtest::ref_row>& ref) {
            REQUIRE(lib.st.ok());
            CHECK(lib.indptr.back() == max_sel);  // max_selected is the exact kept count on the CPU
            const std::int64_t H = lib.rows / s.batch;
            for (std::int64_t r = 0; r < lib.rows; ++r) {
              const std::int64_t L = pr.length(r / H, (r % H) / (H / s.kv_heads));
              CAPTURE(r);
              CHECK(ref[static_cast<std::size_t>(r)].plan.L == L);
              CHECK((L == 0 || !lib.kept(r).empty()));
              CHECK(static_cast<std::int64_t>(lib.kept(r).size()) == std::min(ref[static_cast<std::size_t>(r)].budget, L));
              floored += sinks == 0 && L > 1 && lib.kept(r).size() == 1;
            }
          };
          {  // AdaKV, alpha 0 (pure) and 1: per sequence the total is sum of B (pass-through: L)
            for (float alpha : {0.0f, 1.0f}) {
              auto p = kv::presets::adakv::defaults();
              p.selector.num_recent = 0;
              p.selector.num_sink = sinks;
              p.gqa = g.lib;
              p.budgeter.alpha = alpha;
              auto cc = c;
              cc.budgeter = kvtest::budget_kind::adakv;
              cc.adakv_alpha = static_cast<double>(alpha);
              kv::evictor<kv::presets::adakv, kv::cpu::backend> ev(p);
              const auto lib = kvtest::run_lib(ev, st.in, req);
              const auto ref = kvtest::reference_run(pr, cc);
              rows_ok(lib, ev.max_selected(st.in, req), ref);
              const std::string diff = kvtest::compare(lib, ref);
              CHECK_MESSAGE(diff.empty(), diff);
              ++runs;
            }
          }
          {  // PyramidKV over all 6 layers: each evicting row sums to 6 B over the layers (exact)
            auto p = kv::presets::pyramidkv::defaults();
            p.selector.num_recent = 0;
            p.selector.num_sink = sinks;
            p.gqa = g.lib;
            kv::evictor<kv::presets::pyramidkv, kv::cpu::backend> ev(p);
            std::vector<std::int64_t> per_row;
            std::vector<kvtest::ref_row> ref;
            for (int layer = 0; layer < 6; ++layer) {
              CAPTURE(layer);
              st.in.layer_idx = layer;
              st.in.num_layers = 6;
              auto cc = c;
              cc.budgeter = kvtest::budget_kind::pyramid;
              cc.layer = layer, cc.num_layers = 6;
              const auto lib = kvtest::run_lib(ev, st.in, req);
              ref = kvtest::reference_run(pr, cc);
              rows_ok(lib, ev.max_selected(st.in, req), ref);
              const std::string diff = kvtest::compare(lib, ref);
              CHECK_MESSAGE(diff.empty(), diff);
              per_row.resize(static_cast<std::size_t>(lib.rows), 0);
              for (std::int64_t r = 0; r < lib.rows; ++r) per_row[static_cast<std::size_t>(r)] += static_cast<std::int64_t>(lib.kept(r).size());
              ++runs;
            }
            for (std::size_t r = 0; r < per_row.size(); ++r)
              if (!ref[r].plan.pass) CHECK(per_row[r] == 6 * ref[r].plan.base);
            st.in.layer_idx = 0;
            st.in.num_layers = 1;
          }
          {  // CriticalAdaKV: AdaKV budgets on the primary score, then two stages; counts vs the reference
            auto p = kv::presets::critical_adakv::defaults();
            p.selector.num_recent = 0;
            p.selector.num_sink = sinks;
            p.gqa = g.lib;
            auto cc = c;
            cc.scorer = scorer_kind::attention_value_norm;
            cc.temporal = kvref::temporal_kind::mean;
            cc.kernel = 5;
            cc.budgeter = kvtest::budget_kind::adakv;
            cc.adakv_alpha = static_cast<double>(0.2f);
            cc.first_stage_ratio = 0.5;
            cc.eps = static_cast<double>(1e-4f);
            kv::evictor<kv::presets::critical_adakv, kv::cpu::backend> ev(p);
            const auto lib = kvtest::run_lib(ev, st.in, req);
            const auto ref = kvtest::reference_run(pr, cc);
            rows_ok(lib, ev.max_selected(st.in, req), ref);
            ++runs;
          }
        }
      }
  MESSAGE("runs " << runs << ", rows floored to 1 token " << floored);
  CHECK(floored > 50);
}

// ---- budgeters::threshold ---------------------------------------------------------------------

namespace {
/// SnapKV's scores with the threshold budgeter (the budget request is the per-head cap).
using threshold_policy = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::mean,
                                                  kvevict::spatial::avg_pool, kvevict::budgeters::threshold>;

/// The threshold rule on one head's candidate scores (fp64, full sort): how many pass, before floor and cap.
std::int64_t passing(const std::vector<float>& s, const kvevict::budgeters::threshold::params& p) {
  std::vector<float> v = s;
  std::sort(v.begin(), v.end(), [](float a, float b) {
    const bool na = a != a, nb = b != b;
    if (na != nb) return nb;
    return !na && a > b;
  });
  std::int64_t c = 0;
  if (p.mode == kvevict::budgeters::threshold::rule::score) {
    for (float x : v) c += (x >= p.threshold) ? 1 : 0;
    return c;
  }
  double total = 0.0, cum = 0.0;
  for (float x : v) total += std::max(0.0, double(x));
  const double goal = double(p.threshold) * total;
  if (!(total > 0.0) || !(goal > 0.0)) return 0;
  while (c < std::int64_t(v.size()) && cum < goal) cum += std::max(0.0, double(v[size_t(c++)]));
  return c;
}
}  // namespace

TEST_CASE("budgeters::threshold: per-head counts from the scores, floor, cap, per-sequence cap; kept sets are the passing sets") {
  using thr = kvevict::budgeters::threshold;
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 3, s.group = 2, s.cap = 64, s.d = 16, s.window = 8;
  int non_trivial = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    kvtest::problem p = kvtest::make_problem(s, 300 + seed, 1.0, 2.0, 1.0, seed % 2 ? std::vector<std::int32_t>{64, 50, 60, 64, 30, 12} : std::vector<std::int32_t>{});
    kvtest::stored<float> st;
    kvtest::store(p, kvtest::layout::nhd, st);
    for (int variant = 0; variant < 5; ++variant) {
      auto prm = threshold_policy::defaults();
      prm.budgeter.mode = variant % 2 ? thr::rule::mass : thr::rule::score;
      prm.budgeter.threshold = variant % 2 ? 0.5f + 0.1f * float(variant) : 0.02f * float(variant + 1);
      prm.budgeter.min_candidates = variant == 2 ? 5 : 1;
      prm.budgeter.max_tokens = variant >= 3 ? 20 : 0;
      kvevict::evictor<threshold_policy, kvevict::cpu::backend> ev(prm);
      const std::int32_t B = 24;
      const auto lib = kvtest::run_lib(ev, st.in, kvevict::budget_request::tokens(B));
      REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
      CHECK(ev.max_selected(st.in, kvevict::budget_request::tokens(B)) >= lib.indptr.back());
      for (std::int64_t b = 0; b < s.batch; ++b) {
        std::vector<std::int64_t> cnt(size_t(s.kv_heads)), flo(size_t(s.kv_heads));
        std::vector<std::vector<float>> cand(size_t(s.kv_heads));
        std::int64_t sum = 0, floors = 0;
        for (std::int64_t h = 0; h < s.kv_heads; ++h) {
          const std::int64_t r = b * s.kv_heads + h, L = p.length(b, h), w = std::min(s.window, L);
          if (L <= B) {  // kept whole
            CHECK(lib.indptr[size_t(r + 1)] - lib.indptr[size_t(r)] == L);
            cnt[size_t(h)] = -1;
            continue;
          }
          cand[size_t(h)].assign(lib.row_scores(r), lib.row_scores(r) + (L - w));
          const std::int64_t cap = std::min<std::int64_t>(B - w, L - w), f = std::min<std::int64_t>(prm.budgeter.min_candidates, cap);
          cnt[size_t(h)] = std::min(std::max(passing(cand[size_t(h)], prm.budgeter), f), cap);
          flo[size_t(h)] = std::min(f, cnt[size_t(h)]);
          sum += cnt[size_t(h)];
          floors += flo[size_t(h)];
        }
        if (prm.budgeter.max_tokens > 0 && sum > prm.budgeter.max_tokens) {
          // floors, then the best remaining passing candidates of all heads (ties: lower head, then index)
          struct c3 { float v; std::int64_t h, rank; };
          std::vector<c3> rest;
          for (std::int64_t h = 0; h < s.kv_heads; ++h) {
            if (cnt[size_t(h)] < 0) continue;
            std::vector<float> v = cand[size_t(h)];
            std::stable_sort(v.begin(), v.end(), [](float a, float c) { return a > c; });
            for (std::int64_t k = flo[size_t(h)]; k < cnt[size_t(h)]; ++k) rest.push_back({v[size_t(k)], h, k});
            cnt[size_t(h)] = flo[size_t(h)];
          }
          std::stable_sort(rest.begin(), rest.end(), [](const c3& a, const c3& c) { return a.v > c.v; });
          for (std::int64_t k = 0; k < std::min<std::int64_t>(prm.budgeter.max_tokens - floors, std::int64_t(rest.size())); ++k)
            ++cnt[size_t(rest[size_t(k)].h)];
          ++non_trivial;
        }
        for (std::int64_t h = 0; h < s.kv_heads; ++h) {
          if (cnt[size_t(h)] < 0) continue;
          const std::int64_t r = b * s.kv_heads + h, L = p.length(b, h), w = std::min(s.window, L);
          const auto kept = lib.kept(r);
          INFO("seed " << seed << " variant " << variant << " row " << r);
          CHECK(std::int64_t(kept.size()) == w + cnt[size_t(h)]);
          // the kept candidates are the head's best by score (no unkept candidate scores higher)
          float worst_kept = std::numeric_limits<float>::infinity(), best_dropped = -std::numeric_limits<float>::infinity();
          for (std::int64_t n = 0; n < L - w; ++n) {
            const bool k = std::binary_search(kept.begin(), kept.end(), std::int32_t(n));
            const float v = lib.row_scores(r)[n];
            if (k) worst_kept = std::min(worst_kept, v);
            else best_dropped = std::max(best_dropped, v);
          }
          if (cnt[size_t(h)] > 0 && cnt[size_t(h)] < L - w) CHECK(worst_kept >= best_dropped);
          for (std::int64_t n = L - w; n < L; ++n) CHECK(std::binary_search(kept.begin(), kept.end(), std::int32_t(n)));
        }
      }
    }
  }
  CHECK(non_trivial > 0);  // the per-sequence cap bound somewhere
}

TEST_CASE("budgeters::threshold: a threshold no score passes keeps the floor; errors name the parameter") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 1, s.cap = 40, s.d = 8, s.window = 4;
  kvtest::problem p = kvtest::make_problem(s, 77);
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::nhd, st);
  auto prm = threshold_policy::defaults();
  prm.budgeter.threshold = 1e30f;  // nothing passes
  prm.budgeter.min_candidates = 3;
  kvevict::evictor<threshold_policy, kvevict::cpu::backend> ev(prm);
  const auto lib = kvtest::run_lib(ev, st.in, kvevict::budget_request::tokens(20));
  REQUIRE(lib.st.ok());
  CHECK(lib.indptr == std::vector<std::int32_t>{0, 7, 14});  // window 4 + floor 3 per head
  auto bad = [&](auto edit, const char* what) {
    auto q = threshold_policy::defaults();
    edit(q.budgeter);
    kvevict::evictor<threshold_policy, kvevict::cpu::backend> e(q);
    const auto r = kvtest::run_lib(e, st.in, kvevict::budget_request::tokens(20));
    INFO(what);
    REQUIRE_FALSE(r.st.ok());
    CHECK(std::string(r.st.message()).find(what) != std::string::npos);
    for (auto x : r.indptr) CHECK(x == -7);  // outputs untouched
    for (auto x : r.indices) CHECK(x == -7);
  };
  bad([](auto& b) { b.threshold = std::numeric_limits<float>::infinity(); }, "budgeter.threshold = inf");
  bad([](auto& b) { b.mode = kvevict::budgeters::threshold::rule::mass; b.threshold = 1.5f; }, "budgeter.threshold = 1.5");
  bad([](auto& b) { b.min_candidates = -1; }, "budgeter.min_candidates = -1");
  bad([](auto& b) { b.max_tokens = -2; }, "budgeter.max_tokens = -2");
  bad([](auto& b) { b.mode = static_cast<kvevict::budgeters::threshold::rule>(7); }, "budgeter.mode = 7");
}
