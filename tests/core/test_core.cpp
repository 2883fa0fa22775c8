// Core tests (no Eigen): storage types, temporal weights, adaptive-window rule and smoothers,
// plans and budgets, the top-k selector. Every check is against tests/reference/reference.hpp
// or an independent closed form.
#include <doctest/doctest.h>

#include <kvevict/kvevict.hpp>
#include <kvevict/backends/cpu/select.hpp>
#include <kvevict/backends/cpu/smoothers.hpp>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "common/tolerance.hpp"
#include "reference/reference.hpp"

using kvevict::bfloat16_t;
using kvevict::half_t;

namespace {

// ---- independent fp64 decoding / rounding of the 16-bit formats ----------------------------
struct fmt {
  int mant_bits, exp_bits, bias;
};
constexpr fmt f16{10, 5, 15};
constexpr fmt b16{7, 8, 127};

double decode(std::uint16_t bits, fmt f) {
  const int sign = bits >> 15;
  const int e = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  double v;
  if (e == (1 << f.exp_bits) - 1) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - f.bias - f.mant_bits);
  else v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mant_bits), e - f.bias);
  return sign ? -v : v;
}

/// Round x to the format, nearest-even, overflow to inf (fp64 arithmetic; exact for floats).
double round_ref(float xf, fmt f) {
  const double x = xf;
  if (std::isnan(x)) return x;
  if (std::isinf(x)) return x;
  const double a = std::fabs(x);
  if (a == 0.0) return x;
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  int ex = e - 1;
  const int emin = 1 - f.bias;
  if (ex < emin) ex = emin;
  const double ulp = std::ldexp(1.0, ex - f.mant_bits);
  const double q = a / ulp;
  double r = std::floor(q);
  const double rem = q - r;
  if (rem > 0.5 || (rem == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;
  double v = r * ulp;
  const double maxf = std::ldexp(2.0 - std::ldexp(1.0, -f.mant_bits), (1 << f.exp_bits) - 2 - f.bias);
  if (v > maxf) v = std::numeric_limits<double>::infinity();
  return std::signbit(x) ? -v : v;
}

template <class T>
constexpr fmt fmt_of() {
  return std::is_same<T, half_t>::value ? f16 : b16;
}

float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
bool same_value(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

}  // namespace

TEST_CASE_TEMPLATE("numeric: every 16-bit pattern decodes exactly and round-trips", T, half_t, bfloat16_t) {
  int bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    T x;
    x.bits = static_cast<std::uint16_t>(b);
    const float f = kvevict::to_float(x);
    const double want = decode(x.bits, fmt_of<T>());
    if (!same_value<T>(f, want)) {
      if (++bad < 5) {
        CAPTURE(b);
        FAIL_CHECK("decode mismatch");
      }
    }
    const T y = kvevict::from_float<T>(f);
    if (std::isnan(want)) {
      if (!std::isnan(kvevict::to_float(y))) ++bad;
    } else if (y.bits != x.bits) {
      if (++bad < 5) {
        CAPTURE(b);
        FAIL_CHECK("round trip changed the bits");
      }
    }
    CHECK(kvevict::is_finite_value(x) == std::isfinite(want));
  }
  CHECK(bad == 0);
}

TEST_CASE_TEMPLATE("numeric: from_float rounds to nearest-even like an fp64 reference", T, half_t, bfloat16_t) {
  constexpr fmt F = fmt_of<T>();
  long bad = 0, n = 0;
  auto check1 = [&](float x) {
    ++n;
    const float got = kvevict::to_float(kvevict::from_float<T>(x));
    const double want = round_ref(x, F);
    if (!same_value<T>(got, want)) {
      if (++bad < 8) {
        CAPTURE(x);
        CAPTURE(got);
        CAPTURE(want);
        FAIL_CHECK("rounding mismatch");
      }
    }
  };
  // A stride through all 2^32 float bit patterns (normals, subnormals, inf, NaN).
  for (std::uint64_t u = 0; u < (1ull << 32); u += 251) check1(bits_to_float(static_cast<std::uint32_t>(u)));
  // Exact midpoints between consecutive finite values, and their neighbours (tie-to-even).
  for (std::uint32_t b = 0; b < 0x8000u; ++b) {
    T x;
    x.bits = static_cast<std::uint16_t>(b);
    const double lo = decode(x.bits, F);
    x.bits = static_cast<std::uint16_t>(b + 1);
    const double hi = decode(x.bits, F);
    if (!std::isfinite(lo) || std::isnan(hi)) continue;
    const double mid = std::isinf(hi) ? lo + (lo - decode(static_cast<std::uint16_t>(b - 1), F)) / 2 : (lo + hi) / 2;
    const float m = static_cast<float>(mid);
    if (static_cast<double>(m) != mid) continue;  // not representable in fp32 (never for these formats)
    for (float v : {m, std::nextafter(m, 0.0f), std::nextafter(m, INFINITY)}) {
      check1(v);
      check1(-v);
    }
  }
  // Named edge cases.
  for (float v : {0.0f, -0.0f, FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN, FLT_MAX, -FLT_MAX, 65504.0f, 65519.99f, 65520.0f,
                  65536.0f, 1e-8f, 5.96e-8f, 2.98e-8f, 6.1e-5f, INFINITY, -INFINITY, NAN})
    check1(v);
  CAPTURE(n);
  CHECK(bad == 0);
  CHECK(std::isinf(kvevict::to_float(kvevict::from_float<T>(FLT_MAX))));  // beyond both formats' range
  CHECK(std::isnan(kvevict::to_float(kvevict::from_float<T>(NAN))));
  CHECK(!kvevict::is_finite_value(kvevict::from_float<T>(INFINITY)));
}

TEST_CASE("numeric: overflow and subnormal landmarks") {
  CHECK(std::isinf(kvevict::to_float(kvevict::from_float<half_t>(65520.0f))));
  CHECK(kvevict::to_float(kvevict::from_float<half_t>(65519.0f)) == 65504.0f);
  CHECK(kvevict::to_float(kvevict::from_float<half_t>(std::ldexp(1.0f, -24))) == std::ldexp(1.0f, -24));
  CHECK(kvevict::to_float(kvevict::from_float<half_t>(std::ldexp(1.0f, -25))) == 0.0f);  // tie to even (0)
  CHECK(kvevict::to_float(kvevict::from_float<half_t>(std::ldexp(1.5f, -25))) == std::ldexp(1.0f, -24));
  CHECK(std::isinf(kvevict::to_float(kvevict::from_float<bfloat16_t>(FLT_MAX))));
  CHECK(kvevict::to_float(kvevict::from_float<bfloat16_t>(FLT_TRUE_MIN)) == 0.0f);  // 2^-149 < half ulp 2^-134
  CHECK(kvevict::to_float(kvevict::from_float<bfloat16_t>(std::ldexp(1.0f, -133))) == std::ldexp(1.0f, -133));
}

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

// ---- plans, budgets ----------------------------------------------------------------------

namespace {
kvevict::detail::head_plan lib_plan(const kvref::head_plan& h) {
  kvevict::detail::head_plan p;
  p.length = h.L;
  p.base_budget = h.base;
  p.sinks = h.sinks;
  p.recent = h.recent;
  p.pass_through = h.pass;
  return p;
}
}  // namespace

TEST_CASE("budget: plan_head follows the documented rule (tokens, fractions, sinks, recent share)") {
  kvtest::rng r(21);
  for (int it = 0; it < 3000; ++it) {
    kvevict::selectors::topk::params sp;
    sp.num_sink = static_cast<std::int32_t>(r.integer(0, 4));
    const double u = r.uniform();
    if (u < 0.3) sp.num_recent = static_cast<std::int32_t>(r.integer(0, 6));
    else if (u < 0.5) sp.recent_share = static_cast<float>(r.integer(0, 4)) / 4.0f;
    const std::int64_t W = r.integer(1, 8), L = r.integer(0, 60);
    kvevict::budget_request req;
    if (r.uniform() < 0.5) req = kvevict::budget_request::tokens(static_cast<std::int32_t>(r.integer(1, 70)));
    else req = kvevict::budget_request::fraction(r.uniform(0.001, 1.0));
    if (!kvevict::detail::validate_budget(req, sp, W).ok()) continue;
    const auto h = kvevict::detail::plan_head(req, sp, L, W);
    const auto ref = kvref::plan(L, req.keep_tokens, req.keep_fraction, sp.num_sink, sp.num_recent, sp.recent_share, W);
    CAPTURE(L);
    CAPTURE(W);
    CAPTURE(req.keep_tokens);
    CAPTURE(req.keep_fraction);
    CAPTURE(sp.num_sink);
    CAPTURE(sp.num_recent);
    CAPTURE(sp.recent_share);
    CHECK(h.pass_through == ref.pass);
    CHECK(h.base_budget == ref.base);
    CHECK(h.base_budget >= 1);
    if (!ref.pass) {
      CHECK(h.sinks == ref.sinks);
      CHECK(h.recent == ref.recent);
    }
    // uniform budgeter: B (or L), never above L, never an empty head with L > 0
    const auto b = kvevict::budgeters::uniform::head_budget({}, h, 0, 1);
    CHECK(b == (ref.pass ? L : ref.base));
    if (L > 0) CHECK(std::min(b, L) >= 1);
  }
}

TEST_CASE("budget: a fraction that floors to 0 keeps the protected tokens, never an empty head") {
  kvevict::selectors::topk::params sp;  // window protected
  const auto h = kvevict::detail::plan_head(kvevict::budget_request::fraction(0.01), sp, 50, 8);
  CHECK(h.base_budget == 8);
  CHECK(!h.pass_through);
  CHECK(h.recent == 8);
  sp.num_recent = 0;
  const auto h2 = kvevict::detail::plan_head(kvevict::budget_request::fraction(0.01), sp, 50, 8);
  CHECK(h2.base_budget == 1);
  CHECK(kvevict::budgeters::uniform::head_budget({}, h2, 0, 1) == 1);
}

TEST_CASE("budget: apportion sums exactly, respects caps and matches largest remainder") {
  kvtest::rng r(3);
  for (int it = 0; it < 2000; ++it) {
    const std::int64_t n = r.integer(1, 12);
    std::vector<double> share(static_cast<std::size_t>(n));
    std::vector<std::int64_t> cap(share.size()), out(share.size());
    double tot = 0.0;
    std::int64_t capsum = 0;
    for (std::size_t i = 0; i < share.size(); ++i) {
      share[i] = r.uniform(0.0, 30.0);
      tot += share[i];
      cap[i] = static_cast<std::int64_t>(std::ceil(share[i])) + r.integer(0, 3);
      capsum += cap[i];
    }
    const std::int64_t total = static_cast<std::int64_t>(std::llround(tot));
    if (total > capsum) continue;
    kvevict::detail::apportion(share.data(), cap.data(), n, total, out.data());
    const auto ref = kvref::largest_remainder(share, &cap, total);
    std::int64_t s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      s += out[i];
      CHECK(out[i] >= 0);
      CHECK(out[i] <= cap[i]);
      CHECK(out[i] == ref[i]);
    }
    CHECK(s == total);
  }
}

TEST_CASE("budget: pyramid matches PyramidKV's integer code (exact_total = false) and sums exactly otherwise") {
  kvtest::rng r(17);
  int nonuniform = 0;
  long exact_match = 0, layers = 0;
  for (int it = 0; it < 1500; ++it) {
    kvevict::budgeters::pyramid::params p;
    p.beta = static_cast<float>(r.uniform() < 0.5 ? 20.0 : static_cast<double>(r.integer(1, 40)));
    const std::int64_t P = r.integer(1, 300), C = P + r.integer(1, 600);
    const int n = static_cast<int>(r.integer(1, 40));
    CAPTURE(P);
    CAPTURE(C);
    CAPTURE(n);
    CAPTURE(p.beta);
    std::int64_t sum = 0;
    std::vector<std::int64_t> a(static_cast<std::size_t>(n));
    layers += n;
    for (int l = 0; l < n; ++l) {
      p.exact_total = false;
      CHECK(kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n) == kvref::pyramid_integer(P, C, p.beta, l, n));
      p.exact_total = true;
      const auto v = kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n);
      // Equal to the exact-rational reference (integer arithmetic: ties go to the lower layer).
      if (v == kvref::pyramid_exact(P, C, p.beta, l, n)) ++exact_match;
      CHECK(v == kvevict::budgeters::pyramid::layer_candidates(p, P, C, l, n));  // deterministic
      CHECK(v >= 0);
      CHECK(v <= C);
      a[static_cast<std::size_t>(l)] = v;
      sum += v;
    }
    CHECK(sum == static_cast<std::int64_t>(n) * P);
    if (n > 1 && 2 * P - static_cast<std::int64_t>(std::floor(static_cast<double>(P) / p.beta)) < C) {
      // Largest-remainder property with exact fractional parts: every layer gets floor or
      // floor + 1 of its share, and no layer left at the floor has a larger remainder than a
      // layer that got the extra unit.
      std::vector<std::int64_t> rem;
      (void)kvref::pyramid_exact(P, C, p.beta, 0, n, &rem);
      const std::int64_t mn = static_cast<std::int64_t>(std::floor(static_cast<double>(P) / p.beta)), mx = 2 * P - mn;
      std::int64_t min_up = n, max_down = -1;
      for (int l = 0; l < n; ++l) {
        const std::int64_t fl = (mx * (n - 1) - l * (mx - mn)) / (n - 1);
        const std::int64_t extra = a[static_cast<std::size_t>(l)] - fl;
        CHECK((extra == 0 || extra == 1));
        if (extra == 1) min_up = std::min(min_up, rem[static_cast<std::size_t>(l)]);
        else max_down = std::max(max_down, rem[static_cast<std::size_t>(l)]);
      }
      CHECK(max_down <= min_up);
    }
    for (int l = 1; l < n; ++l) CHECK(a[static_cast<std::size_t>(l)] <= a[static_cast<std::size_t>(l - 1)]);
    if (n > 1 && a[0] != a[static_cast<std::size_t>(n - 1)]) ++nonuniform;
  }
  CHECK(nonuniform > 100);
  CHECK(exact_match == layers);
  // head_budget adds the protected tokens; pass-through keeps L.
  kvevict::detail::head_plan h;
  h.length = 100;
  h.base_budget = 40;
  h.sinks = 2;
  h.recent = 8;
  CHECK(kvevict::budgeters::pyramid::head_budget({}, h, 0, 4) ==
        10 + kvref::pyramid_exact(30, 90, 20.0, 0, 4));
  h.pass_through = true;
  CHECK(kvevict::budgeters::pyramid::head_budget({}, h, 0, 4) == 100);
  CHECK(!kvevict::budgeters::pyramid::check({0.5f, true}).ok());
  CHECK(std::string(kvevict::budgeters::pyramid::check({NAN, true}).message()).find("beta") != std::string::npos);
}

TEST_CASE("budget: AdaKV head-wise allocation matches the documented formula") {
  kvtest::rng r(23);
  int uneven = 0;
  for (int it = 0; it < 300; ++it) {
    const std::int64_t H = r.integer(1, 6);
    std::vector<kvref::head_plan> plans;
    std::vector<kvref::vec> sc;
    std::vector<std::vector<float>> scf(static_cast<std::size_t>(H));
    std::vector<const float*> ptr;
    std::vector<kvevict::detail::head_plan> lp;
    const std::int64_t B = it % 3 == 0 ? r.integer(1, 6) : r.integer(4, 20);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = r.integer(1, 50);
      // a third of the cases protect nothing (the floor of 1 candidate per evicting head)
      plans.push_back(it % 3 == 0 ? kvref::plan(L, B, 0.0, 0, 0, -1.0, 3) : kvref::plan(L, B, 0.0, 1, 3, -1.0, 3));
      kvref::vec s(static_cast<std::size_t>(L));
      const double scale = r.uniform(0.1, 10.0);  // heads of different score scales
      for (auto& x : s) x = static_cast<float>(scale * r.uniform());
      if (r.uniform() < 0.2) std::fill(s.begin(), s.end(), 0.5);  // ties across heads
      scf[static_cast<std::size_t>(h)].assign(s.begin(), s.end());
      sc.push_back(s);
      lp.push_back(lib_plan(plans.back()));
    }
    for (auto& v : scf) ptr.push_back(v.data());
    const float alpha = r.uniform() < 0.5 ? 0.2f : static_cast<float>(r.uniform());
    std::vector<std::int64_t> got(static_cast<std::size_t>(H)), again(got.size());
    kvevict::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, got.data());
    kvevict::cpu::detail::adakv_budgets({alpha}, lp.data(), ptr.data(), H, again.data());
    const auto ref = kvref::adakv_budgets(plans, sc, static_cast<double>(alpha));
    std::int64_t sum = 0, want = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& pl = plans[static_cast<std::size_t>(h)];
      CAPTURE(h);
      CHECK(got[static_cast<std::size_t>(h)] == ref[static_cast<std::size_t>(h)]);
      CHECK(got[static_cast<std::size_t>(h)] == again[static_cast<std::size_t>(h)]);
      CHECK(got[static_cast<std::size_t>(h)] <= pl.L);
      CHECK(got[static_cast<std::size_t>(h)] >= std::min(pl.L, pl.prot()));
      CHECK(got[static_cast<std::size_t>(h)] >= 1);  // never an empty head (L >= 1 here)
      sum += got[static_cast<std::size_t>(h)];
      want += pl.pass ? pl.L : pl.base;
      if (!pl.pass && got[static_cast<std::size_t>(h)] != pl.base) ++uneven;
    }
    CHECK(sum == want);
  }
  CHECK(uneven > 50);
  CHECK(!kvevict::budgeters::adakv::check({1.5f}).ok());
  CHECK(std::string(kvevict::budgeters::adakv::check({-0.5f}).message()).find("alpha") != std::string::npos);
}

// ---- selector -----------------------------------------------------------------------------

TEST_CASE("selector: top-k with protected tokens vs reference, including adversarial scores") {
  kvtest::rng r(31);
  const float big = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  for (int it = 0; it < 2000; ++it) {
    const std::int64_t L = r.integer(0, 40), W = r.integer(1, 6);
    const std::int64_t budget = r.integer(W + 2, 45);
    const auto pl = kvref::plan(L, budget, 0.0, 2, -1, -1.0, W);
    std::vector<float> s(static_cast<std::size_t>(std::max<std::int64_t>(L, 1)));
    const int mode = static_cast<int>(r.integer(0, 5));
    for (auto& x : s) {
      switch (mode) {
        case 0: x = static_cast<float>(r.normal()); break;
        case 1: x = 1.0f; break;  // all equal
        case 2: x = r.uniform() < 0.5 ? NAN : static_cast<float>(r.normal()); break;
        case 3: x = r.uniform() < 0.3 ? inf : (r.uniform() < 0.5 ? -inf : 0.0f); break;
        case 4: x = r.uniform() < 0.5 ? big : -big; break;
        default: x = static_cast<float>(r.integer(0, 2)); break;  // many ties
      }
    }
    // the protected slots get the most hostile values: -inf / NaN / lowest
    for (std::int64_t i = 0; i < L; ++i)
      if (i < 2 || i >= L - W) s[static_cast<std::size_t>(i)] = (i % 2) ? -inf : NAN;
    kvref::vec sd(s.begin(), s.begin() + L);
    const auto ref = kvref::topk_select(sd, L, pl.pass ? L : budget, pl.sinks, pl.recent);
    std::vector<std::int32_t> out(static_cast<std::size_t>(std::max<std::int64_t>(L, 1)), -1), idx(out.size());
    const auto n = kvevict::cpu::detail::select_head(lib_plan(pl), budget, s.data(), out.data(), idx.data());
    out.resize(static_cast<std::size_t>(n));
    CAPTURE(L);
    CAPTURE(W);
    CAPTURE(budget);
    CAPTURE(mode);
    CHECK(out == ref);
    CHECK(n == std::min(budget, L));
    for (std::int64_t i = 0; i < L; ++i)
      if (!pl.pass && (i < pl.sinks || i >= L - pl.recent))
        CHECK(std::binary_search(out.begin(), out.end(), static_cast<std::int32_t>(i)));
  }
}
