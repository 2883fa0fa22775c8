// Failure kinds 1, 3, 8, 9, 10 of ../shared/spec/failure-kinds.md at the policy level, through
// the ReST-KV and SnapKV presets on the CPU backend (failure kind 2, protection under hostile
// scores, is in test_selectors.cpp):
//  1: degenerate sizes (L = 0, 1, L <= window, budget >= L, fractions that floor to 0);
//  3: large norms in fp16 / bf16 give finite scores close to fp64;
//  8: a padded batch equals the sequences run one by one; per-sequence lengths;
//  9, 10: exact counts, workspace query, compaction, ascending order, logical positions.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "policies/policy_test_common.hpp"

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
