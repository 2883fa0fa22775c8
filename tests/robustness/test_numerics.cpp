// SPDX-License-Identifier: Apache-2.0
// Failure kind 3 (low-precision overflow) of /shared/spec/failure-kinds.md: fp16/bf16 inputs
// with large norms, a softmax that puts almost all mass on one token, sentinel values and
// denormals. The library's final scores are compared with naive fp64 references written here
// (double loops over the SAME rounded storage values), and every result must be finite.
#include <doctest/doctest.h>

#include "common/tolerance.hpp"
#include "robustness/robust_common.hpp"

using namespace robust;

namespace {

/// fp64 window attention rows of query head hq of sequence b: A[j][n], n < L (masked = 0).
template <class T>
std::vector<std::vector<double>> ref_attention(const problem<T>& pr, std::int64_t b, std::int64_t hq) {
  const std::int64_t h = hq / pr.sh.G, L = pr.length(b, h), w = std::min(pr.sh.W, L), D = pr.sh.D;
  std::vector<std::vector<double>> A(static_cast<std::size_t>(w), std::vector<double>(static_cast<std::size_t>(L), 0.0));
  for (std::int64_t j = 0; j < w; ++j) {
    const std::int64_t vis = L - w + j + 1;
    std::vector<double> l(static_cast<std::size_t>(vis));
    double mx = -1e308;
    for (std::int64_t n = 0; n < vis; ++n) {
      double acc = 0.0;
      for (std::int64_t d = 0; d < D; ++d)
        acc += static_cast<double>(kvevict::to_float(pr.q.view(b, hq, pr.sh.W - w + j, d))) *
               static_cast<double>(kvevict::to_float(pr.k.view(b, h, n, d)));
      l[static_cast<std::size_t>(n)] = acc / std::sqrt(static_cast<double>(D));
      mx = std::max(mx, l[static_cast<std::size_t>(n)]);
    }
    double z = 0.0;
    for (auto& x : l) z += std::exp(x - mx);
    for (std::int64_t n = 0; n < vis; ++n)
      A[static_cast<std::size_t>(j)][static_cast<std::size_t>(n)] = std::exp(l[static_cast<std::size_t>(n)] - mx) / z;
  }
  return A;
}

/// SnapKV final scores (sum over the window rows, GQA mean, avg-pool k, zero padding counted)
/// over the evictable region [0, N), N = L - W.
template <class T>
std::vector<double> ref_snapkv(const problem<T>& pr, std::int64_t b, std::int64_t h, int kernel) {
  const std::int64_t L = pr.length(b, h), N = L - std::min(pr.sh.W, L);
  std::vector<double> s(static_cast<std::size_t>(L), 0.0);
  for (std::int64_t g = 0; g < pr.sh.G; ++g) {
    const auto A = ref_attention(pr, b, h * pr.sh.G + g);
    for (const auto& row : A)
      for (std::int64_t n = 0; n < L; ++n) s[static_cast<std::size_t>(n)] += row[static_cast<std::size_t>(n)] / static_cast<double>(pr.sh.G);
  }
  std::vector<double> y(static_cast<std::size_t>(L), 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    double acc = 0.0;
    for (std::int64_t j = i - kernel / 2; j <= i + kernel / 2; ++j)
      if (j >= 0 && j < N) acc += s[static_cast<std::size_t>(j)];
    y[static_cast<std::size_t>(i)] = acc / kernel;
  }
  return y;
}

/// ReST-KV "after" LOR scores in value space (tau 1, EMA alpha, no spatial smoothing), GQA
/// mean, in fp64 without cancellation: 1 - a_bar[n] is summed from the OTHER tokens' weights and
/// z - v_n = sum_{m != n} a_bar[m] v_m - (1 - a_bar[n]) v_n.
template <class T>
std::vector<double> ref_lor_after(const problem<T>& pr, std::int64_t b, std::int64_t h, double alpha) {
  const std::int64_t L = pr.length(b, h), w = std::min(pr.sh.W, L), zlim = L - w, D = pr.sh.D;
  std::vector<double> c(static_cast<std::size_t>(w));
  for (std::int64_t j = 0; j < w; ++j)
    c[static_cast<std::size_t>(j)] = j == 0 ? std::pow(1.0 - alpha, static_cast<double>(w - 1))
                                            : alpha * std::pow(1.0 - alpha, static_cast<double>(w - 1 - j));
  auto V = [&](std::int64_t n, std::int64_t d) { return static_cast<double>(kvevict::to_float(pr.v.view(b, h, n, d))); };
  std::vector<double> out(static_cast<std::size_t>(L), 0.0);
  for (std::int64_t g = 0; g < pr.sh.G; ++g) {
    const auto A = ref_attention(pr, b, h * pr.sh.G + g);
    std::vector<double> abar(static_cast<std::size_t>(L), 0.0);
    for (std::int64_t j = 0; j < w; ++j)
      for (std::int64_t n = 0; n < L; ++n) abar[static_cast<std::size_t>(n)] += c[static_cast<std::size_t>(j)] * A[static_cast<std::size_t>(j)][static_cast<std::size_t>(n)];
    for (std::int64_t n = 0; n < zlim; ++n) {
      double one_minus = 0.0;
      for (std::int64_t j = 0; j < w; ++j) {
        double others = 0.0;
        for (std::int64_t m = 0; m < L; ++m)
          if (m != n) others += A[static_cast<std::size_t>(j)][static_cast<std::size_t>(m)];
        one_minus += c[static_cast<std::size_t>(j)] * others;
      }
      double d2 = 0.0;
      for (std::int64_t d = 0; d < D; ++d) {
        double z = 0.0;
        for (std::int64_t m = 0; m < zlim; ++m)
          if (m != n) z += abar[static_cast<std::size_t>(m)] * V(m, d);
        const double diff = z - one_minus * V(n, d);
        d2 += diff * diff;
      }
      const double a = abar[static_cast<std::size_t>(n)];
      out[static_cast<std::size_t>(n)] += (a > 0.0 ? a / one_minus * std::sqrt(d2) : 0.0) / static_cast<double>(pr.sh.G);
    }
  }
  return out;
}

template <class T>
struct tol;
template <>
struct tol<float> {
  static constexpr double rtol = 1e-4, atol = 2e-6;
};
template <>
struct tol<half_t> {
  static constexpr double rtol = 1e-4, atol = 2e-6;  // same: the reference reads the rounded values
};
template <>
struct tol<bfloat16_t> {
  static constexpr double rtol = 1e-4, atol = 2e-6;
};

void check_all_finite(const result& r) {
  for (float x : r.scores) REQUIRE(std::isfinite(x));
}

/// Compare the library's final scores of every row with `ref(b, h)` over the candidates, and the
/// kept candidates with the reference top-k (as sets where separated, else by score sums).
template <class P, class T, class Ref>
void compare_scores(const kvevict::evictor<P, kvevict::cpu::backend>& ev, const problem<T>& pr, const result& r,
                    kvevict::budget_request budget, Ref ref) {
  check_all_finite(r);
  const std::string bad = check_contract(ev, pr, r, budget);
  CHECK_MESSAGE(bad.empty(), bad);
  const contract k = contract::of<P>(ev.params(), pr.in.window(), pr.sh.Hkv, pr.sh.Hkv, budget);
  for (std::int64_t b = 0; b < pr.sh.B; ++b)
    for (std::int64_t h = 0; h < pr.sh.Hkv; ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const std::int64_t L = pr.length(b, h), B = k.base_budget(L);
      if (L <= B) continue;
      const std::int64_t R = k.recent(L, B), c0 = std::min<std::int64_t>(ev.params().selector.num_sink, L), c1 = L - R;
      const std::vector<double> want = ref(b, h);
      const float* lib = r.scores.data() + (b * pr.sh.Hkv + h) * r.seq;
      double worst = 0.0;
      const std::int64_t mis = kvtest::first_mismatch(lib, want, c0, c1, tol<T>::rtol, tol<T>::atol, &worst);
      CAPTURE(worst);
      CHECK_MESSAGE(mis < 0, "first mismatch at slot " << mis << ": lib " << (mis >= 0 ? lib[mis] : 0.0f) << " ref "
                                                       << (mis >= 0 ? want[static_cast<std::size_t>(mis)] : 0.0));
      // kept candidates vs reference top-k
      std::vector<std::int32_t> lib_kept, ref_kept;
      for (std::int32_t i = r.indptr[static_cast<std::size_t>(b * pr.sh.Hkv + h)]; i < r.indptr[static_cast<std::size_t>(b * pr.sh.Hkv + h + 1)]; ++i) {
        const std::int32_t s = r.indices[static_cast<std::size_t>(i)];
        if (s >= c0 && s < c1) lib_kept.push_back(s);
      }
      // Reference top-k: every candidate by decreasing reference score (stable: ties keep slot order),
      // cut to as many as the library kept.
      for (std::int64_t t = c0; t < c1; ++t) ref_kept.push_back(static_cast<std::int32_t>(t));
      std::stable_sort(ref_kept.begin(), ref_kept.end(), [&](std::int32_t x, std::int32_t y) {
        return want[static_cast<std::size_t>(x)] > want[static_cast<std::size_t>(y)];
      });
      REQUIRE(lib_kept.size() <= ref_kept.size());
      ref_kept.resize(lib_kept.size());
      const auto sc = kvtest::compare_kept_candidates(lib_kept, ref_kept, want, c0, c1, tol<T>::rtol, tol<T>::atol);
      CHECK_MESSAGE(sc.ok, sc.why);
    }
}

/// Scale query rows so that the window attention is nearly one-hot on key `hot` of every head
/// with a logit gap of about `gap` (keys: hot = +u, others random small; queries = c u).
template <class T>
void make_dominant(problem<T>& pr, std::int64_t hot, double gap, std::uint64_t seed) {
  kvtest::rng r(seed);
  const std::int64_t D = pr.sh.D;
  for (std::int64_t b = 0; b < pr.sh.B; ++b)
    for (std::int64_t h = 0; h < pr.sh.Hkv; ++h) {
      const std::int64_t L = pr.length(b, h);
      for (std::int64_t n = 0; n < L; ++n)
        for (std::int64_t d = 0; d < D; ++d)
          pr.k.at(b, h, n, d) = kvevict::from_float<T>(n == hot ? (d == 0 ? 1.0f : 0.0f) : static_cast<float>(0.05 * r.normal()));
      for (std::int64_t g = 0; g < pr.sh.G; ++g)
        for (std::int64_t j = 0; j < pr.sh.W; ++j)
          for (std::int64_t d = 0; d < D; ++d)
            pr.q.at(b, h * pr.sh.G + g, j, d) =
                kvevict::from_float<T>(d == 0 ? static_cast<float>(gap * std::sqrt(static_cast<double>(D))) : static_cast<float>(0.05 * r.normal()));
    }
}

shape num_shape() {
  shape s;
  s.B = 2;
  s.Hkv = 2;
  s.G = 2;
  s.S = 48;
  s.W = 8;
  s.D = 16;
  s.layout = kvevict::kv_layout::nhd;
  s.pad = 1;
  return s;
}

}  // namespace

using lor_after = kvevict::eviction_policy<kvevict::scorers::output_reconstruction, kvevict::temporal::ema, kvevict::spatial::none>;

TEST_CASE_TEMPLATE("kind 3: SnapKV scores of large-norm fp16/bf16/fp32 inputs match fp64", T, float, half_t, bfloat16_t) {
  kvevict::evictor<kvevict::presets::snapkv, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(20);
  // Magnitudes: ordinary, large (one-hot softmax), near the fp16 maximum, beyond fp32 logits (bf16 only).
  std::vector<float> scales = {1.0f, 30.0f, 200.0f};
  if (std::is_same<T, bfloat16_t>::value || std::is_same<T, float>::value) scales.push_back(1.0e20f);
  for (float scale : scales) {
    CAPTURE(type_name<T>());
    CAPTURE(scale);
    problem<T> pr;
    pr.init(num_shape(), 31, scale);
    const result r = run_evictor(ev, pr.in, budget);
    REQUIRE_MESSAGE(r.st.ok(), r.st.message());
    compare_scores(ev, pr, r, budget, [&](std::int64_t b, std::int64_t h) { return ref_snapkv(pr, b, h, 5); });
  }
  // fp16 maximum as a sentinel inside the valid keys (finite: a valid, finite result).
  if (std::is_same<T, half_t>::value) {
    problem<T> pr;
    pr.init(num_shape(), 32);
    pr.k.at(0, 1, 7, 3) = kvevict::from_float<T>(65504.0f);
    pr.k.at(1, 0, 2, 0) = kvevict::from_float<T>(-65504.0f);
    const result r = run_evictor(ev, pr.in, budget);
    REQUIRE(r.st.ok());
    compare_scores(ev, pr, r, budget, [&](std::int64_t b, std::int64_t h) { return ref_snapkv(pr, b, h, 5); });
  }
}

TEST_CASE_TEMPLATE("kind 3: ReST-KV LOR with a dominating token is finite and matches fp64", T, float, half_t, bfloat16_t) {
  auto params = lor_after::defaults();
  params.scorer.use_wo = false;  // value space: the reference needs no W_O
  kvevict::evictor<lor_after, kvevict::cpu::backend> ev(params);
  const auto budget = kvevict::budget_request::tokens(16);
  for (double gap : {0.0, 5.0, 40.0, 150.0}) {
    CAPTURE(type_name<T>());
    CAPTURE(gap);
    problem<T> pr;
    pr.init(num_shape(), 33);
    if (gap > 0.0) make_dominant(pr, 13, gap, 34);
    const result r = run_evictor(ev, pr.in, budget);
    REQUIRE_MESSAGE(r.st.ok(), r.st.message());
    compare_scores(ev, pr, r, budget, [&](std::int64_t b, std::int64_t h) { return ref_lor_after(pr, b, h, 0.3); });
    if (gap >= 40.0) {
      // The dominating token is the most important one: kept, with the largest finite score.
      for (std::int64_t row = 0; row < r.rows; ++row) {
        const auto kept = r.row(row);
        CHECK(std::find(kept.begin(), kept.end(), 13) != kept.end());
        const float* sc = r.scores.data() + row * r.seq;
        CHECK(sc[13] > 0.0f);
        for (std::int64_t n = 0; n < 40; ++n) CHECK(sc[n] <= sc[13]);
      }
    }
  }
}

TEST_CASE_TEMPLATE("kind 3: every preset stays finite on huge, tiny and denormal inputs", P, KVEVICT_ROBUST_PRESETS) {
  for_each_storage_type([](auto tag) {
    using T = typename decltype(tag)::type;
    const float denorm = std::is_same<T, half_t>::value ? 6.0e-8f : std::numeric_limits<float>::denorm_min() * 8.0f;
    const float big = std::is_same<T, half_t>::value ? 8000.0f : 1.0e30f;  // fp16: 8 sigma < 65504
    for (float scale : {big, denorm, 1.0e-3f}) {
      CAPTURE(preset_name<P>());
      CAPTURE(type_name<T>());
      CAPTURE(scale);
      problem<T> pr;
      pr.init(num_shape(), 35, scale);
      // Values as large as the keys (the reconstruction distance must not overflow either).
      for (std::int64_t b = 0; b < pr.sh.B; ++b)
        for (std::int64_t h = 0; h < pr.sh.Hkv; ++h)
          for (std::int64_t n = 0; n < pr.sh.S; ++n)
            for (std::int64_t d = 0; d < pr.sh.D; ++d)
              pr.v.at(b, h, n, d) = kvevict::from_float<T>(kvevict::to_float(pr.k.at(b, h, n, d)) * 0.5f);
      set_layer<P>(pr);
      kvevict::evictor<P, kvevict::cpu::backend> ev;
      const auto budget = kvevict::budget_request::tokens(std::max(min_tokens_budget<P>(P::defaults(), 8), 16));
      const result r = run_evictor(ev, pr.in, budget);
      REQUIRE_MESSAGE(r.st.ok(), r.st.message());
      check_all_finite(r);
      const std::string bad = check_contract(ev, pr, r, budget);
      CHECK_MESSAGE(bad.empty(), bad);
    }
  });
}

TEST_CASE("kind 3: NaN and inf in the valid region are reported with coordinates; pads are never scanned") {
  kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(16);
  struct where {
    const char* tensor;
    float value;
    const char* text;
  };
  const where cases[] = {{"keys", std::numeric_limits<float>::quiet_NaN(), "keys(b=1, h=0, s=20, d=3) = nan"},
                         {"values", std::numeric_limits<float>::infinity(), "values(b=1, h=0, s=20, d=3) = inf"},
                         {"queries", -std::numeric_limits<float>::infinity(), "queries(b=1, h=0, s=5, d=3) = -inf"},
                         {"wo", std::numeric_limits<float>::quiet_NaN(), "wo_factor(0, 1, 2) is not finite"}};
  for (const auto& c : cases) {
    CAPTURE(c.tensor);
    problem<half_t> pr;
    shape s = num_shape();
    s.lengths = {48, 48, 30, 30};
    pr.init(s, 36);
    if (std::string(c.tensor) == "keys") pr.k.at(1, 0, 20, 3) = kvevict::from_float<half_t>(c.value);
    if (std::string(c.tensor) == "values") pr.v.at(1, 0, 20, 3) = kvevict::from_float<half_t>(c.value);
    if (std::string(c.tensor) == "queries") pr.q.at(1, 0, 5, 3) = kvevict::from_float<half_t>(c.value);
    if (std::string(c.tensor) == "wo") pr.wo[0 * 16 * 16 + 1 * 16 + 2] = c.value;
    const auto r = run_evictor(ev, pr.in, budget);
    CHECK(r.st.code() == kvevict::errc::non_finite_input);
    CHECK_MESSAGE(std::string(r.st.message()).find(c.text) != std::string::npos, r.st.message());
  }
  // The same non-finite values in pad slots (slot >= length) are never read.
  problem<half_t> pr;
  shape s = num_shape();
  s.lengths = {48, 48, 30, 30};
  pr.init(s, 37);  // pads are NaN by default
  pr.k.at(1, 0, 40, 3) = kvevict::from_float<half_t>(std::numeric_limits<float>::infinity());
  const auto r = run_evictor(ev, pr.in, budget);
  REQUIRE_MESSAGE(r.st.ok(), r.st.message());
}

TEST_CASE("kind 3: extreme adaptive-window parameters stay defined (tiny beta, huge k_min)") {
  // t / beta overflows every integer type for a tiny beta: the kernel and shift must saturate.
  for (float beta : {1.0e-30f, std::numeric_limits<float>::denorm_min(), 1.0f, 3.0e38f}) {
    for (int k_min : {1, 5, 2147483647}) {
      CAPTURE(beta);
      CAPTURE(k_min);
      auto p = kvevict::presets::restkv::defaults();
      p.spatial.beta = beta;
      p.spatial.k_min = k_min;
      kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev(p);
      problem<float> pr;
      pr.init(num_shape(), 38);
      const auto budget = kvevict::budget_request::tokens(16);
      const result r = run_evictor(ev, pr.in, budget);
      REQUIRE_MESSAGE(r.st.ok(), r.st.message());
      check_all_finite(r);
      CHECK(check_contract(ev, pr, r, budget) == "");
    }
  }
}

namespace {

/// Multiply every valid value of `pr` by 2^e (exact).
template <class T>
void scale_values_pow2(problem<T>& pr, int e) {
  for (std::int64_t b = 0; b < pr.sh.B; ++b)
    for (std::int64_t h = 0; h < pr.sh.Hkv; ++h)
      for (std::int64_t t = 0; t < pr.length(b, h); ++t)
        for (std::int64_t d = 0; d < pr.sh.D; ++d) pr.v.at(b, h, t, d) = std::ldexp(pr.v.at(b, h, t, d), e);
}

/// Exponent e with 2^(e-1) <= max |valid value| < 2^e.
template <class T>
int value_exponent(const problem<T>& pr) {
  float vmax = 0.0f;
  for (std::int64_t b = 0; b < pr.sh.B; ++b)
    for (std::int64_t h = 0; h < pr.sh.Hkv; ++h)
      for (std::int64_t t = 0; t < pr.length(b, h); ++t)
        for (std::int64_t d = 0; d < pr.sh.D; ++d) vmax = std::max(vmax, std::fabs(pr.v.view(b, h, t, d)));
  int e = 0;
  std::frexp(vmax, &e);
  return e;
}

/// Scale the values by 2^shift (shift chosen so that max |v| lands in [2^(top-1), 2^top)) and
/// check that policy P selects exactly the same tokens, with primary scores scaled by
/// 2^(score_power * shift): the scores are homogeneous in V and every step commutes with an exact
/// power-of-two scale.
template <class P>
void check_value_scale(const typename P::params& params, int top, int score_power) {
  problem<float> pr;
  pr.init(num_shape(), 39);
  kvevict::evictor<P, kvevict::cpu::backend> ev(params);
  const auto budget = kvevict::budget_request::tokens(16);
  const result r1 = run_evictor(ev, pr.in, budget);
  REQUIRE_MESSAGE(r1.st.ok(), r1.st.message());
  const int shift = top - value_exponent(pr);
  scale_values_pow2(pr, shift);
  CHECK(value_exponent(pr) == top);
  const result r2 = run_evictor(ev, pr.in, budget);
  REQUIRE_MESSAGE(r2.st.ok(), r2.st.message());
  check_all_finite(r2);
  CHECK(r2.indptr == r1.indptr);
  CHECK(r2.indices == r1.indices);
  std::int64_t nonzero = 0;
  for (std::size_t i = 0; i < r1.scores.size(); ++i) {
    const double want = std::ldexp(static_cast<double>(r1.scores[i]), score_power * shift);
    CHECK(static_cast<double>(r2.scores[i]) == doctest::Approx(want).epsilon(1e-6));
    nonzero += r2.scores[i] != 0.0f;
  }
  CHECK(nonzero > 0);
}

}  // namespace

TEST_CASE("kind 3: values up to FLT_MAX keep the selection of the same values at scale 1 (ReST-KV LOR, CriticalKV)") {
  // ReST-KV's LOR in value space, max |v| in [2^127, FLT_MAX]: the power-of-two rescaling of V must
  // not form 2^128 in fp32 (it did: inf, every score 0, the lowest slots kept).
  auto lor = lor_after::defaults();
  lor.scorer.use_wo = false;
  check_value_scale<lor_after>(lor, 128, 1);
  check_value_scale<lor_after>(lor, 60, 1);
  // CriticalKV: the value term ||v W_O^h||_1 is rescaled the same way (primary scores do not
  // depend on V: score_power 0). 2^100 keeps ||v W_O||_1 below FLT_MAX.
  check_value_scale<kvevict::presets::criticalkv>(kvevict::presets::criticalkv::defaults(), 100, 0);
  check_value_scale<kvevict::presets::criticalkv>(kvevict::presets::criticalkv::defaults(), -60, 0);
}
