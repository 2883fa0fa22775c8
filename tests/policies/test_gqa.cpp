// GQA reductions (kv::gqa_reduction: mean, max, per query head, layer mean;
// backends/cpu/gqa_reduce.hpp) through the SnapKV preset vs the fp64 reference, and the size of
// the compacted cache (kv_heads heads, or every query head for per_query_head).
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "policies/policy_test_common.hpp"

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

TEST_CASE("presets::adakv_published: the authors' settings; per query head on GQA K/V == the policy on K/V repeated to q_heads") {
  // The reference code repeats K/V to q_heads heads and runs with G = 1. The preset selects per query head
  // on the GQA-native K/V; both must keep the same tokens per query head (ragged lengths, both sequences).
  using P = kv::presets::adakv_published;
  const auto d = P::defaults();
  CHECK(d.spatial.kernel == 7);
  CHECK(d.budgeter.alpha == 0.2f);
  CHECK(d.gqa == kv::gqa_reduction::per_query_head);
  CHECK(d.selector.num_sink == kv::presets::adakv::defaults().selector.num_sink);
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 4, s.cap = 64, s.d = 16, s.window = 8;
  const std::vector<std::int32_t> lens{64, 40, 57, 64};
  for (std::uint64_t seed = 1400; seed < 1404; ++seed) {
    CAPTURE(seed);
    kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, lens);
    kvtest::problem r = p;  // K/V repeated: head h * G + g of r is head h of p
    r.s.kv_heads = s.q_heads();
    r.s.group = 1;
    r.K.assign(static_cast<std::size_t>(s.batch * s.q_heads() * s.cap * s.d), 0.0);
    r.V = r.K;
    r.lens.clear();
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t hq = 0; hq < s.q_heads(); ++hq) {
        r.lens.push_back(static_cast<int>(p.length(b, hq / s.group)));
        for (std::int64_t n = 0; n < s.cap; ++n)
          for (std::int64_t c = 0; c < s.d; ++c) {
            r.K[r.kv_idx(b, hq, n, c)] = p.K[p.kv_idx(b, hq / s.group, n, c)];
            r.V[r.kv_idx(b, hq, n, c)] = p.V[p.kv_idx(b, hq / s.group, n, c)];
          }
      }
    kvtest::stored<float> sp, sr;
    kvtest::store(p, layout::hnd, sp);
    kvtest::store(r, layout::hnd, sr);
    const kv::budget_request budget = kv::budget_request::tokens(24);
    kv::evictor<P, kv::cpu::backend> ev(d);
    const auto got = kvtest::run_lib(ev, sp.in, budget);
    REQUIRE(got.st.ok());
    REQUIRE(got.rows == s.batch * s.q_heads());
    for (const kv::gqa_reduction g : {kv::gqa_reduction::mean, kv::gqa_reduction::per_query_head}) {
      auto q = d;
      q.gqa = g;
      kv::evictor<P, kv::cpu::backend> er(q);
      const auto want = kvtest::run_lib(er, sr.in, budget);
      REQUIRE(want.st.ok());
      CHECK(got.indptr == want.indptr);
      CHECK(got.indices == want.indices);
    }
    // not vacuous: query heads of one group keep different tokens somewhere
    bool differs = false;
    for (std::int64_t row = 1; row < got.rows; ++row) {
      if (row % s.group == 0) continue;
      const std::vector<std::int32_t> a(got.indices.begin() + got.indptr[static_cast<std::size_t>(row) - 1],
                                        got.indices.begin() + got.indptr[static_cast<std::size_t>(row)]);
      const std::vector<std::int32_t> b(got.indices.begin() + got.indptr[static_cast<std::size_t>(row)],
                                        got.indices.begin() + got.indptr[static_cast<std::size_t>(row) + 1]);
      differs = differs || a != b;
    }
    CHECK(differs);
  }
}
