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

// ---- row-maximum aggregation: temporal::maximum and temporal::defensive ---------------------------

namespace {
template <class Temporal>
using max_snap = kvevict::eviction_policy<kvevict::scorers::attention_weight, Temporal, kvevict::spatial::none>;

/// fp64 reference of the aggregated rows: per query head M_g[n] = max_j A_g[j, n], reduced by `gqa`
/// (mean, max, per query head, or the mean over every query head of the sequence), then, with
/// `floor`, each row floored at its mean over n < L - w. Rows: (b, out row) -> L scores.
std::vector<std::vector<double>> max_reference(const kvtest::problem& p, kvevict::gqa_reduction gqa, bool floor) {
  const auto& s = p.s;
  const std::int64_t G = s.group, H = s.kv_heads;
  std::vector<std::vector<double>> rows;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    std::vector<std::vector<double>> M(static_cast<std::size_t>(H * G));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = p.length(b, h), w = std::min(s.window, L);
      for (std::int64_t g = 0; g < G; ++g) {
        const kvref::mat A = kvref::window_attention(p.queries(b, h * G + g, w), p.keys(b, h), L, w);
        auto& m = M[static_cast<std::size_t>(h * G + g)];
        m.assign(static_cast<std::size_t>(L), 0.0);
        for (std::int64_t j = 0; j < w; ++j)
          for (std::int64_t n = 0; n < L; ++n) m[static_cast<std::size_t>(n)] = std::max(m[static_cast<std::size_t>(n)], A(j, n));
      }
    }
    std::vector<std::vector<double>> out;
    for (std::int64_t h = 0; h < H; ++h) {
      if (gqa == kvevict::gqa_reduction::per_query_head) {
        for (std::int64_t g = 0; g < G; ++g) out.push_back(M[static_cast<std::size_t>(h * G + g)]);
        continue;
      }
      std::vector<double> r(M[static_cast<std::size_t>(h * G)].size(), 0.0);
      for (std::size_t n = 0; n < r.size(); ++n) {
        if (gqa == kvevict::gqa_reduction::layer_mean) {
          for (std::int64_t q = 0; q < H * G; ++q) r[n] += M[static_cast<std::size_t>(q)][n] / static_cast<double>(H * G);
        } else {
          for (std::int64_t g = 0; g < G; ++g) {
            const double x = M[static_cast<std::size_t>(h * G + g)][n];
            r[n] = gqa == kvevict::gqa_reduction::max ? std::max(r[n], x) : r[n] + x / static_cast<double>(G);
          }
        }
      }
      out.push_back(r);
    }
    for (auto& r : out) {
      const std::int64_t L = static_cast<std::int64_t>(r.size()), Lc = L - std::min(s.window, L);
      if (floor && Lc > 0) {
        double mean = 0.0;
        for (std::int64_t n = 0; n < Lc; ++n) mean += r[static_cast<std::size_t>(n)] / static_cast<double>(Lc);
        for (std::int64_t n = 0; n < Lc; ++n) r[static_cast<std::size_t>(n)] = std::max(r[static_cast<std::size_t>(n)], mean);
      }
      rows.push_back(r);
    }
  }
  return rows;
}

template <class Temporal>
void check_row_max(bool floor) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 56, s.d = 16, s.window = 8;
  int exact = 0;
  for (auto gqa : {kvevict::gqa_reduction::mean, kvevict::gqa_reduction::max, kvevict::gqa_reduction::per_query_head,
                   kvevict::gqa_reduction::layer_mean}) {
    for (std::uint64_t seed : {1u, 2u, 3u}) {
      const bool ragged = gqa != kvevict::gqa_reduction::layer_mean && seed == 2;  // layer_mean needs equal lengths
      kvtest::problem p = kvtest::make_problem(s, 9100 + seed, 1.0, 2.0, 1.0, ragged ? std::vector<std::int32_t>{56, 40, 48, 56} : std::vector<std::int32_t>{});
      kvtest::stored<float> st;
      kvtest::store(p, seed == 3 ? kvtest::layout::hnd : kvtest::layout::nhd, st);
      auto prm = max_snap<Temporal>::defaults();
      prm.gqa = gqa;
      kvevict::evictor<max_snap<Temporal>, kvevict::cpu::backend> ev(prm);
      const std::int32_t B = 20;
      const auto lib = kvtest::run_lib(ev, st.in, kvevict::budget_request::tokens(B));
      REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
      const auto ref = max_reference(p, gqa, floor);
      REQUIRE(static_cast<std::int64_t>(ref.size()) == lib.rows);
      const std::int64_t per_seq = lib.rows / s.batch, G = gqa == kvevict::gqa_reduction::per_query_head ? s.group : 1;
      for (std::int64_t r = 0; r < lib.rows; ++r) {
        const std::int64_t b = r / per_seq, h = (r % per_seq) / G, L = p.length(b, h), w = std::min(s.window, L);
        const auto& want = ref[static_cast<std::size_t>(r)];
        INFO("gqa " << kvevict::to_string(gqa) << " seed " << seed << " row " << r);
        for (std::int64_t n = 0; n < L - w; ++n)
          CHECK(std::fabs(lib.row_scores(r)[n] - want[static_cast<std::size_t>(n)]) <= 1e-5 * want[static_cast<std::size_t>(n)] + 1e-12);
        // the kept candidates: the B - w best by the reference (ties to the lower index), unless a near tie
        std::vector<std::int32_t> ord(static_cast<std::size_t>(L - w));
        for (std::int64_t n = 0; n < L - w; ++n) ord[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(n);
        std::stable_sort(ord.begin(), ord.end(), [&](std::int32_t a, std::int32_t c) { return want[static_cast<std::size_t>(a)] > want[static_cast<std::size_t>(c)]; });
        const std::int64_t k = B - w;
        if (L <= B) continue;
        const double a = want[static_cast<std::size_t>(ord[static_cast<std::size_t>(k - 1)])], c = want[static_cast<std::size_t>(ord[static_cast<std::size_t>(k)])];
        if (a != c && a - c <= 1e-5 * a) continue;  // near tie: the scores were checked
        std::vector<std::int32_t> expect(ord.begin(), ord.begin() + k);
        for (std::int64_t n = L - w; n < L; ++n) expect.push_back(static_cast<std::int32_t>(n));
        std::sort(expect.begin(), expect.end());
        CHECK(lib.kept(r) == expect);
        ++exact;
      }
    }
  }
  CHECK(exact >= 40);
}
}  // namespace

TEST_CASE("temporal::maximum: the maximum over the window rows, through every GQA reduction, vs the fp64 reference") {
  check_row_max<kvevict::temporal::maximum>(false);
}

TEST_CASE("temporal::defensive: the maximum floored at the reduced row's mean over the candidates, vs the fp64 reference") {
  check_row_max<kvevict::temporal::defensive>(true);
}

TEST_CASE("temporal::defensive then avg-pool 5 (the report's SnapKV-def): the floored row is pooled, vs the fp64 reference") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 60, s.d = 16, s.window = 8;
  using snap_def = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::defensive, kvevict::spatial::avg_pool>;
  for (std::uint64_t seed : {5u, 6u}) {
    kvtest::problem p = kvtest::make_problem(s, 9300 + seed, 1.0, 2.0, 1.0);
    kvtest::stored<float> st;
    kvtest::store(p, kvtest::layout::nhd, st);
    auto prm = snap_def::defaults();
    prm.gqa = kvevict::gqa_reduction::max;
    const auto lib = kvtest::run_lib(kvevict::evictor<snap_def, kvevict::cpu::backend>(prm), st.in, kvevict::budget_request::tokens(20));
    REQUIRE(lib.st.ok());
    const auto ref = max_reference(p, kvevict::gqa_reduction::max, true);
    for (std::int64_t r = 0; r < lib.rows; ++r) {
      const std::int64_t L = s.cap, Lc = L - s.window;
      kvref::vec x(ref[static_cast<std::size_t>(r)].begin(), ref[static_cast<std::size_t>(r)].begin() + Lc);  // the smoothing region [0, L - w)
      const kvref::vec want = kvref::avg_pool(x, 5);
      for (std::int64_t n = 0; n < Lc; ++n) {
        INFO("seed " << seed << " row " << r << " n " << n);
        CHECK(std::fabs(lib.row_scores(r)[n] - want[static_cast<std::size_t>(n)]) <= 1e-5 * want[static_cast<std::size_t>(n)] + 1e-12);
      }
    }
  }
}

TEST_CASE("temporal::maximum on TOVA's last row is that row; the floor changes the selection") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8;
  kvtest::problem p = kvtest::make_problem(s, 77, 1.0, 2.0, 1.0);
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::nhd, st);
  using tova_max = kvevict::eviction_policy<kvevict::scorers::last_query, kvevict::temporal::maximum, kvevict::spatial::none>;
  auto tp = tova_max::defaults();  // TOVA's settings: layer mean, nothing protected by rule
  tp.gqa = kvevict::gqa_reduction::layer_mean;
  tp.selector.num_recent = 0;
  auto a = kvtest::run_lib(kvevict::evictor<tova_max, kvevict::cpu::backend>(tp), st.in, kvevict::budget_request::tokens(20));
  auto b = kvtest::run_lib(kvevict::evictor<kvevict::presets::tova, kvevict::cpu::backend>(), st.in, kvevict::budget_request::tokens(20));
  REQUIRE(a.st.ok());
  REQUIRE(b.st.ok());
  CHECK(a.indices == b.indices);
  CHECK(a.scores == b.scores);
  // on the window's maximum, the floor at the mean moves low tokens up to it: a different selection at some budget
  bool differs = false;
  for (std::int32_t B : {16, 24, 32, 40}) {
    auto m = kvtest::run_lib(kvevict::evictor<max_snap<kvevict::temporal::maximum>, kvevict::cpu::backend>(), st.in, kvevict::budget_request::tokens(B));
    auto d = kvtest::run_lib(kvevict::evictor<max_snap<kvevict::temporal::defensive>, kvevict::cpu::backend>(), st.in, kvevict::budget_request::tokens(B));
    differs = differs || m.indices != d.indices;
  }
  CHECK(differs);
}
