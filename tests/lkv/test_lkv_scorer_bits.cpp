// LKV-T's blockwise CPU scorer (cpu::learned_mlp_rows::score_rows, used by
// cpu::scorer_impl<learned_mlp> and lkv::score_tokens) against its definition,
// learned_mlp::utility: the floats must be
// BIT-IDENTICAL (memcmp) for every token, since the parity tests compare selections with
// PyTorch's and a last-bit change can swap two tokens. The fp64 sums before the fp32 rounding
// are compared too (score_rows_fp64 vs utility_fp64): the rounding to fp32 hides almost every
// change of summation order or of multiply-add contraction, the fp64 bits do not.
//
// Built twice (tests/lkv/CMakeLists.txt):
//   test_lkv_scorer_bits      the project's flags; also the CPU backend's entry points
//                             (scorer_impl<learned_mlp>::score_head with cpu::head_inputs,
//                             lkv::score_tokens)
//   test_lkv_scorer_bits_fma  x86 hosts with AVX2 + FMA only: -mavx2 -mfma -ffp-contract=fast,
//                             learned_mlp_rows.hpp only (no Eigen), so the compiler may fuse every
//                             multiply-add it sees, in both forms, and the AVX code path runs
//
// Grid: head_dim 1, 3, 8, 64, 128 (+ 300: the scalar fallback above max_block_inputs), hidden 1,
// 7, 32, 64, lengths 0, 1, 5, 33, 1000, relu and silu, rows with a stride > head_dim, random
// inputs plus rows with huge values (saturation at +-FLT_MAX; w2 scaled by 1e10 in every other
// case) and with inf / NaN (NaN -> 0).
#include <doctest/doctest.h>

#if KVEVICT_TEST_WITH_CPU_BACKEND
#include <kvevict/backends/cpu/learned.hpp>
#else
#include <kvevict/backends/cpu/scorers/learned_mlp_rows.hpp>
#endif

#include "lkv_prng.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

namespace {

/// memcmp of n bytes that allows n == 0 with empty vectors (memcmp's pointers must not be null,
/// even for 0 bytes; UBSan reports it).
bool same_bytes(const void* a, const void* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

using mlp = kvevict::scorers::learned_mlp;
using rows_scorer = kvevict::cpu::learned_mlp_rows;

using lkv_test::prng;


// Independent fp64 value of u before the fp32 step (naive loop; used only to classify the
// token: NaN, beyond the fp32 range, or ordinary).
double naive_u(const std::vector<float>& w, std::int64_t off, std::int64_t d, std::int64_t hid, const float* k, const float* v, bool relu) {
  double u = w[static_cast<std::size_t>(off + hid * 2 * d + 2 * hid)];
  for (std::int64_t j = 0; j < hid; ++j) {
    double a = w[static_cast<std::size_t>(off + hid * 2 * d + j)];
    for (std::int64_t i = 0; i < 2 * d; ++i)
      a += static_cast<double>(w[static_cast<std::size_t>(off + j * 2 * d + i)]) * static_cast<double>(i < d ? k[i] : v[i - d]);
    a = relu ? (a > 0 ? a : 0.0) : a / (1.0 + std::exp(-a));
    u += static_cast<double>(w[static_cast<std::size_t>(off + hid * 2 * d + hid + j)]) * a;
  }
  return u;
}

}  // namespace

TEST_CASE("learned_mlp_rows::score_rows / scorer_impl::score_head / lkv::score_tokens == utility() bit for bit") {
  const float big = 1e30f, inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::int64_t n_tokens = 0, n_nan = 0, n_sat = 0, n_block = 0;
  std::uint64_t seed = 1000;
  for (std::int64_t d : {1, 3, 8, 64, 128, 300}) {
    for (std::int64_t hid : {1, 7, 32, 64}) {
      if (d == 300 && hid > 7) continue;  // the scalar fallback: a few shapes suffice
      for (std::int64_t len : {0, 1, 5, 33, 1000}) {
        for (bool relu : {false, true}) {
          ++seed;
          CAPTURE(seed);
          CAPTURE(d);
          CAPTURE(hid);
          CAPTURE(len);
          CAPTURE(relu);
          prng g(seed);
          const std::int32_t layers = 2, heads = 3, layer = 1, head = 2;
          const std::int64_t off = (static_cast<std::int64_t>(layer) * heads + head) * mlp::block_floats(d, hid);
          std::vector<float> w(static_cast<std::size_t>(layers * heads * mlp::block_floats(d, hid)));
          const double ws = 1.0 / std::sqrt(static_cast<double>(2 * d));
          for (auto& x : w) x = g.sym(2.0 * ws);
          // every other case: w2 (and b2) x 1e10, so that the huge rows (|a_j| ~ 1e30) give |u| > FLT_MAX
          const bool wide = seed % 2 == 0;
          if (wide)
            for (std::int64_t e = hid * 2 * d + hid; e < mlp::block_floats(d, hid); ++e)
              w[static_cast<std::size_t>(off + e)] *= 1e10f;
          mlp::params p;
          p.weights = w.data();
          p.num_layers = layers;
          p.kv_heads = heads;
          p.head_dim = static_cast<std::int32_t>(d);
          p.hidden = static_cast<std::int32_t>(hid);
          p.activation = relu ? kvevict::lkv_activation::relu : kvevict::lkv_activation::silu;
          // K and V rows with stride d + 3 (the padding holds garbage that must not be read).
          const std::int64_t stride = d + 3;
          std::vector<float> K(static_cast<std::size_t>(len * stride + 1)), V(K.size());
          for (auto& x : K) x = g.sym(3.0);
          for (auto& x : V) x = g.sym(3.0);
          for (std::int64_t n = 0; n < len; ++n) {
            float* k = K.data() + n * stride;
            float* v = V.data() + n * stride;
            switch (n % 11) {
              case 3:  // huge values: a_j ~ +-1e30, u beyond the fp32 range -> saturated
                for (std::int64_t i = 0; i < d; ++i) k[i] = v[i] = big * static_cast<float>(1 + (i % 3));
                break;
              case 7:  // huge negative values
                for (std::int64_t i = 0; i < d; ++i) k[i] = v[i] = -big;
                break;
              case 9:  // inf and NaN inputs -> NaN accumulators -> u = 0
                k[0] = inf;
                v[d - 1] = (n % 2) ? nan : -inf;
                break;
              default:
                break;
            }
          }
          std::vector<float> want(static_cast<std::size_t>(len)), rows(want.size() + 1, -7.0f);
          std::vector<double> want64(want.size()), rows64(want.size() + 1, -7.0);
          for (std::int64_t n = 0; n < len; ++n) {
            const float* k = K.data() + n * stride;
            const float* v = V.data() + n * stride;
            want[static_cast<std::size_t>(n)] = mlp::utility(p, layer, head, k, v);
            want64[static_cast<std::size_t>(n)] = mlp::utility_fp64(p, layer, head, k, v);
            const double u = naive_u(w, off, d, hid, k, v, relu);
            if (std::isnan(u)) {
              ++n_nan;
              CHECK(want[static_cast<std::size_t>(n)] == 0.0f);
            } else if (std::fabs(u) > 3.4028234663852886e38) {
              ++n_sat;
              CHECK(std::fabs(want[static_cast<std::size_t>(n)]) == std::numeric_limits<float>::max());
            }
          }
          n_tokens += len;
          if (2 * d <= rows_scorer::max_block_inputs) n_block += len;

          // fp64 u first: the fp32 rounding would hide most differences of order or contraction
          rows_scorer::score_rows_fp64(p, layer, head, K.data(), V.data(), len, stride, rows64.data());
          CHECK(same_bytes(rows64.data(), want64.data(), want64.size() * sizeof(double)));
          CHECK(rows64[static_cast<std::size_t>(len)] == -7.0);
          std::int64_t diff64 = 0;
          for (std::int64_t n = 0; n < len; ++n)
            diff64 += std::memcmp(&rows64[static_cast<std::size_t>(n)], &want64[static_cast<std::size_t>(n)], sizeof(double)) != 0;
          CHECK(diff64 == 0);
          for (std::int64_t n = 0; n < len; ++n)  // utility = to_score(utility_fp64): the float follows from the double
            if (!std::isnan(want64[static_cast<std::size_t>(n)]) && std::fabs(want64[static_cast<std::size_t>(n)]) <= 3.4e38)
              CHECK(want[static_cast<std::size_t>(n)] == static_cast<float>(want64[static_cast<std::size_t>(n)]));

          rows_scorer::score_rows(p, layer, head, K.data(), V.data(), len, stride, rows.data());
          CHECK(same_bytes(rows.data(), want.data(), want.size() * sizeof(float)));
          CHECK(rows[static_cast<std::size_t>(len)] == -7.0f);  // nothing written past length
          for (std::int64_t n = 0; n < len; ++n) {
            INFO("token ", n);
            CHECK(same_bytes(&rows[static_cast<std::size_t>(n)], &want[static_cast<std::size_t>(n)], sizeof(float)));
            if (n >= 40) break;  // the per-token report only for the first tokens (the memcmp above covers all)
          }

          // The CPU scorer reads contiguous rows (stride head_dim) and the layer from layer_idx.
          std::vector<float> Kc(static_cast<std::size_t>(len * d)), Vc(Kc.size());
          for (std::int64_t n = 0; n < len; ++n)
            for (std::int64_t i = 0; i < d; ++i) {
              Kc[static_cast<std::size_t>(n * d + i)] = K[static_cast<std::size_t>(n * stride + i)];
              Vc[static_cast<std::size_t>(n * d + i)] = V[static_cast<std::size_t>(n * stride + i)];
            }
          std::vector<float> hook(want.size());
          rows_scorer::score_rows(p, layer, head, Kc.data(), Vc.data(), len, d, hook.data());
          CHECK(same_bytes(hook.data(), want.data(), want.size() * sizeof(float)));
#if KVEVICT_TEST_WITH_CPU_BACKEND
          {  // the layer from head_inputs::layer_idx (params.layer = -1)
            kvevict::cpu::head_inputs hl;
            hl.kv_head = head;
            hl.length = len;
            hl.head_dim = d;
            hl.layer_idx = layer;
            hl.keys = Kc.data();
            hl.values = Vc.data();
            std::vector<float> hook1(want.size(), 5.0f);
            REQUIRE(p.layer == -1);
            kvevict::cpu::scorer_impl<mlp>::score_head(p, hl, hook1.data());
            CHECK(same_bytes(hook1.data(), want.data(), want.size() * sizeof(float)));
          }
          kvevict::cpu::head_inputs hi;
          hi.kv_head = head;
          hi.length = len;
          hi.head_dim = d;
          hi.layer_idx = 0;  // p.layer set: the table row comes from the params
          hi.keys = Kc.data();
          hi.values = Vc.data();
          mlp::params pl = p;
          pl.layer = layer;
          std::vector<float> hook2(want.size(), 5.0f);
          kvevict::cpu::scorer_impl<mlp>::score_head(pl, hi, hook2.data());
          CHECK(same_bytes(hook2.data(), want.data(), want.size() * sizeof(float)));
          std::vector<float> tok(want.size(), 5.0f);
          REQUIRE(kvevict::lkv::score_tokens(p, layer, head, K.data(), V.data(), len, stride, tok.data()).ok());
          CHECK(same_bytes(tok.data(), want.data(), want.size() * sizeof(float)));
#endif
          // non-vacuous: the ordinary tokens' scores differ (the utility depends on the token)
          if (len >= 5) {
            std::set<float> distinct;
            for (std::int64_t n = 0; n < len; ++n)
              if (n % 11 != 3 && n % 11 != 7 && n % 11 != 9) distinct.insert(want[static_cast<std::size_t>(n)]);
            CHECK(static_cast<std::int64_t>(distinct.size()) >= (len >= 1000 ? len / 4 : 2));
          }
        }
      }
    }
  }
  INFO("tokens ", n_tokens, ", blockwise ", n_block, ", NaN -> 0: ", n_nan, ", saturated: ", n_sat);
  CHECK(n_block > 0);
  CHECK(n_block < n_tokens);  // the scalar fallback ran too
  CHECK(n_nan > 100);         // the NaN -> 0 path was exercised
  CHECK(n_sat > 100);         // the saturation path was exercised
#if defined(__FMA__)
  MESSAGE("compiled with FMA (-ffp-contract as given): ", n_tokens, " tokens compared");
#endif
}
