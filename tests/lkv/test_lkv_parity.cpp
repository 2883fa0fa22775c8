// C++ / PyTorch parity of LKV: the smoke training (tools/lkv/train.py --smoke --parity FILE)
// writes an artifact, the K/V of a held-out prompt and the tokens its Python code selects
// (budgets by its copy of the water-filling rule, top-k of the utilities). This test runs the
// library's evictor<lkv::full, cpu::backend> on the same K/V and requires identical budgets and
// identical kept indices for every (layer, KV head) and keep fraction.
// Paths: $KVEVICT_LKV_ARTIFACT and $KVEVICT_LKV_PARITY (set by ctest after the lkv_smoke_train
// fixture); the test skips with a message when they are not set.
#include <doctest/doctest.h>

#include <kvevict/backends/cpu/learned.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
struct reader {
  std::vector<unsigned char> b;
  std::size_t off = 0;
  bool ok = true;
  template <class T>
  T get() {
    T v{};
    if (off + sizeof(T) > b.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, b.data() + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> vec(std::size_t n) {
    std::vector<T> v(n);
    for (auto& x : v) x = get<T>();
    return v;
  }
};
}  // namespace

TEST_CASE("LKV selections: C++ library == PyTorch trainer on the same K/V") {
  const char* art_path = std::getenv("KVEVICT_LKV_ARTIFACT");
  const char* par_path = std::getenv("KVEVICT_LKV_PARITY");
  if (!art_path || !par_path || !*art_path || !*par_path) {
    MESSAGE("skipping: KVEVICT_LKV_ARTIFACT / KVEVICT_LKV_PARITY not set (ctest sets them after the smoke training)");
    return;
  }
  if (std::FILE* f = std::fopen(par_path, "rb")) {
    std::fclose(f);
  } else {
    MESSAGE("skipping: " << par_path << " does not exist (the smoke training skipped: model or text missing)");
    return;
  }
  kvevict::io::lkv_artifact art;
  const kvevict::status s = kvevict::io::read_lkv_artifact(art_path, &art);
  INFO(std::string(s.message()));
  REQUIRE(s.ok());
  reader r;
  REQUIRE(kvevict::io::detail::read_whole_file(par_path, &r.b).ok());
  REQUIRE(r.b.size() > 8);
  REQUIRE(std::memcmp(r.b.data(), "LKVPAR01", 8) == 0);
  r.off = 8;
  const int L = r.get<std::int32_t>(), H = r.get<std::int32_t>(), T = r.get<std::int32_t>(), d = r.get<std::int32_t>();
  const int nf = r.get<std::int32_t>();
  CAPTURE(L);
  CAPTURE(H);
  CAPTURE(T);
  CAPTURE(d);
  REQUIRE(L == art.num_layers);
  REQUIRE(H == art.kv_heads);
  REQUIRE(d == art.head_dim);
  const std::size_t n = static_cast<std::size_t>(L) * H * T * d;
  const auto K = r.vec<float>(n), V = r.vec<float>(n);
  const auto u_py = r.vec<float>(static_cast<std::size_t>(L) * H * T);
  REQUIRE(r.ok);
  double knorm = 0;
  for (float k : K) knorm += std::fabs(k);
  REQUIRE(knorm > 0);  // non-vacuous inputs

  kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(kvevict::lkv::full_params(art));
  int compared = 0;
  for (int f = 0; f < nf; ++f) {
    const double R = r.get<double>();
    const auto bud = r.vec<std::int32_t>(static_cast<std::size_t>(L * H));
    const auto indptr = r.vec<std::int32_t>(static_cast<std::size_t>(L * H + 1));
    const auto idx = r.vec<std::int32_t>(static_cast<std::size_t>(indptr.back()));
    REQUIRE(r.ok);
    CAPTURE(R);
    std::int64_t total = 0;
    for (int l = 0; l < L; ++l) {
      CAPTURE(l);
      kvevict::layer_inputs<float> in;
      in.keys = kvevict::make_kv_view<const float>(K.data() + static_cast<std::size_t>(l) * H * T * d, 1, H, T, d, kvevict::kv_layout::hnd);
      in.values = kvevict::make_kv_view<const float>(V.data() + static_cast<std::size_t>(l) * H * T * d, 1, H, T, d, kvevict::kv_layout::hnd);
      in.layer_idx = l;
      in.num_layers = L;
      const auto budget = kvevict::budget_request::fraction(R);
      const std::int64_t cap = ev.max_selected(in, budget);
      REQUIRE(cap >= 0);
      std::vector<std::int32_t> ip(static_cast<std::size_t>(H + 1)), ix(static_cast<std::size_t>(cap + 1));
      std::vector<float> scores(static_cast<std::size_t>(H * T));
      kvevict::selection_view sel;
      sel.indptr = ip.data();
      sel.indices = ix.data();
      sel.capacity = cap;
      const auto st = ev.run(in, budget, sel, scores.data());
      INFO(std::string(st.message()));
      REQUIRE(st.ok());
      for (int h = 0; h < H; ++h) {
        CAPTURE(h);
        const int row = l * H + h;
        CHECK(ip[static_cast<std::size_t>(h + 1)] - ip[static_cast<std::size_t>(h)] == bud[static_cast<std::size_t>(row)]);
        const std::vector<std::int32_t> mine(ix.begin() + ip[static_cast<std::size_t>(h)], ix.begin() + ip[static_cast<std::size_t>(h + 1)]);
        const std::vector<std::int32_t> theirs(idx.begin() + indptr[static_cast<std::size_t>(row)], idx.begin() + indptr[static_cast<std::size_t>(row + 1)]);
        CHECK(mine == theirs);
        if (bud[static_cast<std::size_t>(row)] < T) {  // scores are reported for scored heads
          for (int t = 0; t < T; ++t) {
            const float a = scores[static_cast<std::size_t>(h * T + t)], b = u_py[static_cast<std::size_t>(row * T + t)];
            CHECK(std::fabs(a - b) <= 1e-5f * (1.0f + std::fabs(b)));
          }
        }
        total += bud[static_cast<std::size_t>(row)];
        ++compared;
      }
    }
    CHECK(total == static_cast<std::int64_t>(std::floor(R * static_cast<double>(L * H * T))));
    CHECK(total < static_cast<std::int64_t>(L) * H * T);
  }
  CHECK(compared == nf * L * H);
  MESSAGE("parity: " << compared << " (layer, head, fraction) selections identical, t = " << T);
}
