// Every built-in policy on the CPU backend against the fp64 whole-pipeline reference
// (tests/reference), in all three storage types where the storage is read; GQA reductions;
// failure kinds 1, 2, 3, 4, 8, 9, 10 of /work/shared/spec/failure-kinds.md at the policy level.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/harness.hpp"

using kvevict::bfloat16_t;
using kvevict::half_t;
using kvtest::layout;
using kvtest::ref_config;
using kvtest::scorer_kind;
using kvtest::spatial_kind;
namespace kv = kvevict;

namespace {

template <class T>
const char* type_name() {
  return kv::to_string(kv::dtype_of<T>::value);
}

/// Run Policy on `seeds` random problems of shape s and compare with the reference.
/// Returns the number of rows whose selection was compared as exact sets.
template <class Policy, class T>
int check_policy(const typename Policy::params& params, const ref_config& cfg, const kvtest::shape& s,
                 kv::budget_request budget, std::uint64_t seed0, int seeds, std::vector<std::int32_t> lens = {},
                 double rtol = kvtest::score_rtol, double atol = kvtest::score_atol) {
  int sets = 0;
  for (int i = 0; i < seeds; ++i) {
    const std::uint64_t seed = seed0 + static_cast<std::uint64_t>(i);
    kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, lens);
    kvtest::quantize<T>(p);
    kvtest::stored<T> st;
    kvtest::store(p, layout::nhd, st);
    kv::evictor<Policy, kv::cpu::backend> ev(params);
    auto lib = kvtest::run_lib(ev, st.in, budget);
    auto ref = kvtest::reference_run(p, cfg);
    CAPTURE(seed);
    CAPTURE(type_name<T>());
    CAPTURE(budget.keep_tokens);
    CAPTURE(budget.keep_fraction);
    const std::string diff = kvtest::compare(lib, ref, rtol, atol, &sets);
    CHECK_MESSAGE(diff.empty(), diff);
    // non-vacuity: something was evicted somewhere
    std::int64_t kept = lib.indptr.back(), total = 0;
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < ev.out_heads(st.in); ++h) total += p.length(b, h / (ev.out_heads(st.in) / s.kv_heads));
    CHECK(kept < total);
  }
  return sets;
}

ref_config cfg_tokens(ref_config c, std::int64_t b) {
  c.keep_tokens = b;
  return c;
}

}  // namespace

TEST_CASE_TEMPLATE("SnapKV (attention weight, sum, avg pool 5) vs reference", T, float, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8;
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  c.temporal = kvref::temporal_kind::sum;
  c.spatial = spatial_kind::avg_pool;
  c.kernel = 5;
  const int sets = check_policy<kv::presets::snapkv, T>(kv::presets::snapkv::defaults(), cfg_tokens(c, 24), s,
                                                        kv::budget_request::tokens(24), 100, 4);
  CHECK(sets >= 8);
}

TEST_CASE_TEMPLATE("H2O (accumulated attention, full causal, recent share 0.5) vs reference", T, float, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 40, s.d = 16, s.window = 40;  // W = L: every prompt query
  for (bool norm : {false, true}) {
    CAPTURE(norm);
    auto params = kv::presets::h2o::defaults();
    params.scorer.normalize_by_visible = norm;
    ref_config c;
    c.scorer = scorer_kind::accumulated;
    c.normalize_visible = norm;
    c.recent_share = 0.5;
    c.keep_tokens = 16;
    const int sets = check_policy<kv::presets::h2o, T>(params, c, s, kv::budget_request::tokens(16), 200, 3);
    CHECK(sets >= 3);
  }
}

TEST_CASE_TEMPLATE("key norm vs reference", T, float, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 1, s.cap = 50, s.d = 8, s.window = 4;
  ref_config c;
  c.scorer = scorer_kind::key_norm;
  const int sets = check_policy<kv::presets::key_norm, T>(kv::presets::key_norm::defaults(), cfg_tokens(c, 20), s,
                                                          kv::budget_request::tokens(20), 300, 3);
  CHECK(sets >= 6);
}

TEST_CASE_TEMPLATE("ReST-KV preset (LOR after, EMA 0.3, adaptive window) vs reference", T, float, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 96, s.d = 16, s.window = 16, s.hidden = 48;
  ref_config c;
  c.scorer = scorer_kind::lor;
  c.temporal = kvref::temporal_kind::ema;
  c.alpha = static_cast<double>(0.3f);
  c.spatial = spatial_kind::adaptive;
  c.beta = 2000.0;
  c.k_min = 5;
  for (auto g : {kv::gqa_reduction::mean, kv::gqa_reduction::per_query_head}) {
    auto params = kv::presets::restkv::defaults();
    params.gqa = g;
    c.gqa = g == kv::gqa_reduction::mean ? kvref::gqa_kind::mean : kvref::gqa_kind::per_query_head;
    CAPTURE(kv::to_string(g));
    const int sets = check_policy<kv::presets::restkv, T>(params, cfg_tokens(c, 40), s, kv::budget_request::tokens(40), 400, 3);
    CHECK(sets >= 3);
  }
}

TEST_CASE("TOVA (last query, layer mean, nothing protected) vs reference") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 3, s.cap = 40, s.d = 16, s.window = 6;
  ref_config c;
  c.scorer = scorer_kind::last_query;
  c.temporal = kvref::temporal_kind::last;
  c.gqa = kvref::gqa_kind::layer_mean;
  c.num_recent = 0;
  const int sets = check_policy<kv::presets::tova, float>(kv::presets::tova::defaults(), cfg_tokens(c, 12), s,
                                                          kv::budget_request::tokens(12), 500, 3);
  CHECK(sets >= 6);
  // one token set per layer: every KV head of a sequence keeps the same slots
  kvtest::problem p = kvtest::make_problem(s, 77);
  kvtest::stored<float> st;
  kvtest::store(p, layout::hnd, st);
  kv::evictor<kv::presets::tova, kv::cpu::backend> ev;
  auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(12));
  REQUIRE(lib.st.ok());
  CHECK(lib.kept(0) == lib.kept(1));
  CHECK(lib.kept(2) == lib.kept(3));
}

TEST_CASE("StreamingLLM (no scores): 4 sinks + recent tokens") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 1, s.cap = 30, s.d = 8, s.window = 4;
  ref_config c;
  c.scorer = scorer_kind::key_norm;  // unused: no scores
  c.num_sink = 4;
  c.recent_share = 1.0;
  kvtest::problem p = kvtest::make_problem(s, 5);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  kv::evictor<kv::presets::streaming_llm, kv::cpu::backend> ev;
  auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(10));
  REQUIRE(lib.st.ok());
  const std::vector<std::int32_t> want = {0, 1, 2, 3, 24, 25, 26, 27, 28, 29};
  CHECK(lib.kept(0) == want);
  CHECK(lib.kept(1) == want);
}

TEST_CASE("attention weight with EMA / reversed EMA / mean / last and max pool, avg pool, adaptive window") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 70, s.d = 16, s.window = 12;
  using aw_max = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::ema, kv::spatial::max_pool>;
  using aw_rev = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::reversed_ema, kv::spatial::adaptive_window>;
  using aw_mean = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::mean, kv::spatial::avg_pool>;
  using aw_last = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::last, kv::spatial::none>;
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  {
    auto p = aw_max::defaults();
    p.temporal.alpha = 0.25f;
    p.spatial.kernel = 3;
    p.gqa = kv::gqa_reduction::max;
    p.selector.num_sink = 2;
    auto cc = c;
    cc.temporal = kvref::temporal_kind::ema, cc.alpha = 0.25, cc.spatial = spatial_kind::max_pool, cc.kernel = 3;
    cc.gqa = kvref::gqa_kind::max, cc.num_sink = 2;
    CHECK(check_policy<aw_max, float>(p, cfg_tokens(cc, 30), s, kv::budget_request::tokens(30), 600, 3) >= 3);
  }
  {
    auto p = aw_rev::defaults();
    p.temporal.alpha = 0.5f;
    p.spatial.beta = 3.0f;  // small beta: drift of a few tokens gives wide shifted kernels
    auto cc = c;
    cc.temporal = kvref::temporal_kind::reversed_ema, cc.alpha = 0.5, cc.spatial = spatial_kind::adaptive, cc.beta = 3.0;
    CHECK(check_policy<aw_rev, float>(p, cfg_tokens(cc, 30), s, kv::budget_request::tokens(30), 700, 3) >= 3);
    p.spatial.reference_exact = false;
    cc.reference_exact = false;
    CHECK(check_policy<aw_rev, float>(p, cfg_tokens(cc, 30), s, kv::budget_request::tokens(30), 710, 3) >= 3);
  }
  {
    auto p = aw_mean::defaults();
    p.spatial.kernel = 7;
    auto cc = c;
    cc.temporal = kvref::temporal_kind::mean, cc.spatial = spatial_kind::avg_pool, cc.kernel = 7;
    cc.keep_fraction = 0.4;
    CHECK(check_policy<aw_mean, float>(p, cc, s, kv::budget_request::fraction(0.4), 800, 3) >= 3);
  }
  {
    auto p = aw_last::defaults();
    p.gqa = kv::gqa_reduction::per_query_head;
    auto cc = c;
    cc.temporal = kvref::temporal_kind::last, cc.gqa = kvref::gqa_kind::per_query_head;
    CHECK(check_policy<aw_last, float>(p, cfg_tokens(cc, 25), s, kv::budget_request::tokens(25), 900, 3) >= 6);
  }
}

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

TEST_CASE("randomised configurations (shapes, lengths, sinks, recent rules, budgets, GQA, smoothing) vs reference") {
  kvtest::rng r(4243);
  int sets = 0, runs = 0;
  for (int it = 0; it < 600; ++it) {
    kvtest::shape s;
    s.batch = r.integer(1, 2), s.kv_heads = r.integer(1, 3), s.group = r.integer(1, 3);
    s.cap = r.integer(12, 60), s.d = 4 * r.integer(1, 4), s.window = r.integer(1, 8), s.hidden = 8 * r.integer(1, 4);
    std::vector<std::int32_t> lens;
    const bool layer_mean = r.uniform() < 0.15;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const auto Lb = static_cast<std::int32_t>(r.integer(0, s.cap));
      for (std::int64_t h = 0; h < s.kv_heads; ++h)
        lens.push_back(layer_mean ? Lb : static_cast<std::int32_t>(r.integer(s.window, s.cap)));
    }
    ref_config c;
    c.num_sink = r.integer(0, 3);
    const double u = r.uniform();
    if (u < 0.2) c.num_recent = r.integer(0, s.window);
    else if (u < 0.3) c.recent_share = 0.5;
    const std::int64_t fixed_recent = c.recent_share >= 0 ? 0 : (c.num_recent >= 0 ? c.num_recent : s.window);
    kv::budget_request budget;
    if (r.uniform() < 0.7) {
      budget = kv::budget_request::tokens(static_cast<std::int32_t>(c.num_sink + fixed_recent + r.integer(0, 20)));
      if (budget.keep_tokens < 1) budget.keep_tokens = 1;
      c.keep_tokens = budget.keep_tokens;
    } else {
      budget = kv::budget_request::fraction(r.uniform(0.05, 0.9));
      c.keep_fraction = budget.keep_fraction;
    }
    const int g = layer_mean ? 3 : static_cast<int>(r.integer(0, 2));
    const kv::gqa_reduction gq = static_cast<kv::gqa_reduction>(g);
    c.gqa = static_cast<kvref::gqa_kind>(g);
    kvtest::problem p = kvtest::make_problem(s, 5000 + static_cast<std::uint64_t>(it), 1.0, r.uniform(0.5, 3.0), 1.0, lens);
    kvtest::stored<float> st;
    kvtest::store(p, static_cast<layout>(r.integer(0, 3)), st);
    CAPTURE(it);
    CAPTURE(s.batch);
    CAPTURE(s.kv_heads);
    CAPTURE(s.group);
    CAPTURE(s.cap);
    CAPTURE(s.window);
    CAPTURE(g);
    CAPTURE(c.num_sink);
    CAPTURE(c.num_recent);
    CAPTURE(c.recent_share);
    CAPTURE(budget.keep_tokens);
    CAPTURE(budget.keep_fraction);
    kvtest::lib_result lib;
    if (r.uniform() < 0.6) {
      auto prm = kv::presets::restkv::defaults();
      prm.gqa = gq;
      prm.selector.num_sink = static_cast<std::int32_t>(c.num_sink);
      prm.selector.num_recent = static_cast<std::int32_t>(c.num_recent);
      prm.selector.recent_share = static_cast<float>(c.recent_share);
      prm.temporal.alpha = static_cast<float>(r.uniform(0.05, 1.0));
      prm.spatial.beta = r.uniform() < 0.5 ? 2000.0f : static_cast<float>(r.uniform(0.5, 6.0));
      prm.spatial.k_min = 1 + 2 * static_cast<int>(r.integer(0, 3));
      prm.spatial.reference_exact = r.uniform() < 0.7;
      prm.scorer.aggregation = r.uniform() < 0.3 ? kv::scorers::output_reconstruction::mode::before
                                                 : kv::scorers::output_reconstruction::mode::after;
      prm.scorer.use_wo = r.uniform() < 0.7;
      prm.scorer.include_window_in_output = r.uniform() < 0.3;
      c.scorer = scorer_kind::lor, c.temporal = kvref::temporal_kind::ema, c.alpha = static_cast<double>(prm.temporal.alpha);
      c.spatial = spatial_kind::adaptive, c.beta = static_cast<double>(prm.spatial.beta), c.k_min = prm.spatial.k_min;
      c.reference_exact = prm.spatial.reference_exact;
      c.before = prm.scorer.aggregation == kv::scorers::output_reconstruction::mode::before;
      c.use_wo = prm.scorer.use_wo;
      c.include_window = prm.scorer.include_window_in_output;
      c.eval = kvref::lor_eval::exact;
      CAPTURE(prm.temporal.alpha);
      CAPTURE(prm.spatial.beta);
      CAPTURE(c.before);
      CAPTURE(c.use_wo);
      CAPTURE(c.include_window);
      lib = kvtest::run_lib(kv::evictor<kv::presets::restkv, kv::cpu::backend>(prm), st.in, budget);
    } else {
      auto prm = kv::presets::snapkv::defaults();
      prm.gqa = gq;
      prm.selector.num_sink = static_cast<std::int32_t>(c.num_sink);
      prm.selector.num_recent = static_cast<std::int32_t>(c.num_recent);
      prm.selector.recent_share = static_cast<float>(c.recent_share);
      prm.spatial.kernel = 1 + 2 * static_cast<int>(r.integer(0, 4));
      c.scorer = scorer_kind::attention_weight, c.temporal = kvref::temporal_kind::sum;
      c.spatial = spatial_kind::avg_pool, c.kernel = prm.spatial.kernel;
      lib = kvtest::run_lib(kv::evictor<kv::presets::snapkv, kv::cpu::backend>(prm), st.in, budget);
    }
    REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
    ++runs;
    const std::string diff = kvtest::compare(lib, kvtest::reference_run(p, c), kvtest::score_rtol, kvtest::score_atol, &sets);
    CHECK_MESSAGE(diff.empty(), diff);
  }
  MESSAGE("randomised configurations: " << runs << " runs, " << sets << " heads compared as exact sets");
  CHECK(sets > 60);
}

// ---- GQA ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("GQA: mean / max / per-query-head / layer-mean vs reference; the cache keeps kv_heads heads", T, float,
                   half_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 4, s.cap = 48, s.d = 16, s.window = 8;
  using P = kv::presets::snapkv;
  const kv::gqa_reduction modes[] = {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head,
                                     kv::gqa_reduction::layer_mean};
  const kvref::gqa_kind rmodes[] = {kvref::gqa_kind::mean, kvref::gqa_kind::max, kvref::gqa_kind::per_query_head,
                                    kvref::gqa_kind::layer_mean};
  for (int m = 0; m < 4; ++m) {
    CAPTURE(kv::to_string(modes[m]));
    auto params = P::defaults();
    params.gqa = modes[m];
    ref_config c;
    c.scorer = scorer_kind::attention_weight;
    c.spatial = spatial_kind::avg_pool;
    c.gqa = rmodes[m];
    c.keep_tokens = 20;
    check_policy<P, T>(params, c, s, kv::budget_request::tokens(20), 1200 + static_cast<std::uint64_t>(m) * 10, 2);

    // rows and memory after compaction
    kvtest::problem p = kvtest::make_problem(s, 1300);
    kvtest::stored<T> st;
    kvtest::store(p, layout::hnd, st);
    kv::evictor<P, kv::cpu::backend> ev(params);
    auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(20));
    REQUIRE(lib.st.ok());
    const std::int64_t heads = modes[m] == kv::gqa_reduction::per_query_head ? s.q_heads() : s.kv_heads;
    CHECK(lib.rows == s.batch * heads);
    std::vector<T> kc(static_cast<std::size_t>(lib.indptr.back() * s.d)), vc(kc.size());
    const kv::const_selection_view cs(lib.indptr.data(), lib.indices.data(), lib.rows);
    REQUIRE(kv::cpu::compact_ragged<T>(st.in.keys, cs, kc.data(), static_cast<std::int64_t>(kc.size())).ok());
    REQUIRE(kv::cpu::compact_ragged<T>(st.in.values, cs, vc.data(), static_cast<std::int64_t>(vc.size())).ok());
    const std::size_t bytes = (kc.size() + vc.size()) * sizeof(T);
    const std::size_t expect = static_cast<std::size_t>(20 * heads * s.batch * s.d * 2) * sizeof(T);
    CHECK(bytes == expect);
    if (modes[m] != kv::gqa_reduction::per_query_head)
      CHECK(bytes * static_cast<std::size_t>(s.group) == static_cast<std::size_t>(20 * s.q_heads() * s.batch * s.d * 2) * sizeof(T));
  }
}

// ---- failure kind 1: degenerate sizes -----------------------------------------------------

TEST_CASE_TEMPLATE("failure kind 1: L = 0, 1, L <= window, budget >= L pass through; fractions never empty a head", T,
                   float, bfloat16_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 3, s.group = 2, s.cap = 20, s.d = 8, s.window = 4, s.hidden = 16;
  // lengths: 0, 1, 3 (< window), 4 (= window), 6 (= budget), 20
  const std::vector<std::int32_t> lens = {0, 1, 3, 4, 6, 20};
  kvtest::problem p = kvtest::make_problem(s, 42, 1.0, 1.0, 1.0, lens);
  kvtest::quantize<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, layout::nhd, st);
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
  auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(6));
  REQUIRE(lib.st.ok());
  for (std::int64_t r = 0; r < 6; ++r) {
    CAPTURE(r);
    const auto kept = lib.kept(r);
    const std::int64_t L = lens[static_cast<std::size_t>(r)];
    if (L <= 6) {
      std::vector<std::int32_t> all;
      for (std::int32_t i = 0; i < L; ++i) all.push_back(i);
      CHECK(kept == all);
    } else {
      CHECK(kept.size() == 6);
      for (std::int32_t i = 16; i < 20; ++i) CHECK(std::binary_search(kept.begin(), kept.end(), i));
    }
    for (std::int64_t n = 0; n < s.cap; ++n) CHECK(std::isfinite(lib.row_scores(r)[n]));
  }
  ref_config c;
  c.scorer = scorer_kind::lor, c.temporal = kvref::temporal_kind::ema, c.alpha = static_cast<double>(0.3f);
  c.spatial = spatial_kind::adaptive, c.keep_tokens = 6;
  const std::string diff = kvtest::compare(lib, kvtest::reference_run(p, c));
  CHECK_MESSAGE(diff.empty(), diff);

  // budget == window keeps exactly the window
  auto lib2 = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(4));
  REQUIRE(lib2.st.ok());
  CHECK(lib2.kept(5) == std::vector<std::int32_t>{16, 17, 18, 19});
  // a fraction that floors to 0: the window is kept, and with nothing protected 1 token
  auto lib3 = kvtest::run_lib(ev, st.in, kv::budget_request::fraction(0.01));
  REQUIRE(lib3.st.ok());
  CHECK(lib3.kept(5) == std::vector<std::int32_t>{16, 17, 18, 19});
  CHECK(lib3.kept(1) == std::vector<std::int32_t>{0});
  auto p2 = kv::presets::snapkv::defaults();
  p2.selector.num_recent = 0;
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev2(p2);
  auto lib4 = kvtest::run_lib(ev2, st.in, kv::budget_request::fraction(0.01));
  REQUIRE(lib4.st.ok());
  for (std::int64_t r = 0; r < 6; ++r) CHECK(lib4.kept(r).size() == (lens[static_cast<std::size_t>(r)] > 0 ? 1u : 0u));
  // a single-token cache with capacity 1 and window 1
  kvtest::shape s1;
  s1.batch = 1, s1.kv_heads = 1, s1.group = 1, s1.cap = 1, s1.d = 4, s1.window = 1, s1.hidden = 8;
  kvtest::problem p1 = kvtest::make_problem(s1, 1);
  kvtest::stored<T> st1;
  kvtest::store(p1, layout::hnd, st1);
  auto lib5 = kvtest::run_lib(ev, st1.in, kv::budget_request::tokens(1));
  REQUIRE(lib5.st.ok());
  CHECK(lib5.kept(0) == std::vector<std::int32_t>{0});
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

// ---- failure kind 3: low-precision overflow ------------------------------------------------

TEST_CASE_TEMPLATE("failure kind 3: large norms in fp16/bf16 give finite scores close to fp64", T, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8, s.hidden = 32;
  // fp16: entries ~ 100 (|k| ~ 400, logits ~ 1e4: one-hot attention); bf16: entries ~ 1e19,
  // whose logits overflow fp32 (recomputed in fp64 by the backend).
  const double big = std::is_same<T, half_t>::value ? 100.0 : 1e19;
  for (std::uint64_t seed = 0; seed < 3; ++seed) {
    CAPTURE(seed);
    kvtest::problem p = kvtest::make_problem(s, 1400 + seed, big, big, std::is_same<T, half_t>::value ? 300.0 : 1e30);
    // a few softer keys so that not every row is exactly one-hot
    for (std::int64_t n = 0; n < 20; n += 2)
      for (std::int64_t h = 0; h < s.kv_heads; ++h)
        for (std::int64_t d = 0; d < s.d; ++d) p.K[p.kv_idx(0, h, n, d)] *= 1e-3;
    kvtest::quantize<T>(p);
    kvtest::stored<T> st;
    kvtest::store(p, layout::nhd, st);
    kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
    auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(24));
    REQUIRE(lib.st.ok());
    ref_config c;
    c.scorer = scorer_kind::lor, c.temporal = kvref::temporal_kind::ema, c.alpha = static_cast<double>(0.3f);
    c.spatial = spatial_kind::adaptive, c.keep_tokens = 24, c.eval = kvref::lor_eval::exact;
    const auto ref = kvtest::reference_run(p, c);
    const std::string diff = kvtest::compare(lib, ref, 1e-3, 1e-5);
    CHECK_MESSAGE(diff.empty(), diff);
    // SnapKV on the same data: attention weights stay in [0, w]
    kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev2;
    auto lib2 = kvtest::run_lib(ev2, st.in, kv::budget_request::tokens(24));
    REQUIRE(lib2.st.ok());
    for (float x : lib2.scores) CHECK((std::isfinite(x) && x <= 8.0f + 1e-3f));
  }
}

// ---- failure kind 8: batches ---------------------------------------------------------------

TEST_CASE_TEMPLATE("failure kind 8: a padded batch equals the sequences run one by one", T, float, half_t) {
  kvtest::shape s;
  s.batch = 3, s.kv_heads = 2, s.group = 2, s.cap = 40, s.d = 16, s.window = 6, s.hidden = 32;
  const std::vector<std::int32_t> seq_lens = {40, 25, 33};
  std::vector<std::int32_t> lens;
  for (auto L : seq_lens) lens.insert(lens.end(), {L, L});
  kvtest::problem p = kvtest::make_problem(s, 1500, 1.0, 1.0, 1.0, lens);  // pad slots are NaN
  kvtest::quantize<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, layout::nhd, st);
  for (int pol = 0; pol < 2; ++pol) {
    CAPTURE(pol);
    const auto budget = kv::budget_request::fraction(0.5);
    kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
    kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev2;
    auto run = [&](const kv::layer_inputs<T>& in) { return pol == 0 ? kvtest::run_lib(ev, in, budget) : kvtest::run_lib(ev2, in, budget); };
    auto all = run(st.in);
    REQUIRE(all.st.ok());
    for (std::int64_t b = 0; b < s.batch; ++b) {
      CAPTURE(b);
      kvtest::shape s1 = s;
      s1.batch = 1;
      s1.cap = seq_lens[static_cast<std::size_t>(b)];
      kvtest::problem p1 = kvtest::make_problem(s1, 0);
      for (std::int64_t h = 0; h < s.kv_heads; ++h)
        for (std::int64_t n = 0; n < s1.cap; ++n)
          for (std::int64_t d = 0; d < s.d; ++d) {
            p1.K[p1.kv_idx(0, h, n, d)] = p.K[p.kv_idx(b, h, n, d)];
            p1.V[p1.kv_idx(0, h, n, d)] = p.V[p.kv_idx(b, h, n, d)];
          }
      for (std::int64_t hq = 0; hq < s.q_heads(); ++hq)
        for (std::int64_t j = 0; j < s.window; ++j)
          for (std::int64_t d = 0; d < s.d; ++d) p1.Q[p1.q_idx(0, hq, j, d)] = p.Q[p.q_idx(b, hq, j, d)];
      p1.WO = p.WO;
      kvtest::stored<T> st1;
      kvtest::store(p1, layout::hnd, st1);
      auto one = run(st1.in);
      REQUIRE(one.st.ok());
      for (std::int64_t h = 0; h < s.kv_heads; ++h) {
        CAPTURE(h);
        const auto a = all.kept(b * s.kv_heads + h), o = one.kept(h);
        CHECK(a == o);
        CHECK(static_cast<std::int64_t>(a.size()) == seq_lens[static_cast<std::size_t>(b)] / 2);
        for (auto i : a) CHECK(i < seq_lens[static_cast<std::size_t>(b)]);  // pad slots never kept
        for (std::int64_t n = 0; n < s1.cap; ++n)
          CHECK(all.row_scores(b * s.kv_heads + h)[n] == doctest::Approx(one.row_scores(h)[n]).epsilon(1e-5));
        for (std::int64_t n = s1.cap; n < s.cap; ++n) CHECK(all.row_scores(b * s.kv_heads + h)[n] == 0.0f);
      }
    }
  }
}

TEST_CASE("failure kind 8: per-sequence lengths, and a sequence shorter than the window with NaN in its unused query rows") {
  kvtest::shape s;
  s.batch = 3, s.kv_heads = 2, s.group = 2, s.cap = 30, s.d = 8, s.window = 6, s.hidden = 16;
  const std::vector<std::int32_t> seq_lens = {30, 3, 22};
  kvtest::problem p = kvtest::make_problem(s, 1550, 1.0, 1.0, 1.0, {30, 30, 3, 3, 22, 22});
  for (std::int64_t hq = 0; hq < s.q_heads(); ++hq)  // sequence 1 uses only its last 3 query rows
    for (std::int64_t j = 0; j < 3; ++j)
      for (std::int64_t d = 0; d < s.d; ++d) p.Q[p.q_idx(1, hq, j, d)] = std::numeric_limits<double>::quiet_NaN();
  kvtest::stored<float> st;
  kvtest::store(p, layout::hnd, st);
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
  auto per_head = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(10));
  REQUIRE_MESSAGE(per_head.st.ok(), per_head.st.message());
  st.in.lengths = kv::per_sequence_lengths(seq_lens.data(), s.batch, s.kv_heads);
  auto per_seq = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(10));
  REQUIRE(per_seq.st.ok());
  CHECK(per_seq.indices == per_head.indices);
  CHECK(per_seq.indptr == per_head.indptr);
  CHECK(per_seq.kept(2) == std::vector<std::int32_t>{0, 1, 2});
  CHECK(per_seq.kept(3) == std::vector<std::int32_t>{0, 1, 2});
  for (float x : per_seq.scores) CHECK(std::isfinite(x));
  ref_config c;
  c.scorer = scorer_kind::lor, c.temporal = kvref::temporal_kind::ema, c.alpha = static_cast<double>(0.3f);
  c.spatial = spatial_kind::adaptive, c.keep_tokens = 10;
  const std::string diff = kvtest::compare(per_seq, kvtest::reference_run(p, c));
  CHECK_MESSAGE(diff.empty(), diff);
}

// ---- failure kinds 9 and 10: accounting, order, positions -----------------------------------

TEST_CASE("failure kinds 9, 10: exact counts, workspace query, compaction shrinks, ascending order, positions") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 50, s.d = 8, s.window = 5, s.hidden = 16;
  kvtest::problem p = kvtest::make_problem(s, 1600);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(s.batch * s.kv_heads * s.cap));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(1000 + 3 * i);  // logical != slot
  st.in.positions = kv::make_positions_view(pos.data(), s.batch, s.kv_heads, s.cap);
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
  const auto budget = kv::budget_request::tokens(17);
  const std::int64_t n = ev.max_selected(st.in, budget);
  CHECK(n == 17 * s.batch * s.kv_heads);
  const std::size_t ws = ev.workspace_size(st.in);
  CHECK(ws > 0);
  CHECK(ws == ev.workspace_size(st.in));
  std::vector<unsigned char> w(ws + 256);
  void* base = w.data() + (256 - reinterpret_cast<std::uintptr_t>(w.data()) % 256) % 256;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(s.batch * s.kv_heads + 1)), idx(static_cast<std::size_t>(n)), kp(idx.size());
  kv::selection_view sel{indptr.data(), idx.data(), kp.data(), n};
  const auto stt = ev.run(st.in, budget, sel, base, ws);
  REQUIRE_MESSAGE(stt.ok(), stt.message());
  CHECK(indptr.back() == n);
  for (std::int64_t r = 0; r < s.batch * s.kv_heads; ++r) {
    CHECK(indptr[static_cast<std::size_t>(r + 1)] - indptr[static_cast<std::size_t>(r)] == 17);
    for (std::int32_t i = indptr[static_cast<std::size_t>(r)]; i < indptr[static_cast<std::size_t>(r + 1)]; ++i) {
      if (i > indptr[static_cast<std::size_t>(r)]) CHECK(idx[static_cast<std::size_t>(i)] > idx[static_cast<std::size_t>(i - 1)]);
      CHECK(kp[static_cast<std::size_t>(i)] == pos[static_cast<std::size_t>(r * s.cap + idx[static_cast<std::size_t>(i)])]);
    }
  }
  // compaction: the kept rows, in order, and exactly kept x H_kv x d x 2 x bytes
  std::vector<float> kc(static_cast<std::size_t>(n * s.d));
  REQUIRE(kv::cpu::compact_ragged<float>(st.in.keys, kv::const_selection_view(sel, s.batch * s.kv_heads), kc.data(),
                                         static_cast<std::int64_t>(kc.size()))
              .ok());
  for (std::int64_t r = 0; r < s.batch * s.kv_heads; ++r)
    for (std::int32_t i = indptr[static_cast<std::size_t>(r)]; i < indptr[static_cast<std::size_t>(r + 1)]; ++i)
      for (std::int64_t d = 0; d < s.d; ++d)
        CHECK(kc[static_cast<std::size_t>(i * s.d + d)] ==
              static_cast<float>(p.K[p.kv_idx(r / s.kv_heads, r % s.kv_heads, idx[static_cast<std::size_t>(i)], d)]));
  CHECK(2 * kc.size() * sizeof(float) == static_cast<std::size_t>(17 * s.kv_heads * s.batch * s.d * 2) * sizeof(float));
  CHECK(static_cast<double>(n) / static_cast<double>(s.batch * s.kv_heads * s.cap) == doctest::Approx(17.0 / 50.0));
}
