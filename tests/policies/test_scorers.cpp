// The built-in scorers through their presets on the CPU backend against the fp64 whole-pipeline
// reference (tests/reference), in all three storage types where the storage is read:
//  - SnapKV (scorers::attention_weight, temporal sum, spatial avg_pool) and attention_weight
//    with every temporal smoother and every spatial smoother;
//  - H2O (scorers::accumulated_attention), key norm (scorers::key_norm), TOVA
//    (scorers::last_query, layer mean), StreamingLLM (no scores: sinks + recent);
//  - the ReST-KV preset (scorers::output_reconstruction; its own tests are in test_restkv.cpp);
//  - randomised configurations of the SnapKV and ReST-KV presets.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "policies/policy_test_common.hpp"

// ---- SnapKV: attention weight -------------------------------------------------------------

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

// ---- H2O: accumulated attention -----------------------------------------------------------

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

// ---- key norm ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("key norm vs reference", T, float, half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 1, s.cap = 50, s.d = 8, s.window = 4;
  ref_config c;
  c.scorer = scorer_kind::key_norm;
  const int sets = check_policy<kv::presets::key_norm, T>(kv::presets::key_norm::defaults(), cfg_tokens(c, 20), s,
                                                          kv::budget_request::tokens(20), 300, 3);
  CHECK(sets >= 6);
}

// ---- ReST-KV preset (output reconstruction; see also test_restkv.cpp) -----------------------

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

// ---- TOVA: last query ----------------------------------------------------------------------

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

// ---- StreamingLLM: no scores ----------------------------------------------------------------

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

// ---- attention weight with every temporal and spatial smoother -------------------------------

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

// ---- randomised configurations of the SnapKV and ReST-KV presets ----------------------------

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
