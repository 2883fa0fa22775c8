// Tests of LKV (kvevict/policies/learned.hpp, backends/cpu/learned.hpp, io/lkv_artifact.hpp) and
// of layer-wise prefill (examples/engine/layerwise_prefill.hpp), against independent naive
// references (sorting-based apportionment, double loops for the MLP, brute-force top-k).
#include <doctest/doctest.h>

#include <kvevict/backends/cpu/learned.hpp>

#include "layerwise_prefill.hpp"
#include "model_path.hpp"
#include "lkv_prng.hpp"
#include "tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace {

using lkv_test::prng;

// Reference LKV-H: clip loop, then floor + one unit each to the largest fractional parts
// (sorted; ties to the lower index). Independent of detail::apportion.
std::vector<std::int64_t> ref_budgets(const std::vector<float>& z, double temp, std::int64_t total, std::int64_t cap) {
  const std::size_t n = z.size();
  double mx = -1e300;
  for (float v : z) mx = std::max(mx, static_cast<double>(v) / temp);
  std::vector<double> r(n);
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += (r[i] = std::exp(static_cast<double>(z[i]) / temp - mx));
  for (auto& x : r) x /= s;
  std::vector<bool> clipped(n, false);
  std::vector<double> share(n, 0.0);
  for (;;) {
    double rs = 0, rest = static_cast<double>(total);
    for (std::size_t i = 0; i < n; ++i) {
      if (clipped[i]) rest -= static_cast<double>(cap);
      else rs += r[i];
    }
    bool any = false;
    for (std::size_t i = 0; i < n; ++i)
      if (!clipped[i]) {
        share[i] = r[i] / rs * rest;
        if (share[i] > static_cast<double>(cap)) any = true;
      }
    if (!any) break;
    for (std::size_t i = 0; i < n; ++i)
      if (!clipped[i] && share[i] > static_cast<double>(cap)) clipped[i] = true, share[i] = static_cast<double>(cap);
  }
  std::vector<std::int64_t> out(n);
  std::int64_t left = total;
  for (std::size_t i = 0; i < n; ++i) left -= (out[i] = static_cast<std::int64_t>(std::floor(share[i])));
  std::vector<std::size_t> ord(n);
  std::iota(ord.begin(), ord.end(), 0);
  std::stable_sort(ord.begin(), ord.end(), [&](std::size_t a, std::size_t b) {
    return share[a] - std::floor(share[a]) > share[b] - std::floor(share[b]);
  });
  for (std::size_t k = 0; k < n && left > 0; ++k)
    if (out[ord[k]] < cap) ++out[ord[k]], --left;
  return out;
}

// Naive MLP utility straight from the documented layout.
double ref_utility(const std::vector<float>& w, int L_idx, int H, int h, int d, int hid, const float* k, const float* v, bool relu) {
  const std::size_t block = static_cast<std::size_t>(hid * 2 * d + 2 * hid + 1);
  const float* p = w.data() + (static_cast<std::size_t>(L_idx) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)) * block;
  double u = p[block - 1];
  for (int j = 0; j < hid; ++j) {
    double a = p[hid * 2 * d + j];
    for (int i = 0; i < 2 * d; ++i) a += static_cast<double>(p[j * 2 * d + i]) * (i < d ? k[i] : v[i - d]);
    a = relu ? std::max(a, 0.0) : a / (1.0 + std::exp(-a));
    u += static_cast<double>(p[hid * 2 * d + hid + j]) * a;
  }
  return u;
}

// Top-b of float scores, ties to the lower index, ascending.
std::vector<std::int32_t> ref_topk(const std::vector<float>& s, std::int64_t b) {
  std::vector<std::int32_t> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t c) { return s[static_cast<std::size_t>(a)] > s[static_cast<std::size_t>(c)]; });
  idx.resize(static_cast<std::size_t>(std::min<std::int64_t>(b, static_cast<std::int64_t>(s.size()))));
  std::sort(idx.begin(), idx.end());
  return idx;
}

struct toy {
  int L, H, d, hid, T;
  std::vector<float> logits, mlp, K, V;  // K, V: (L, H, T, d)
  toy(int L_, int H_, int d_, int hid_, int T_, std::uint64_t seed) : L(L_), H(H_), d(d_), hid(hid_), T(T_) {
    prng g(seed);
    for (int i = 0; i < L * H; ++i) logits.push_back(g.sym(1.5));
    const int block = hid * 2 * d + 2 * hid + 1;
    for (int i = 0; i < L * H * block; ++i) mlp.push_back(g.sym(0.6));
    for (int i = 0; i < L * H * T * d; ++i) K.push_back(g.sym(2.0)), V.push_back(g.sym(1.0));
  }
  kvevict::layer_inputs<float> inputs(int l) const {
    kvevict::layer_inputs<float> in;
    in.keys = kvevict::make_kv_view<const float>(K.data() + static_cast<std::size_t>(l) * H * T * d, 1, H, T, d, kvevict::kv_layout::hnd);
    in.values = kvevict::make_kv_view<const float>(V.data() + static_cast<std::size_t>(l) * H * T * d, 1, H, T, d, kvevict::kv_layout::hnd);
    in.layer_idx = l;
    in.num_layers = L;
    return in;
  }
  kvevict::scorers::learned_mlp::params scorer() const {
    kvevict::scorers::learned_mlp::params p;
    p.weights = mlp.data();
    p.num_layers = L;
    p.kv_heads = H;
    p.head_dim = d;
    p.hidden = hid;
    return p;
  }
  kvevict::budgeters::headwise_learned::params budgeter() const {
    kvevict::budgeters::headwise_learned::params p;
    p.logits = logits.data();
    p.num_layers = L;
    p.kv_heads = H;
    return p;
  }
};

template <class Policy>
std::vector<std::vector<std::int32_t>> run_layer(const kvevict::evictor<Policy, kvevict::cpu::backend>& ev,
                                                 const kvevict::layer_inputs<float>& in, kvevict::budget_request b,
                                                 std::vector<float>* scores = nullptr) {
  const std::int64_t n = ev.max_selected(in, b);
  REQUIRE(n >= 0);
  const std::int64_t H = in.kv_heads();
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(H + 1)), idx(static_cast<std::size_t>(n + 1));
  kvevict::selection_view sel;
  sel.indptr = indptr.data();
  sel.indices = idx.data();
  sel.capacity = n;
  if (scores) scores->assign(static_cast<std::size_t>(H * in.capacity()), 0.0f);
  const kvevict::status st = ev.run(in, b, sel, scores ? scores->data() : nullptr);
  INFO(std::string(st.message()));
  REQUIRE(st.ok());
  REQUIRE(indptr[static_cast<std::size_t>(H)] == n);
  std::vector<std::vector<std::int32_t>> rows;
  for (std::int64_t h = 0; h < H; ++h)
    rows.emplace_back(idx.begin() + indptr[static_cast<std::size_t>(h)], idx.begin() + indptr[static_cast<std::size_t>(h + 1)]);
  return rows;
}

// A valid version-1 artifact in memory (the documented layout, written independently of the reader).
std::vector<unsigned char> make_artifact_bytes(const toy& t, const std::int32_t header[7], std::uint64_t ck_bytes, std::uint64_t ck_hash) {
  std::vector<unsigned char> b;
  auto put = [&b](const void* p, std::size_t n) { b.insert(b.end(), static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + n); };
  auto u32 = [&](std::uint32_t v) { put(&v, 4); };
  auto i32 = [&](std::int32_t v) { put(&v, 4); };
  auto u64 = [&](std::uint64_t v) { put(&v, 8); };
  auto f32 = [&](float v) { put(&v, 4); };
  put("KVEVLKV", 8);
  u32(1);
  u32(128);
  for (int i = 0; i < 7; ++i) i32(header[i]);
  u32(0);
  u64(ck_bytes);
  u64(ck_hash);
  i32(t.L), i32(t.H), i32(t.d), i32(t.hid), i32(0), i32(0);
  f32(0.1f), f32(0.25f), f32(1.0f), f32(0.0f);
  std::vector<unsigned char> payload;
  for (float v : t.logits) payload.insert(payload.end(), reinterpret_cast<const unsigned char*>(&v), reinterpret_cast<const unsigned char*>(&v) + 4);
  for (float v : t.mlp) payload.insert(payload.end(), reinterpret_cast<const unsigned char*>(&v), reinterpret_cast<const unsigned char*>(&v) + 4);
  u64(static_cast<std::uint64_t>(t.logits.size() + t.mlp.size()));
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : payload) h = (h ^ c) * 1099511628211ull;
  u64(h);
  u64(0);
  REQUIRE(b.size() == 128);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

}  // namespace

TEST_CASE("headwise_learned water-filling: exact total, caps, naive reference, determinism") {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    prng g(seed);
    const int n = 1 + static_cast<int>(g.next() % 37);
    const std::int64_t t = 1 + static_cast<std::int64_t>(g.next() % 200);
    const double spread = seed % 3 == 0 ? 6.0 : 1.0;  // large spread: many heads clip at t
    std::vector<float> z(static_cast<std::size_t>(n));
    for (auto& v : z) v = g.sym(spread);
    for (double R : {0.05, 0.1, 0.2, 0.5, 0.9}) {
      const std::int64_t total = static_cast<std::int64_t>(std::floor(R * static_cast<double>(n * t)));
      CAPTURE(seed);
      CAPTURE(n);
      CAPTURE(t);
      CAPTURE(R);
      std::vector<std::int64_t> out(static_cast<std::size_t>(n)), again(static_cast<std::size_t>(n));
      REQUIRE(kvevict::detail::lkv_water_fill(z.data(), n, 1.0, total, t, 0, out.data()));
      REQUIRE(kvevict::detail::lkv_water_fill(z.data(), n, 1.0, total, t, 0, again.data()));
      CHECK(out == again);
      CHECK(std::accumulate(out.begin(), out.end(), std::int64_t{0}) == total);
      for (auto b : out) CHECK((b >= 0 && b <= t));
      CHECK(out == ref_budgets(z, 1.0, total, t));
    }
  }
}

TEST_CASE("headwise_learned: ties go to the lower head index; temperature flattens") {
  std::vector<float> z(5, 0.25f);
  std::vector<std::int64_t> out(5);
  REQUIRE(kvevict::detail::lkv_water_fill(z.data(), 5, 1.0, 13, 10, 0, out.data()));
  CHECK(out == std::vector<std::int64_t>{3, 3, 3, 2, 2});
  std::vector<float> z2{0.0f, 3.0f};
  REQUIRE(kvevict::detail::lkv_water_fill(z2.data(), 2, 1.0, 10, 100, 0, out.data()));
  CHECK(out[1] > out[0]);
  const std::int64_t sharp = out[1];
  REQUIRE(kvevict::detail::lkv_water_fill(z2.data(), 2, 100.0, 10, 100, 0, out.data()));
  CHECK(out[1] < sharp);
  CHECK(out[0] + out[1] == 10);
  // floor_each: every head gets it first
  REQUIRE(kvevict::detail::lkv_water_fill(z2.data(), 2, 1.0, 10, 100, 4, out.data()));
  CHECK(out[0] >= 4);
  CHECK(out[0] + out[1] == 10);
  CHECK_FALSE(kvevict::detail::lkv_water_fill(z2.data(), 2, 1.0, 201, 100, 0, out.data()));
}

TEST_CASE("headwise_learned: heads whose ratio underflows to 0 share the rest equally, in O(heads)") {
  // Found by tests/fuzz/fuzz_evictor: at temperature 1e-30 softmax gives r = {0, 0, 1, 0}; head 2
  // clips at the cap and the others had shares of 0, which left the rest to apportion's one-unit
  // loop: O(total) steps (a 2^40-token reference did not finish in 2 minutes).
  const std::vector<float> z{0.0f, 1.0f, 2.0f, -1.0f};
  std::vector<std::int64_t> out(4);
  const std::int64_t cap = std::int64_t{1} << 40, total = 3 * cap;  // head 2 clips; 2 cap left for 3 heads
  REQUIRE(kvevict::detail::lkv_water_fill(z.data(), 4, 1e-30, total, cap, 0, out.data()));
  CHECK(out[2] == cap);
  CHECK(out[0] + out[1] + out[3] == 2 * cap);
  // 2 cap / 3 each: the largest fractional parts (ties: lower index) take the remainder
  const std::int64_t third = 2 * cap / 3;
  CHECK(out[0] == third + 1);
  CHECK(out[1] == third + 1);
  CHECK(out[3] == third);
  // a small case, the same rule: 10 tokens, cap 4: head 2 takes 4, the other three 2 each
  REQUIRE(kvevict::detail::lkv_water_fill(z.data(), 4, 1e-30, 10, 4, 0, out.data()));
  CHECK(out == std::vector<std::int64_t>{2, 2, 4, 2});
}

TEST_CASE("full LKV with the CPU evictor equals the naive reference, layer by layer") {
  for (std::uint64_t seed : {11ull, 12ull, 13ull}) {
    const toy t(3, 2, 4, 8, 57, seed);
    for (bool relu : {false, true}) {
      kvevict::lkv::full::params p = kvevict::lkv::full::defaults();
      p.scorer = t.scorer();
      p.scorer.activation = relu ? kvevict::lkv_activation::relu : kvevict::lkv_activation::silu;
      p.budgeter = t.budgeter();
      kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(p);
      for (double R : {0.1, 0.2, 0.45}) {
        CAPTURE(seed);
        CAPTURE(relu);
        CAPTURE(R);
        const std::int64_t total = static_cast<std::int64_t>(std::floor(R * t.L * t.H * t.T));
        const auto bud = ref_budgets(t.logits, 1.0, total, t.T);
        std::int64_t kept = 0;
        for (int l = 0; l < t.L; ++l) {
          std::vector<float> scores;
          const auto rows = run_layer(ev, t.inputs(l), kvevict::budget_request::fraction(R), &scores);
          for (int h = 0; h < t.H; ++h) {
            std::vector<float> u(static_cast<std::size_t>(t.T));
            for (int n = 0; n < t.T; ++n) {
              const float* k = t.K.data() + ((static_cast<std::size_t>(l) * t.H + h) * t.T + n) * t.d;
              const float* v = t.V.data() + ((static_cast<std::size_t>(l) * t.H + h) * t.T + n) * t.d;
              u[static_cast<std::size_t>(n)] = static_cast<float>(ref_utility(t.mlp, l, t.H, h, t.d, t.hid, k, v, relu));
              CHECK(scores[static_cast<std::size_t>(h * t.T + n)] == doctest::Approx(u[static_cast<std::size_t>(n)]).epsilon(1e-6));
            }
            const std::int64_t b = bud[static_cast<std::size_t>(l * t.H + h)];
            CHECK(static_cast<std::int64_t>(rows[static_cast<std::size_t>(h)].size()) == b);
            CHECK(rows[static_cast<std::size_t>(h)] == ref_topk(u, b));
            kept += b;
          }
        }
        CHECK(kept == total);
        CHECK(kept < static_cast<std::int64_t>(t.L) * t.H * t.T);  // something was evicted
      }
    }
  }
}

TEST_CASE("compositions: learned budgets + ReST-KV / attention scores, uniform budgets + learned scorer") {
  const toy t(2, 2, 4, 8, 64, 21);
  const int G = 2, W = 4;
  prng g(99);
  std::vector<float> Q(static_cast<std::size_t>(t.H * G * W * t.d));
  for (auto& q : Q) q = g.sym(1.0);
  std::vector<float> wo(static_cast<std::size_t>(t.H * G * t.d * t.d), 0.0f);
  for (int h = 0; h < t.H * G; ++h)
    for (int i = 0; i < t.d; ++i) wo[static_cast<std::size_t>((h * t.d + i) * t.d + i)] = 1.0f;  // R_h = I
  const double R = 0.25;
  const std::int64_t total = static_cast<std::int64_t>(std::floor(R * t.L * t.H * t.T));
  // learned budgets + ReST-KV: each head first gets its window W, the rest water-filled
  {
    kvevict::lkv::budgets_restkv::params p = kvevict::lkv::budgets_restkv::defaults();
    p.budgeter = t.budgeter();
    kvevict::evictor<kvevict::lkv::budgets_restkv, kvevict::cpu::backend> ev(p);
    std::vector<std::int64_t> ref(static_cast<std::size_t>(t.L * t.H));
    REQUIRE(kvevict::detail::lkv_water_fill(t.logits.data(), t.L * t.H, 1.0, total, t.T, W, ref.data()));
    std::int64_t kept = 0;
    for (int l = 0; l < t.L; ++l) {
      auto in = t.inputs(l);
      in.queries = kvevict::make_query_view<const float>(Q.data(), 1, t.H * G, W, t.d, kvevict::kv_layout::hnd);
      in.wo_factor.data = wo.data();
      in.wo_factor.extent[0] = t.H * G, in.wo_factor.extent[1] = t.d, in.wo_factor.extent[2] = t.d;
      in.wo_factor.stride[0] = t.d * t.d, in.wo_factor.stride[1] = t.d, in.wo_factor.stride[2] = 1;
      const auto rows = run_layer(ev, in, kvevict::budget_request::fraction(R));
      for (int h = 0; h < t.H; ++h) {
        const auto& r = rows[static_cast<std::size_t>(h)];
        CHECK(static_cast<std::int64_t>(r.size()) == ref[static_cast<std::size_t>(l * t.H + h)]);
        for (int j = 0; j < W; ++j) CHECK(std::find(r.begin(), r.end(), t.T - W + j) != r.end());  // window kept
        CHECK(std::is_sorted(r.begin(), r.end()));
        kept += static_cast<std::int64_t>(r.size());
      }
    }
    CHECK(kept == total);
  }
  // learned budgets + attention-weight (SnapKV) scores
  {
    kvevict::lkv::budgets_attention::params p = kvevict::lkv::budgets_attention::defaults();
    p.budgeter = t.budgeter();
    kvevict::evictor<kvevict::lkv::budgets_attention, kvevict::cpu::backend> ev(p);
    std::int64_t kept = 0;
    for (int l = 0; l < t.L; ++l) {
      auto in = t.inputs(l);
      in.queries = kvevict::make_query_view<const float>(Q.data(), 1, t.H * G, W, t.d, kvevict::kv_layout::hnd);
      for (const auto& r : run_layer(ev, in, kvevict::budget_request::fraction(R))) kept += static_cast<std::int64_t>(r.size());
    }
    CHECK(kept == total);
  }
  // uniform budgets + learned scorer: floor(R * t) per head, top by the MLP
  {
    kvevict::lkv::uniform_budgets::params p = kvevict::lkv::uniform_budgets::defaults();
    p.scorer = t.scorer();
    kvevict::evictor<kvevict::lkv::uniform_budgets, kvevict::cpu::backend> ev(p);
    for (int l = 0; l < t.L; ++l) {
      const auto rows = run_layer(ev, t.inputs(l), kvevict::budget_request::fraction(R));
      for (int h = 0; h < t.H; ++h) {
        std::vector<float> u(static_cast<std::size_t>(t.T));
        for (int n = 0; n < t.T; ++n)
          u[static_cast<std::size_t>(n)] = static_cast<float>(
              ref_utility(t.mlp, l, t.H, h, t.d, t.hid, t.K.data() + ((static_cast<std::size_t>(l) * t.H + h) * t.T + n) * t.d,
                          t.V.data() + ((static_cast<std::size_t>(l) * t.H + h) * t.T + n) * t.d, false));
        CHECK(rows[static_cast<std::size_t>(h)] == ref_topk(u, 16));
      }
    }
  }
}

TEST_CASE("learned policies: parameter and shape errors name the parameter") {
  const toy t(2, 2, 4, 8, 16, 5);
  kvevict::lkv::full::params p = kvevict::lkv::full::defaults();
  p.scorer = t.scorer();
  p.budgeter = t.budgeter();
  auto in = t.inputs(0);
  const auto b = kvevict::budget_request::fraction(0.5);
  {  // device tables: the ratios were computed for one temperature; a changed one is refused
    auto bp = p.budgeter;
    const double fake_ratios[1] = {1.0};
    bp.on_device = true;
    bp.ratios = fake_ratios;
    bp.ratios_temperature = bp.temperature;
    CHECK(kvevict::budgeters::headwise_learned::check(bp).ok());
    bp.temperature = 2.0f * bp.ratios_temperature;
    const auto s = kvevict::budgeters::headwise_learned::check(bp);
    CHECK(s.code() == kvevict::errc::invalid_argument);
    CHECK(std::string(s.message()).find("ratios_temperature") != std::string::npos);
  }
  {  // num_tokens so large that N * t is no longer exact in fp64 (or overflows int64)
    auto bp = p.budgeter;
    for (std::int64_t nt : {std::int64_t{1} << 62, (std::int64_t{1} << 53) / 4 + 1}) {
      bp.num_tokens = nt;
      const auto s = kvevict::budgeters::headwise_learned::check(bp);
      CHECK(s.code() == kvevict::errc::invalid_argument);
      CHECK(std::string(s.message()).find("num_tokens = " + std::to_string(nt)) != std::string::npos);
    }
    bp.num_tokens = (std::int64_t{1} << 53) / 4;  // N = 2 layers x 2 KV heads: the largest exact t
    CHECK(kvevict::budgeters::headwise_learned::check(bp).ok());
  }
  {
    auto q = p;
    q.budgeter.logits = nullptr;
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(q);
    const auto s = ev.can_implement(in, b);
    CHECK(s.code() == kvevict::errc::null_pointer);
    CHECK(std::string(s.message()).find("budgeter.logits") != std::string::npos);
  }
  {
    auto q = p;
    q.budgeter.temperature = 0.0f;
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(q);
    CHECK(std::string(ev.can_implement(in, b).message()).find("budgeter.temperature") != std::string::npos);
  }
  {
    // A 3-layer table (the params' pointer must hold num_layers * kv_heads logits) used on a
    // 2-layer model: the shapes disagree with the inputs.
    std::vector<float> logits3(static_cast<std::size_t>(3 * p.budgeter.kv_heads), 0.0f);
    auto q = p;
    q.budgeter.logits = logits3.data();
    q.budgeter.num_layers = 3;
    q.scorer.num_layers = 3;
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(q);
    CHECK(ev.can_implement(in, b).code() == kvevict::errc::shape_mismatch);
    CHECK(ev.max_selected(in, b) == -1);
  }
  {
    auto q = p;
    q.scorer.head_dim = 8;
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(q);
    const auto s = ev.can_implement(in, b);
    CHECK(s.code() == kvevict::errc::shape_mismatch);
    CHECK(std::string(s.message()).find("head_dim") != std::string::npos);
  }
  {  // unequal head lengths need num_tokens
    std::vector<std::int32_t> lens{16, 12};
    auto in2 = in;
    in2.lengths = kvevict::per_head_lengths(lens.data(), 1, 2);
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(p);
    CHECK(std::string(ev.can_implement(in2, b).message()).find("num_tokens") != std::string::npos);
    auto q = p;
    q.budgeter.num_tokens = 16;
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev2(q);
    const auto rows = run_layer(ev2, in2, b);
    CHECK(rows[1].size() <= 12u);
  }
}

TEST_CASE("LKV artifact: round trip and clear errors (truncated, version, magic, corrupted, other model)") {
  const toy t(2, 3, 4, 5, 8, 31);
  const std::int32_t header[7] = {24, 172, 2, 6, 3, 512, 512};  // head_dim 24 / 6 = 4
  const auto bytes = make_artifact_bytes(t, header, 1056540, 0x1234);
  kvevict::io::lkv_artifact a;
  REQUIRE(kvevict::io::parse_lkv_artifact(bytes.data(), bytes.size(), &a).ok());
  CHECK(a.logits == t.logits);
  CHECK(a.mlp == t.mlp);
  CHECK(a.keep_ratio_min == 0.1f);
  auto err = [](const std::vector<unsigned char>& b) {
    kvevict::io::lkv_artifact x;
    return kvevict::io::parse_lkv_artifact(b.data(), b.size(), &x, "test.lkv");
  };
  for (std::size_t cut : {std::size_t{0}, std::size_t{100}, std::size_t{128}, bytes.size() - 1}) {
    CAPTURE(cut);
    const auto s = err(std::vector<unsigned char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut)));
    CHECK(s.code() == kvevict::errc::format_error);
    CHECK(std::string(s.message()).find("truncated") != std::string::npos);
  }
  auto v2 = bytes;
  v2[8] = 2;
  CHECK(std::string(err(v2).message()).find("version 2") != std::string::npos);
  auto bad = bytes;
  bad[0] = 'X';
  CHECK(std::string(err(bad).message()).find("magic") != std::string::npos);
  auto corrupt = bytes;
  corrupt[200] ^= 0x40;
  CHECK(std::string(err(corrupt).message()).find("hash") != std::string::npos);
  auto longer = bytes;
  longer.push_back(0);
  CHECK(std::string(err(longer).message()).find("trailing") != std::string::npos);
  kvevict::io::lkv_model_identity id;
  std::memcpy(id.header, header, sizeof header);
  id.checkpoint_bytes = 1056540;
  id.checkpoint_hash = 0x1234;
  CHECK(kvevict::io::check_model(a, id).ok());
  auto other = id;
  other.header[4] = 4;
  CHECK(std::string(kvevict::io::check_model(a, other).message()).find("n_kv_heads") != std::string::npos);
  other = id;
  other.checkpoint_hash = 0x999;
  CHECK(std::string(kvevict::io::check_model(a, other).message()).find("hash") != std::string::npos);
  kvevict::io::lkv_artifact missing;
  CHECK(kvevict::io::read_lkv_artifact("/nonexistent/x.lkv", &missing).code() == kvevict::errc::io_error);
}

TEST_CASE("the committed artifact matches stories260K and runs") {
  const std::string dir = kvevict_engine::resolve_model_dir();
  const std::string art_path = std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
  if (!kvevict_engine::model_dir_exists(dir)) {
    MESSAGE("skipping: model folder " << dir << " missing");
    return;
  }
  kvevict::io::lkv_artifact a;
  const auto s = kvevict::io::read_lkv_artifact(art_path.c_str(), &a);
  INFO(std::string(s.message()));
  REQUIRE(s.ok());
  kvevict::io::lkv_model_identity id;
  REQUIRE(kvevict::io::checkpoint_identity(kvevict_engine::model_file(dir).c_str(), &id).ok());
  const auto m = kvevict::io::check_model(a, id);
  INFO(std::string(m.message()));
  CHECK(m.ok());
  id.checkpoint_bytes += 4;
  CHECK(kvevict::io::check_model(a, id).code() == kvevict::errc::format_error);
}

TEST_CASE("layer-wise prefill gives the same caches as full prefill then evict; lower peak KV bytes") {
  using namespace kvevict_engine;
  const std::string dir = resolve_model_dir();
  if (!model_dir_exists(dir)) {
    MESSAGE("skipping: model folder " << dir << " missing");
    return;
  }
  model m;
  REQUIRE(load_model(model_file(dir), m));
  tokenizer tok;
  REQUIRE(tok.load(tokenizer_file(dir), m.cfg.vocab_size));
  const std::vector<int> prompt = tok.encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
      "One day, she saw a big red ball under a tree. She ran to get it, but a dog took it first and ran away.");
  REQUIRE(prompt.size() > 40);
  const config& c = m.cfg;
  // LKV tables: the committed artifact when present, else random (query-agnostic either way)
  toy t(c.n_layers, c.n_kv_heads, c.head_dim(), 16, 1, 77);
  kvevict::io::lkv_artifact art;
  kvevict::lkv::full::params p = kvevict::lkv::full::defaults();
  if (kvevict::io::read_lkv_artifact((std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv").c_str(), &art).ok()) {
    p = kvevict::lkv::full_params(art);
  } else {
    p.scorer = t.scorer();
    p.budgeter = t.budgeter();
  }
  kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(p);
  for (double R : {0.1, 0.2, 0.5}) {
    CAPTURE(R);
    const auto budget = kvevict::budget_request::fraction(R);
    kv_cache a(c, int(prompt.size()) + 4), b(c, int(prompt.size()) + 4);
    std::vector<float> la, lb;
    REQUIRE(prefill(m, a, prompt, la));
    const std::int64_t peak_full = live_kv_bytes(a);
    for (int l = 0; l < c.n_layers; ++l) {
      const result r = evict_layer_kv(ev, a, l, budget);
      INFO(r.error);
      REQUIRE(r);
    }
    layerwise_stats st;
    const result r = layerwise_prefill(m, b, prompt, lb, [&](int l, kv_cache& cc) { return evict_layer_kv(ev, cc, l, budget); }, &st);
    INFO(r.error);
    REQUIRE(r);
    CHECK(la == lb);
    CHECK(a.next_position == b.next_position);
    std::int64_t kept = 0, max_layer = 0;
    for (int l = 0; l < c.n_layers; ++l) {
      std::int64_t layer_kept = 0;
      for (int h = 0; h < c.n_kv_heads; ++h) {
        REQUIRE(a.length(l, h) == b.length(l, h));
        for (int s = 0; s < a.length(l, h); ++s) {
          CHECK(a.position(l, h, s) == b.position(l, h, s));
          CHECK(std::memcmp(a.key(l, h, s), b.key(l, h, s), sizeof(float) * size_t(c.head_dim())) == 0);
          CHECK(std::memcmp(a.value(l, h, s), b.value(l, h, s), sizeof(float) * size_t(c.head_dim())) == 0);
        }
        layer_kept += a.length(l, h);
      }
      kept += layer_kept;
      max_layer = std::max(max_layer, layer_kept);
    }
    const std::int64_t T = std::int64_t(prompt.size());
    CHECK(kept == static_cast<std::int64_t>(std::floor(R * double(c.n_layers * c.n_kv_heads * T))));
    const std::int64_t row = 2 * c.head_dim() * std::int64_t(sizeof(float));
    const std::int64_t full_layer = T * c.n_kv_heads * row;
    CHECK(peak_full == c.n_layers * full_layer);
    // peak <= one full layer + every other layer compressed
    CHECK(st.peak_kv_bytes <= full_layer + (kept * row - 0));
    CHECK(st.peak_kv_bytes < peak_full);
    CHECK(st.final_kv_bytes == kept * row);
    MESSAGE("R = " << R << ", prompt " << T << " tokens: peak KV bytes full-prefill-then-evict " << peak_full
                   << ", layer-wise " << st.peak_kv_bytes << " (final " << st.final_kv_bytes << ")");
  }
  // without eviction, layer-wise prefill reproduces prefill() exactly
  kv_cache a(c, int(prompt.size())), b(c, int(prompt.size()));
  std::vector<float> la, lb;
  REQUIRE(prefill(m, a, prompt, la));
  REQUIRE(layerwise_prefill(m, b, prompt, lb));
  CHECK(la == lb);
  CHECK(std::memcmp(a.keys(c.n_layers - 1), b.keys(c.n_layers - 1), sizeof(float) * size_t(a.head_stride()) * size_t(c.n_kv_heads)) == 0);
}
