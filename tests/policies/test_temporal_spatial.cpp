// Temporal and spatial smoothers (include/kvevict/policies/temporal.hpp, policies/spatial.hpp,
// backends/cpu/spatial/*.hpp through backends/cpu/smoothers.hpp), without the evictor (no Eigen,
// a cheap translation unit):
//  - temporal: EMA / reversed EMA closed form vs the reference and the recursion, mean, sum,
//    last; alpha validation;
//  - spatial: the adaptive window's kernel/shift rule (the spec's test vectors and random t) and
//    its replicate-padded smoothing, avg pool and max pool vs the reference; parameter checks.
// The smoothers inside the whole pipeline are covered by test_scorers.cpp.
#include <doctest/doctest.h>

#include <kvevict/kvevict.hpp>
#include <kvevict/backends/cpu/smoothers.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "common/tolerance.hpp"
#include "reference/reference.hpp"

// ---- temporal weights ---------------------------------------------------------------------

TEST_CASE("temporal: EMA closed form sums to 1, matches the spec landmarks and the recursion") {
  for (float alpha : {0.05f, 0.3f, 0.5f, 0.9f, 1.0f})
    for (int w : {1, 2, 7, 32, 64}) {
      CAPTURE(alpha);
      CAPTURE(w);
      const kvevict::temporal::ema::params p{alpha};
      const kvevict::temporal::reversed_ema::params pr{alpha};
      const auto ref = kvref::temporal_weights(kvref::temporal_kind::ema, alpha, w);
      const auto rref = kvref::temporal_weights(kvref::temporal_kind::reversed_ema, alpha, w);
      double s = 0.0, sr = 0.0;
      for (int j = 0; j < w; ++j) {
        const double c = kvevict::temporal::ema::weight(p, j, w);
        const double cr = kvevict::temporal::reversed_ema::weight(pr, j, w);
        CHECK(c == doctest::Approx(ref[static_cast<std::size_t>(j)]).epsilon(1e-13));
        CHECK(cr == doctest::Approx(rref[static_cast<std::size_t>(j)]).epsilon(1e-13));
        CHECK(c >= 0.0);
        s += c;
        sr += cr;
        // mean / sum / last
        CHECK(kvevict::temporal::mean::weight({}, j, w) == doctest::Approx(1.0 / w));
        CHECK(kvevict::temporal::sum::weight({}, j, w) == 1.0);
        CHECK(kvevict::temporal::last::weight({}, j, w) == (j == w - 1 ? 1.0 : 0.0));
      }
      CHECK(s == doctest::Approx(1.0).epsilon(1e-12));
      CHECK(sr == doctest::Approx(1.0).epsilon(1e-12));
    }
  const kvevict::temporal::ema::params p{0.3f};
  CHECK(kvevict::temporal::ema::weight(p, 31, 32) == doctest::Approx(0.3).epsilon(1e-7));
  const double oldest = kvevict::temporal::ema::weight(p, 0, 32);
  CHECK(oldest == doctest::Approx(std::pow(1.0 - 0.3, 31)).epsilon(1e-6));
  CHECK(oldest > 1.5e-5);
  CHECK(oldest < 1.7e-5);
  // Equivalence with the recursive accumulator on random rows.
  kvtest::rng r(11);
  for (int w : {1, 3, 32}) {
    kvref::mat X(w, 17);
    for (auto& x : X.a) x = r.normal();
    const auto rec = kvref::ema_recursive(X, static_cast<double>(0.3f));
    for (std::int64_t n = 0; n < X.cols; ++n) {
      double s = 0.0;
      for (int j = 0; j < w; ++j) s += kvevict::temporal::ema::weight(p, j, w) * X(j, n);
      CHECK(s == doctest::Approx(rec[static_cast<std::size_t>(n)]).epsilon(1e-12));
    }
  }
}

TEST_CASE("temporal: alpha outside (0, 1] is rejected with a message naming alpha") {
  for (float a : {0.0f, -0.1f, 1.5f, NAN, INFINITY}) {
    CAPTURE(a);
    const auto s = kvevict::temporal::ema::check({a});
    CHECK(!s.ok());
    CHECK(s.code() == kvevict::errc::invalid_argument);
    CHECK(std::string(s.message()).find("alpha") != std::string::npos);
    CHECK(!kvevict::temporal::reversed_ema::check({a}).ok());
  }
  CHECK(kvevict::temporal::ema::check({1.0f}).ok());
  CHECK(kvevict::temporal::ema::check({1e-6f}).ok());
}

// ---- adaptive window ---------------------------------------------------------------------

TEST_CASE("adaptive window: the five test vectors of the spec (kernel_and_shift and the CPU smoother)") {
  struct tv {
    double t;
    std::int64_t k, s, lo, hi;
  };
  const tv tvs[] = {{5000, 5, 2, 6, 10}, {-5000, 5, -2, 10, 14}, {100, 5, 0, 8, 12}, {-100, 5, 0, 8, 12},
                    {0, 5, 1, 7, 11},    {-4000, 5, -1, 9, 13}};
  kvevict::spatial::adaptive_window::params p;  // beta 2000, k_min 5, reference_exact
  REQUIRE(p.beta == 2000.0f);
  REQUIRE(p.k_min == 5);
  REQUIRE(p.reference_exact);
  for (const auto& v : tvs) {
    CAPTURE(v.t);
    std::int64_t k = 0, s = 0;
    kvevict::spatial::adaptive_window::kernel_and_shift(p, v.t, &k, &s);
    CHECK(k == v.k);
    CHECK(s == v.s);
    std::int64_t rk, rs;
    kvref::aws_kernel_shift(v.t, 2000.0, 5, true, &rk, &rs);
    CHECK(rk == v.k);
    CHECK(rs == v.s);
    std::vector<float> x(21, 0.0f), tmp(21);
    std::vector<double> pre(22);
    std::vector<std::int64_t> dq(21);
    x[10] = 1.0f;
    kvevict::cpu::detail::smooth_row<kvevict::spatial::adaptive_window>(p, x.data(), 21, v.t, tmp.data(), pre.data(), dq.data());
    for (std::int64_t i = 0; i < 21; ++i) {
      CAPTURE(i);
      if (i >= v.lo && i <= v.hi) CHECK(x[static_cast<std::size_t>(i)] == doctest::Approx(0.2).epsilon(1e-7));
      else CHECK(x[static_cast<std::size_t>(i)] == 0.0f);
    }
  }
}

TEST_CASE("adaptive window: kernel/shift rule and replicate-padded smoothing vs reference") {
  kvtest::rng r(5);
  for (bool exact : {true, false})
    for (int it = 0; it < 400; ++it) {
      kvevict::spatial::adaptive_window::params p;
      p.reference_exact = exact;
      p.beta = static_cast<float>(r.uniform() < 0.5 ? 2000.0 : 3.0);
      p.k_min = r.uniform() < 0.5 ? 5 : 1 + 2 * static_cast<int>(r.integer(0, 5));
      double t;
      const double u = r.uniform();
      if (u < 0.3) t = p.beta * static_cast<double>(r.integer(-6, 6));  // exact multiples (quirks)
      else t = r.uniform(-8.0, 8.0) * p.beta;
      CAPTURE(exact);
      CAPTURE(t);
      CAPTURE(p.beta);
      CAPTURE(p.k_min);
      std::int64_t k, s, rk, rs;
      kvevict::spatial::adaptive_window::kernel_and_shift(p, t, &k, &s);
      kvref::aws_kernel_shift(t, p.beta, p.k_min, exact, &rk, &rs);
      CHECK(k == rk);
      CHECK(s == rs);
      CHECK(std::abs(s) <= k / 2);
      const std::int64_t N = r.integer(1, 40);
      std::vector<float> x(static_cast<std::size_t>(N)), tmp(x.size());
      std::vector<double> xd(x.size()), pre(x.size() + 1);
      std::vector<std::int64_t> dq(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) xd[i] = x[i] = static_cast<float>(r.uniform());
      kvevict::cpu::detail::smooth_row<kvevict::spatial::adaptive_window>(p, x.data(), N, t, tmp.data(), pre.data(), dq.data());
      const auto y = kvref::aws_smooth(xd, rk, rs);
      double worst = 0.0;
      CHECK(kvtest::first_mismatch(x.data(), y, 0, N, 1e-6, 1e-7, &worst) < 0);
    }
  // Published exactness quirks spelled out.
  kvevict::spatial::adaptive_window::params p;
  std::int64_t k, s;
  kvevict::spatial::adaptive_window::kernel_and_shift(p, -6000.0, &k, &s);  // m = 3: k = 7, s = -3 + 1
  CHECK(k == 7);
  CHECK(s == -2);
  p.reference_exact = false;
  kvevict::spatial::adaptive_window::kernel_and_shift(p, 0.0, &k, &s);
  CHECK(s == 0);
  kvevict::spatial::adaptive_window::kernel_and_shift(p, -4000.0, &k, &s);
  CHECK(s == -2);
}

// ---- avg pool, max pool ------------------------------------------------------------------

TEST_CASE("spatial: avg pool (zero padding counted) and max pool (-inf padding) vs reference") {
  kvtest::rng r(9);
  for (int k : {1, 3, 5, 7, 13})
    for (std::int64_t N : {1, 2, 4, 5, 12, 37}) {
      CAPTURE(k);
      CAPTURE(N);
      std::vector<float> x(static_cast<std::size_t>(N)), x2, tmp(x.size());
      std::vector<double> xd(x.size()), pre(x.size() + 1);
      std::vector<std::int64_t> dq(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) xd[i] = x[i] = static_cast<float>(r.normal());
      x2 = x;
      kvevict::cpu::detail::smooth_row<kvevict::spatial::avg_pool>({k}, x.data(), N, 0.0, tmp.data(), pre.data(), dq.data());
      CHECK(kvtest::first_mismatch(x.data(), kvref::avg_pool(xd, k), 0, N, 1e-6, 1e-7) < 0);
      kvevict::cpu::detail::smooth_row<kvevict::spatial::max_pool>({k}, x2.data(), N, 0.0, tmp.data(), pre.data(), dq.data());
      CHECK(kvtest::first_mismatch(x2.data(), kvref::max_pool(xd, k), 0, N, 0.0, 0.0) < 0);
    }
}

TEST_CASE("spatial: even or non-positive kernels, even k_min and bad beta are rejected by name") {
  for (int k : {0, 2, 4, -1}) {
    CAPTURE(k);
    const auto s = kvevict::spatial::avg_pool::check({k});
    CHECK(!s.ok());
    CHECK(std::string(s.message()).find("kernel") != std::string::npos);
    CHECK(!kvevict::spatial::max_pool::check({k}).ok());
  }
  kvevict::spatial::adaptive_window::params p;
  p.k_min = 4;
  auto s = kvevict::spatial::adaptive_window::check(p);
  CHECK(!s.ok());
  CHECK(std::string(s.message()).find("k_min") != std::string::npos);
  p.k_min = 5;
  for (float b : {0.0f, -1.0f, NAN, INFINITY}) {
    p.beta = b;
    s = kvevict::spatial::adaptive_window::check(p);
    CHECK(!s.ok());
    CHECK(std::string(s.message()).find("beta") != std::string::npos);
  }
}
