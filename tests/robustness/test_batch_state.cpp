// SPDX-License-Identifier: Apache-2.0
// Failure kinds 7 (phase and state) and 8 (batches) of /shared/spec/failure-kinds.md, for every
// preset and every storage type, plus kind 6 (metadata from explicit lengths).
//
//  * Batches: a padded batch of sequences of different lengths (pads filled with NaN or with huge
//    sentinels, non-contiguous NHD strides) gives, row for row, the same selection, positions and
//    final scores as each sequence run alone in an exactly sized, contiguous HND buffer.
//  * State: the library's evictor holds only its parameters; run() is const. Running request A
//    before B on the same evictor with the same workspace (refilled with NaN bytes in between)
//    gives exactly B's result alone; request order and workspace contents never change results.
#include <doctest/doctest.h>

#include <thread>
#include <type_traits>

#include "robustness/robust_common.hpp"

using namespace robust;

namespace {

/// The base batched shape: 3 sequences, GQA 2, window 6, one sequence shorter than the window.
shape batch_shape(std::vector<std::int32_t> lens, bool per_seq) {
  shape s;
  s.B = 3;
  s.Hkv = 2;
  s.G = 2;
  s.S = 40;
  s.W = 6;
  s.D = 8;
  s.layout = kvevict::kv_layout::nhd;
  s.pad = 3;
  s.lengths = std::move(lens);
  s.per_sequence_lengths = per_seq;
  return s;
}

/// Sequence b of a batched problem, alone, in an exactly sized contiguous HND buffer (no
/// lengths view; window = min(W, L_b): the last rows of the batched window).
template <class T>
problem<T> extract_sequence(const problem<T>& big, std::int64_t b) {
  problem<T> one;
  shape s = big.sh;
  s.B = 1;
  std::int64_t L = big.length(b, 0);
  const bool equal = [&] {
    for (std::int64_t h = 1; h < big.sh.Hkv; ++h)
      if (big.length(b, h) != L) return false;
    return true;
  }();
  // Per-head lengths differ inside the sequence: keep the capacity and pass per-head lengths
  // (still no pads of other sequences, and a different layout and capacity).
  s.lengths.clear();
  s.per_sequence_lengths = false;
  if (!equal) {
    L = 0;
    for (std::int64_t h = 0; h < big.sh.Hkv; ++h) {
      s.lengths.push_back(static_cast<std::int32_t>(big.length(b, h)));
      L = std::max<std::int64_t>(L, big.length(b, h));
    }
  }
  s.S = L;
  s.W = std::min(big.sh.W, std::max<std::int64_t>(L, 1));
  s.layout = kvevict::kv_layout::hnd;
  s.pad = 0;
  one.sh = s;
  one.k.allocate(1, s.Hkv, s.S, s.D, s.layout, 0);
  one.k.fill_all(0.0f);
  if (s.with_values) {
    one.v.allocate(1, s.Hkv, s.S, s.D, s.layout, 0);
    one.v.fill_all(0.0f);
  }
  if (s.with_queries) {
    one.q.allocate(1, s.Hq(), s.W, s.D, s.layout, 0);
    one.q.fill_all(0.0f);
  }
  one.lens = s.lengths;
  for (std::int64_t h = 0; h < s.Hkv; ++h)
    for (std::int64_t t = 0; t < big.length(b, h); ++t)
      for (std::int64_t d = 0; d < s.D; ++d) {
        one.k.at(0, h, t, d) = big.k.view(b, h, t, d);
        if (s.with_values) one.v.at(0, h, t, d) = big.v.view(b, h, t, d);
      }
  if (s.with_queries)
    for (std::int64_t hq = 0; hq < s.Hq(); ++hq)
      for (std::int64_t j = 0; j < s.W; ++j)
        for (std::int64_t d = 0; d < s.D; ++d) one.q.at(0, hq, j, d) = big.q.view(b, hq, big.sh.W - s.W + j, d);
  one.wo = big.wo;
  one.wo_mat = big.wo_mat;
  if (!big.pos.empty()) {
    one.pos.assign(static_cast<std::size_t>(s.Hkv * s.S), 0);
    for (std::int64_t h = 0; h < s.Hkv; ++h)
      for (std::int64_t t = 0; t < s.S; ++t)
        one.pos[static_cast<std::size_t>(h * s.S + t)] = big.pos[static_cast<std::size_t>((b * big.sh.Hkv + h) * big.sh.S + t)];
  }
  one.rebuild_views();
  one.in.layer_idx = big.in.layer_idx;
  one.in.num_layers = big.in.num_layers;
  return one;
}

template <class P, class T>
void check_batch_equals_singles(const shape& s, float poison, kvevict::budget_request budget, std::uint64_t seed) {
  using ev_t = kvevict::evictor<P, kvevict::cpu::backend>;
  ev_t ev;
  problem<T> big;
  big.init(s, seed, 1.0f, poison);
  // Logical positions that are not slot numbers (as after an earlier eviction).
  big.pos.assign(static_cast<std::size_t>(s.B * s.Hkv * s.S), -1);
  for (std::size_t i = 0; i < big.pos.size(); ++i) big.pos[i] = static_cast<std::int32_t>(3 * i + 11);
  big.rebuild_views();
  set_layer<P>(big);
  CAPTURE(preset_name<P>());
  CAPTURE(type_name<T>());
  CAPTURE(seed);
  CAPTURE(poison);
  CAPTURE(budget.keep_tokens);
  CAPTURE(budget.keep_fraction);
  CAPTURE(s.per_sequence_lengths);
  const result rb = run_evictor(ev, big.in, budget);
  REQUIRE_MESSAGE(rb.st.ok(), rb.st.message());
  const std::string bad = check_contract(ev, big, rb, budget);
  CHECK_MESSAGE(bad.empty(), bad);
  const std::int64_t H = ev.out_heads(big.in);
  std::int64_t evicted = 0, kept_total = 0;
  for (std::int64_t b = 0; b < s.B; ++b) {
    CAPTURE(b);
    problem<T> one = extract_sequence(big, b);
    const result r1 = run_evictor(ev, one.in, budget);
    REQUIRE_MESSAGE(r1.st.ok(), r1.st.message());
    REQUIRE(r1.rows == H);
    for (std::int64_t h = 0; h < H; ++h) {
      CAPTURE(h);
      const std::vector<std::int32_t> a = rb.row(b * H + h), c = r1.row(h);
      CHECK(a == c);
      // positions of the kept slots
      const std::int32_t o = rb.indptr[static_cast<std::size_t>(b * H + h)];
      for (std::size_t i = 0; i < a.size() && a == c; ++i)
        CHECK(rb.positions[static_cast<std::size_t>(o) + i] == r1.positions[static_cast<std::size_t>(r1.indptr[static_cast<std::size_t>(h)]) + i]);
      // final scores over the valid slots: bit-identical (same arithmetic, per head)
      const std::int64_t L = big.length(b, h / (H / s.Hkv));
      for (std::int64_t t = 0; t < L; ++t)
        CHECK(rb.scores[static_cast<std::size_t>((b * H + h) * rb.seq + t)] == r1.scores[static_cast<std::size_t>(h * r1.seq + t)]);
      evicted += L - static_cast<std::int64_t>(a.size());
      kept_total += static_cast<std::int64_t>(a.size());
    }
  }
  // Non-vacuity: something was evicted, and pads were poisoned but never counted.
  CHECK(evicted > 0);
  CHECK(kept_total == rb.max_selected);
}

}  // namespace

TEST_CASE_TEMPLATE("kind 8: a padded batch equals the sequences run one by one", P, KVEVICT_ROBUST_PRESETS) {
  for_each_storage_type([](auto tag) {
    using T = typename decltype(tag)::type;
    const float poisons[] = {std::numeric_limits<float>::quiet_NaN(), 65504.0f, -3.0e38f,
                             std::numeric_limits<float>::infinity()};
    std::uint64_t seed = 100;
    for (float poison : poisons) {
      for (int mode = 0; mode < 2; ++mode) {
        const kvevict::budget_request budget =
            mode == 0 ? kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 6), 10))
                      : kvevict::budget_request::fraction(0.3);
        // per-sequence lengths (one shorter than the window, one full)
        check_batch_equals_singles<P, T>(batch_shape({40, 40, 23, 23, 5, 5}, true), poison, budget, ++seed);
        // per-(sequence, head) lengths: TOVA (layer_mean) requires equal lengths across heads
        if (P::defaults().gqa != kvevict::gqa_reduction::layer_mean)
          check_batch_equals_singles<P, T>(batch_shape({40, 31, 17, 23, 5, 12}, false), poison, budget, ++seed);
      }
    }
  });
}

TEST_CASE_TEMPLATE("kind 8: TOVA rejects unequal head lengths instead of mixing them", P, kvevict::presets::tova) {
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  problem<float> pr;
  pr.init(batch_shape({40, 31, 17, 23, 5, 12}, false), 7);
  const auto st = ev.can_implement(pr.in, kvevict::budget_request::tokens(10));
  CHECK(st.code() == kvevict::errc::invalid_argument);
  CHECK(std::string(st.message()).find("layer_mean") != std::string::npos);
}

TEST_CASE_TEMPLATE("kind 8: batch rows are independent (no reduction over the batch axis)", P, KVEVICT_ROBUST_PRESETS) {
  // Changing sequence 1's data must not change sequence 0's or 2's selection or scores.
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  problem<float> a, b;
  const shape s = batch_shape({40, 40, 33, 33, 21, 21}, true);
  a.init(s, 11);
  b.init(s, 11);
  kvtest::rng r(99);
  for (std::int64_t h = 0; h < s.Hkv; ++h)
    for (std::int64_t t = 0; t < 33; ++t)
      for (std::int64_t d = 0; d < s.D; ++d) {
        b.k.at(1, h, t, d) = static_cast<float>(50.0 * r.normal());
        b.v.at(1, h, t, d) = static_cast<float>(50.0 * r.normal());
      }
  for (std::int64_t hq = 0; hq < s.Hq(); ++hq)
    for (std::int64_t j = 0; j < s.W; ++j)
      for (std::int64_t d = 0; d < s.D; ++d) b.q.at(1, hq, j, d) = static_cast<float>(5.0 * r.normal());
  set_layer<P>(a);
  set_layer<P>(b);
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 6), 10));
  const result ra = run_evictor(ev, a.in, budget), rb = run_evictor(ev, b.in, budget);
  REQUIRE(ra.st.ok());
  REQUIRE(rb.st.ok());
  const std::int64_t H = ev.out_heads(a.in);
  for (std::int64_t seq : {0, 2})
    for (std::int64_t h = 0; h < H; ++h) {
      CAPTURE(seq);
      CAPTURE(h);
      CHECK(ra.row(seq * H + h) == rb.row(seq * H + h));
      for (std::int64_t t = 0; t < s.S; ++t)
        CHECK(ra.scores[static_cast<std::size_t>((seq * H + h) * s.S + t)] == rb.scores[static_cast<std::size_t>((seq * H + h) * s.S + t)]);
    }
}

// ------------------------------------------------------------------------------------ kind 7

TEST_CASE_TEMPLATE("kind 7: the evictor holds no per-request state", P, KVEVICT_ROBUST_PRESETS) {
  using ev_t = kvevict::evictor<P, kvevict::cpu::backend>;
  // Only parameters: copyable as plain data, and run() is callable on a const object.
  static_assert(std::is_trivially_copyable<ev_t>::value, "evictor must be plain data (no hidden state)");
  const ev_t ev;
  problem<float> pr;
  pr.init(batch_shape({}, false), 5);
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 6), 10));
  const result r1 = run_evictor(ev, pr.in, budget);
  const ev_t copy = ev;
  const result r2 = run_evictor(copy, pr.in, budget);
  REQUIRE(r1.st.ok());
  CHECK(r1.same_selection(r2));
  CHECK(r1.scores == r2.scores);
}

TEST_CASE_TEMPLATE("kind 7: A then B on one evictor and one reused workspace equals B alone", P, KVEVICT_ROBUST_PRESETS) {
  for_each_storage_type([](auto tag) {
    using T = typename decltype(tag)::type;
    CAPTURE(preset_name<P>());
    CAPTURE(type_name<T>());
    kvevict::evictor<P, kvevict::cpu::backend> ev;
    // Request A: another shape, larger, large values; request B: the batched shape; request C: tiny.
    shape sa = batch_shape({50, 44, 30, 50}, false);
    sa.B = 2;
    sa.S = 50;
    sa.W = 9;
    sa.D = 16;
    if (P::defaults().gqa == kvevict::gqa_reduction::layer_mean) sa.lengths = {50, 50, 30, 30};
    const shape sb = batch_shape({40, 40, 23, 23, 5, 5}, true);
    shape sc = batch_shape({}, false);
    sc.B = 1;
    sc.S = 7;
    sc.W = 1;
    problem<T> A, Bp, C;
    A.init(sa, 1, 30.0f);
    Bp.init(sb, 2);
    C.init(sc, 3);
    for (auto* p : {&A, &Bp, &C}) set_layer<P>(*p);
    const std::int32_t tok = std::max(min_tokens_budget<P>(P::defaults(), 9), 12);
    const auto budget = kvevict::budget_request::tokens(tok);
    const auto budget_c = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 1), 4));

    // Reference: each request on a fresh evictor with a fresh, zero-filled workspace.
    const result refA = run_evictor(kvevict::evictor<P, kvevict::cpu::backend>{}, A.in, budget, 0x00);
    const result refB = run_evictor(kvevict::evictor<P, kvevict::cpu::backend>{}, Bp.in, budget, 0x00);
    const result refC = run_evictor(kvevict::evictor<P, kvevict::cpu::backend>{}, C.in, budget_c, 0x00);
    REQUIRE_MESSAGE(refA.st.ok(), refA.st.message());
    REQUIRE_MESSAGE(refB.st.ok(), refB.st.message());
    REQUIRE_MESSAGE(refC.st.ok(), refC.st.message());

    // One evictor, one workspace vector reused; refilled with NaN bytes (0xFF) before each run.
    std::vector<unsigned char> ws;
    const result a1 = run_evictor(ev, A.in, budget, 0xFF, &ws);
    const result b1 = run_evictor(ev, Bp.in, budget, 0xFF, &ws);
    const result c1 = run_evictor(ev, C.in, budget_c, 0xFF, &ws);
    // Reverse order, workspace NOT refilled between runs (stale results of the previous request).
    std::vector<unsigned char> ws2;
    const result c2 = run_evictor(ev, C.in, budget_c, 0x7F, &ws2);
    kvevict::selection_view dummy;
    (void)dummy;
    const result b2 = [&] {
      // run B directly on the stale workspace of C (no memset)
      result r;
      r.rows = Bp.sh.B * ev.out_heads(Bp.in);
      r.seq = Bp.sh.S;
      r.workspace_bytes = ev.workspace_size(Bp.in);
      r.max_selected = ev.max_selected(Bp.in, budget);
      if (ws2.size() < r.workspace_bytes) ws2.resize(r.workspace_bytes, 0xAB);
      r.indptr.assign(static_cast<std::size_t>(r.rows + 1), 0);
      r.indices.assign(static_cast<std::size_t>(r.max_selected), 0);
      r.positions.assign(r.indices.size(), 0);
      r.scores.assign(static_cast<std::size_t>(r.rows * r.seq), 0.0f);
      kvevict::selection_view sel{r.indptr.data(), r.indices.data(), r.positions.data(), r.max_selected};
      r.st = ev.run(Bp.in, budget, sel, ws2.data(), r.workspace_bytes, r.scores.data());
      return r;
    }();
    const result a2 = run_evictor(ev, A.in, budget, 0x80, &ws2);
    for (const result* r : {&a1, &b1, &c1, &a2, &b2, &c2}) REQUIRE_MESSAGE(r->st.ok(), r->st.message());
    CHECK(a1.same_selection(refA));
    CHECK(b1.same_selection(refB));
    CHECK(c1.same_selection(refC));
    CHECK(a2.same_selection(refA));
    CHECK(b2.same_selection(refB));
    CHECK(c2.same_selection(refC));
    CHECK(a1.scores == refA.scores);
    CHECK(b1.scores == refB.scores);
    CHECK(b2.scores == refB.scores);
    CHECK(c2.scores == refC.scores);
    // Non-vacuity: B evicts something.
    CHECK(refB.max_selected < 40 * 2 + 23 * 2 + 5 * 2);
  });
}

TEST_CASE_TEMPLATE("kind 7: workspace contents never influence results", P, KVEVICT_ROBUST_PRESETS) {
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  problem<half_t> pr;
  pr.init(batch_shape({40, 36, 23, 23, 5, 9}, P::defaults().gqa == kvevict::gqa_reduction::layer_mean), 21);
  set_layer<P>(pr);
  const auto budget = kvevict::budget_request::fraction(0.4);
  const result ref = run_evictor(ev, pr.in, budget, 0x00);
  REQUIRE(ref.st.ok());
  for (unsigned fill : {0xFFu, 0x7Fu, 0x80u, 0x01u, 0xC3u}) {
    CAPTURE(fill);
    const result r = run_evictor(ev, pr.in, budget, static_cast<unsigned char>(fill));
    REQUIRE(r.st.ok());
    CHECK(r.same_selection(ref));
    CHECK(r.scores == ref.scores);
  }
  // Random garbage, and a workspace at an odd address (the evictor aligns it itself).
  std::vector<unsigned char> raw(ev.workspace_size(pr.in) + 64);
  kvtest::rng g(3);
  for (auto& x : raw) x = static_cast<unsigned char>(g.next());
  for (std::size_t off : {std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
    CAPTURE(off);
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(ref.rows + 1)), idx(static_cast<std::size_t>(ref.max_selected)),
        pos(idx.size());
    std::vector<float> sc(ref.scores.size());
    kvevict::selection_view sel{indptr.data(), idx.data(), pos.data(), ref.max_selected};
    const auto st = ev.run(pr.in, budget, sel, raw.data() + off, ev.workspace_size(pr.in), sc.data());
    REQUIRE_MESSAGE(st.ok(), st.message());
    CHECK(indptr == ref.indptr);
    CHECK(idx == ref.indices);
    CHECK(sc == ref.scores);
  }
}

TEST_CASE_TEMPLATE("kind 7: results do not depend on the thread count or on concurrent runs", P, KVEVICT_ROBUST_PRESETS) {
  problem<float> pr;
  pr.init(batch_shape({40, 36, 23, 23, 5, 9}, P::defaults().gqa == kvevict::gqa_reduction::layer_mean), 31);
  set_layer<P>(pr);
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 6), 10));
  const kvevict::evictor<P, kvevict::cpu::backend> ev1(P::defaults(), kvevict::cpu::backend{1});
  const result ref = run_evictor(ev1, pr.in, budget);
  REQUIRE(ref.st.ok());
  for (int nt : {2, 3, 7}) {
    CAPTURE(nt);
    const kvevict::evictor<P, kvevict::cpu::backend> ev(P::defaults(), kvevict::cpu::backend{nt});
    const result r = run_evictor(ev, pr.in, budget);
    REQUIRE(r.st.ok());
    CHECK(r.same_selection(ref));
    CHECK(r.scores == ref.scores);
  }
  // Two threads share one const evictor, each with its own workspace and outputs.
  result t1, t2;
  std::thread a([&] { t1 = run_evictor(ev1, pr.in, budget, 0x11); });
  std::thread b([&] { t2 = run_evictor(ev1, pr.in, budget, 0xEE); });
  a.join();
  b.join();
  CHECK(t1.same_selection(ref));
  CHECK(t2.same_selection(ref));
}

// ------------------------------------------------------------------------------------ kind 6

TEST_CASE_TEMPLATE("kind 6: valid lengths come from the lengths view, never from the capacity", P, KVEVICT_ROBUST_PRESETS) {
  // The same tokens in a buffer of capacity 40 with lengths, and of capacity 64 (pads NaN):
  // identical selections. And the default (no lengths view) means L = capacity.
  kvevict::evictor<P, kvevict::cpu::backend> ev;
  const bool eq = P::defaults().gqa == kvevict::gqa_reduction::layer_mean;
  const std::vector<std::int32_t> lens = eq ? std::vector<std::int32_t>{33, 33, 19, 19, 40, 40}
                                            : std::vector<std::int32_t>{33, 29, 19, 40, 40, 7};
  problem<float> a;
  a.init(batch_shape(lens, false), 41);
  shape wide = batch_shape(lens, false);
  wide.S = 64;
  wide.layout = kvevict::kv_layout::hnd;
  problem<float> b;
  b.init(wide, 41);  // same seed and same lengths => same valid values
  set_layer<P>(a);
  set_layer<P>(b);
  const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 6), 10));
  const result ra = run_evictor(ev, a.in, budget), rb = run_evictor(ev, b.in, budget);
  REQUIRE(ra.st.ok());
  REQUIRE(rb.st.ok());
  CHECK(ra.indptr == rb.indptr);
  CHECK(ra.indices == rb.indices);
  CHECK(check_contract(ev, a, ra, budget) == "");
  CHECK(check_contract(ev, b, rb, budget) == "");
  // No lengths view: every head holds the capacity.
  problem<float> c;
  c.init(batch_shape({}, false), 42);
  set_layer<P>(c);
  const result rc = run_evictor(ev, c.in, budget);
  REQUIRE(rc.st.ok());
  CHECK(check_contract(ev, c, rc, budget) == "");
  // Lengths outside [0, capacity] are an error naming the head, not a read past the buffer.
  std::vector<std::int32_t> badlens = lens;
  badlens[1] = 41;
  a.lens = badlens;
  a.rebuild_views();
  const auto st = ev.can_implement(a.in, budget);
  CHECK(st.code() == kvevict::errc::invalid_argument);
  CHECK(std::string(st.message()).find("lengths(b=0, h=1) = 41") != std::string::npos);
}

TEST_CASE("kind 9: more threads than the evictor's 256 scratch slots") {
  // backend::num_threads above the per-thread scratch the workspace holds must not index past it.
  shape s;
  s.B = 20;
  s.Hkv = 16;
  s.G = 1;
  s.S = 8;
  s.W = 2;
  s.D = 4;
  problem<float> pr;
  pr.init(s, 51);
  const auto budget = kvevict::budget_request::tokens(4);
  const kvevict::evictor<kvevict::presets::snapkv, kvevict::cpu::backend> ev1(kvevict::presets::snapkv::defaults(),
                                                                             kvevict::cpu::backend{1});
  const kvevict::evictor<kvevict::presets::snapkv, kvevict::cpu::backend> evn(kvevict::presets::snapkv::defaults(),
                                                                             kvevict::cpu::backend{300});
  const result r1 = run_evictor(ev1, pr.in, budget);
  const result rn = run_evictor(evn, pr.in, budget);
  REQUIRE(r1.st.ok());
  REQUIRE(rn.st.ok());
  CHECK(r1.same_selection(rn));
  CHECK(r1.scores == rn.scores);
}
