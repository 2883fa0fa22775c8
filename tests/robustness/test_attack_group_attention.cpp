// SPDX-License-Identifier: Apache-2.0
// Attacks on the CPU window attention of a whole GQA group (commits bf8ecb4..bd10bf5:
// attention_block over the G x rb rows of a group, logits in key tiles of 1024 with a running
// max and a finiteness check per tile, the in-place unnormalised softmax (row_stats::inv_z),
// per-head accumulators in the output rows, the radix-select drift, head_scratch's new carve):
//  - cpu::detail::score_kv_head of every window scorer (attention weight with EMA, H2O with and
//    without normalize_by_visible, TOVA, ReST-KV LOR "after" / "before" with and without W_O,
//    CriticalKV's two rows), called directly, against the fp64 references of tests/reference
//    PER QUERY HEAD (raw rows over all L tokens, before any GQA reduction, and the
//    adaptive-window drift): G = 1, 3, 8 (and 32); windows 1, 7, 32, 33, 70 (one to three row blocks);
//    L = w, w + 1, 1023, 1024, 1025, 2049 (one to three key tiles); a second head shorter than
//    the window (ragged lengths, scratch carved for the capacity); every layout. Each
//    head_scratch array is carved as the evictor carves it (K / V tiles, the scorer's own
//    options) but with logits blocks of 3000 bytes (a few window rows, one at the longest
//    lengths: several passes over K), each array as its own allocation with guard bytes (a write past a carve
//    size is caught), filled with NaN first (a stale read shows), one scratch reused for every
//    head as in the evictor; the output rows past G x L must stay untouched;
//  - logits that are not finite in fp32 (inf, ties of inf, inf + -inf = NaN) in ONE head of a
//    group (fp64 fallback), on either side of a key-tile boundary, only in the second tile, and
//    inside the window;
//  - a dominant token (logit +40 and +150 above the others, spec restkv.md "Numerics") in ONE
//    head of a group (phase 3 of "after", the exact row path of "before");
//  - the presets through the evictor (ReST-KV with the adaptive window, H2O with the prompt as
//    the window, TOVA) over several row blocks and key tiles vs kvtest::reference_run, with a
//    caller workspace of exactly workspace_size() bytes followed by guard bytes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "reference/harness.hpp"

namespace kv = kvevict;
using kvtest::layout;
using kvtest::ref_config;
using kvtest::scorer_kind;

namespace {

using aw_ema = kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::ema, kv::spatial::none>;
using kvtest::lor_plain;

/// A Carver for head_scratch::carve that gives every carve its own allocation: NaN bytes (0xFF)
/// inside, guard bytes around it. check() names the first carve whose guard changed.
class guarded_carver {
 public:
  static constexpr std::size_t pad = 512;
  static constexpr unsigned char guard_byte = 0xA5;

  template <class T>
  T* carve(std::size_t count) {
    blocks_.push_back(std::make_unique<block>());
    block& b = *blocks_.back();
    b.bytes = count * sizeof(T);
    b.mem.assign(b.bytes + 2 * pad + 64, guard_byte);
    const auto base = reinterpret_cast<std::uintptr_t>(b.mem.data());
    b.off = static_cast<std::size_t>((base + pad + 63) / 64 * 64 - base);
    std::memset(b.mem.data() + b.off, 0xFF, b.bytes);
    return reinterpret_cast<T*>(b.mem.data() + b.off);
  }

  std::string check() const {
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const block& b = *blocks_[i];
      for (std::size_t k = 0; k < b.mem.size(); ++k) {
        if (k == b.off) k += b.bytes;  // skip the carve itself
        if (k < b.mem.size() && b.mem[k] != guard_byte)
          return "carve #" + std::to_string(i) + " (" + std::to_string(b.bytes) + " bytes) written at byte " +
                 std::to_string(static_cast<long long>(k) - static_cast<long long>(b.off));
      }
    }
    return "";
  }

 private:
  struct block {
    std::vector<unsigned char> mem;
    std::size_t off = 0, bytes = 0;
  };
  std::vector<std::unique_ptr<block>> blocks_;
};

/// K of the drift statistic for a head of L tokens and effective window w (< every row's
/// visible count when L > w, so the reference's top-K over all L columns is the visible one).
std::int64_t drift_k_of(std::int64_t L, std::int64_t w) { return std::max<std::int64_t>(1, (L - w) / 3); }

/// What score_kv_head returned for every (sequence, query head), in order b, h, g.
struct direct_result {
  std::vector<std::vector<float>> rows, rows2;
  std::vector<double> drift;
  std::string error;  ///< scratch guard or output-row sentinel violations
};

/// Runs cpu::detail::score_kv_head of Policy over every (sequence, KV head) of `in` with one
/// scratch carved as the evictor carves it (capacity, queries window, head_dim, G, full_y).
template <class Policy, class T>
direct_result run_direct(const typename Policy::params& prm, const kv::layer_inputs<T>& in, bool with_drift) {
  using Scorer = typename Policy::scorer;
  using Temporal = typename Policy::temporal_smoother;
  namespace cd = kv::cpu::detail;
  constexpr bool secondary = kv::detail::scorer_secondary<Scorer>::value;
  const std::int64_t G = in.group_size(), S = in.capacity(), d = in.head_dim();
  // The evictor calls score_kv_head inside its parallel region, where Eigen's products run on
  // one thread: the same here (and no OpenMP spinning against the other tests under ctest -j).
  struct one_eigen_thread {
    int saved = Eigen::nbThreads();
    one_eigen_thread() { Eigen::setNbThreads(1); }
    ~one_eigen_thread() { Eigen::setNbThreads(saved); }
  } eigen_threads;
  guarded_carver gc;
  cd::head_scratch s;
  // The evictor's tight carve (tiles, no whole copies) with small logits blocks: 3000 bytes hold
  // a few window rows at these lengths, one row at the longest (several passes over K).
  using impl = kv::cpu::scorer_impl<Scorer>;
  cd::head_scratch::options so;
  so.full_y = cd::needs_full_projection<Scorer>(prm.scorer);
  so.block_bytes = 3000;
  so.full_kv = impl::full_kv();
  so.all_queries = impl::all_queries();
  so.rows_max = impl::block_rows_max(in.window());
  so.drift_row = with_drift;
  s.carve(gc, S, in.window(), d, G, so);
  if constexpr (kv::detail::scorer_needs_wo_matrix<Scorer>::value) s.carve_projection(gc, in.wo.extent[0], d);
  const float sentinel = 12345.0f;
  const std::size_t nrows = static_cast<std::size_t>(G * S + 64);
  std::vector<float> rows(nrows), rows2(nrows);
  std::vector<double> dr(static_cast<std::size_t>(G + 4));
  direct_result out;
  for (std::int64_t b = 0; b < in.batch(); ++b)
    for (std::int64_t h = 0; h < in.kv_heads(); ++h) {
      const std::int64_t L = in.length(b, h), w = std::min<std::int64_t>(in.window(), L);
      std::fill(rows.begin(), rows.end(), sentinel);
      std::fill(rows2.begin(), rows2.end(), sentinel);
      std::fill(dr.begin(), dr.end(), 777.0);
      cd::head_job<Policy, T> job{&in, &prm, b, h, L, w, with_drift ? drift_k_of(L, w) : 0};
      job.rows_per_block = cd::block_rows(so.block_bytes, G, L, w);
      cd::score_kv_head<Scorer, Temporal>(job, s, rows.data(), dr.data(), secondary ? rows2.data() : nullptr);
      for (std::size_t i = static_cast<std::size_t>(G * L); i < nrows; ++i)
        if (rows[i] != sentinel || rows2[i] != sentinel) {
          out.error += "(b " + std::to_string(b) + ", h " + std::to_string(h) + ") output row written at " + std::to_string(i) +
                       " >= G L = " + std::to_string(G * L) + "; ";
          break;
        }
      for (std::int64_t g = G; g < G + 4; ++g)
        if (dr[static_cast<std::size_t>(g)] != 777.0) out.error += "drift written past G; ";
      for (std::int64_t g = 0; g < G; ++g) {
        out.rows.emplace_back(rows.begin() + g * L, rows.begin() + (g + 1) * L);
        if (secondary) out.rows2.emplace_back(rows2.begin() + g * L, rows2.begin() + (g + 1) * L);
        out.drift.push_back(dr[static_cast<std::size_t>(g)]);
      }
    }
  out.error += gc.check();
  return out;
}

/// Tolerance of the drift of one query head against kvref::attention_drift: 0 (up to rounding
/// of the means) unless a row's K-th and (K+1)-th fp64 weights are within fp32 error of each
/// other or below the fp32 range (the top-K set may then legitimately differ): such a row may
/// move its mean index by up to vis - 1. *ambiguous counts those rows.
double drift_tolerance(const kvref::mat& A, std::int64_t L, std::int64_t K, int* ambiguous) {
  const std::int64_t w = A.rows, nf = w / 2, nr = w - w / 2;
  double tf = 0.0, tr = 0.0;
  for (std::int64_t j = 0; j < w; ++j) {
    const std::int64_t vis = L - w + j + 1;
    if (K >= vis) continue;
    std::vector<double> v(A.row(j), A.row(j) + vis);
    std::nth_element(v.begin(), v.begin() + (K - 1), v.end(), [](double a, double b) { return a > b; });
    const double a = v[static_cast<std::size_t>(K - 1)];
    const double b = *std::max_element(v.begin() + K, v.end());
    if (a < 1e-30 || a - b <= 1e-4 * a) {
      ++*ambiguous;
      (j < w / 2 ? tf : tr) += static_cast<double>(vis - 1);
    }
  }
  return 1e-9 * static_cast<double>(L) + (nf > 0 ? tf / static_cast<double>(nf) : 0.0) + (nr > 0 ? tr / static_cast<double>(nr) : 0.0);
}

struct direct_stats {
  int heads = 0, drifts_exact = 0, drift_rows_ambiguous = 0;
};

/// Compares a direct run with the per-query-head fp64 references. skip(b, hq, n): positions
/// left out of the score comparison (checked finite and >= 0 only). "" when all agree.
/// The fp64 drift of one query head and its tolerance (the same for every scorer of a problem).
struct drift_ref {
  bool done = false;
  double want = 0.0, tol = 0.0;
  int ambiguous = 0;
};
using drift_cache = std::vector<drift_ref>;  ///< per (b, hq), sized batch * q_heads

template <class Skip>
std::string compare_direct(const direct_result& lib, const kvtest::problem& p, const ref_config& cfg, bool with_drift,
                           direct_stats* st, drift_cache* dc, Skip skip, double rtol = kvtest::score_rtol,
                           double atol = kvtest::score_atol) {
  if (!lib.error.empty()) return lib.error;
  const auto& s = p.s;
  std::size_t i = 0;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.kv_heads; ++h)
      for (std::int64_t g = 0; g < s.group; ++g, ++i) {
        const std::int64_t hq = h * s.group + g, L = p.length(b, h), w = std::min(s.window, L);
        const std::string at = "(b " + std::to_string(b) + ", hq " + std::to_string(hq) + ", L " + std::to_string(L) + "): ";
        const std::vector<float>& got = lib.rows[i];
        if (static_cast<std::int64_t>(got.size()) != L) return at + "row length";
        double unused = 0.0;
        std::vector<double> want = kvtest::reference_head_scores(p, cfg, b, h, hq, 0, &unused);
        for (std::int64_t n = 0; n < L; ++n) {
          if (!std::isfinite(got[static_cast<std::size_t>(n)])) return at + "non-finite score at " + std::to_string(n);
          if (skip(b, hq, n)) {
            if (!(got[static_cast<std::size_t>(n)] >= 0.0f)) return at + "negative score at skipped " + std::to_string(n);
            want[static_cast<std::size_t>(n)] = static_cast<double>(got[static_cast<std::size_t>(n)]);
          }
        }
        double worst = 0.0;
        const std::int64_t bad = kvtest::first_mismatch(got.data(), want, 0, L, rtol, atol, &worst);
        if (bad >= 0)
          return at + "score " + std::to_string(bad) + ": lib " + std::to_string(got[static_cast<std::size_t>(bad)]) + " ref " +
                 std::to_string(want[static_cast<std::size_t>(bad)]) + " (worst err/tol " + std::to_string(worst) + ")";
        if (cfg.scorer == scorer_kind::attention_value_norm) {
          const std::vector<float>& u = lib.rows2[i];
          const std::vector<double> uw = kvtest::reference_value_norms(p, b, h, hq);
          const std::int64_t bu = kvtest::first_mismatch(u.data(), uw, 0, L, rtol, atol, &worst);
          if (bu >= 0) return at + "value norm " + std::to_string(bu) + " differs (worst err/tol " + std::to_string(worst) + ")";
        }
        const double dg = lib.drift[i];
        if (!with_drift || cfg.scorer == scorer_kind::last_query) {
          // TOVA scores the last row only: no front half, drift 0 (as without a drift request).
          if (dg != 0.0) return at + "drift " + std::to_string(dg) + " != 0";
        } else {
          const std::int64_t K = drift_k_of(L, w);
          drift_ref& dref = (*dc)[static_cast<std::size_t>(b * s.q_heads() + hq)];
          if (!dref.done) {
            const kvref::mat A = kvref::window_attention(p.queries(b, hq, w), p.keys(b, h), L, w);
            dref.want = kvref::attention_drift(A, K);
            dref.tol = drift_tolerance(A, L, K, &dref.ambiguous);
            dref.done = true;
          }
          const double dw = dref.want, tol = dref.tol;
          st->drift_rows_ambiguous += dref.ambiguous;
          if (dref.ambiguous == 0) ++st->drifts_exact;
          if (!(std::fabs(dg - dw) <= tol))
            return at + "drift " + std::to_string(dg) + " ref " + std::to_string(dw) + " (tol " + std::to_string(tol) + ", K " +
                   std::to_string(K) + ")";
        }
        ++st->heads;
      }
  return "";
}

std::string compare_direct(const direct_result& lib, const kvtest::problem& p, const ref_config& cfg, bool with_drift,
                           direct_stats* st, drift_cache* dc) {
  return compare_direct(lib, p, cfg, with_drift, st, dc, [](std::int64_t, std::int64_t, std::int64_t) { return false; });
}

drift_cache make_drift_cache(const kvtest::problem& p) {
  return drift_cache(static_cast<std::size_t>(p.s.batch * p.s.q_heads()));
}

ref_config aw_ref() {
  ref_config c;
  c.scorer = scorer_kind::attention_weight;
  c.temporal = kvref::temporal_kind::ema;
  c.alpha = static_cast<double>(0.3f);
  return c;
}

/// Every window scorer configuration on one problem (direct calls), each compared with
/// compare_direct in one CHECK_MESSAGE.
template <class T>
void check_all_scorers(const kvtest::problem& p, const kvtest::stored<T>& st, direct_stats* stats, bool with_lor_before = true) {
  const auto& in = st.in;
  drift_cache dc = make_drift_cache(p);
  {
    const auto r = run_direct<aw_ema>(aw_ema::defaults(), in, true);
    const std::string diff = compare_direct(r, p, aw_ref(), true, stats, &dc);
    CHECK_MESSAGE(diff.empty(), "attention_weight/ema: " << diff);
  }
  for (bool norm : {false, true}) {
    auto prm = kv::presets::h2o::defaults();
    prm.scorer.normalize_by_visible = norm;
    const auto r = run_direct<kv::presets::h2o>(prm, in, true);
    ref_config c;
    c.scorer = scorer_kind::accumulated;
    c.normalize_visible = norm;
    const std::string diff = compare_direct(r, p, c, true, stats, &dc);
    CHECK_MESSAGE(diff.empty(), "accumulated (normalize " << norm << "): " << diff);
  }
  {
    const auto r = run_direct<kv::presets::tova>(kv::presets::tova::defaults(), in, true);
    ref_config c;
    c.scorer = scorer_kind::last_query;
    c.temporal = kvref::temporal_kind::last;
    const std::string diff = compare_direct(r, p, c, true, stats, &dc);
    CHECK_MESSAGE(diff.empty(), "last_query: " << diff);
  }
  {
    const auto r = run_direct<kv::presets::criticalkv>(kv::presets::criticalkv::defaults(), in, true);
    ref_config c;
    c.scorer = scorer_kind::attention_value_norm;
    c.temporal = kvref::temporal_kind::mean;
    const std::string diff = compare_direct(r, p, c, true, stats, &dc);
    CHECK_MESSAGE(diff.empty(), "attention_value_norm: " << diff);
  }
  for (int mode = 0; mode < 4; ++mode) {  // "after": use_wo x include_window (tau 2 with both)
    const bool use_wo = mode % 2 == 1, incl = mode >= 2;
    const float tau = mode == 3 ? 2.0f : 1.0f;
    const auto r = run_direct<lor_plain>(kvtest::lor_plain_params(false, use_wo, incl, tau), in, true);
    // A head of ONE token (L = w = 1): a_bar = 1 with no other weight, nothing to renormalise;
    // the score is 0 as in the reference (phase 3; it saturated to FLT_MAX before 2026-12-01).
    const std::string diff = compare_direct(r, p, kvtest::lor_ref_config(false, use_wo, incl, tau), true, stats, &dc,
                                            [](std::int64_t, std::int64_t, std::int64_t) { return false; });
    CHECK_MESSAGE(diff.empty(), "lor after (use_wo " << use_wo << ", include_window " << incl << ", tau " << tau << "): " << diff);
  }
  if (with_lor_before)
    for (bool use_wo : {false, true}) {
      const auto r = run_direct<lor_plain>(kvtest::lor_plain_params(true, use_wo, false), in, true);
      const std::string diff = compare_direct(r, p, kvtest::lor_ref_config(true, use_wo, false), true, stats, &dc);
      CHECK_MESSAGE(diff.empty(), "lor before (use_wo " << use_wo << "): " << diff);
    }
}

}  // namespace

namespace {
// The direct-scorer problems of the test cases below, in one fixed order (seeds and layouts follow
// it); `take(G)` chooses the groups this test case checks, so the two shards (run as two ctest
// tests, for the sanitizer run's balance on two cores) check every problem exactly once, with the
// same data as one test case would.
void direct_scorers(bool (*take)(std::int64_t)) {
  direct_stats stats;
  int problems = 0;
  std::uint64_t seed = 7000;
  for (const std::int64_t G : {1, 3, 8})
    for (const std::int64_t W : {1, 7, 32, 33, 70})
      for (const std::int64_t L : {W, W + 1, std::int64_t{1023}, std::int64_t{1024}, std::int64_t{1025}, std::int64_t{2049}}) {
        // Head 1 is shorter (for L = W: shorter than the window, so its effective window is
        // smaller than the queries' window); the capacity exceeds both.
        const std::int64_t L1 = std::max<std::int64_t>(1, std::min<std::int64_t>(L - 1, (2 * L) / 3));
        kvtest::shape s;
        s.batch = L <= W + 1 ? 2 : 1, s.kv_heads = 2, s.group = G, s.cap = L + 3, s.d = 8, s.window = W, s.hidden = 16;
        const layout lay = static_cast<layout>(problems % 4);
        std::vector<std::int32_t> lens = {static_cast<std::int32_t>(L), static_cast<std::int32_t>(L1)};
        if (s.batch == 2) lens.insert(lens.end(), {static_cast<std::int32_t>(L1), static_cast<std::int32_t>(L)});
        CAPTURE(G);
        CAPTURE(W);
        CAPTURE(L);
        CAPTURE(L1);
        CAPTURE(kvtest::to_string(lay));
        kvtest::problem p = kvtest::make_problem(s, seed++, 1.0, 1.5, 1.0, lens);
        CAPTURE(s.batch);
        if (!take(G)) {
          // another shard checks this problem
        } else if (problems % 3 == 2) {
          kvtest::quantize<kv::bfloat16_t>(p);
          kvtest::quantize_wo<kv::bfloat16_t>(p);  // CriticalKV reads W_O in the storage type
          kvtest::stored<kv::bfloat16_t> st;
          kvtest::store(p, lay, st);
          check_all_scorers(p, st, &stats, L < 2000);
        } else if (problems % 3 == 1) {
          kvtest::quantize<kv::half_t>(p);
          kvtest::quantize_wo<kv::half_t>(p);
          kvtest::stored<kv::half_t> st;
          kvtest::store(p, lay, st);
          check_all_scorers(p, st, &stats, L < 2000);
        } else {
          kvtest::quantize<float>(p);
          kvtest::stored<float> st;
          kvtest::store(p, lay, st);
          check_all_scorers(p, st, &stats, L < 2000);
        }
        ++problems;
      }
  // A group of 32 query heads (1024 rows per block GEMM), windows of one and three blocks.
  for (const std::int64_t W : {33, 70}) {
    kvtest::shape s;
    s.batch = 1, s.kv_heads = 1, s.group = 32, s.cap = 1025, s.d = 8, s.window = W, s.hidden = 16;
    CAPTURE(W);
    kvtest::problem p = kvtest::make_problem(s, seed++, 1.0, 1.5, 1.0);
    if (take(32)) {
      kvtest::quantize<float>(p);
      kvtest::stored<float> st;
      kvtest::store(p, layout::interleaved, st);
      check_all_scorers(p, st, &stats, W < 50);
    }
    ++problems;
  }
  MESSAGE("direct scorers: " << problems << " problems, " << stats.heads << " query-head rows, " << stats.drifts_exact
                             << " drifts compared exactly, " << stats.drift_rows_ambiguous << " drift rows at a near-tie");
  CHECK(problems == 92);
  CHECK(stats.heads > 0);
  CHECK(stats.drifts_exact * 10 >= stats.heads * 5);
}
}  // namespace

TEST_CASE("score_kv_head of every window scorer vs fp64 per query head: row blocks, key tiles, G = 1 and 3, ragged heads, "
          "guarded scratch") {
  direct_scorers([](std::int64_t G) { return G < 8; });
}

// Run by its own ctest test (tests/robustness/CMakeLists.txt filters on "shard G = 8").
TEST_CASE("score_kv_head of every window scorer vs fp64 per query head: row blocks, key tiles, shard G = 8 and 32, ragged "
          "heads, guarded scratch") {
  direct_scorers([](std::int64_t G) { return G >= 8; });
}

namespace {

/// Query head hq_big of KV head h gets logits that are not finite in fp32 for up to three keys:
/// q[., 0] = q[., 1] = 2e19 and
///   k_n0 = (4e19, 0, ..):    fp32 product inf, fp64 logit 2.8e38 (the row's maximum);
///   k_n1 = (3.9e19, 0, ..):  also inf in fp32 (a tie with n0 there, lower index), 2.76e38 in fp64;
///   k_n2 = (4e19, -4e19, ..): inf + (-inf) = NaN in fp32, logit 0 in fp64.
/// Every other key has k[., 0] = k[., 1] = 0 and the other heads of the group q[., 0] =
/// q[., 1] = 0, so nothing else changes. n1, n2 < 0: not used.
void overflow_one_head(kvtest::problem& p, std::int64_t h, std::int64_t hq_big, std::int64_t n0, std::int64_t n1,
                       std::int64_t n2) {
  const auto& s = p.s;
  for (std::int64_t g = 0; g < s.group; ++g) {
    const std::int64_t hq = h * s.group + g;
    for (std::int64_t j = 0; j < s.window; ++j)
      for (std::int64_t c = 0; c < 2; ++c) p.Q[p.q_idx(0, hq, j, c)] = hq == hq_big ? 2.0e19 : 0.0;
  }
  for (std::int64_t n = 0; n < p.length(0, h); ++n)
    for (std::int64_t c = 0; c < 2; ++c) p.K[p.kv_idx(0, h, n, c)] = 0.0;
  p.K[p.kv_idx(0, h, n0, 0)] = 4.0e19;
  if (n1 >= 0) p.K[p.kv_idx(0, h, n1, 0)] = 3.9e19;
  if (n2 >= 0) {
    p.K[p.kv_idx(0, h, n2, 0)] = 4.0e19;
    p.K[p.kv_idx(0, h, n2, 1)] = -4.0e19;
  }
}

/// Key n0 of KV head h gets a logit `gap` above every other visible logit of every window row of
/// query head hq_dom (exactly `gap` for the tightest row, before rounding to fp32); the other
/// heads of the group see it with logit 0 (their q[., 0] = 0). Inputs scaled as
/// tests/policies/test_restkv.cpp's dominant_problem (K 0.3, Q 0.1) so the other logits are small.
void dominant_one_head(kvtest::problem& p, std::int64_t h, std::int64_t hq_dom, std::int64_t n0, double gap) {
  const auto& s = p.s;
  const std::int64_t L = p.length(0, h), w = std::min(s.window, L);
  for (std::int64_t g = 0; g < s.group; ++g) {
    const std::int64_t hq = h * s.group + g;
    for (std::int64_t j = 0; j < s.window; ++j) p.Q[p.q_idx(0, hq, j, 0)] = hq == hq_dom ? 3.0 + 0.05 * static_cast<double>(j % 20) : 0.0;
  }
  kvtest::quantize<float>(p);
  const double sc = 1.0 / std::sqrt(static_cast<double>(s.d));
  double beta = 0.0;
  for (std::int64_t j = 0; j < w; ++j) {
    const std::int64_t jq = s.window - w + j, vis = L - w + j + 1;
    if (n0 >= vis) continue;
    double mx = -1e300;
    for (std::int64_t n = 0; n < vis; ++n) {
      if (n == n0) continue;
      double l = 0.0;
      for (std::int64_t c = 0; c < s.d; ++c) l += p.Q[p.q_idx(0, hq_dom, jq, c)] * p.K[p.kv_idx(0, h, n, c)];
      mx = std::max(mx, l * sc);
    }
    beta = std::max(beta, (gap + mx) / (p.Q[p.q_idx(0, hq_dom, jq, 0)] * sc));
  }
  for (std::int64_t c = 0; c < s.d; ++c) p.K[p.kv_idx(0, h, n0, c)] = c == 0 ? beta : 0.0;
  kvtest::quantize<float>(p);
}

}  // namespace

TEST_CASE("score_kv_head with logits not finite in fp32 in one head of a group (fp64 fallback, key tiles) vs fp64") {
  direct_stats stats;
  int cases = 0;
  for (const std::int64_t G : {3, 8}) {
    const std::int64_t gbig = G == 3 ? 1 : 6, W = 40;
    // (L, n0, n1, n2) of overflow_one_head. n0 (and n1) either seen by every window row, or in
    // the window (n0 = L - 2: seen by the last two rows only, so a_bar stays below 15/16); the
    // NaN key n2 in the second key tile while the first is finite, or absent.
    struct at {
      std::int64_t L, n0, n1, n2;
    };
    for (const at a : {at{2049, 1023, 1000, -1}, at{2049, 1024, 1023, -1}, at{1500, 1024, -1, 1300}, at{1100, 5, 3, 1050},
                       at{2049, 2047, 2046, 1500}, at{1025, 1023, 1022, 5}, at{1026, 1024, 1023, -1}, at{1100, 1098, -1, 1030}}) {
      const bool in_window = a.n0 == a.L - 2;
      kvtest::shape s;
      s.batch = 1, s.kv_heads = 1, s.group = G, s.cap = a.L, s.d = 8, s.window = W, s.hidden = 16;
      kvtest::problem p = kvtest::make_problem(s, 7500 + static_cast<std::uint64_t>(cases), 1.0, 1.5, 1.0);
      overflow_one_head(p, 0, gbig, a.n0, a.n1, a.n2);
      kvtest::quantize<float>(p);
      kvtest::stored<float> st;
      kvtest::store(p, static_cast<layout>(cases % 4), st);
      drift_cache dc = make_drift_cache(p);
      CAPTURE(G);
      CAPTURE(a.L);
      CAPTURE(a.n0);
      CAPTURE(a.n1);
      CAPTURE(a.n2);
      {
        const auto r = run_direct<aw_ema>(aw_ema::defaults(), st.in, true);
        const std::string diff = compare_direct(r, p, aw_ref(), true, &stats, &dc);
        CHECK_MESSAGE(diff.empty(), "attention_weight: " << diff);
      }
      {
        const auto r = run_direct<kv::presets::tova>(kv::presets::tova::defaults(), st.in, true);
        ref_config c;
        c.scorer = scorer_kind::last_query;
        const std::string diff = compare_direct(r, p, c, true, &stats, &dc);
        CHECK_MESSAGE(diff.empty(), "last_query: " << diff);
      }
      {
        auto prm = kv::presets::h2o::defaults();
        prm.scorer.normalize_by_visible = true;
        const auto r = run_direct<kv::presets::h2o>(prm, st.in, true);
        ref_config c;
        c.scorer = scorer_kind::accumulated;
        c.normalize_visible = true;
        const std::string diff = compare_direct(r, p, c, true, &stats, &dc);
        CHECK_MESSAGE(diff.empty(), "accumulated: " << diff);
      }
      if (in_window) {
        // LOR: rows that see n0 put all their weight on it (a_bar[n0] = c_38 + c_39 = 0.51),
        // row 37 on n1.
        for (int mode = 0; mode < 4; ++mode) {
          const bool use_wo = mode % 2 == 1, before = mode >= 2;
          const auto r = run_direct<lor_plain>(kvtest::lor_plain_params(before, use_wo, false), st.in, true);
          // "before": a row that is one-hot in fp64 (the others' weights e^-2.8e38 = 0) has the
          // limit a ||R(z_-n - v_n)|| at its argmax (the library's exact path), which fp64
          // underflows to 0: n0 and n1 of that head are only checked finite there.
          const std::string diff =
              compare_direct(r, p, kvtest::lor_ref_config(before, use_wo, false), true, &stats, &dc, [&](std::int64_t, std::int64_t hq, std::int64_t n) {
                return before && hq == gbig && (n == a.n0 || n == a.n1);
              });
          CHECK_MESSAGE(diff.empty(), "lor (before " << before << ", use_wo " << use_wo << "): " << diff);
        }
      }
      ++cases;
    }
  }
  CHECK(cases == 16);
}

TEST_CASE("score_kv_head with a dominant token (+40, +150) in one head of a group: phase 3 / exact row path vs fp64") {
  direct_stats stats;
  int cases = 0;
  for (const std::int64_t G : {1, 3, 8})
    for (const double gap : {40.0, 150.0})
      for (const std::int64_t n0 : {17, 1023, 1024}) {
        const std::int64_t gdom = G == 1 ? 0 : (G == 3 ? 1 : 5), W = 40, L = n0 == 17 ? 1030 : 1100;
        kvtest::shape s;
        s.batch = 1, s.kv_heads = 1, s.group = G, s.cap = L, s.d = 8, s.window = W, s.hidden = 16;
        kvtest::problem p = kvtest::make_problem(s, 7700 + static_cast<std::uint64_t>(cases), 0.3, 0.1, 1.0);
        dominant_one_head(p, 0, gdom, n0, gap);
        kvtest::stored<float> st;
        kvtest::store(p, static_cast<layout>(cases % 4), st);
        drift_cache dc = make_drift_cache(p);
        CAPTURE(G);
        CAPTURE(gap);
        CAPTURE(n0);
        for (int mode = 0; mode < 5; ++mode) {  // after / before x use_wo; after with the window in z
          const bool use_wo = mode % 2 == 1 || mode == 4, before = mode == 2 || mode == 3, incl = mode == 4;
          CAPTURE(use_wo);
          CAPTURE(before);
          CAPTURE(incl);
          const auto r = run_direct<lor_plain>(kvtest::lor_plain_params(before, use_wo, incl), st.in, true);
          const std::string diff = compare_direct(r, p, kvtest::lor_ref_config(before, use_wo, incl), true, &stats, &dc);
          CHECK_MESSAGE(diff.empty(), diff);
          if (!diff.empty()) continue;
          // The dominant head ranks n0 first with a finite positive score equal to fp64 (1e-4).
          const std::vector<float>& row = r.rows[static_cast<std::size_t>(gdom)];
          const std::int64_t am = std::max_element(row.begin(), row.begin() + (L - W)) - row.begin();
          CHECK(am == n0);
          double unused = 0.0;
          const auto want = kvtest::reference_head_scores(p, kvtest::lor_ref_config(before, use_wo, incl), 0, 0, gdom, 0, &unused);
          CHECK(row[static_cast<std::size_t>(n0)] > 0.0f);
          CHECK(static_cast<double>(row[static_cast<std::size_t>(n0)]) == doctest::Approx(want[static_cast<std::size_t>(n0)]).epsilon(1e-4));
        }
        {
          const auto r = run_direct<aw_ema>(aw_ema::defaults(), st.in, true);
          const std::string diff = compare_direct(r, p, aw_ref(), true, &stats, &dc);
          CHECK_MESSAGE(diff.empty(), "attention_weight: " << diff);
        }
        ++cases;
      }
  CHECK(cases == 18);
}

namespace {

/// run() with a caller workspace of exactly workspace_size() bytes (at an odd address) followed
/// by guard bytes; the result must equal kvtest::run_lib's and the guard must be intact.
template <class Policy, class T>
std::string guarded_run_matches(const kv::evictor<Policy, kv::cpu::backend>& ev, const kv::layer_inputs<T>& in,
                                kv::budget_request budget, const kvtest::lib_result& lib) {
  const std::size_t need = ev.workspace_size(in), guard = 4096;
  std::vector<unsigned char> ws(need + guard + 1, 0xA5);
  unsigned char* base = ws.data() + 1;
  kvtest::lib_result g;
  g.rows = lib.rows;
  g.cap = lib.cap;
  g.indptr.assign(lib.indptr.size(), -7);
  g.indices.assign(lib.indices.size(), -7);
  g.positions.assign(lib.positions.size(), -7);
  g.scores.assign(lib.scores.size(), -7.0f);
  kv::selection_view sel{g.indptr.data(), g.indices.data(), g.positions.data(), static_cast<std::int64_t>(g.indices.size())};
  const kv::status st = ev.run(in, budget, sel, base, need, g.scores.data());
  if (!st.ok()) return std::string("guarded run failed: ") + st.message();
  for (std::size_t i = need; i < need + guard; ++i)
    if (base[i] != 0xA5) return "workspace written past workspace_size() at byte " + std::to_string(i);
  if (g.indptr != lib.indptr || g.indices != lib.indices) return "guarded run selected differently";
  for (std::size_t i = 0; i < g.scores.size(); ++i)
    if (std::memcmp(&g.scores[i], &lib.scores[i], sizeof(float)) != 0) return "guarded run scored differently";
  return "";
}

}  // namespace

TEST_CASE("presets through the evictor over several row blocks and key tiles vs reference_run; guarded workspace") {
  int sets = 0, rows = 0;
  std::uint64_t seed = 7900;
  // ReST-KV (LOR after, W_O, EMA 0.3, adaptive window): G 3 and 8, windows 33 and 70, ragged heads.
  for (const std::int64_t G : {3, 8})
    for (const std::int64_t W : {33, 70})
      for (const std::int64_t L : {1025, 2049}) {
        kvtest::shape s;
        s.batch = 1, s.kv_heads = 2, s.group = G, s.cap = L, s.d = 16, s.window = W, s.hidden = 32;
        kvtest::problem p = kvtest::make_problem(s, seed++, 1.0, 1.5, 1.0, {static_cast<std::int32_t>(L), static_cast<std::int32_t>(L - 300)});
        kvtest::quantize<float>(p);
        kvtest::stored<float> st;
        kvtest::store(p, layout::nhd, st);
        CAPTURE(G);
        CAPTURE(W);
        CAPTURE(L);
        const kv::budget_request budget = kv::budget_request::tokens(static_cast<std::int32_t>(L / 4));
        kv::evictor<kv::presets::restkv, kv::cpu::backend> ev;
        const auto lib = kvtest::run_lib(ev, st.in, budget);
        ref_config c = kvtest::lor_ref_config(false, true, false);
        c.spatial = kvtest::spatial_kind::adaptive;
        c.beta = 2000.0;
        c.k_min = 5;
        c.keep_tokens = budget.keep_tokens;
        int sc = 0;
        const std::string diff = kvtest::compare(lib, kvtest::reference_run(p, c), kvtest::score_rtol, kvtest::score_atol, &sc);
        CHECK_MESSAGE(diff.empty(), "restkv: " << diff);
        CHECK_MESSAGE(guarded_run_matches(ev, st.in, budget, lib) == "", "restkv");
        sets += sc;
        rows += static_cast<int>(lib.rows);
      }
  // H2O: the whole prompt is the window (33 row blocks at 1025), ragged sequences.
  for (bool norm : {false, true})
    for (const std::int64_t cap : {100, 1025}) {
      kvtest::shape s;
      s.batch = 2, s.kv_heads = 2, s.group = 3, s.cap = cap, s.d = 8, s.window = cap;
      const auto c2 = static_cast<std::int32_t>(cap - 37);
      kvtest::problem p = kvtest::make_problem(s, seed++, 1.0, 1.5, 1.0, {static_cast<std::int32_t>(cap), c2, c2, c2});
      kvtest::quantize<float>(p);
      kvtest::stored<float> st;
      kvtest::store(p, layout::hnd, st);
      CAPTURE(norm);
      CAPTURE(cap);
      auto prm = kv::presets::h2o::defaults();
      prm.scorer.normalize_by_visible = norm;
      kv::evictor<kv::presets::h2o, kv::cpu::backend> ev(prm);
      const kv::budget_request budget = kv::budget_request::tokens(static_cast<std::int32_t>(cap / 4));
      const auto lib = kvtest::run_lib(ev, st.in, budget);
      ref_config c;
      c.scorer = scorer_kind::accumulated;
      c.normalize_visible = norm;
      c.recent_share = 0.5;
      c.keep_tokens = budget.keep_tokens;
      int sc = 0;
      const std::string diff = kvtest::compare(lib, kvtest::reference_run(p, c), kvtest::score_rtol, kvtest::score_atol, &sc);
      CHECK_MESSAGE(diff.empty(), "h2o: " << diff);
      CHECK_MESSAGE(guarded_run_matches(ev, st.in, budget, lib) == "", "h2o");
      sets += sc;
      rows += static_cast<int>(lib.rows);
    }
  // TOVA (last row only, layer mean) with a 70-row window: only row 69's block is computed.
  for (const std::int64_t G : {1, 8}) {
    kvtest::shape s;
    s.batch = 1, s.kv_heads = 2, s.group = G, s.cap = 2049, s.d = 8, s.window = 70;
    kvtest::problem p = kvtest::make_problem(s, seed++, 1.0, 1.5, 1.0);
    kvtest::quantize<float>(p);
    kvtest::stored<float> st;
    kvtest::store(p, layout::padded, st);
    CAPTURE(G);
    kv::evictor<kv::presets::tova, kv::cpu::backend> ev;
    const kv::budget_request budget = kv::budget_request::tokens(300);
    const auto lib = kvtest::run_lib(ev, st.in, budget);
    ref_config c;
    c.scorer = scorer_kind::last_query;
    c.temporal = kvref::temporal_kind::last;
    c.gqa = kvref::gqa_kind::layer_mean;
    c.num_recent = 0;
    c.keep_tokens = 300;
    int sc = 0;
    const std::string diff = kvtest::compare(lib, kvtest::reference_run(p, c), kvtest::score_rtol, kvtest::score_atol, &sc);
    CHECK_MESSAGE(diff.empty(), "tova: " << diff);
    CHECK_MESSAGE(guarded_run_matches(ev, st.in, budget, lib) == "", "tova");
    sets += sc;
    rows += static_cast<int>(lib.rows);
  }
  MESSAGE("presets through the evictor: " << rows << " rows, " << sets << " compared as exact sets");
  CHECK(sets * 10 >= rows * 7);
}
