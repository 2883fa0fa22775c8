// CPU backend: layouts and strides, compaction, W_O factors, and bad input (clear error, outputs
// untouched).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "reference/harness.hpp"

using kvevict::bfloat16_t;
using kvevict::half_t;
using kvtest::layout;
namespace kv = kvevict;

namespace {
/// Raw bits of a stored element (bit-exact comparisons for every storage type).
template <class T>
std::uint32_t bits_of(T x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}
}  // namespace

// ---- layouts -------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("layouts: NHD, HND, padded and element-strided views give identical selections", T, float, half_t,
                   bfloat16_t) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 56, s.d = 16, s.window = 8, s.hidden = 32;
  const std::vector<std::int32_t> lens = {56, 50, 41, 56};
  for (std::uint64_t seed = 0; seed < 2; ++seed) {
    CAPTURE(seed);
    kvtest::problem p = kvtest::make_problem(s, 3000 + seed, 1.0, 1.5, 1.0, lens);
    kvtest::quantize<T>(p);
    kvtest::lib_result base_r, base_s, base_k;
    for (layout l : {layout::hnd, layout::nhd, layout::padded, layout::interleaved}) {
      CAPTURE(kvtest::to_string(l));
      kvtest::stored<T> st;
      kvtest::store(p, l, st);
      kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
      kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev2;
      kv::evictor<kv::presets::key_norm, kv::cpu::backend> ev3;
      auto r = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(20));
      auto sn = kvtest::run_lib(ev2, st.in, kv::budget_request::tokens(20));
      auto k = kvtest::run_lib(ev3, st.in, kv::budget_request::tokens(20));
      REQUIRE_MESSAGE(r.st.ok(), r.st.message());
      REQUIRE(sn.st.ok());
      REQUIRE(k.st.ok());
      CHECK(r.indptr.back() < 4 * 56);  // something evicted
      if (l == layout::hnd) {
        base_r = r, base_s = sn, base_k = k;
        continue;
      }
      CHECK(r.indptr == base_r.indptr);
      CHECK(r.indices == base_r.indices);
      CHECK(sn.indices == base_s.indices);
      CHECK(k.indices == base_k.indices);
      for (std::size_t i = 0; i < r.scores.size(); ++i) {
        CHECK(r.scores[i] == doctest::Approx(base_r.scores[i]).epsilon(1e-5));
        CHECK(sn.scores[i] == doctest::Approx(base_s.scores[i]).epsilon(1e-5));
      }
    }
  }
}

// ---- compaction ----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("compaction: dense (NHD/HND), in place and ragged equal a naive gather; positions preserved", T, float,
                   half_t, bfloat16_t) {
  const std::int64_t B = 2, H = 3, S = 20, D = 5;
  kvtest::rng r(7);
  std::vector<T> src(static_cast<std::size_t>(B * H * S * D));
  for (auto& x : src) x = kv::from_float<T>(static_cast<float>(r.normal()));
  for (kv::kv_layout lay : {kv::kv_layout::hnd, kv::kv_layout::nhd}) {
    CAPTURE(kv::to_string(lay));
    // a random ascending selection per head, counts 0 .. S
    std::vector<std::int32_t> indptr{0}, idx;
    for (std::int64_t row = 0; row < B * H; ++row) {
      for (std::int32_t i = 0; i < S; ++i)
        if (r.uniform() < (row == 2 ? 0.0 : (row == 3 ? 1.0 : 0.4))) idx.push_back(i);
      indptr.push_back(static_cast<std::int32_t>(idx.size()));
    }
    std::int64_t maxk = 0;
    for (std::int64_t row = 0; row < B * H; ++row) maxk = std::max<std::int64_t>(maxk, indptr[static_cast<std::size_t>(row + 1)] - indptr[static_cast<std::size_t>(row)]);
    const kv::const_selection_view sel(indptr.data(), idx.data(), B * H);
    auto sv = kv::make_kv_view<const T>(src.data(), B, H, S, D, lay);
    auto naive = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t c) {
      const std::int32_t slot = idx[static_cast<std::size_t>(indptr[static_cast<std::size_t>(b * H + h)] + i)];
      return bits_of(sv(b, h, slot, c));
    };
    // dense into the other layout, with a sentinel in unused slots
    const kv::kv_layout other = lay == kv::kv_layout::hnd ? kv::kv_layout::nhd : kv::kv_layout::hnd;
    std::vector<T> dst(static_cast<std::size_t>(B * H * maxk * D), kv::from_float<T>(-99.0f));
    auto dv = kv::make_kv_view<T>(dst.data(), B, H, maxk, D, other);
    REQUIRE(kv::cpu::compact<T>(sv, sel, dv).ok());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t n = indptr[static_cast<std::size_t>(b * H + h + 1)] - indptr[static_cast<std::size_t>(b * H + h)];
        for (std::int64_t i = 0; i < maxk; ++i)
          for (std::int64_t c = 0; c < D; ++c) {
            if (i < n) CHECK(bits_of(dv(b, h, i, c)) == naive(b, h, i, c));
            else CHECK(kv::to_float(dv(b, h, i, c)) == -99.0f);
          }
      }
    // in place
    std::vector<T> inplace = src;
    auto iv = kv::make_kv_view<T>(inplace.data(), B, H, S, D, lay);
    REQUIRE(kv::cpu::compact<T>(iv, sel, iv).ok());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t n = indptr[static_cast<std::size_t>(b * H + h + 1)] - indptr[static_cast<std::size_t>(b * H + h)];
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t c = 0; c < D; ++c) CHECK(bits_of(iv(b, h, i, c)) == naive(b, h, i, c));
      }
    // ragged
    std::vector<T> rg(idx.size() * D);
    REQUIRE(kv::cpu::compact_ragged<T>(sv, sel, rg.data(), static_cast<std::int64_t>(rg.size())).ok());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int32_t i = indptr[static_cast<std::size_t>(b * H + h)]; i < indptr[static_cast<std::size_t>(b * H + h + 1)]; ++i)
          for (std::int64_t c = 0; c < D; ++c)
            CHECK(bits_of(rg[static_cast<std::size_t>(i * D + c)]) == naive(b, h, i - indptr[static_cast<std::size_t>(b * H + h)], c));
    // errors leave dst untouched
    std::vector<T> before = dst;
    std::vector<std::int32_t> bad = idx;
    if (bad.size() >= 2) {
      std::swap(bad[0], bad[1]);
      const kv::const_selection_view bsel(indptr.data(), bad.data(), B * H);
      const auto e = kv::cpu::compact<T>(sv, bsel, dv);
      CHECK(!e.ok());
      CHECK(std::string(e.message()).find("ascending") != std::string::npos);
    }
    auto small = kv::make_kv_view<T>(dst.data(), B, H, maxk - 1, D, other);
    const auto e2 = kv::cpu::compact<T>(sv, sel, small);
    CHECK(e2.code() == kv::errc::insufficient_capacity);
    const auto e3 = kv::cpu::compact_ragged<T>(sv, sel, rg.data(), static_cast<std::int64_t>(rg.size()) - 1);
    CHECK(e3.code() == kv::errc::insufficient_capacity);
    CHECK(std::memcmp(before.data(), dst.data(), dst.size() * sizeof(T)) == 0);
  }
}

TEST_CASE("compaction: a partial overlap of src and dst is an error and writes nothing") {
  const std::int64_t B = 1, H = 2, S = 10, D = 4;
  std::vector<float> buf(static_cast<std::size_t>(B * H * S * D + 64));
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  const std::vector<float> orig = buf;
  std::vector<std::int32_t> indptr = {0, 3, 6}, idx = {2, 5, 9, 0, 1, 7};
  const kv::const_selection_view sel(indptr.data(), idx.data(), B * H);
  auto src = kv::make_kv_view<const float>(buf.data(), B, H, S, D, kv::kv_layout::hnd);
  for (std::int64_t shift : {1, 4, 40}) {
    CAPTURE(shift);
    auto dst = kv::make_kv_view<float>(buf.data() + shift, B, H, 3, D, kv::kv_layout::hnd);
    const auto e = kv::cpu::compact<float>(src, sel, dst);
    CHECK(!e.ok());
    CHECK(std::string(e.message()).find("overlap") != std::string::npos);
    CHECK(buf == orig);
    const auto e2 = kv::cpu::compact_ragged<float>(src, sel, buf.data() + shift, 6 * D);
    CHECK(!e2.ok());
    CHECK(std::string(e2.message()).find("overlap") != std::string::npos);
    CHECK(buf == orig);
  }
  // disjoint buffers right next to each other are fine
  auto dst = kv::make_kv_view<float>(buf.data() + B * H * S * D, B, H, 3, D, kv::kv_layout::hnd);
  CHECK(kv::cpu::compact<float>(src, sel, dst).ok());
  CHECK(dst(0, 1, 2, 3) == orig[static_cast<std::size_t>((1 * S + 7) * D + 3)]);
}

TEST_CASE("compaction of a per-query-head selection expands to q_heads heads; evictor positions follow the slots") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 3, s.cap = 30, s.d = 8, s.window = 4, s.hidden = 16;
  kvtest::problem p = kvtest::make_problem(s, 3100);
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(s.cap));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(7 * i + 3);
  st.in.positions = kv::make_positions_view(pos.data(), s.batch, s.kv_heads, s.cap, true);
  auto params = kv::presets::restkv::defaults();
  params.gqa = kv::gqa_reduction::per_query_head;
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev(params);
  auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(10));
  REQUIRE(lib.st.ok());
  REQUIRE(lib.rows == s.q_heads());
  std::vector<float> dst(static_cast<std::size_t>(s.q_heads() * 10 * s.d));
  auto dv = kv::make_kv_view<float>(dst.data(), 1, s.q_heads(), 10, s.d, kv::kv_layout::hnd);
  REQUIRE(kv::cpu::compact<float>(st.in.keys, kv::const_selection_view(lib.indptr.data(), lib.indices.data(), lib.rows), dv).ok());
  for (std::int64_t hq = 0; hq < s.q_heads(); ++hq) {
    const auto kept = lib.kept(hq);
    for (std::size_t i = 0; i < kept.size(); ++i) {
      CHECK(lib.positions[static_cast<std::size_t>(lib.indptr[static_cast<std::size_t>(hq)]) + i] == pos[static_cast<std::size_t>(kept[i])]);
      for (std::int64_t c = 0; c < s.d; ++c)
        CHECK(dv(0, hq, static_cast<std::int64_t>(i), c) == static_cast<float>(p.K[p.kv_idx(0, hq / s.group, kept[i], c)]));
    }
  }
}

// ---- W_O factors ---------------------------------------------------------------------------

TEST_CASE("W_O factor: ||R x|| equals the hidden-size projection norm (full rank and rank deficient)") {
  kvtest::rng r(8);
  for (std::int64_t C : {4, 16, 64}) {
    const std::int64_t Hq = 3, d = 8;
    CAPTURE(C);
    std::vector<float> wo(static_cast<std::size_t>(C * Hq * d));
    for (auto& x : wo) x = static_cast<float>(r.normal());
    std::vector<float> R(static_cast<std::size_t>(Hq * d * d), -1.0f);
    kv::strided_view<const float, 2> wv{wo.data(), {C, Hq * d}, {Hq * d, 1}};
    REQUIRE(kv::cpu::compute_wo_factors(wv, Hq, d, R.data()).ok());
    for (std::int64_t h = 0; h < Hq; ++h)
      for (int t = 0; t < 10; ++t) {
        std::vector<double> x(static_cast<std::size_t>(d));
        for (auto& v : x) v = r.normal();
        kvref::mat W(C, d);
        for (std::int64_t c = 0; c < C; ++c)
          for (std::int64_t i = 0; i < d; ++i) W(c, i) = wo[static_cast<std::size_t>(c * Hq * d + h * d + i)];
        const double want = kvref::proj_norm(x.data(), d, &W);
        double rx = 0.0;
        for (std::int64_t i = 0; i < d; ++i) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < d; ++j) acc += R[static_cast<std::size_t>(h * d * d + i * d + j)] * x[static_cast<std::size_t>(j)];
          rx += acc * acc;
        }
        CHECK(std::sqrt(rx) == doctest::Approx(want).epsilon(1e-5));
      }
  }
  std::vector<float> wo(4 * 8, 1.0f), R(64);
  kv::strided_view<const float, 2> wv{wo.data(), {4, 8}, {8, 1}};
  CHECK(kv::cpu::compute_wo_factors(wv, 2, 8, R.data()).code() == kv::errc::shape_mismatch);
  CHECK(kv::cpu::compute_wo_factors(wv, 1, 8, nullptr).code() == kv::errc::null_pointer);
  wo[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(kv::cpu::compute_wo_factors(wv, 1, 8, R.data()).code() == kv::errc::non_finite_input);
}

// ---- bad input -----------------------------------------------------------------------------

namespace {

/// Run with sentinel-filled outputs; expect the error code and a message containing `needle`;
/// check every output is untouched. cap_delta / ws_delta shrink the selection capacity and the
/// workspace below what the evictor asked for.
template <class Policy, class T>
void expect_error(const kv::evictor<Policy, kv::cpu::backend>& ev, const kv::layer_inputs<T>& in, kv::budget_request budget,
                  kv::errc code, const char* needle, std::int64_t cap_delta = 0, std::int64_t ws_delta = 0,
                  bool null_indptr = false, std::int64_t rows_hint = 64, std::int64_t cap_hint = 4096) {
  const std::string want = needle;
  CAPTURE(want);
  const std::int32_t sentinel = -12345;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows_hint + 1), sentinel), idx(static_cast<std::size_t>(cap_hint), sentinel),
      pos(idx.size(), sentinel);
  std::vector<float> scores(static_cast<std::size_t>(rows_hint * 256), -123.0f);
  std::int64_t cap = cap_hint;
  if (cap_delta != 0) cap = ev.max_selected(in, budget) - cap_delta;
  kv::selection_view sel{null_indptr ? nullptr : indptr.data(), idx.data(), pos.data(), cap};
  std::size_t ws = 1 << 22;
  if (ws_delta != 0) ws = ev.workspace_size(in) - static_cast<std::size_t>(ws_delta);
  std::vector<unsigned char> w(std::max<std::size_t>(ws, 1) + 256);
  void* base = w.data() + (256 - reinterpret_cast<std::uintptr_t>(w.data()) % 256) % 256;
  if (ws_delta == 0) ws = std::max(ws, ev.workspace_size(in));
  if (ws_delta == 0) w.resize(ws + 256), base = w.data() + (256 - reinterpret_cast<std::uintptr_t>(w.data()) % 256) % 256;
  const kv::status s = ev.run(in, budget, sel, base, ws, scores.data());
  CHECK(!s.ok());
  CHECK(s.code() == code);
  const std::string msg = s.message();
  CAPTURE(msg);
  CHECK(msg.find(needle) != std::string::npos);
  CHECK(msg.find(kv::to_string(code)) == 0);
  for (auto v : indptr) CHECK(v == sentinel);
  for (auto v : idx) CHECK(v == sentinel);
  for (auto v : pos) CHECK(v == sentinel);
  for (auto v : scores) CHECK(v == -123.0f);
  // can_implement covers shapes and parameters (the NaN scan of the data is run()'s)
  if (cap_delta == 0 && ws_delta == 0 && !null_indptr && code != kv::errc::non_finite_input) {
    CHECK(!ev.can_implement(in, budget).ok());
    CHECK(ev.max_selected(in, budget) == -1);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("bad input returns a clear error naming the parameter and leaves the outputs untouched", T, float,
                   half_t, bfloat16_t) {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 24, s.d = 8, s.window = 8, s.hidden = 16;
  kvtest::problem p = kvtest::make_problem(s, 3200);
  kvtest::quantize<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, layout::nhd, st);
  using R = kv::presets::restkv;
  kv::evictor<R, kv::cpu::backend> ev;
  const auto b12 = kv::budget_request::tokens(12);
  {  // sanity: the unmodified inputs work
    auto ok = kvtest::run_lib(ev, st.in, b12);
    REQUIRE_MESSAGE(ok.st.ok(), ok.st.message());
  }
  SUBCASE("shape mismatch") {
    auto in = st.in;
    in.values.extent[2] = s.cap - 1;
    expect_error(ev, in, b12, kv::errc::shape_mismatch, "values");
    in = st.in;
    in.queries.extent[3] = s.d - 1;
    expect_error(ev, in, b12, kv::errc::shape_mismatch, "head_dim");
    in = st.in;
    in.wo_factor.extent[0] = 3;
    expect_error(ev, in, b12, kv::errc::shape_mismatch, "wo_factor");
    in = st.in;
    std::vector<std::int32_t> lens = {24, 24, 24};
    in.lengths = kv::per_head_lengths(lens.data(), 1, 3);
    expect_error(ev, in, b12, kv::errc::shape_mismatch, "lengths");
  }
  SUBCASE("q_heads not a multiple of kv_heads") {
    auto in = st.in;
    in.queries.extent[1] = 3;
    expect_error(ev, in, b12, kv::errc::invalid_argument, "q_heads");
  }
  SUBCASE("window > seq_len") {
    auto in = st.in;
    in.keys.extent[2] = 6;
    in.values.extent[2] = 6;
    expect_error(ev, in, kv::budget_request::tokens(8), kv::errc::invalid_argument, "window");
  }
  SUBCASE("budget < window, and malformed budgets") {
    expect_error(ev, st.in, kv::budget_request::tokens(7), kv::errc::invalid_argument, "budget.keep_tokens");
    expect_error(ev, st.in, kv::budget_request::tokens(0), kv::errc::invalid_argument, "budget");
    expect_error(ev, st.in, kv::budget_request::fraction(1.5), kv::errc::invalid_argument, "keep_fraction");
    kv::budget_request both;
    both.keep_tokens = 10;
    both.keep_fraction = 0.5;
    expect_error(ev, st.in, both, kv::errc::invalid_argument, "exactly one");
  }
  SUBCASE("alpha outside (0, 1]") {
    for (float a : {0.0f, -0.5f, 1.0001f, std::numeric_limits<float>::quiet_NaN()}) {
      auto prm = R::defaults();
      prm.temporal.alpha = a;
      kv::evictor<R, kv::cpu::backend> bad(prm);
      expect_error(bad, st.in, b12, kv::errc::invalid_argument, "alpha");
    }
  }
  SUBCASE("even kernel width, bad k_min / beta / tau / gqa") {
    auto prm = R::defaults();
    prm.spatial.k_min = 6;
    expect_error(kv::evictor<R, kv::cpu::backend>(prm), st.in, b12, kv::errc::invalid_argument, "k_min");
    prm = R::defaults();
    prm.spatial.beta = 0.0f;
    expect_error(kv::evictor<R, kv::cpu::backend>(prm), st.in, b12, kv::errc::invalid_argument, "beta");
    prm = R::defaults();
    prm.scorer.tau = -1.0f;
    expect_error(kv::evictor<R, kv::cpu::backend>(prm), st.in, b12, kv::errc::invalid_argument, "tau");
    prm = R::defaults();
    prm.gqa = static_cast<kv::gqa_reduction>(9);
    expect_error(kv::evictor<R, kv::cpu::backend>(prm), st.in, b12, kv::errc::invalid_argument, "gqa");
    auto sp = kv::presets::snapkv::defaults();
    sp.spatial.kernel = 4;
    expect_error(kv::evictor<kv::presets::snapkv, kv::cpu::backend>(sp), st.in, b12, kv::errc::invalid_argument, "kernel");
  }
  SUBCASE("null pointers") {
    auto in = st.in;
    in.keys.data = nullptr;
    expect_error(ev, in, b12, kv::errc::null_pointer, "keys");
    in = st.in;
    in.values.data = nullptr;
    expect_error(ev, in, b12, kv::errc::null_pointer, "values");
    in = st.in;
    in.queries.data = nullptr;
    expect_error(ev, in, b12, kv::errc::null_pointer, "queries");
    in = st.in;
    in.wo_factor.data = nullptr;
    expect_error(ev, in, b12, kv::errc::null_pointer, "wo_factor");
    expect_error(ev, st.in, b12, kv::errc::null_pointer, "indptr", 0, 0, true);
  }
  SUBCASE("NaN / inf in K, V, Q and W_O factor") {
    const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    for (float v : bad) {
      CAPTURE(v);
      kvtest::stored<T> s2;
      kvtest::problem q = p;
      q.K[q.kv_idx(0, 1, 5, 3)] = static_cast<double>(v);
      kvtest::store(q, layout::nhd, s2);
      expect_error(ev, s2.in, b12, kv::errc::non_finite_input, "keys");
      q = p;
      q.V[q.kv_idx(0, 0, 23, 0)] = static_cast<double>(v);
      kvtest::store(q, layout::nhd, s2);
      expect_error(ev, s2.in, b12, kv::errc::non_finite_input, "values");
      q = p;
      q.Q[q.q_idx(0, 3, 7, 7)] = static_cast<double>(v);
      kvtest::store(q, layout::nhd, s2);
      expect_error(ev, s2.in, b12, kv::errc::non_finite_input, "queries");
      kvtest::store(p, layout::nhd, s2);
      s2.R[5] = v;
      expect_error(ev, s2.in, b12, kv::errc::non_finite_input, "wo_factor");
    }
    // a value that overflows the storage type on the way in (fp16: 1e6 -> inf)
    if (std::is_same<T, half_t>::value) {
      kvtest::stored<T> s2;
      kvtest::problem q = p;
      q.K[q.kv_idx(0, 0, 0, 0)] = 1e6;
      kvtest::store(q, layout::nhd, s2);
      expect_error(ev, s2.in, b12, kv::errc::non_finite_input, "keys");
    }
  }
  SUBCASE("insufficient workspace and capacity; bad lengths, layer index, strides, per-query-head without queries") {
    expect_error(ev, st.in, b12, kv::errc::insufficient_workspace, "workspace", 0, 1);
    expect_error(ev, st.in, b12, kv::errc::insufficient_capacity, "capacity", 1, 0);
    auto in = st.in;
    std::vector<std::int32_t> lens = {24, 25};
    in.lengths = kv::per_head_lengths(lens.data(), 1, 2);
    expect_error(ev, in, b12, kv::errc::invalid_argument, "lengths");
    in = st.in;
    in.layer_idx = 1;
    expect_error(ev, in, b12, kv::errc::invalid_argument, "layer_idx");
    in = st.in;
    in.keys.stride[2] = -1;
    expect_error(ev, in, b12, kv::errc::invalid_argument, "stride");
    auto kp = kv::presets::key_norm::defaults();
    kp.gqa = kv::gqa_reduction::per_query_head;
    in = st.in;
    in.queries.data = nullptr;
    expect_error(kv::evictor<kv::presets::key_norm, kv::cpu::backend>(kp), in, b12, kv::errc::invalid_argument, "per_query_head");
  }
}

TEST_CASE("row_finite (the NaN scan's vectorised row test) equals is_finite_value on every 16-bit pattern and every "
          "float exponent, at every position of rows of 1 to 70 elements") {
  // every half and bfloat16 bit pattern, alone and at each position of a row of finite values
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const half_t h{static_cast<std::uint16_t>(u)};
    const bfloat16_t b{static_cast<std::uint16_t>(u)};
    if (kv::cpu::detail::row_finite(&h, 1) != kv::is_finite_value(h) ||
        kv::cpu::detail::row_finite(&b, 1) != kv::is_finite_value(b)) {
      FAIL("row_finite differs from is_finite_value at bits 0x" << std::hex << u);
    }
  }
  // float: every exponent with a few mantissas and both signs
  for (std::uint32_t e = 0; e < 256; ++e)
    for (std::uint32_t m : {0u, 1u, 0x400000u, 0x7fffffu})
      for (std::uint32_t sgn : {0u, 0x80000000u}) {
        const std::uint32_t u = sgn | (e << 23) | m;
        float f;
        std::memcpy(&f, &u, sizeof f);
        CHECK(kv::cpu::detail::row_finite(&f, 1) == kv::is_finite_value(f));
      }
  // one bad element at every position of every row length (vector bodies and remainders)
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  int misses = 0;
  for (std::int64_t n = 1; n <= 70; ++n) {
    std::vector<float> f(static_cast<std::size_t>(n), 1.5f);
    std::vector<half_t> h(static_cast<std::size_t>(n), kv::from_float<half_t>(-2.0f));
    std::vector<bfloat16_t> b(static_cast<std::size_t>(n), kv::from_float<bfloat16_t>(3.0f));
    misses += !kv::cpu::detail::row_finite(f.data(), n) + !kv::cpu::detail::row_finite(h.data(), n) +
              !kv::cpu::detail::row_finite(b.data(), n);
    for (std::int64_t i = 0; i < n; ++i)
      for (float v : bad) {
        const std::size_t k = static_cast<std::size_t>(i);
        f[k] = v, h[k] = kv::from_float<half_t>(v), b[k] = kv::from_float<bfloat16_t>(v);
        misses += kv::cpu::detail::row_finite(f.data(), n) + kv::cpu::detail::row_finite(h.data(), n) +
                  kv::cpu::detail::row_finite(b.data(), n);
        f[k] = 1.5f, h[k] = kv::from_float<half_t>(-2.0f), b[k] = kv::from_float<bfloat16_t>(3.0f);
      }
  }
  CHECK(misses == 0);
}

TEST_CASE_TEMPLATE("the NaN scan's memory-order pass finds a NaN in every valid element of K and Q in every layout, and in no other",
                   T, float, bfloat16_t) {
  // cpu::detail::any_nonfinite reads slot-major when a slot's heads lie side by side (NHD) and
  // head-major otherwise; scan_finite names the first bad element in (b, h, s, d) order. The
  // slots past a head's length, the padding and the query rows before a short head's window
  // hold NaN throughout. Ragged lengths (an empty head), equal ones (NHD: the slots every head
  // holds are read as one block) and one KV head.
  struct shape_case {
    std::int64_t kv_heads;
    std::vector<std::int32_t> lens;
  };
  const std::vector<shape_case> shapes = {{3, {5, 11, 0, 9, 2, 11}}, {3, {11, 11, 11, 7, 7, 7}}, {1, {7, 3}}};
  const T nan = kv::from_float<T>(std::numeric_limits<float>::quiet_NaN()), ninf = kv::from_float<T>(-std::numeric_limits<float>::infinity());
  int cases = 0, expected = 0;
  for (const shape_case& sc : shapes) {
    kvtest::shape sh;
    sh.batch = 2, sh.kv_heads = sc.kv_heads, sh.group = 2, sh.cap = 11, sh.d = 3, sh.window = 4, sh.hidden = 8;
    for (layout l : {layout::hnd, layout::nhd, layout::padded, layout::interleaved}) {
      CAPTURE(kvtest::to_string(l));
      CAPTURE(sc.kv_heads);
      const kvtest::problem p = kvtest::make_problem(sh, 4242, 1.0, 1.0, 1.0, sc.lens);
      kvtest::stored<T> st;
      kvtest::store(p, l, st);
      const auto& in = st.in;
      auto kv_rows = [&](std::int64_t b, std::int64_t h, std::int64_t* r0, std::int64_t* r1) {
        *r0 = 0;
        *r1 = in.length(b, h);
      };
      const std::int64_t G = in.group_size(), W = in.window();
      auto q_rows = [&](std::int64_t b, std::int64_t hq, std::int64_t* r0, std::int64_t* r1) {
        *r0 = W - std::min<std::int64_t>(W, in.length(b, hq / G));
        *r1 = W;
      };
      auto elem = [](std::vector<T>& buf, const auto& v, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t c) -> T& {
        return buf[static_cast<std::size_t>(&v(b, h, s, c) - buf.data())];
      };
      for (std::int64_t b = 0; b < 2; ++b)  // the query rows no head's window reaches: NaN
        for (std::int64_t hq = 0; hq < in.queries.extent[1]; ++hq) {
          std::int64_t r0, r1;
          q_rows(b, hq, &r0, &r1);
          for (std::int64_t s = 0; s < r0; ++s)
            for (std::int64_t c = 0; c < 3; ++c) elem(st.qbuf, in.queries, b, hq, s, c) = nan;
        }
      REQUIRE_FALSE(kv::cpu::detail::any_nonfinite(in.keys, kv_rows));
      REQUIRE_FALSE(kv::cpu::detail::any_nonfinite(in.queries, q_rows));
      REQUIRE(kv::cpu::detail::scan_finite(in.queries, "queries", q_rows).ok());
      auto each_valid = [&](const auto& v, std::vector<T>& buf, auto rows, const char* name) {
        for (std::int64_t b = 0; b < v.extent[0]; ++b)
          for (std::int64_t h = 0; h < v.extent[1]; ++h) {
            std::int64_t r0, r1;
            rows(b, h, &r0, &r1);
            for (std::int64_t s = r0; s < r1; ++s)
              for (std::int64_t c = 0; c < v.extent[3]; ++c) {
                T& x = elem(buf, v, b, h, s, c);
                const T keep = x;
                x = ninf;
                const bool found = kv::cpu::detail::any_nonfinite(v, rows);
                const kv::status e = kv::cpu::detail::scan_finite(v, name, rows);
                x = keep;
                CHECK(found);
                const std::string want = std::string(name) + "(b=" + std::to_string(b) + ", h=" + std::to_string(h) +
                                         ", s=" + std::to_string(s) + ", d=" + std::to_string(c) + ") = -inf";
                CHECK(std::string(e.message()).find(want) != std::string::npos);
                ++cases;
              }
          }
      };
      each_valid(in.keys, st.kbuf, kv_rows, "keys");
      each_valid(in.queries, st.qbuf, q_rows, "queries");
      for (std::int32_t L : sc.lens) expected += 3 * (L + static_cast<int>(G * std::min<std::int64_t>(W, L)));  // K, then Q
    }
  }
  CHECK(cases == expected);
  CHECK(cases > 1000);
}

namespace {

/// Every valid element of K in turn NaN or -inf, through evictor<Policy>: the error names it as
/// the K scan does (cpu::detail::scan_finite's message), nothing is written; `whole` counts the
/// elements of heads kept whole (length <= budget: the scorer does not read them, run() scans
/// them after scoring). With the element's query row (the newest of head 0 of its group) NaN too,
/// and for a scorer that reads V with V bad too, K is still named first.
template <class Policy, class T>
void check_fused_key_scan(int* cases, int* whole, const typename Policy::params& params = Policy::defaults()) {
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 3, sh.group = 2, sh.cap = 11, sh.d = 3, sh.window = 4, sh.hidden = 8;
  const std::vector<std::int32_t> lens = {5, 11, 0, 9, 2, 11};
  const T ninf = kv::from_float<T>(-std::numeric_limits<float>::infinity());
  const T nan = kv::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  kv::evictor<Policy, kv::cpu::backend> ev(params);
  kv::evictor<kv::presets::streaming_llm, kv::cpu::backend> sl;
  const auto budget = kv::budget_request::tokens(6);
  for (layout l : {layout::hnd, layout::nhd}) {
    CAPTURE(kvtest::to_string(l));
    const kvtest::problem p = kvtest::make_problem(sh, 4343, 1.0, 1.0, 1.0, lens);
    kvtest::stored<T> st;
    kvtest::store(p, l, st);
    const auto& in = st.in;
    const auto ok = kvtest::run_lib(ev, in, budget);
    const std::string why = std::string(Policy::scorer::name) + ": " + ok.st.message();
    REQUIRE_MESSAGE(ok.st.ok(), why);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 3; ++h)
        for (std::int64_t s = 0; s < in.length(b, h); ++s)
          for (std::int64_t c = 0; c < 3; ++c) {
            T& x = st.kbuf[static_cast<std::size_t>(&in.keys(b, h, s, c) - st.kbuf.data())];
            const T keep = x;
            x = (s + c) % 2 ? ninf : nan;
            const std::string want = "keys(b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", s=" + std::to_string(s) +
                                     ", d=" + std::to_string(c) + ") = " + ((s + c) % 2 ? "-inf" : "nan");
            const auto r = kvtest::run_lib(ev, in, budget);
            CHECK(r.st.code() == kv::errc::non_finite_input);
            CHECK_MESSAGE(std::string(r.st.message()).find(want) != std::string::npos, r.st.message());
            for (std::int64_t v : r.indptr) CHECK(v == -7);
            for (float v : r.scores) CHECK(v == -7.0f);
            if (c == 0 && Policy::scorer::needs_queries) {  // K before the queries
              T& q = st.qbuf[static_cast<std::size_t>(&in.queries(b, h * 2, in.window() - 1, 1) - st.qbuf.data())];
              const T qkeep = q;
              q = nan;
              const auto rq = kvtest::run_lib(ev, in, budget);
              q = qkeep;
              CHECK_MESSAGE(std::string(rq.st.message()).find(want) != std::string::npos, rq.st.message());
            }
            if (c == 1 && Policy::scorer::needs_values) {  // K before V
              T& v = st.vbuf[static_cast<std::size_t>(&in.values(b, h, s, 2) - st.vbuf.data())];
              const T vkeep = v;
              v = nan;
              const auto rv = kvtest::run_lib(ev, in, budget);
              v = vkeep;
              CHECK_MESSAGE(std::string(rv.st.message()).find(want) != std::string::npos, rv.st.message());
            }
            const auto r2 = kvtest::run_lib(sl, in, budget);
            x = keep;
            CHECK_MESSAGE(r2.st.ok(), r2.st.message());  // StreamingLLM: positions only
            *whole += in.length(b, h) <= 6;
            ++*cases;
          }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("scorers that check K in their own pass (key norm, SnapKV, TOVA, ReST-KV, H2O, CriticalKV): the same error as the K scan, "
                   "scored heads and heads kept whole, nothing written; StreamingLLM reads no key", T, float, bfloat16_t) {
  // cpu::scorer_impl<S>::detects_nonfinite_keys: run() skips the K scan before scoring; a
  // non-finite key (key norm: a non-finite sum of squares; the window-attention scorers: a
  // non-finite fp64 logit of the newest window row, which sees every key) sends it to the scan,
  // which names the element, and the heads the scorer did not read are scanned after scoring.
  int cases = 0, whole = 0;
  check_fused_key_scan<kv::presets::key_norm, T>(&cases, &whole);
  check_fused_key_scan<kv::presets::snapkv, T>(&cases, &whole);
  auto tova = kv::presets::tova::defaults();
  tova.gqa = kv::gqa_reduction::mean;  // ragged lengths (layer_mean needs equal ones)
  check_fused_key_scan<kv::presets::tova, T>(&cases, &whole, tova);
  check_fused_key_scan<kv::presets::restkv, T>(&cases, &whole);
  check_fused_key_scan<kv::presets::h2o, T>(&cases, &whole);
  check_fused_key_scan<kv::presets::criticalkv, T>(&cases, &whole);
  CHECK(cases == 6 * 2 * 3 * (5 + 11 + 0 + 9 + 2 + 11));
  CHECK(whole == 6 * 2 * 3 * (5 + 2));
}

TEST_CASE("NaN/inf outside the valid region (padding) is never read; check_finite = false skips the scan") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 1, s.group = 1, s.cap = 20, s.d = 8, s.window = 4, s.hidden = 8;
  kvtest::problem p = kvtest::make_problem(s, 3300, 1.0, 1.0, 1.0, {20, 9});  // slots 9.. of seq 1 are NaN
  kvtest::stored<float> st;
  kvtest::store(p, layout::padded, st);  // padding NaN too
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
  auto lib = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(6));
  REQUIRE_MESSAGE(lib.st.ok(), lib.st.message());
  for (float x : lib.scores) CHECK(std::isfinite(x));
  CHECK(lib.kept(1).size() == 6);
  CHECK(lib.kept(1).back() == 8);
}

TEST_CASE("threads and workspace alignment do not change the result") {
  kvtest::shape s;
  s.batch = 3, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8, s.hidden = 32;
  kvtest::problem p = kvtest::make_problem(s, 3400, 1.0, 1.5, 1.0, {64, 64, 50, 41, 64, 20});
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  const auto budget = kv::budget_request::tokens(24);
  kv::evictor<kv::presets::restkv, kv::cpu::backend> ev1(kv::presets::restkv::defaults(), kv::cpu::backend{1});
  auto base = kvtest::run_lib(ev1, st.in, budget);
  REQUIRE(base.st.ok());
  for (int nt : {2, 3, 7}) {
    CAPTURE(nt);
    kv::evictor<kv::presets::restkv, kv::cpu::backend> ev(kv::presets::restkv::defaults(), kv::cpu::backend{nt});
    auto r = kvtest::run_lib(ev, st.in, budget);
    REQUIRE(r.st.ok());
    CHECK(r.indptr == base.indptr);
    CHECK(r.indices == base.indices);
    CHECK(r.scores == base.scores);
  }
  // a caller's workspace at an arbitrary address, exactly workspace_size() bytes
  const std::size_t ws = ev1.workspace_size(st.in);
  for (std::size_t off : {1u, 8u, 100u}) {
    CAPTURE(off);
    std::vector<unsigned char> w(ws + 512);
    unsigned char* aligned = w.data() + (256 - reinterpret_cast<std::uintptr_t>(w.data()) % 256) % 256;
    std::vector<std::int32_t> indptr(base.indptr.size()), idx(base.indices.size());
    std::vector<float> sc(base.scores.size());
    kv::selection_view sel{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())};
    const kv::status r = ev1.run(st.in, budget, sel, aligned + off, ws, sc.data());
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(indptr == base.indptr);
    CHECK(idx == base.indices);
    CHECK(sc == base.scores);
  }
}

TEST_CASE("gqa = layer_mean with unequal head lengths is rejected by name") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 1, s.cap = 20, s.d = 8, s.window = 4;
  kvtest::problem p = kvtest::make_problem(s, 3500, 1.0, 1.0, 1.0, {20, 18});
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  kv::evictor<kv::presets::tova, kv::cpu::backend> ev;
  expect_error(ev, st.in, kv::budget_request::tokens(8), kv::errc::invalid_argument, "layer_mean");
}

// ---- window attention internals -------------------------------------------------------------

namespace {
/// Mean index of the top-K of fl(p[i] * f) by (value desc, index asc), by a full stable sort.
double topk_mean_index_by_sort(const std::vector<float>& p, std::int64_t K, float f) {
  const std::int64_t n = static_cast<std::int64_t>(p.size());
  if (n == 0) return 0.0;
  K = std::max<std::int64_t>(1, std::min(K, n));
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) idx[static_cast<std::size_t>(i)] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](std::int64_t a, std::int64_t b) {
    return p[static_cast<std::size_t>(a)] * f > p[static_cast<std::size_t>(b)] * f;
  });
  double s = 0.0;
  for (std::int64_t i = 0; i < K; ++i) s += static_cast<double>(idx[static_cast<std::size_t>(i)]);
  return s / static_cast<double>(K);
}
}  // namespace

TEST_CASE("topk_mean_index (radix select) equals a full sort: ties, signed zeros, denormals, scaled weights") {
  kvtest::rng g(2026);
  std::int64_t cases = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const std::int64_t n = trial % 50 == 0 ? g.integer(2000, 40000) : g.integer(0, 400);
    const std::int64_t K = g.integer(-1, n + 2);
    const int kind = trial % 7;
    std::vector<float> p(static_cast<std::size_t>(n));
    for (float& x : p) {
      switch (kind) {
        case 0: x = static_cast<float>(std::exp(3.0 * g.normal())); break;           // softmax-like spread
        case 1: x = static_cast<float>(g.integer(0, 3)) * 0.25f; break;              // few values, many ties
        case 2: x = g.integer(0, 1) ? 0.0f : -0.0f; break;                           // signed zeros only
        case 3: x = std::ldexp(1.0f, -static_cast<int>(g.integer(0, 149))); break;   // normal .. denormal
        case 4: x = g.integer(0, 2) ? 1.0f : std::nextafter(1.0f, 0.0f); break;      // one crowded bucket
        case 5: x = 1e-3f * (1.0f + static_cast<float>(g.integer(0, 7)) * 1e-7f); break;  // ulp-apart values
        default: x = static_cast<float>(g.uniform()); x = g.integer(0, 9) == 0 ? 0.0f : x; break;
      }
    }
    const float f = trial % 3 == 0 ? 1.0f : static_cast<float>(g.uniform(1e-3, 2.0));
    std::vector<std::uint32_t> vals(p.size() + 1);
    const double got = kv::cpu::detail::topk_mean_index(p.data(), n, K, vals.data(), f);
    const double want = topk_mean_index_by_sort(p, K, f);
    if (got != want) {
      CAPTURE(trial);
      CAPTURE(n);
      CAPTURE(K);
      CAPTURE(kind);
      CHECK(got == want);
    }
    ++cases;
  }
  CHECK(cases == 6000);
}

TEST_CASE("attention_block: a GQA group in one call equals its heads one at a time and an fp64 softmax; unnormalised "
          "and in-place weights give the probabilities bit for bit") {
  namespace cd = kv::cpu::detail;
  kvtest::rng g(7);
  for (const std::int64_t L : {1, 5, 33, 1023, 1024, 1025, 2100}) {
    for (const std::int64_t G : {1, 3, 4}) {
      const std::int64_t d = 24, w = std::min<std::int64_t>(L, 20), rb = w;
      std::vector<float> k(static_cast<std::size_t>(L * d)), q(static_cast<std::size_t>(G * rb * d));
      for (float& x : k) x = static_cast<float>(g.normal());
      for (float& x : q) x = static_cast<float>(2.0 * g.normal());
      if (L == 1025 && G == 3) q[static_cast<std::size_t>(d * rb + 2)] = 3e38f;  // head 1, row 0: logits overflow -> fp64 path
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
      const std::size_t rows = static_cast<std::size_t>(G * rb), n = rows * static_cast<std::size_t>(L);
      std::vector<float> lg(n), pr(n), lg2(n), pr2(n), lg3(n);
      std::vector<float> mx(rows), mx2(rows), mx3(rows), iz(rows), iz2(rows), iz3(rows);
      std::vector<double> zo(rows), zo2(rows), zo3(rows);
      std::vector<std::int32_t> am(rows), am2(rows), am3(rows);
      const cd::cmap_rm K(k.data(), L, d, Eigen::OuterStride<>(d)), Q(q.data(), G * rb, d, Eigen::OuterStride<>(d));
      cd::attention_block(Q, K, L, w, 0, rb, scale, lg.data(), pr.data(), cd::row_stats{mx.data(), zo.data(), am.data(), iz.data()});
      // Unnormalised into a second buffer, and in place over the logits.
      cd::attention_block(Q, K, L, w, 0, rb, scale, lg2.data(), pr2.data(), cd::row_stats{mx2.data(), zo2.data(), am2.data(), iz2.data()},
                          false);
      cd::attention_block(Q, K, L, w, 0, rb, scale, lg3.data(), lg3.data(), cd::row_stats{mx3.data(), zo3.data(), am3.data(), iz3.data()},
                          false);
      std::int64_t bad_bits = 0, bad_inplace = 0;
      for (std::size_t r = 0; r < rows; ++r)
        for (std::int64_t m = 0; m < L; ++m) {
          const std::size_t i = r * static_cast<std::size_t>(L) + static_cast<std::size_t>(m);
          bad_bits += bits_of(pr2[i] * iz2[r]) != bits_of(pr[i]);
          bad_inplace += bits_of(lg3[i]) != bits_of(pr2[i]);
        }
      CAPTURE(L);
      CAPTURE(G);
      CHECK(bad_bits == 0);
      CHECK(bad_inplace == 0);
      CHECK(iz == iz2);
      CHECK(am == am3);
      // One head at a time (rows of head h only), and the fp64 reference softmax.
      double worst = 0.0;
      for (std::int64_t h = 0; h < G; ++h) {
        const std::size_t hn = static_cast<std::size_t>(rb * L);
        std::vector<float> hl(hn), hp(hn), hm(static_cast<std::size_t>(rb)), hz(static_cast<std::size_t>(rb));
        std::vector<double> ho(static_cast<std::size_t>(rb));
        std::vector<std::int32_t> ha(static_cast<std::size_t>(rb));
        cd::attention_block(cd::cmap_rm(q.data() + h * rb * d, rb, d, Eigen::OuterStride<>(d)), K, L, w, 0, rb, scale, hl.data(),
                            hp.data(), cd::row_stats{hm.data(), ho.data(), ha.data(), hz.data()});
        for (std::int64_t r = 0; r < rb; ++r) {
          const std::size_t gr = static_cast<std::size_t>(h * rb + r);
          CHECK(ha[static_cast<std::size_t>(r)] == am[gr]);
          const std::int64_t vis = L - w + r + 1;
          std::vector<double> lo(static_cast<std::size_t>(vis));
          double top = -std::numeric_limits<double>::infinity();
          for (std::int64_t m = 0; m < vis; ++m) {
            double acc = 0.0;
            for (std::int64_t c = 0; c < d; ++c)
              acc += static_cast<double>(q[static_cast<std::size_t>((h * rb + r) * d + c)]) * k[static_cast<std::size_t>(m * d + c)];
            lo[static_cast<std::size_t>(m)] = acc * scale;
            top = std::max(top, acc * scale);
          }
          double z = 0.0;
          for (double x : lo) z += std::exp(x - top);
          for (std::int64_t m = 0; m < L; ++m) {
            const double want = m < vis ? std::exp(lo[static_cast<std::size_t>(m)] - top) / z : 0.0;
            const float got = pr[gr * static_cast<std::size_t>(L) + static_cast<std::size_t>(m)];
            const float one = hp[static_cast<std::size_t>(r * L + m)];
            worst = std::max(worst, std::fabs(got - want));
            worst = std::max(worst, std::fabs(static_cast<double>(one) - want));
            if (m >= vis) CHECK((got == 0.0f && one == 0.0f));
          }
        }
      }
      CHECK(worst < 2e-6);
    }
  }
}

// ---- plan / run ---------------------------------------------------------------------------

namespace {
/// run(plan) into fresh buffers of `cap` indices; sentinel -7 everywhere.
template <class Ev, class T>
kvtest::lib_result run_plan(const Ev& ev, const kv::eviction_plan& pl, const kv::layer_inputs<T>& in, std::int64_t cap,
                            std::vector<unsigned char>& ws) {
  kvtest::lib_result res;
  res.rows = in.batch() * ev.out_heads(in);
  res.cap = in.capacity();
  res.indptr.assign(static_cast<std::size_t>(res.rows + 1), -7);
  res.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(cap, 1)), -7);
  res.positions.assign(res.indices.size(), -7);
  res.scores.assign(static_cast<std::size_t>(res.rows * res.cap), -7.0f);
  kv::selection_view sel{res.indptr.data(), res.indices.data(), res.positions.data(), cap};
  res.st = ev.run(pl, in, sel, ws.data(), ws.size(), res.scores.data());
  return res;
}

template <class P>
void check_plan_reuse(std::uint64_t seed) {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8, s.hidden = 32;
  kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, {64, 50, 41, 64});
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  const auto budget = kv::budget_request::fraction(0.3);
  kv::evictor<P, kv::cpu::backend> ev(P::defaults(), kv::cpu::backend{2});
  kv::eviction_plan pl;
  REQUIRE(ev.plan(st.in, budget, &pl, kv::plan_options{3}).ok());
  CHECK(pl.valid);
  CHECK(pl.num_threads == 3);
  CHECK(pl.workspace_bytes == ev.workspace_size(st.in, kv::plan_options{3}));
  CHECK(pl.max_selected_exact);
  CHECK(pl.rows == s.batch * s.kv_heads);
  std::vector<unsigned char> ws(pl.workspace_bytes);
  const auto legacy = kvtest::run_lib(ev, st.in, budget);
  REQUIRE(legacy.st.ok());
  CHECK(pl.max_selected == legacy.indptr.back());  // exact
  CHECK(pl.max_selected == ev.max_selected(st.in, budget));
  for (int rep = 0; rep < 2; ++rep) {  // one plan, repeated runs: the same result as run(inputs, budget)
    const auto r = run_plan(ev, pl, st.in, pl.max_selected, ws);
    REQUIRE_MESSAGE(r.st.ok(), r.st.message());
    CHECK(r.indptr == legacy.indptr);
    CHECK(r.indices == legacy.indices);
    CHECK(r.scores == legacy.scores);
  }
  // New lengths of the same shapes: the plan still serves; the result is that of a fresh plan.
  st.lens = {30, 50, 20, 17};  // (slots past the first lengths hold NaN: the new lengths are shorter)
  const auto fresh = kvtest::run_lib(ev, st.in, budget);
  REQUIRE_MESSAGE(fresh.st.ok(), std::string(fresh.st.message()));
  const auto r2 = run_plan(ev, pl, st.in, 4 * 64, ws);
  REQUIRE_MESSAGE(r2.st.ok(), r2.st.message());
  CHECK(r2.indptr == fresh.indptr);
  CHECK(std::vector<std::int32_t>(r2.indices.begin(), r2.indices.begin() + r2.indptr.back()) ==
        std::vector<std::int32_t>(fresh.indices.begin(), fresh.indices.begin() + fresh.indptr.back()));
  CHECK(r2.scores == fresh.scores);
  // ... but lengths outside [0, seq] are data errors that run(plan) still catches, writing nothing.
  st.lens = {30, 65, 64, 17};
  const auto bad = run_plan(ev, pl, st.in, 4 * 64, ws);
  CHECK(bad.st.code() == kv::errc::invalid_argument);
  CHECK(std::string(bad.st.message()).find("lengths(b=0, h=1) = 65") != std::string::npos);
  CHECK(std::all_of(bad.indptr.begin(), bad.indptr.end(), [](std::int32_t x) { return x == -7; }));
  CHECK(std::all_of(bad.scores.begin(), bad.scores.end(), [](float x) { return x == -7.0f; }));
}
}  // namespace

TEST_CASE("plan / run: one plan serves repeated runs and new lengths of the same shapes; max_selected is exact") {
  SUBCASE("per-head budgets (ReST-KV)") { check_plan_reuse<kv::presets::restkv>(3500); }
  SUBCASE("per-head budgets by layer (PyramidKV)") { check_plan_reuse<kv::presets::pyramidkv>(3501); }
  SUBCASE("score-driven budgets (AdaKV)") { check_plan_reuse<kv::presets::adakv>(3502); }
  SUBCASE("no scores (StreamingLLM)") { check_plan_reuse<kv::presets::streaming_llm>(3503); }
}

TEST_CASE("plan / run: a plan of another evictor, a stale plan and inputs of other shapes are rejected; nothing written") {
  kvtest::shape s;
  s.batch = 1, s.kv_heads = 2, s.group = 2, s.cap = 48, s.d = 16, s.window = 8, s.hidden = 32;
  kvtest::problem p = kvtest::make_problem(s, 3510);
  kvtest::stored<float> st;
  kvtest::store(p, layout::hnd, st);
  const auto budget = kv::budget_request::tokens(16);
  using P = kv::presets::restkv;
  kv::evictor<P, kv::cpu::backend> ev, other;
  kv::eviction_plan pl;
  REQUIRE(ev.plan(st.in, budget, &pl).ok());
  std::vector<unsigned char> ws(pl.workspace_bytes);
  auto expect_rejected = [&](const kv::evictor<P, kv::cpu::backend>& e, const kv::eviction_plan& plan,
                             const kv::layer_inputs<float>& in, const char* what) {
    CAPTURE(what);
    const auto r = run_plan(e, plan, in, 64, ws);
    CHECK(r.st.code() == kv::errc::invalid_argument);
    CHECK_MESSAGE(std::string(r.st.message()).find(what) != std::string::npos, r.st.message());
    CHECK(std::all_of(r.indptr.begin(), r.indptr.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(std::all_of(r.indices.begin(), r.indices.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(std::all_of(r.scores.begin(), r.scores.end(), [](float x) { return x == -7.0f; }));
  };
  expect_rejected(ev, kv::eviction_plan{}, st.in, "not valid");
  expect_rejected(other, pl, st.in, "another evictor");
  kv::layer_inputs<float> shorter = st.in;
  shorter.keys.extent[2] = 40;  // other shapes
  shorter.values.extent[2] = 40;
  expect_rejected(ev, pl, shorter, "do not match the plan");
  kv::layer_inputs<float> other_layer = st.in;
  other_layer.num_layers = 2;
  other_layer.layer_idx = 1;
  expect_rejected(ev, pl, other_layer, "do not match the plan");
  // A copy is another owner; a failed plan() leaves the caller's plan untouched.
  const kv::evictor<P, kv::cpu::backend> copy = ev;
  expect_rejected(copy, pl, st.in, "another evictor");
  kv::eviction_plan kept = pl;
  CHECK(ev.plan(st.in, kv::budget_request::tokens(0), &kept).code() == kv::errc::invalid_argument);
  {
    const kv::status neg = ev.plan(st.in, budget, &kept, kv::plan_options{-1});
    CHECK(neg.code() == kv::errc::invalid_argument);
    CHECK(std::string(neg.message()).find("plan_options.num_threads = -1") != std::string::npos);
  }
  CHECK(kept.workspace_bytes == pl.workspace_bytes);
  CHECK(kept.valid);
  {
    const auto ok = run_plan(ev, kept, st.in, pl.max_selected, ws);
    CHECK_MESSAGE(ok.st.ok(), ok.st.message());
  }
  // Changing the parameters makes every earlier plan stale (the workspace could differ).
  ev.params().scorer.aggregation = kv::scorers::output_reconstruction::mode::before;
  expect_rejected(ev, pl, st.in, "stale");
  kv::eviction_plan fresh;
  REQUIRE(ev.plan(st.in, budget, &fresh).ok());
  CHECK(fresh.workspace_bytes > pl.workspace_bytes);  // "before" mode holds every token's projections
  std::vector<unsigned char> ws2(fresh.workspace_bytes);
  const auto r = run_plan(ev, fresh, st.in, fresh.max_selected, ws2);
  CHECK_MESSAGE(r.st.ok(), r.st.message());
  CHECK(ev.plan(st.in, budget, nullptr).code() == kv::errc::null_pointer);
  // Too small a workspace for the plan.
  std::vector<unsigned char> small(fresh.workspace_bytes - 1);
  {
    std::vector<std::int32_t> ip(3, -7), ix(64, -7);
    kv::selection_view sv{ip.data(), ix.data(), nullptr, 64};
    CHECK(ev.run(fresh, st.in, sv, small.data(), small.size()).code() == kv::errc::insufficient_workspace);
    CHECK(std::all_of(ip.begin(), ip.end(), [](std::int32_t x) { return x == -7; }));
  }
}

namespace {
/// A user scorer that reads the window queries: s[n] = sum_j c_j (q_j . k_n) of the group's
/// first query head, c_j the policy's temporal weights as head_inputs gives them.
struct weighted_dot_scorer {
  struct params {};
  static constexpr const char* name = "weighted_dot";
  static constexpr bool needs_queries = true, needs_values = false, window_attention = false, has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static kv::status check(const params&) { return {}; }
};
/// The same scorer through the legacy hook (no specialisation).
struct weighted_dot_hook : weighted_dot_scorer {
  static void score_kv_head(const params&, const kv::cpu::head_inputs& in, float* out);
};
void weighted_dot(const kv::cpu::head_inputs& in, float* out) {
  for (std::int64_t n = 0; n < in.length; ++n) {
    double s = 0.0;
    for (std::int64_t j = 0; j < in.window; ++j) {
      double dot = 0.0;
      for (std::int64_t c = 0; c < in.head_dim; ++c) dot += double(in.queries[j * in.head_dim + c]) * in.keys[n * in.head_dim + c];
      s += double(in.temporal_weights[j]) * dot;
    }
    out[n] = static_cast<float>(s);
  }
}
void weighted_dot_hook::score_kv_head(const params&, const kv::cpu::head_inputs& in, float* out) { weighted_dot(in, out); }
}  // namespace

template <>
struct kvevict::cpu::scorer_impl<weighted_dot_scorer> : kvevict::cpu::head_scorer<kvevict::cpu::scorer_impl<weighted_dot_scorer>> {
  static void score_head(const weighted_dot_scorer::params&, const kvevict::cpu::head_inputs& in, float* out) { weighted_dot(in, out); }
};

TEST_CASE("a user scorer through cpu::scorer_impl sees the policy's temporal weights; the legacy hook gives the same") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 3, s.cap = 40, s.d = 8, s.window = 6, s.hidden = 0;
  kvtest::problem p = kvtest::make_problem(s, 3520, 1.0, 1.0, 1.0, {40, 33, 20, 40});
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  using trait_p = kv::eviction_policy<weighted_dot_scorer, kv::temporal::ema>;
  using hook_p = kv::eviction_policy<weighted_dot_hook, kv::temporal::ema>;
  const auto budget = kv::budget_request::tokens(12);
  const auto a = kvtest::run_lib(kv::evictor<trait_p, kv::cpu::backend>(), st.in, budget);
  const auto b = kvtest::run_lib(kv::evictor<hook_p, kv::cpu::backend>(), st.in, budget);
  REQUIRE_MESSAGE(a.st.ok(), a.st.message());
  REQUIRE(b.st.ok());
  CHECK(a.indptr == b.indptr);
  CHECK(a.indices == b.indices);
  CHECK(a.scores == b.scores);
  // fp64 reference: EMA(alpha 0.3) weights over the effective window w = min(W, L), query head
  // h G (the group's first), window rows oldest first; scored slots only.
  const double alpha = 0.3;
  int checked = 0;
  for (std::int64_t bq = 0; bq < s.batch; ++bq)
    for (std::int64_t h = 0; h < s.kv_heads; ++h) {
      const std::int64_t L = p.length(bq, h), w = std::min<std::int64_t>(s.window, L), r = bq * s.kv_heads + h;
      const kvref::mat K = p.keys(bq, h), Q = p.queries(bq, h * s.group, w);
      for (std::int64_t n = 0; n < L - w; ++n) {  // candidates (the window is protected)
        double want = 0.0;
        for (std::int64_t j = 0; j < w; ++j) {
          const double c = j == 0 ? std::pow(1.0 - alpha, double(w - 1)) : alpha * std::pow(1.0 - alpha, double(w - 1 - j));
          double dot = 0.0;
          for (std::int64_t k = 0; k < s.d; ++k) dot += Q(j, k) * K(n, k);
          want += c * dot;
        }
        CHECK(a.row_scores(r)[n] == doctest::Approx(want).epsilon(1e-5));
        ++checked;
      }
    }
  CHECK(checked > 100);
}

TEST_CASE("plan / run: parameters changed through a reference held across plan(), and a tampered plan, never reach the kernels") {
  kvtest::shape s;
  s.batch = 2, s.kv_heads = 2, s.group = 2, s.cap = 64, s.d = 16, s.window = 8, s.hidden = 0;
  kvtest::problem p = kvtest::make_problem(s, 3530, 1.0, 1.5, 1.0, {64, 50, 41, 64});
  kvtest::stored<float> st;
  kvtest::store(p, layout::nhd, st);
  const auto budget = kv::budget_request::tokens(16);
  using P = kv::presets::snapkv;
  auto expect_rejected = [&](const kv::evictor<P, kv::cpu::backend>& e, const kv::eviction_plan& plan, const char* what,
                             kv::errc code = kv::errc::invalid_argument) {
    CAPTURE(what);
    std::vector<unsigned char> ws(plan.workspace_bytes + 64, 0xAB);
    const auto r = run_plan(e, plan, st.in, std::max<std::int64_t>(plan.max_selected, 1), ws);
    CHECK(r.st.code() == code);
    CHECK_MESSAGE(std::string(r.st.message()).find(what) != std::string::npos, std::string(r.st.message()));
    CHECK(std::all_of(r.indptr.begin(), r.indptr.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(std::all_of(r.indices.begin(), r.indices.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(std::all_of(r.scores.begin(), r.scores.end(), [](float x) { return x == -7.0f; }));
  };
  {  // protection raised after plan(): each row would keep more than its budget (past the capacity)
    kv::evictor<P, kv::cpu::backend> ev;
    auto& prm = ev.params();
    kv::eviction_plan pl;
    REQUIRE(ev.plan(st.in, budget, &pl).ok());
    prm.selector.num_sink = 40;
    expect_rejected(ev, pl, "stale");
    prm.selector.num_sink = 0;  // the same bytes again: the plan is current again
    std::vector<unsigned char> ws(pl.workspace_bytes);
    CHECK(run_plan(ev, pl, st.in, pl.max_selected, ws).st.ok());
    prm.selector.num_sink = -5;  // invalid: Policy::check would reject it
    expect_rejected(ev, pl, "stale");
    prm.selector.num_sink = 0;
    prm.spatial.kernel = 0;  // a zero-width pooling kernel (division by zero if it ran)
    expect_rejected(ev, pl, "stale");
  }
  {  // the assignment route: ev = x copies x's generation, but not the parameters the plan saw
    kv::evictor<P, kv::cpu::backend> ev, x;
    kv::eviction_plan pl;
    REQUIRE(ev.plan(st.in, budget, &pl).ok());
    x = ev;
    x.params().selector.num_recent = 40;
    ev = x;
    expect_rejected(ev, pl, "stale");
  }
  {  // tampered plan fields
    kv::evictor<P, kv::cpu::backend> ev;
    kv::eviction_plan pl;
    REQUIRE(ev.plan(st.in, budget, &pl).ok());
    kv::eviction_plan t = pl;
    t.budget.keep_tokens = 1;  // below the protected window
    expect_rejected(ev, t, "budget.keep_tokens = 1");
    t = pl;
    t.budget.keep_fraction = 0.5;  // both forms set
    expect_rejected(ev, t, "both set");
    t = pl;
    t.rows += 1;
    expect_rejected(ev, t, "plan.rows = 5");
    t = pl;
    t.workspace_bytes = 16;  // run() counts what it needs
    expect_rejected(ev, t, "needed", kv::errc::insufficient_workspace);
    t = pl;
    t.num_threads = 100000;  // more threads than the workspace holds scratch for
    expect_rejected(ev, t, "needed", kv::errc::insufficient_workspace);
    t = pl;
    t.num_threads = 0;  // clamped to one thread: the same result
    std::vector<unsigned char> ws(pl.workspace_bytes);
    const auto a = run_plan(ev, t, st.in, pl.max_selected, ws), b = run_plan(ev, pl, st.in, pl.max_selected, ws);
    REQUIRE(a.st.ok());
    CHECK(a.indices == b.indices);
  }
}

TEST_CASE("gemm_nt_few_rows (the BLAS build's products of <= 8 rows, TOVA's) against fp64 loops; a NaN or inf key "
          "makes its whole column non-finite") {
  // include/kvevict/backends/cpu/gemm.hpp: compiled in every build (the BLAS build calls it), so
  // the default build tests it too. Every m in [1, few_rows_max], k with and without a tail of
  // the 16 partial sums, leading dimensions wider than the rows.
  std::uint64_t state = 99;
  auto uniform = [&]() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(state >> 40) / static_cast<double>(1ull << 24)) * 2.0f - 1.0f;
  };
  int checked = 0;
  for (std::int64_t m = 1; m <= kv::cpu::detail::few_rows_max; ++m)
    for (std::int64_t k : {1, 3, 16, 17, 64, 128, 131})
      for (std::int64_t n : {1, 5, 40}) {
        const std::int64_t lda = k + 3, ldb = k + 1, ldc = n + 2;
        std::vector<float> a(static_cast<std::size_t>(m * lda)), b(static_cast<std::size_t>(n * ldb)), c(static_cast<std::size_t>(m * ldc), -7.0f);
        for (float& x : a) x = uniform();
        for (float& x : b) x = uniform();
        const float alpha = 0.125f;
        kv::cpu::detail::gemm_nt_few_rows(alpha, a.data(), lda, b.data(), ldb, m, n, k, c.data(), ldc);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double ref = 0.0, mag = 0.0;
            for (std::int64_t t = 0; t < k; ++t) {
              ref += static_cast<double>(a[static_cast<std::size_t>(i * lda + t)]) * b[static_cast<std::size_t>(j * ldb + t)];
              mag += std::abs(static_cast<double>(a[static_cast<std::size_t>(i * lda + t)]) * b[static_cast<std::size_t>(j * ldb + t)]);
            }
            ref *= alpha;
            CHECK(std::abs(c[static_cast<std::size_t>(i * ldc + j)] - ref) <= 1e-5 * alpha * mag + 1e-30);  // fp32: 16 partial sums of <= 9 terms, then <= 19 adds
            ++checked;
          }
          for (std::int64_t j = n; j < ldc; ++j) CHECK(c[static_cast<std::size_t>(i * ldc + j)] == -7.0f);  // past n: untouched
        }
        // a NaN, +inf or -inf anywhere in key j (a = 0 there included: 0 x inf = NaN): column j is
        // non-finite in every row, the other columns are finite
        const std::int64_t j = n / 2, t = (k * 2) / 3;
        for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
          std::vector<float> bb = b, aa = a;
          bb[static_cast<std::size_t>(j * ldb + t)] = bad;
          aa[static_cast<std::size_t>(t)] = 0.0f;  // row 0 multiplies it by zero
          kv::cpu::detail::gemm_nt_few_rows(alpha, aa.data(), lda, bb.data(), ldb, m, n, k, c.data(), ldc);
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t jj = 0; jj < n; ++jj)
              CHECK(std::isfinite(c[static_cast<std::size_t>(i * ldc + jj)]) == (jj != j));
        }
      }
  CHECK(checked == 36 * 7 * 46);
}

TEST_CASE("topk_slots (select_head's top-k) keeps exactly the set nth_element by score_before keeps: ties, NaN, -0/+0, inf, crowded buckets") {
  // include/kvevict/backends/cpu/select.hpp: the radix select against the comparison select it
  // replaced (nth_element by score_before, then a sort of the k slots), on rows with many equal
  // scores, NaNs of both signs, -0 and +0, +-inf, subnormals, and an offset first candidate c0.
  std::uint64_t state = 5;
  auto next = [&]() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(), 1.0f, -1.0f};
  int rows = 0;
  for (int kind = 0; kind < 6; ++kind)
    for (std::int64_t m : {2, 3, 17, 300, 5000}) {
      const std::int64_t c0 = m % 7;
      std::vector<float> s(static_cast<std::size_t>(c0 + m));
      for (float& x : s) {
        const std::uint64_t u = next();
        if (kind == 0) x = static_cast<float>(u % 1000) / 7.0f - 50.0f;             // spread
        else if (kind == 1) x = static_cast<float>(u % 5);                          // many ties
        else if (kind == 2) x = specials[u % 10];                                   // specials only
        else if (kind == 3) x = (u % 4 == 0) ? specials[u % 10] : static_cast<float>(u % 97) * 1e-3f;  // mixed
        // key norms: one sign and exponent, so a few top-bit buckets (the second radix level)
        else if (kind == 4) x = -(8.0f + static_cast<float>(u % 60000) * 1e-4f);
        else x = std::nextafter(2.5f, static_cast<float>(u % 2) * 9.0f) + static_cast<float>(u % 3) * 2.4e-7f;  // ulps apart (third)
      }
      for (std::int64_t k : {std::int64_t{1}, m / 3, m / 2, m - 1}) {
        if (k < 1 || k >= m) continue;
        std::vector<std::int32_t> ref(static_cast<std::size_t>(m)), got(static_cast<std::size_t>(k + 4), -1);
        for (std::int64_t i = 0; i < m; ++i) ref[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(c0 + i);
        std::nth_element(ref.begin(), ref.begin() + (k - 1), ref.end(), [&](std::int32_t a, std::int32_t b) {
          return kv::cpu::detail::score_before(s[static_cast<std::size_t>(a)], a, s[static_cast<std::size_t>(b)], b);
        });
        ref.resize(static_cast<std::size_t>(k));
        std::sort(ref.begin(), ref.end());
        std::vector<std::uint32_t> scratch(static_cast<std::size_t>(m));
        const std::int64_t n = kv::cpu::detail::topk_slots(s.data(), c0, m, k, got.data(), scratch.data());
        CAPTURE(kind);
        CAPTURE(m);
        CAPTURE(k);
        CHECK(n == k);
        for (std::int64_t i = k; i < k + 4; ++i) CHECK(got[static_cast<std::size_t>(i)] == -1);  // nothing past k
        got.resize(static_cast<std::size_t>(k));
        CHECK(got == ref);
        ++rows;
      }
    }
  CHECK(rows == 6 * (3 + 4 + 4 + 4 + 4));  // m = 2 and 3 repeat k = 1
}
