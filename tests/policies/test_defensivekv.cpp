// DefensiveKV (Feng et al., ICLR 2026, arXiv 2510.13334) on the CPU backend:
// scorers::defensive_attention + budgeters::adakv (alpha 0), presets::defensivekv.
//  - seeded random problems (float and bf16 storage, NHD and HND, GQA 1 / 2 / 4, ragged lengths,
//    several budgets, each share rule, clamp on and off) against a float64 reference written
//    from the paper and the authors' EfficientDefensiveKVPress: per-row avg pooling rescaled to
//    the row's mass, max over window rows and the group, clamp at the mean, value norms
//    normalised over the heads, the mass stage, one flattened top-k over the heads;
//  - each stage shown to change the selection (non-vacuity);
//  - parameter and input errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "reference/harness.hpp"

using kvevict::bfloat16_t;
using kvtest::layout;
namespace kv = kvevict;
using defensive = kv::scorers::defensive_attention;

namespace {

/// A problem shape: batch, KV heads, GQA group, capacity, head_dim, window, hidden size (W_O rows).
kvtest::shape shape_of(std::int64_t batch, std::int64_t kv_heads, std::int64_t group, std::int64_t cap, std::int64_t d, std::int64_t window,
                       std::int64_t hidden) {
  kvtest::shape s;
  s.batch = batch;
  s.kv_heads = kv_heads;
  s.group = group;
  s.cap = cap;
  s.d = d;
  s.window = window;
  s.hidden = hidden;
  return s;
}

struct ref_out {
  std::vector<std::vector<std::int32_t>> kept;  ///< per head, ascending
  std::vector<std::vector<double>> F;           ///< per head, the final scores on [0, L)
  std::vector<std::vector<char>> forced;        ///< per head: forced by the mass stage
  bool ambiguous = false;                       ///< a near-tie at the mass threshold or at the top-k cut
};

/// The float64 reference of one sequence b: heads with L <= budget are kept whole and take no part;
/// `sinks` first tokens of every evicting head are protected (not candidates, never forced).
ref_out reference(const kvtest::problem& p, std::int64_t b, const defensive::params& sp, std::int64_t budget, std::int64_t sinks = 0) {
  const auto& s = p.s;
  const std::int64_t H = s.kv_heads, G = s.group, k = sp.kernel, half = k / 2;
  ref_out o;
  o.F.resize(static_cast<std::size_t>(H));
  o.forced.resize(static_cast<std::size_t>(H));
  std::vector<std::vector<double>> S(H), u(H), mass(H);
  std::vector<std::int64_t> Ls(H), ws(H);
  std::vector<char> whole(static_cast<std::size_t>(H));
  double share = 0.0;
  std::int64_t evicting = 0;
  for (std::int64_t h = 0; h < H; ++h) evicting += p.length(b, h) > budget ? 1 : 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t L = p.length(b, h), w = std::min(s.window, L), Lc = L - w;
    Ls[h] = L;
    ws[h] = w;
    whole[h] = L <= budget;
    if (whole[h]) continue;
    const kvref::mat K = p.keys(b, h), V = p.values(b, h);
    std::vector<double> M(static_cast<std::size_t>(Lc), 0.0);
    mass[h].assign(static_cast<std::size_t>(L), 0.0);
    u[h].assign(static_cast<std::size_t>(L), 0.0);
    double head_share = 0.0;
    for (std::int64_t g = 0; g < G; ++g) {
      const std::int64_t hq = h * G + g;
      const kvref::mat A = kvref::window_attention(p.queries(b, hq, w), K, L, w);
      double gshare = 0.0;
      for (std::int64_t j = 0; j < w; ++j) {
        for (std::int64_t n = 0; n < L; ++n) mass[h][n] += A(j, n) / static_cast<double>(w * G);
        double sh = 0.0;
        if (sp.share == defensive::share_rule::preceding_keys)
          for (std::int64_t n = std::max<std::int64_t>(0, Lc - w); n < Lc; ++n) sh += A(j, n);
        else if (sp.share == defensive::share_rule::window)
          for (std::int64_t n = Lc; n < L; ++n) sh += A(j, n);
        gshare += sh / static_cast<double>(w);
        // avg pool (zero padding, divided by k), rescaled to the row's mass on [0, Lc)
        std::vector<double> q(static_cast<std::size_t>(Lc), 0.0);
        double rmass = 0.0, qmass = 0.0;
        for (std::int64_t n = 0; n < Lc; ++n) {
          rmass += A(j, n);
          for (std::int64_t m = n - half; m <= n + half; ++m)
            if (m >= 0 && m < Lc) q[n] += A(j, m) / static_cast<double>(k);
          qmass += q[n];
        }
        for (std::int64_t n = 0; n < Lc; ++n) M[n] = std::max(M[n], qmass > 0 ? q[n] / qmass * rmass : 0.0);
      }
      head_share += gshare / static_cast<double>(G);
      const kvref::mat WO = p.wo(hq);
      for (std::int64_t n = 0; n < L; ++n) u[h][n] += kvref::proj_l1_norm(V.row(n), s.d, WO) / static_cast<double>(G);
    }
    share += head_share / static_cast<double>(evicting);
    double mean = 0.0;
    for (double x : M) mean += x / static_cast<double>(Lc);
    S[h] = M;
    if (sp.clamp_at_mean)
      for (auto& x : S[h]) x = std::max(x, mean);
  }
  double fmax = 0.0;
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t Lc = Ls[h] - ws[h];
    o.F[h].assign(static_cast<std::size_t>(Ls[h]), 0.0);
    o.forced[h].assign(static_cast<std::size_t>(Ls[h]), 0);
    if (whole[h]) continue;
    for (std::int64_t n = 0; n < Lc; ++n) {
      double U = 0.0;
      for (std::int64_t h2 = 0; h2 < H; ++h2)
        if (!whole[h2] && n < Ls[h2] - ws[h2]) U += u[h2][n];
      o.F[h][n] = S[h][n] * u[h][n] / U;
      fmax = std::max(fmax, o.F[h][n]);
    }
  }
  const double tau = sp.mass_threshold - share;
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t Lc = Ls[h] - ws[h];
    if (whole[h]) continue;
    for (std::int64_t n = Lc; n < Ls[h]; ++n) o.F[h][n] = inf;
    if (!(sp.mass_threshold > 0.0f) || !(tau > 0.0)) continue;
    double total = 0.0;
    for (std::int64_t n = 0; n < Lc; ++n) total += mass[h][n];
    std::vector<std::int32_t> ord(static_cast<std::size_t>(Lc));
    std::iota(ord.begin(), ord.end(), 0);
    std::stable_sort(ord.begin(), ord.end(), [&](std::int32_t a, std::int32_t c) { return mass[h][a] > mass[h][c]; });
    std::int64_t count = 0;
    double cum = 0.0;
    for (std::int64_t i = 0; i < Lc; ++i) {
      cum += mass[h][ord[i]] / total;
      if (std::fabs(cum - tau) < 1e-5) o.ambiguous = true;
      if (cum >= tau) {
        count = i;
        break;
      }
    }
    std::int64_t cap = std::max<std::int64_t>(budget - ws[h] - sinks, 0);
    for (std::int64_t i = 0; i < count && cap > 0; ++i) {
      if (ord[i] < sinks) continue;  // protected: not a candidate
      o.forced[h][ord[i]] = 1;
      o.F[h][ord[i]] = inf;  // forced: above every score
      --cap;
    }
  }
  // one flattened top-T over the candidates of every head (ties: lower head, lower index)
  struct cand {
    double f;
    std::int64_t h, n;
  };
  std::vector<cand> all;
  std::int64_t T = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    if (whole[h]) continue;
    T += budget - ws[h] - sinks;
    for (std::int64_t n = sinks; n < Ls[h] - ws[h]; ++n) all.push_back({o.F[h][n], h, n});
  }
  std::stable_sort(all.begin(), all.end(), [](const cand& a, const cand& c) { return a.f > c.f; });
  if (T > 0 && T < static_cast<std::int64_t>(all.size())) {
    const double a = all[T - 1].f, c = all[T].f;
    // a near tie at the cut (fp32 scores are good to ~1e-6) is ambiguous; an exact one is not: it comes
    // from the clamp at the mean where one head alone holds a position (u / U = 1), and both sides break
    // it to the lower head, then the lower index
    if (std::isfinite(a) && a != c && std::fabs(a - c) <= 1e-5 * std::max(std::fabs(a), 1e-30)) o.ambiguous = true;
  }
  o.kept.resize(static_cast<std::size_t>(H));
  for (std::int64_t i = 0; i < T; ++i) o.kept[all[i].h].push_back(static_cast<std::int32_t>(all[i].n));
  for (std::int64_t h = 0; h < H; ++h) {
    if (whole[h]) {  // kept whole
      o.kept[h].clear();
      for (std::int64_t n = 0; n < Ls[h]; ++n) o.kept[h].push_back(static_cast<std::int32_t>(n));
      continue;
    }
    for (std::int64_t n = 0; n < sinks; ++n) o.kept[h].push_back(static_cast<std::int32_t>(n));
    for (std::int64_t n = Ls[h] - ws[h]; n < Ls[h]; ++n) o.kept[h].push_back(static_cast<std::int32_t>(n));
    std::sort(o.kept[h].begin(), o.kept[h].end());
  }
  return o;
}

template <class T>
void check_case(const kvtest::shape& s, std::uint64_t seed, layout lay, const defensive::params& sp, std::int64_t budget,
                std::vector<std::int32_t> lens, int* exact, int* skipped, std::int32_t sinks = 0) {
  kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, lens);
  kvtest::quantize<T>(p);
  kvtest::quantize_wo<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, lay, st);
  auto prm = kv::presets::defensivekv::defaults();
  prm.scorer = sp;
  prm.selector.num_sink = sinks;
  kv::evictor<kv::presets::defensivekv, kv::cpu::backend> ev(prm);
  const auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(static_cast<std::int32_t>(budget)));
  REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const ref_out r = reference(p, b, sp, budget, sinks);
    // scores: every candidate not forced, to 1e-4 relative (fp32 attention and GEMMs)
    for (std::int64_t h = 0; h < s.kv_heads; ++h) {
      const std::int64_t row = b * s.kv_heads + h, L = p.length(b, h), Lc = L - std::min(s.window, L);
      const float* f = lib.row_scores(row);
      if (L <= budget) continue;  // kept whole: not scored
      for (std::int64_t n = sinks; n < Lc; ++n) {
        if (r.forced[h][n]) continue;
        const double want = r.F[h][n];
        INFO("seed " << seed << " b " << b << " h " << h << " n " << n);
        CHECK(std::fabs(f[n] - want) <= 1e-4 * std::fabs(want) + 1e-12);
      }
    }
    if (r.ambiguous) {
      ++*skipped;
      continue;
    }
    for (std::int64_t h = 0; h < s.kv_heads; ++h) {
      INFO("seed " << seed << " b " << b << " h " << h << " budget " << budget);
      CHECK(lib.kept(b * s.kv_heads + h) == r.kept[h]);
    }
    ++*exact;
  }
}

}  // namespace

TEST_CASE("defensivekv: selections and scores equal the float64 reference") {
  int exact = 0, skipped = 0;
  std::uint64_t seed = 7100;
  for (std::int64_t group : {1, 2, 4}) {
    const kvtest::shape s = shape_of(2, 3, group, 72, 16, 8, 24);
    for (std::int64_t budget : {12, 24, 40}) {
      for (int variant = 0; variant < 4; ++variant) {
        defensive::params sp;
        if (variant == 1) sp.share = defensive::share_rule::window;
        if (variant == 2) {
          sp.share = defensive::share_rule::none;
          sp.clamp_at_mean = false;
          sp.kernel = 3;
        }
        if (variant == 3) sp.mass_threshold = 0.0f;
        const layout lay = (variant % 2) ? layout::hnd : layout::nhd;
        std::vector<std::int32_t> lens;
        if (variant == 2) lens = {72, 60, 66, 50, 72, 58};  // ragged per head
        if (variant == 3) lens = {72, 20, 66, 72, 72, 30};  // heads of 20 and 30 tokens kept whole at budget 40
        check_case<float>(s, ++seed, lay, sp, budget, lens, &exact, &skipped);
        if (variant == 1) check_case<float>(s, ++seed, lay, sp, budget, lens, &exact, &skipped, 2);  // 2 sinks
        if (variant == 0) check_case<bfloat16_t>(s, ++seed, layout::nhd, sp, budget, {}, &exact, &skipped);
      }
    }
  }
  MESSAGE("exact sequences " << exact << ", near-tie sequences (scores only) " << skipped);
  CHECK(skipped == 0);  // with these seeds every sequence is compared exactly
  CHECK(exact == 108);
}

TEST_CASE("defensivekv: every stage changes the selection") {
  const kvtest::shape s = shape_of(1, 3, 2, 96, 16, 8, 24);
  kvtest::problem p = kvtest::make_problem(s, 4242, 1.0, 2.0, 1.0);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  auto run = [&](defensive::params sp, std::int32_t budget) {
    auto prm = kv::presets::defensivekv::defaults();
    prm.scorer = sp;
    kv::evictor<kv::presets::defensivekv, kv::cpu::backend> ev(prm);
    const auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(budget));
    REQUIRE(lib.st.ok());
    return lib.indices;
  };
  const defensive::params base;
  defensive::params no_mass = base;
  no_mass.mass_threshold = 0.0f;
  const auto a = run(base, 24);
  CHECK(a.size() == static_cast<std::size_t>(3 * 24));  // one flattened top-k: exactly heads x budget in all
  CHECK(run(no_mass, 24) != a);                         // the mass stage
  // without the mass stage (which at small budgets takes the whole budget): the pooling, the clamp
  defensive::params k1 = no_mass, nc = no_mass;
  k1.kernel = 1;
  nc.clamp_at_mean = false;
  CHECK(run(k1, 24) != run(no_mass, 24));
  CHECK(run(nc, 72) != run(no_mass, 72));
  // the share rule moves the threshold where the mass stage does not fill the budget
  defensive::params win = base;
  win.share = defensive::share_rule::none;
  CHECK(run(win, 72) != run(base, 72));
}

TEST_CASE("defensivekv: errors name the parameter, outputs untouched") {
  const kvtest::shape s = shape_of(1, 2, 2, 40, 8, 4, 16);
  kvtest::problem p = kvtest::make_problem(s, 99);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  auto expect_error = [&](kv::presets::defensivekv::params prm, const char* what, kv::layer_inputs<float> in) {
    kv::evictor<kv::presets::defensivekv, kv::cpu::backend> ev(prm);
    const auto lib = kvtest::run_lib(ev, in, kv::budget_request::tokens(10));
    INFO(what);
    REQUIRE_FALSE(lib.st.ok());
    CHECK(std::string(lib.st.message()).find(what) != std::string::npos);
    for (auto x : lib.indptr) CHECK(x == -7);
  };
  auto prm = kv::presets::defensivekv::defaults();
  prm.scorer.kernel = 4;
  expect_error(prm, "scorer.kernel = 4", st.in);
  prm = kv::presets::defensivekv::defaults();
  prm.scorer.mass_threshold = 1.5f;
  expect_error(prm, "scorer.mass_threshold = 1.5", st.in);
  prm = kv::presets::defensivekv::defaults();
  prm.scorer.mass_threshold = std::nanf("");
  expect_error(prm, "scorer.mass_threshold", st.in);
  prm = kv::presets::defensivekv::defaults();
  prm.gqa = kv::gqa_reduction::per_query_head;
  expect_error(prm, "gqa = per_query_head", st.in);
  prm = kv::presets::defensivekv::defaults();
  auto no_wo = st.in;
  no_wo.wo = {};
  expect_error(prm, "wo", no_wo);
  // a sharded layer cannot normalise the value norms over heads held by other ranks: refused at plan time
  kv::evictor<kv::presets::defensivekv, kv::cpu::backend> ev;
  kv::eviction_plan pl;
  kv::plan_options opt;
  opt.sharded = true;
  const kv::status ps = ev.plan(st.in, kv::budget_request::tokens(10), &pl, opt);
  CHECK(ps.code() == kv::errc::not_supported);
  CHECK(std::string(ps.message()).find("sharded") != std::string::npos);
  CHECK_FALSE(pl.valid);
}

TEST_CASE("defensivekv: layer_wide_topk over one layer is the preset's own flattened allocation") {
  // Layer-DefensiveKV's cut (kvevict::layer_wide_topk) over a single layer keeps T = heads x (B - w)
  // candidates by the preset's final scores (maybe_scores): exactly the preset's AdaKV (alpha 0) choice.
  const kvtest::shape s = shape_of(1, 4, 2, 80, 16, 8, 24);
  for (std::uint64_t seed : {11u, 12u, 13u}) {
    kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0);
    kvtest::stored<float> st;
    kvtest::store(p, layout::nhd, st);
    for (std::int32_t B : {16, 30}) {
      kv::evictor<kv::presets::defensivekv, kv::cpu::backend> ev(kv::presets::defensivekv::defaults());
      const auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(B));
      REQUIRE(lib.st.ok());
      kv::layer_wide_topk w;
      REQUIRE(w.reset(1, s.kv_heads).ok());
      std::vector<std::int64_t> len(static_cast<std::size_t>(s.kv_heads), s.cap), sinks(len.size(), 0), recent(len.size(), s.window);
      REQUIRE(w.add_layer(0, lib.scores.data(), s.cap, len.data(), sinks.data(), recent.data()).ok());
      REQUIRE(w.cut(s.kv_heads * (B - s.window)).ok());
      std::vector<std::int32_t> indptr(static_cast<std::size_t>(s.kv_heads + 1)), idx(static_cast<std::size_t>(s.kv_heads * s.cap));
      REQUIRE(w.selection(0, kv::selection_view{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())}).ok());
      CHECK(indptr == lib.indptr);
      CHECK(std::vector<std::int32_t>(idx.begin(), idx.begin() + indptr.back()) ==
            std::vector<std::int32_t>(lib.indices.begin(), lib.indices.begin() + lib.indptr.back()));
    }
  }
}
