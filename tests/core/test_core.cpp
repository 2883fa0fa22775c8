// Core tests (no Eigen) of include/kvevict/core/: the 16-bit storage types (numeric.hpp), head
// plans (budget_rules.hpp plan_head, with the uniform budgeter's head_budget) and apportionment
// (apportion.hpp). Every check is against tests/reference/reference.hpp or an independent closed
// form. The stages of the built-in policies (smoothers, PyramidKV / AdaKV budgets, the top-k
// selector) are tested under tests/policies (see tests/README.md).
#include <doctest/doctest.h>

#include <kvevict/kvevict.hpp>

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

// ---- plans, budgets ----------------------------------------------------------------------

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
