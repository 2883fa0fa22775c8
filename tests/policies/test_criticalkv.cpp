// CriticalKV (Feng et al. 2025, arXiv 2502.03805) on the CPU backend:
// scorers::attention_value_norm + selectors::two_stage (presets::criticalkv, presets::critical_adakv).
//  - a hand-computed case where every stage is visible (integer attention odds, diagonal W_O);
//  - seeded random problems in float / half / bf16 against the independent fp64 reference
//    (tests/reference: naive window attention, temporal mean, avg pooling, GQA reduction, the
//    projection through the full W_O^h with an L1 norm, AdaKV budgets, the two stages by full sort)
//    over several shapes, GQA ratios and reductions, layouts, lengths and budgets;
//  - stage 1 and stage 2 each shown to change the selection (non-vacuity);
//  - parameter and input errors (first_stage_ratio, eps, missing / misshaped / non-finite W_O);
//  - W_O read through arbitrary strides.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/harness.hpp"

using kvevict::bfloat16_t;
using kvevict::half_t;
using kvtest::layout;
using kvtest::ref_config;
namespace kv = kvevict;

namespace {

template <class T>
const char* type_name() {
  return kv::to_string(kv::dtype_of<T>::value);
}

/// Reference configuration of presets::criticalkv (temporal mean, avg pool 5, GQA mean).
ref_config critical_cfg() {
  ref_config c;
  c.scorer = kvtest::scorer_kind::attention_value_norm;
  c.temporal = kvref::temporal_kind::mean;
  c.spatial = kvtest::spatial_kind::avg_pool;
  c.kernel = 5;
  c.first_stage_ratio = 0.5;
  c.eps = static_cast<double>(1e-4f);
  return c;
}

struct critical_stats {
  int exact_rows = 0;      ///< rows whose kept set was compared exactly with the reference
  int ambiguous_rows = 0;  ///< rows with a near-tie at a stage threshold (structural checks only)
};

/// Compare a library run of a two-stage policy with the reference rows. Counts, order, positions,
/// protected tokens, primary scores (within tolerance) always; then the selection:
///  - the stage-1 set must be kept whenever the reference's k1-th and (k1+1)-th candidate scores
///    are separated by more than the score tolerance (else the row is a near-tie: skipped);
///  - the whole kept set must equal the reference's when the stage-2 threshold is separated too;
///    at a stage-2 near-tie every slot of the symmetric difference must sit within the tolerance
///    of the stage-2 threshold.
std::string compare_critical(const kvtest::lib_result& lib, const std::vector<kvtest::ref_row>& ref, double eps,
                             critical_stats* stats, double rtol = kvtest::score_rtol, double atol = kvtest::score_atol) {
  if (!lib.st.ok()) return std::string("library failed: ") + lib.st.message();
  if (static_cast<std::int64_t>(ref.size()) != lib.rows) return "row count differs";
  for (std::int64_t r = 0; r < lib.rows; ++r) {
    const auto& R = ref[static_cast<std::size_t>(r)];
    const std::string at = "row " + std::to_string(r) + ": ";
    const auto kept = lib.kept(r);
    if (static_cast<std::int64_t>(kept.size()) != std::min(R.budget, R.plan.L))
      return at + "kept " + std::to_string(kept.size()) + " != budget " + std::to_string(std::min(R.budget, R.plan.L));
    for (std::size_t i = 1; i < kept.size(); ++i)
      if (kept[i] <= kept[i - 1]) return at + "indices not strictly ascending";
    for (std::size_t i = 0; i < kept.size(); ++i)
      if (lib.positions[static_cast<std::size_t>(lib.indptr[static_cast<std::size_t>(r)]) + i] != kept[i])
        return at + "positions != slots";
    if (R.plan.pass || R.budget >= R.plan.L) {
      if (kept != R.kept) return at + "head with budget >= length does not keep everything in order";
      continue;
    }
    for (std::int64_t i = 0; i < R.plan.sinks; ++i)
      if (!std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(i))) return at + "sink lost";
    for (std::int64_t i = R.plan.L - R.plan.recent; i < R.plan.L; ++i)
      if (!std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(i))) return at + "recent token lost";
    const std::int64_t c0 = R.plan.sinks, c1 = R.plan.L - R.plan.recent;
    double scale_a = 0.0;
    for (std::int64_t i = 0; i < c1; ++i) scale_a = std::max(scale_a, std::fabs(R.scores[static_cast<std::size_t>(i)]));
    double worst = 0.0;
    const std::int64_t bad = kvtest::first_mismatch(lib.row_scores(r), R.scores, c0, c1, rtol, atol, &worst, scale_a);
    if (bad >= 0)
      return at + "primary score " + std::to_string(bad) + ": lib " + std::to_string(lib.row_scores(r)[bad]) + " ref " +
             std::to_string(R.scores[static_cast<std::size_t>(bad)]);
    // Stage 1.
    const std::int64_t k1 = static_cast<std::int64_t>(R.stage1.size());
    const std::int64_t k = static_cast<std::int64_t>(kept.size()) - R.plan.sinks - R.plan.recent;
    std::vector<double> sa;
    for (std::int64_t i = c0; i < c1; ++i) sa.push_back(R.scores[static_cast<std::size_t>(i)]);
    std::sort(sa.begin(), sa.end(), [](double x, double y) { return x > y; });
    auto tol_a = [&](double x) { return rtol * std::fabs(x) + atol * scale_a; };
    if (k1 > 0 && k1 < static_cast<std::int64_t>(sa.size()) &&
        !(sa[static_cast<std::size_t>(k1 - 1)] - sa[static_cast<std::size_t>(k1)] > 2.0 * tol_a(sa[static_cast<std::size_t>(k1 - 1)]))) {
      ++stats->ambiguous_rows;
      continue;
    }
    for (auto i : R.stage1)
      if (!std::binary_search(kept.begin(), kept.end(), i)) return at + "stage-1 slot " + std::to_string(i) + " not kept";
    // Stage 2 over the candidates stage 1 left.
    std::vector<std::int32_t> pool;
    double umax = 0.0;
    for (std::int64_t i = c0; i < c1; ++i)
      if (!std::binary_search(R.stage1.begin(), R.stage1.end(), static_cast<std::int32_t>(i))) {
        pool.push_back(static_cast<std::int32_t>(i));
        umax = std::max(umax, std::fabs(R.secondary[static_cast<std::size_t>(i)]));
      }
    auto crit = [&](std::int32_t i) {
      return (R.scores[static_cast<std::size_t>(i)] + eps) * R.secondary[static_cast<std::size_t>(i)];
    };
    // the fp32 product inherits the primary's absolute tolerance times u, and both relative ones
    auto tol_c = [&](double x) { return 2.0 * rtol * std::fabs(x) + 2.0 * atol * scale_a * umax; };
    std::vector<double> sc;
    for (auto i : pool) sc.push_back(crit(i));
    std::sort(sc.begin(), sc.end(), [](double x, double y) { return x > y; });
    const std::int64_t k2 = k - k1;
    const bool sep2 = !(k2 > 0 && k2 < static_cast<std::int64_t>(sc.size())) ||
                      sc[static_cast<std::size_t>(k2 - 1)] - sc[static_cast<std::size_t>(k2)] > 2.0 * tol_c(sc[static_cast<std::size_t>(k2 - 1)]);
    if (sep2) {
      if (kept != R.kept) return at + "kept set differs from the reference although both stage thresholds are separated";
      ++stats->exact_rows;
      continue;
    }
    ++stats->ambiguous_rows;
    const double thr = sc[static_cast<std::size_t>(k2 - 1)];
    std::vector<std::int32_t> diff;
    std::set_symmetric_difference(kept.begin(), kept.end(), R.kept.begin(), R.kept.end(), std::back_inserter(diff));
    for (auto i : diff)
      if (!(std::fabs(crit(i) - thr) <= 2.0 * tol_c(thr))) return at + "slot " + std::to_string(i) + " differs away from the stage-2 threshold";
  }
  return "";
}

/// presets::criticalkv-shaped policy P on `seeds` random problems of shape s vs the reference.
template <class P, class T>
critical_stats check_critical(const typename P::params& params, const ref_config& cfg, const kvtest::shape& s,
                              kv::budget_request budget, std::uint64_t seed0, int seeds, layout lay = layout::nhd,
                              std::vector<std::int32_t> lens = {}) {
  critical_stats stats;
  for (int i = 0; i < seeds; ++i) {
    const std::uint64_t seed = seed0 + static_cast<std::uint64_t>(i);
    kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, lens);
    kvtest::quantize<T>(p);
    kvtest::quantize_wo<T>(p);
    kvtest::stored<T> st;
    kvtest::store(p, lay, st);
    kv::evictor<P, kv::cpu::backend> ev(params);
    const auto lib = kvtest::run_lib(ev, st.in, budget);
    auto c = cfg;
    c.keep_tokens = budget.keep_tokens;
    c.keep_fraction = budget.keep_fraction;
    const auto ref = kvtest::reference_run(p, c);
    CAPTURE(seed);
    CAPTURE(type_name<T>());
    CAPTURE(kvtest::to_string(lay));
    CAPTURE(budget.keep_tokens);
    CAPTURE(budget.keep_fraction);
    CAPTURE(s.kv_heads);
    CAPTURE(s.group);
    CAPTURE(s.cap);
    CAPTURE(s.hidden);
    const std::string diff = compare_critical(lib, ref, c.eps, &stats);
    CHECK_MESSAGE(diff.empty(), diff);
    // non-vacuity: inputs non-zero and something evicted
    double vsum = 0.0, wsum = 0.0;
    for (std::size_t j = 0; j < p.V.size(); ++j)
      if (std::isfinite(p.V[j])) vsum += std::fabs(p.V[j]);
    for (double x : p.WO) wsum += std::fabs(x);
    CHECK(vsum > 0.0);
    CHECK(wsum > 0.0);
    std::int64_t total = 0;
    const std::int64_t H = ev.out_heads(st.in);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < H; ++h) total += p.length(b, h / (H / s.kv_heads));
    CHECK(lib.indptr.back() < total);
  }
  return stats;
}

/// The hand-computed problem: one sequence, one KV head, G = 1, d = 2, hidden C = 2, L = 8,
/// window 1 (the last token, protected). The window query q = (sqrt 2, 0) against keys
/// k_n = (ln m_n, 0) gives logits ln m_n, so the attention of the last query is a_n = m_n / 24
/// with m = 1 6 2 5 3 4 1 2. W_O^h = diag(2, 3) ([out][in] (2, 2)) and v_n = (u_n / 4, u_n / 6),
/// so ||v_n W_O^h||_1 = u_n with u = 10 0.1 8 1 9 1 1 1.
struct hand_problem {
  std::vector<float> q, k, v, wo;
  kv::layer_inputs<float> in;
  hand_problem() {
    const double m[8] = {1, 6, 2, 5, 3, 4, 1, 2};
    const double u[8] = {10, 0.1, 8, 1, 9, 1, 1, 1};
    q = {static_cast<float>(std::sqrt(2.0)), 0.0f};
    for (int n = 0; n < 8; ++n) {
      k.push_back(static_cast<float>(std::log(m[n])));
      k.push_back(0.0f);
      v.push_back(static_cast<float>(u[n] / 4.0));
      v.push_back(static_cast<float>(u[n] / 6.0));
    }
    wo = {2.0f, 0.0f, 0.0f, 3.0f};
    in.queries = kv::make_query_view<const float>(q.data(), 1, 1, 1, 2, kv::kv_layout::hnd);
    in.keys = kv::make_kv_view<const float>(k.data(), 1, 1, 8, 2, kv::kv_layout::hnd);
    in.values = kv::make_kv_view<const float>(v.data(), 1, 1, 8, 2, kv::kv_layout::hnd);
    in.wo = kv::strided_view<const float, 2>{wo.data(), {2, 2}, {2, 1}};
  }
};

std::vector<std::int32_t> run_hand(const hand_problem& hp, float ratio, float eps, std::vector<float>* scores = nullptr) {
  auto p = kv::presets::criticalkv::defaults();
  p.spatial.kernel = 1;  // no pooling: a is the attention itself
  p.selector.first_stage_ratio = ratio;
  p.selector.eps = eps;
  kv::evictor<kv::presets::criticalkv, kv::cpu::backend> ev(p);
  const auto lib = kvtest::run_lib(ev, hp.in, kv::budget_request::tokens(5));
  REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
  if (scores) *scores = lib.scores;
  return lib.kept(0);
}

}  // namespace

TEST_CASE("CriticalKV hand-computed case: each stage visible") {
  hand_problem hp;
  // Budget 5 = window (1) + k = 4 candidates of slots 0..6.
  //   a*24 = 1 6 2 5 3 4 1; (a + eps) * u ~ a * u = .417 .025 .667 .208 1.125 .167 .042
  //   ratio 0.5: k1 = 2 by a -> {1, 3}; k2 = 2 of {0, 2, 4, 5, 6} by a*u -> {4, 2}
  //   ratio 1  : top 4 by a (SnapKV's rule) -> {1, 3, 5, 4}
  //   ratio 0  : top 4 by a*u -> {4, 2, 0, 3}
  //   ratio 0.3: k1 = floor(1.2) = 1 -> {1}; 3 by a*u of the rest -> {4, 2, 0}
  //   ratio 0.5, eps 1e3: stage 2 ranks by ~ 1e3 u -> {0 (u 10), 4 (u 9)}
  std::vector<float> sc;
  CHECK(run_hand(hp, 0.5f, 1e-4f, &sc) == std::vector<std::int32_t>{1, 2, 3, 4, 7});
  const double m[7] = {1, 6, 2, 5, 3, 4, 1};
  for (int n = 0; n < 7; ++n) CHECK(sc[static_cast<std::size_t>(n)] == doctest::Approx(m[n] / 24.0).epsilon(1e-5));
  CHECK(sc[7] == 0.0f);  // the protected window slot reports 0
  CHECK(run_hand(hp, 1.0f, 1e-4f) == std::vector<std::int32_t>{1, 3, 4, 5, 7});
  CHECK(run_hand(hp, 0.0f, 1e-4f) == std::vector<std::int32_t>{0, 2, 3, 4, 7});
  CHECK(run_hand(hp, 0.3f, 1e-4f) == std::vector<std::int32_t>{0, 1, 2, 4, 7});
  CHECK(run_hand(hp, 0.5f, 1e3f) == std::vector<std::int32_t>{0, 1, 3, 4, 7});
  // The reference's two_stage_select agrees on the exact inputs.
  const kvref::vec a = {1 / 24.0, 6 / 24.0, 2 / 24.0, 5 / 24.0, 3 / 24.0, 4 / 24.0, 1 / 24.0, 2 / 24.0};
  const kvref::vec u = {10, 0.1, 8, 1, 9, 1, 1, 1};
  std::vector<std::int32_t> s1;
  CHECK(kvref::two_stage_select(a, u, 8, 5, 0, 1, 0.5, 1e-4, &s1) == std::vector<std::int32_t>{1, 2, 3, 4, 7});
  CHECK(s1 == std::vector<std::int32_t>{1, 3});
  CHECK(kvref::two_stage_select(a, u, 8, 5, 0, 1, 0.0, 1e-4) == std::vector<std::int32_t>{0, 2, 3, 4, 7});
  // The value term of the reference: ||v W_O^h||_1 through the full projection.
  kvref::mat W(2, 2);
  W(0, 0) = 2, W(1, 1) = 3;
  const double v4[2] = {9 / 4.0, 9 / 6.0};
  CHECK(kvref::proj_l1_norm(v4, 2, W) == doctest::Approx(9.0));
  // A sink moves every candidate range: num_sink 1 protects slot 0, k = 3: stage 1 {1}, stage 2 {4, 2}.
  auto p = kv::presets::criticalkv::defaults();
  p.spatial.kernel = 1;
  p.selector.num_sink = 1;
  kv::evictor<kv::presets::criticalkv, kv::cpu::backend> ev(p);
  const auto lib = kvtest::run_lib(ev, hp.in, kv::budget_request::tokens(5));
  REQUIRE(lib.st.ok());
  CHECK(lib.kept(0) == std::vector<std::int32_t>{0, 1, 2, 4, 7});
}

TEST_CASE_TEMPLATE("CriticalKV preset vs the fp64 reference (shapes, GQA, layouts, budgets)", T, float, half_t, bfloat16_t) {
  struct cfg_case {
    std::int64_t batch, kv_heads, group, cap, d, window, hidden;
  };
  const cfg_case shapes[] = {{2, 2, 2, 64, 16, 8, 48}, {1, 1, 1, 37, 8, 4, 24}, {1, 2, 4, 129, 32, 16, 64}, {2, 3, 1, 27, 8, 3, 5}};
  int exact = 0;
  std::uint64_t seed = 100;
  for (const auto& sh : shapes) {
    kvtest::shape s;
    s.batch = sh.batch, s.kv_heads = sh.kv_heads, s.group = sh.group, s.cap = sh.cap, s.d = sh.d, s.window = sh.window,
    s.hidden = sh.hidden;
    for (auto budget : {kv::budget_request::tokens(static_cast<std::int32_t>(s.window + 6)),
                        kv::budget_request::tokens(static_cast<std::int32_t>(s.cap / 2)), kv::budget_request::fraction(0.3)}) {
      const auto st = check_critical<kv::presets::criticalkv, T>(kv::presets::criticalkv::defaults(), critical_cfg(), s, budget,
                                                                 seed, 2, seed % 2 ? layout::hnd : layout::padded);
      exact += st.exact_rows;
      seed += 10;
    }
  }
  MESSAGE("rows compared as exact sets: " << exact);
  CHECK(exact >= 40);
}

TEST_CASE("CriticalKV: GQA reductions, stage ratios, eps, sinks, ragged lengths and AdaKV budgets vs reference") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 3, s.cap = 70, s.d = 16, s.window = 6, s.hidden = 40;
  int exact = 0;
  // GQA: the value norms are reduced by the same rule as the scores.
  for (auto g : {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head, kv::gqa_reduction::layer_mean}) {
    CAPTURE(kv::to_string(g));
    auto p = kv::presets::criticalkv::defaults();
    p.gqa = g;
    auto c = critical_cfg();
    c.gqa = g == kv::gqa_reduction::mean ? kvref::gqa_kind::mean
            : g == kv::gqa_reduction::max ? kvref::gqa_kind::max
            : g == kv::gqa_reduction::per_query_head ? kvref::gqa_kind::per_query_head
                                                     : kvref::gqa_kind::layer_mean;
    exact += check_critical<kv::presets::criticalkv, float>(p, c, s, kv::budget_request::tokens(24), 300, 2).exact_rows;
  }
  // Ratios and eps, with two sinks and a recent count different from the window.
  for (float ratio : {0.0f, 0.25f, 0.5f, 0.8f, 1.0f}) {
    for (float eps : {0.0f, 1e-4f, 0.05f}) {
      CAPTURE(ratio);
      CAPTURE(eps);
      auto p = kv::presets::criticalkv::defaults();
      p.selector.first_stage_ratio = ratio;
      p.selector.eps = eps;
      p.selector.num_sink = 2;
      p.selector.num_recent = 4;
      auto c = critical_cfg();
      c.first_stage_ratio = static_cast<double>(ratio);
      c.eps = static_cast<double>(eps);
      c.num_sink = 2;
      c.num_recent = 4;
      exact += check_critical<kv::presets::criticalkv, float>(p, c, s, kv::budget_request::tokens(23), 400, 1, layout::hnd).exact_rows;
    }
  }
  // Ragged per-head lengths (one head shorter than its budget: pass-through).
  exact += check_critical<kv::presets::criticalkv, half_t>(kv::presets::criticalkv::defaults(), critical_cfg(), s,
                                                           kv::budget_request::fraction(0.35), 500, 2, layout::nhd, {70, 41, 5, 62})
               .exact_rows;
  // CriticalAdaKV: AdaKV budgets on the pooled attention, then the two stages per head.
  {
    auto c = critical_cfg();
    c.budgeter = kvtest::budget_kind::adakv;
    c.adakv_alpha = static_cast<double>(0.2f);
    kvtest::shape s4 = s;
    s4.kv_heads = 4, s4.group = 1;
    exact += check_critical<kv::presets::critical_adakv, float>(kv::presets::critical_adakv::defaults(), c, s4,
                                                                kv::budget_request::tokens(20), 600, 3)
                 .exact_rows;
    exact += check_critical<kv::presets::critical_adakv, bfloat16_t>(kv::presets::critical_adakv::defaults(), c, s4,
                                                                     kv::budget_request::fraction(0.25), 610, 2, layout::interleaved)
                 .exact_rows;
  }
  MESSAGE("rows compared as exact sets: " << exact);
  CHECK(exact >= 40);
}

TEST_CASE("CriticalKV: stage 2 and stage 1 each change the selection (non-vacuity)") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 80, s.d = 16, s.window = 8, s.hidden = 32;
  const auto budget = kv::budget_request::tokens(28);
  int differs_from_attention = 0, differs_from_value_only = 0, rows = 0;
  for (std::uint64_t seed = 700; seed < 704; ++seed) {
    kvtest::problem p = kvtest::make_problem(s, seed);
    // values of very different norms, so the value term matters
    for (std::size_t i = 0; i < p.V.size(); ++i) p.V[i] *= 0.2 + 2.0 * static_cast<double>((i / static_cast<std::size_t>(s.d)) % 5);
    kvtest::stored<float> st;
    kvtest::store(p, layout::nhd, st);
    auto run = [&](float ratio) {
      auto prm = kv::presets::criticalkv::defaults();
      prm.selector.first_stage_ratio = ratio;
      kv::evictor<kv::presets::criticalkv, kv::cpu::backend> ev(prm);
      auto lib = kvtest::run_lib(ev, st.in, budget);
      REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
      return lib;
    };
    const auto both = run(0.5f), attention_only = run(1.0f), value_only = run(0.0f);
    // ratio 1 is exactly SnapKV's rule on the same (mean, avg-pool 5) attention scores
    using snap_mean = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::mean, kv::spatial::avg_pool>;
    kv::evictor<snap_mean, kv::cpu::backend> snap;
    const auto sl = kvtest::run_lib(snap, st.in, budget);
    REQUIRE(sl.st.ok());
    CHECK(sl.indices == attention_only.indices);
    CHECK(sl.indptr == attention_only.indptr);
    for (std::int64_t r = 0; r < both.rows; ++r) {
      ++rows;
      if (both.kept(r) != attention_only.kept(r)) ++differs_from_attention;
      if (both.kept(r) != value_only.kept(r)) ++differs_from_value_only;
      // stage 1: the top floor(0.5 k) candidates by the primary score are always kept
      const auto kept = both.kept(r);
      const float* a = both.row_scores(r);
      std::vector<std::int32_t> cand;
      for (std::int32_t n = 0; n < s.cap - s.window; ++n) cand.push_back(n);
      std::stable_sort(cand.begin(), cand.end(), [a](std::int32_t x, std::int32_t y) { return a[x] > a[y]; });
      const std::int64_t k1 = (28 - s.window) / 2;
      for (std::int64_t i = 0; i < k1; ++i)
        CHECK(std::binary_search(kept.begin(), kept.end(), cand[static_cast<std::size_t>(i)]));
    }
  }
  MESSAGE("rows " << rows << ", differ from attention-only " << differs_from_attention << ", from value-only "
                  << differs_from_value_only);
  CHECK(differs_from_attention > 0);   // the value-norm stage changes what SnapKV's rule keeps
  CHECK(differs_from_value_only > 0);  // stage 1 changes what ranking by (a + eps) u alone keeps
}

TEST_CASE("CriticalKV: W_O read through arbitrary strides gives the same selection") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 50, s.d = 8, s.window = 4, s.hidden = 20;
  kvtest::problem p = kvtest::make_problem(s, 900);
  kvtest::stored<float> st;
  kvtest::store(p, layout::hnd, st);
  kv::evictor<kv::presets::criticalkv, kv::cpu::backend> ev;
  const auto budget = kv::budget_request::tokens(18);
  const auto a = kvtest::run_lib(ev, st.in, budget);
  REQUIRE(a.st.ok());
  // W_O stored transposed ([in][out]) with a padded leading dimension; bf16 is not mixed in.
  const std::int64_t C = s.hidden, N = s.q_heads() * s.d, ld = C + 3;
  std::vector<float> wt(static_cast<std::size_t>(N * ld), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t i = 0; i < N; ++i) wt[static_cast<std::size_t>(i * ld + c)] = static_cast<float>(p.WO[static_cast<std::size_t>(c * N + i)]);
  auto in = st.in;
  in.wo = kv::strided_view<const float, 2>{wt.data(), {C, N}, {1, ld}};
  const auto b = kvtest::run_lib(ev, in, budget);
  REQUIRE_MESSAGE(b.st.ok(), b.st.message());
  CHECK(a.indptr == b.indptr);
  CHECK(a.indices == b.indices);
}

TEST_CASE("CriticalKV: bad parameters and missing or broken W_O are clear errors") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 30, s.d = 8, s.window = 4, s.hidden = 12;
  kvtest::problem p = kvtest::make_problem(s, 950);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  const auto budget = kv::budget_request::tokens(12);
  auto expect = [&](const kv::presets::criticalkv::params& prm, const kv::layer_inputs<float>& in, kv::errc code, const char* text) {
    kv::evictor<kv::presets::criticalkv, kv::cpu::backend> ev(prm);
    CAPTURE(text);
    std::vector<std::int32_t> indptr(5, -7), idx(64, -7);
    const kv::status r = ev.run(in, budget, kv::selection_view{indptr.data(), idx.data(), nullptr, 64});
    CHECK(r.code() == code);
    CHECK_MESSAGE(std::string(r.message()).find(text) != std::string::npos, r.message());
    CHECK(indptr == std::vector<std::int32_t>(5, -7));  // nothing written on error
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float ratio : {-0.1f, 1.5f, nan, inf}) {
    auto prm = kv::presets::criticalkv::defaults();
    prm.selector.first_stage_ratio = ratio;
    expect(prm, st.in, kv::errc::invalid_argument, "selector.first_stage_ratio");
  }
  for (float eps : {-1e-4f, nan, inf}) {
    auto prm = kv::presets::criticalkv::defaults();
    prm.selector.eps = eps;
    expect(prm, st.in, kv::errc::invalid_argument, "selector.eps");
  }
  {
    auto prm = kv::presets::criticalkv::defaults();
    prm.selector.num_sink = -1;  // the inherited topk checks still apply
    expect(prm, st.in, kv::errc::invalid_argument, "selector.num_sink = -1");
  }
  auto in = st.in;
  in.wo = {};
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::null_pointer, "wo.data is null");
  in = st.in;
  in.wo.extent[1] = s.q_heads() * s.d - 1;
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::shape_mismatch, "wo shape (12, 31)");
  in = st.in;
  in.wo.extent[0] = 0;
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::shape_mismatch, "wo shape (0, 32)");
  in = st.in;
  in.wo.stride[0] = -1;
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::invalid_argument, "wo.stride[0] = -1");
  // the factor of ReST-KV is no substitute: without wo the error names wo
  in = st.in;
  in.wo = {};
  CHECK(in.wo_factor.data != nullptr);
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::null_pointer, "layer_inputs::wo");
  // non-finite weights are found with their coordinates (check_finite), and skipped when off
  std::vector<float> w(st.wot.begin(), st.wot.end());
  w[static_cast<std::size_t>(3 * s.q_heads() * s.d + 5)] = nan;
  in = st.in;
  in.wo.data = w.data();
  expect(kv::presets::criticalkv::defaults(), in, kv::errc::non_finite_input, "wo(3, 5) = nan");
}
