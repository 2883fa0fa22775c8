// kvevict::layer_wide_topk (include/kvevict/schedule/layer_wide.hpp) on its own: one flattened top-T
// over the candidates of every layer and row against a brute-force sort (ties to the lower layer, row
// and index; NaN last), exact totals, protected tokens and rows kept whole, and clear errors with the
// outputs untouched. With a real evictor (one layer equals presets::defensivekv's own flattened
// allocation): tests/policies/test_defensivekv.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/random.hpp"
#include "kvevict/kvevict.hpp"

namespace kv = kvevict;

namespace {

struct layer_in {
  std::vector<float> scores;  // rows x stride
  std::vector<std::int64_t> len, sinks, recent;
};

}  // namespace

TEST_CASE("layer_wide_topk: the flattened top-T over every layer equals a brute-force sort") {
  kvtest::rng r(31);
  for (int trial = 0; trial < 40; ++trial) {
    const int nl = 1 + trial % 4;
    const std::int64_t rows = 1 + trial % 3, stride = 40;
    std::vector<layer_in> in(static_cast<std::size_t>(nl));
    // (score, layer, row, index) of every candidate, for the brute force
    std::vector<std::tuple<float, int, std::int64_t, std::int64_t>> all;
    for (int l = 0; l < nl; ++l) {
      auto& x = in[static_cast<std::size_t>(l)];
      x.scores.assign(static_cast<std::size_t>(rows * stride), -99.0f);
      for (std::int64_t q = 0; q < rows; ++q) {
        const std::int64_t L = 10 + static_cast<std::int64_t>(r.uniform() * 30), s = trial % 2, t = std::min<std::int64_t>(4, L - s);
        const bool whole = trial % 7 == 3 && q == 0;  // a row kept whole: no candidates
        x.len.push_back(L);
        x.sinks.push_back(whole ? L : s);
        x.recent.push_back(whole ? 0 : t);
        for (std::int64_t n = 0; n < L; ++n) {
          // few distinct values so that ties are common; a NaN now and then
          float v = static_cast<float>(std::floor(r.uniform() * 6.0));
          if (r.uniform() < 0.03) v = std::numeric_limits<float>::quiet_NaN();
          x.scores[static_cast<std::size_t>(q * stride + n)] = v;
          if (!whole && n >= s && n < L - t) all.emplace_back(v, l, q, n);
        }
      }
    }
    std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      const float x = std::get<0>(a), y = std::get<0>(b);
      const bool nx = x != x, ny = y != y;
      if (nx != ny) return ny;
      if (!nx && x != y) return x > y;
      return false;  // stable: layer, row, index order already
    });
    const std::int64_t C = static_cast<std::int64_t>(all.size());
    for (std::int64_t T : {std::int64_t{0}, C / 3, C / 2, C, C + 5}) {
      kv::layer_wide_topk w;
      REQUIRE(w.reset(nl, rows).ok());
      for (int l = 0; l < nl; ++l) {
        const auto& x = in[static_cast<std::size_t>(l)];
        REQUIRE(w.add_layer(l, x.scores.data(), stride, x.len.data(), x.sinks.data(), x.recent.data()).ok());
      }
      CHECK(w.kept(0) == -1);  // before cut()
      REQUIRE(w.cut(T).ok());
      std::vector<std::vector<std::vector<std::int32_t>>> want(static_cast<std::size_t>(nl), std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(rows)));
      for (std::int64_t i = 0; i < std::min(T, C); ++i)
        want[static_cast<std::size_t>(std::get<1>(all[static_cast<std::size_t>(i)]))][static_cast<std::size_t>(std::get<2>(all[static_cast<std::size_t>(i)]))]
            .push_back(static_cast<std::int32_t>(std::get<3>(all[static_cast<std::size_t>(i)])));
      std::int64_t total_kept = 0, total_protected = 0;
      for (int l = 0; l < nl; ++l) {
        const auto& x = in[static_cast<std::size_t>(l)];
        std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1), -7), idx(static_cast<std::size_t>(rows * stride), -7);
        kv::selection_view sel{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())};
        REQUIRE(w.selection(l, sel).ok());
        CHECK(indptr[static_cast<std::size_t>(rows)] == w.kept(l));
        total_kept += w.kept(l);
        for (std::int64_t q = 0; q < rows; ++q) {
          std::vector<std::int32_t> exp;
          const std::int64_t L = x.len[static_cast<std::size_t>(q)], s = x.sinks[static_cast<std::size_t>(q)], t = x.recent[static_cast<std::size_t>(q)];
          total_protected += s + t;
          for (std::int64_t n = 0; n < s; ++n) exp.push_back(static_cast<std::int32_t>(n));
          auto& wq = want[static_cast<std::size_t>(l)][static_cast<std::size_t>(q)];
          exp.insert(exp.end(), wq.begin(), wq.end());
          for (std::int64_t n = L - t; n < L; ++n) exp.push_back(static_cast<std::int32_t>(n));
          std::sort(exp.begin(), exp.end());
          const std::vector<std::int32_t> got(idx.begin() + indptr[static_cast<std::size_t>(q)], idx.begin() + indptr[static_cast<std::size_t>(q + 1)]);
          INFO("trial " << trial << " T " << T << " layer " << l << " row " << q);
          CHECK(got == exp);
        }
      }
      CHECK(total_kept == total_protected + std::min(T, C));  // exact total
    }
  }
}

TEST_CASE("layer_wide_topk: errors name the argument, outputs untouched") {
  kv::layer_wide_topk w;
  CHECK(std::string(w.reset(0, 2).message()).find("num_layers = 0") != std::string::npos);
  CHECK(std::string(w.reset(2, 0).message()).find("rows = 0") != std::string::npos);
  REQUIRE(w.reset(2, 1).ok());
  std::vector<float> sc(16, 1.0f);
  std::int64_t L = 10, s = 0, t = 2, bad_t = 11;
  CHECK(std::string(w.add_layer(2, sc.data(), 16, &L, &s, &t).message()).find("layer = 2") != std::string::npos);
  CHECK(std::string(w.add_layer(0, sc.data(), 8, &L, &s, &t).message()).find("stride = 8") != std::string::npos);
  CHECK(std::string(w.add_layer(0, sc.data(), 16, &L, &s, &bad_t).message()).find("recent 11") != std::string::npos);
  CHECK(w.add_layer(0, nullptr, 16, &L, &s, &t).code() == kv::errc::null_pointer);
  REQUIRE(w.add_layer(0, sc.data(), 16, &L, &s, &t).ok());
  CHECK(std::string(w.add_layer(0, sc.data(), 16, &L, &s, &t).message()).find("added twice") != std::string::npos);
  CHECK(std::string(w.cut(3).message()).find("layer 1 was not added") != std::string::npos);
  REQUIRE(w.add_layer(1, sc.data(), 16, &L, &s, &t).ok());
  std::vector<std::int32_t> indptr(2, -7), idx(20, -7), pos(20, -7);
  kv::selection_view sel{indptr.data(), idx.data(), nullptr, 20};
  CHECK(std::string(w.selection(0, sel).message()).find("before cut()") != std::string::npos);
  CHECK(std::string(w.cut(-1).message()).find("total = -1") != std::string::npos);
  REQUIRE(w.cut(5).ok());
  CHECK(std::string(w.add_layer(1, sc.data(), 16, &L, &s, &t).message()).find("after cut()") != std::string::npos);
  kv::selection_view small{indptr.data(), idx.data(), nullptr, 3};
  CHECK(w.selection(0, small).code() == kv::errc::insufficient_capacity);
  kv::selection_view with_pos{indptr.data(), idx.data(), pos.data(), 20};
  CHECK(std::string(w.selection(0, with_pos).message()).find("selection.positions") != std::string::npos);
  for (auto x : indptr) CHECK(x == -7);
  for (auto x : idx) CHECK(x == -7);
  // 5 candidates of 16 tied at 1.0: the lower layer first
  REQUIRE(w.selection(0, sel).ok());
  CHECK(w.kept(0) == 2 + 5);
  CHECK(w.kept(1) == 2);
}
