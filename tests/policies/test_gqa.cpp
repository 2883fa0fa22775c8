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
