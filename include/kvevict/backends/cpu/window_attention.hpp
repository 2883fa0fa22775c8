// IWYU pragma: private, include "kvevict/cpu.hpp"
// Window attention of a GQA group on the CPU, computed in row blocks so that memory stays
// O(rows_per_block * seq_len) whatever the window (H2O passes the whole prompt as window).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/gemm.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// Rows of the window processed together (bounds the rows x L scratch).
inline constexpr std::int64_t attention_row_block = 32;

/// Keys per logits GEMM of attention_block: the tile's logits of every row (G rb x 1024 floats,
/// 512 KiB for a block of 4 x 32 rows) are still in L2 when their maximum is taken.
inline constexpr std::int64_t attention_key_tile = 1024;

/// Window rows per block of the window loop for L keys and a GQA group of G query heads: as many
/// as keep the block's logits (max(G, 2) x rows x L floats; the reconstruction scorer's exact
/// limit reads one head's logits and weights side by side) within block_bytes, between 1 and
/// attention_row_block (and the window). The blocks' rows do not change what is computed, only
/// how many passes over K it takes (and, for the temporal aggregate, how partial sums group).
inline std::int64_t block_rows(std::size_t block_bytes, std::int64_t G, std::int64_t L, std::int64_t w) {
  const std::int64_t cap = std::min(attention_row_block, std::max<std::int64_t>(w, 1));
  if (L <= 0) return cap;
  const std::size_t per_row = static_cast<std::size_t>(std::max<std::int64_t>(G, 2)) * static_cast<std::size_t>(L) * sizeof(float);
  const std::size_t fit = block_bytes / per_row;
  return std::max<std::int64_t>(1, std::min<std::int64_t>(cap, static_cast<std::int64_t>(std::min<std::size_t>(fit, 1u << 20))));
}

/// Floats of the logits buffer that holds a block of min(rows_max, block_rows(block_bytes, G, L,
/// w)) rows for every L <= cap: max(G, 2) x max(cap, min(rows_max cap, floor(block_bytes /
/// (4 max(G, 2))))), an upper bound of max(G, 2) x rows x L over L (0 when rows_max is 0).
inline std::size_t block_logits_floats(std::size_t block_bytes, std::int64_t G, std::int64_t cap, std::int64_t rows_max) {
  if (rows_max <= 0) return 0;
  const std::size_t g2 = static_cast<std::size_t>(std::max<std::int64_t>(G, 2));
  const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(cap, 0));
  const std::size_t rmax = static_cast<std::size_t>(std::min(attention_row_block, rows_max));
  // rows(L) x L <= max(L, min(rmax L, block_bytes / (g2 4))) for every L, largest at L = cap
  const std::size_t fit = block_bytes / (g2 * sizeof(float));
  return g2 * std::max(n, std::min(rmax * n, fit));
}

/// Softmax entries exponentiated and summed together (a chunk stays in L1 between the two).
inline constexpr std::int64_t softmax_chunk = 1024;

/// Index of the first x[i] == v in x[0, n) (n if none): blocks of 64 are tested with a
/// vectorisable OR of comparisons, then the block that holds it is scanned.
inline std::int64_t first_equal(const float* x, std::int64_t n, float v) {
  constexpr std::int64_t blk = 64;
  for (std::int64_t b0 = 0; b0 < n; b0 += blk) {
    const std::int64_t be = std::min(n, b0 + blk);
    bool hit = false;
    for (std::int64_t i = b0; i < be; ++i) hit |= (x[i] == v);
    if (hit) return std::find(x + b0, x + be, v) - x;
  }
  return n;
}

/// attention_block's key source over an fp32 matrix (L x d) held in memory.
struct matrix_keys {
  const cmap_rm& m;
  cmap_rm tile(std::int64_t n0, std::int64_t nt) const { return cmap_rm(m.data() + n0 * m.outerStride(), nt, m.cols(), Eigen::OuterStride<>(m.outerStride())); }
  float at(std::int64_t n, std::int64_t c) const { return m(n, c); }
};

/// attention_block's key source over a row_source: each tile is staged into buf (at most
/// attention_key_tile x d floats) unless it can be read in place.
template <class T>
struct key_tiles {
  const row_source<T>& src;
  float* buf;
  cmap_rm tile(std::int64_t n0, std::int64_t nt) const { return src.rows(n0, nt, buf); }
  float at(std::int64_t n, std::int64_t c) const { return src.at(n, c); }
};

/// Per-row softmax statistics of a block, for the exact paths of the reconstruction score.
struct row_stats {
  float* max_logit;    ///< M_j: largest visible logit (0 when the row was rescaled)
  double* z_other;     ///< sum over visible m != argmax of exp(l_jm - M_j); Z_j = 1 + z_other
  std::int32_t* arg;   ///< argmax (lowest index among equal maxima)
  float* inv_z;        ///< 1 / Z_j rounded to fp32: probability = fl(exp(l_jm - M_j) * inv_z)
};

/// Logits and probabilities of window rows [j0, j0 + rph) of the G = q.rows() / rph query heads
/// of a GQA group, which share the L keys `k` (L x d), with an effective window of w rows.
/// `q` is (G rph) x d (fp32): row g rph + r is head g's window row j = j0 + r, the query of slot
/// L - w + j, which sees keys 0 .. L - w + j (causal mask inside the window). One GEMM for the
/// whole group, so the keys are packed once, not G times.
/// Outputs (row-major, leading dimension L, rows in q's order): logits (masked entries -inf) and
/// probs (masked entries 0), plus the row statistics at offset g rph + r of `st`. Logits that
/// overflow fp32 (huge norms) are recomputed in fp64 and stored relative to the row maximum
/// (M_j = 0 then).
/// normalize = false leaves the unnormalised weights e_jm = exp(l_jm - M_j) in probs (1 at the
/// argmax) and skips a pass over them: the probability is fl(e_jm * st.inv_z[r]), bit for bit
/// what normalize = true stores. probs may be the logits buffer itself (softmax in place; the
/// logits are then lost).
/// Keys: the key source, an object with `cmap_rm tile(n0, nt)` (keys [n0, n0 + nt) as fp32 rows;
/// the view may be invalidated by the next call) and `float at(n, c)`: key_tiles over a
/// row_source (the scorers: K is staged one tile of attention_key_tile keys at a time, never as a
/// whole) or matrix_keys over an fp32 matrix.
/// nonfinite_inputs (optional): set to true when a row's fp64 recompute meets a non-finite dot
/// product, which finite queries and keys never give (a product of two finite floats stays
/// below 1.2e77 in fp64): a NaN or inf key among the row's visible keys, or a NaN or inf query.
/// A non-finite key makes every logit of its column non-finite (x NaN = NaN, x inf = inf or NaN
/// when x = 0), so a row that sees every key checks all of K at no cost while the logits stay
/// finite. The rows are computed as without it.
template <class Keys>
inline void attention_block(const cmap_rm& q, const Keys& k, std::int64_t L, std::int64_t w, std::int64_t j0,
                            std::int64_t rph, float scale, float* logits, float* probs, const row_stats& st,
                            bool normalize = true, bool* nonfinite_inputs = nullptr) {
  const std::int64_t rb = q.rows();
  const float ninf = -std::numeric_limits<float>::infinity();
  // Logits in tiles of attention_key_tile keys: scale * (q k_t^T) is one GEMM with alpha = scale
  // (Eigen folds the scalar into the product; (q k^T) * scale would be evaluated into a
  // temporary and copied). While a tile is in cache, each row's running maximum is updated and
  // its finiteness checked on the logits' exponent bits (row_finite: one vectorised pass, which
  // a user's -ffast-math cannot fold away; the key check below relies on it).
  for (std::int64_t r = 0; r < rb; ++r) {
    st.max_logit[r] = ninf;
    st.z_other[r] = 0.0;  // 1 once a visible logit is not finite, until the softmax below
  }
  for (std::int64_t n0 = 0; n0 < L; n0 += attention_key_tile) {
    const std::int64_t nt = std::min(attention_key_tile, L - n0);
    map_rm lg(logits + n0, rb, nt, Eigen::OuterStride<>(L));
    gemm_nt(scale, q, k.tile(n0, nt), lg);
    for (std::int64_t r = 0; r < rb; ++r) {
      const std::int64_t vis = L - w + j0 + r % rph + 1;  // visible keys [0, vis)
      const std::int64_t m = std::min(nt, vis - n0);
      if (m <= 0) continue;
      const Eigen::Map<const Eigen::ArrayXf> la(logits + r * L + n0, m);
      if (!row_finite(logits + r * L + n0, m)) st.z_other[r] = 1.0;  // on the bits: -ffast-math cannot fold it
      st.max_logit[r] = std::max(st.max_logit[r], la.maxCoeff());
    }
  }
  for (std::int64_t r = 0; r < rb; ++r) {
    const std::int64_t j = j0 + r % rph;
    const std::int64_t vis = L - w + j + 1;  // visible keys [0, vis)
    float* l = logits + r * L;
    float* p = probs + r * L;
    for (std::int64_t n = vis; n < L; ++n) l[n] = ninf;
    float mx = st.max_logit[r];
    if (!(st.z_other[r] == 0.0)) {  // an inf or NaN logit: fp64 recompute, stored relative to the row max
      auto dot = [&](std::int64_t n) {
        double acc = 0.0;
        for (Eigen::Index c = 0; c < q.cols(); ++c) acc += static_cast<double>(q(r, c)) * static_cast<double>(k.at(n, c));
        return acc * scale;
      };
      double dmx = -std::numeric_limits<double>::infinity();
      bool finite = true;
      for (std::int64_t n = 0; n < vis; ++n) {
        const double x = dot(n);
        finite = finite && finite_bits(x);
        dmx = std::max(dmx, x);
      }
      if (!finite && nonfinite_inputs) *nonfinite_inputs = true;
      for (std::int64_t n = 0; n < vis; ++n) {
        const double rel = dot(n) - dmx;
        l[n] = rel < -3.0e38 ? -3.0e38f : static_cast<float>(rel);
      }
      mx = Eigen::Map<const Eigen::ArrayXf>(l, vis).maxCoeff();
    }
    // The first occurrence of the row maximum: the argmax, lowest index on ties (not found only
    // in a row of NaN, possible with check_finite = false: stay inside the row).
    const std::int64_t am = std::min(first_equal(l, vis, mx), vis - 1);
    // p = exp(l - mx) and the sum of the others' weights, chunk by chunk (each chunk is summed
    // while it is in L1); p[am] = exp(0) = 1 is left out of the sum.
    double zo = 0.0;
    for (std::int64_t c0 = 0; c0 < vis; c0 += softmax_chunk) {
      const std::int64_t cn = std::min(softmax_chunk, vis - c0);
      Eigen::Map<Eigen::ArrayXf> pc(p + c0, cn);
      pc = (Eigen::Map<const Eigen::ArrayXf>(l + c0, cn) - mx).exp();
      if (am >= c0 && am < c0 + cn) p[am] = 0.0f;
      zo += static_cast<double>(pc.sum());
    }
    const double z = 1.0 + zo;
    const float inv = static_cast<float>(1.0 / z);
    if (normalize) {
      Eigen::Map<Eigen::ArrayXf>(p, vis) *= inv;
      p[am] = inv;
    } else {
      p[am] = 1.0f;
    }
    for (std::int64_t n = vis; n < L; ++n) p[n] = 0.0f;
    st.max_logit[r] = mx;
    st.z_other[r] = zo;
    st.arg[r] = static_cast<std::int32_t>(am);
    st.inv_z[r] = inv;
  }
}

/// attention_block over an fp32 matrix of keys (tests and benchmarks).
inline void attention_block(const cmap_rm& q, const cmap_rm& k, std::int64_t L, std::int64_t w, std::int64_t j0,
                            std::int64_t rph, float scale, float* logits, float* probs, const row_stats& st,
                            bool normalize = true, bool* nonfinite_inputs = nullptr) {
  attention_block(q, matrix_keys{k}, L, w, j0, rph, scale, logits, probs, st, normalize, nonfinite_inputs);
}

/// Mean index of the top-K entries (value desc, index asc) of x[0, n), x[i] = fl(p[i] * f).
/// p must hold no NaN (softmax weights; f = 1 for probabilities, f = row_stats::inv_z for
/// unnormalised weights, which ranks exactly the probabilities). vals: n uint32 of scratch.
/// kth_largest_key (backend.hpp) finds the K-th largest value t by its score_key (the order of
/// the values, -0 = +0); one pass then sums the indices above t (in int64: exact) and the
/// lowest-index entries equal to t. The result is the same as sorting (tests/backends/cpu
/// compares it with a full sort).
inline double topk_mean_index(const float* p, std::int64_t n, std::int64_t K, std::uint32_t* vals, float f = 1.0f) {
  if (n <= 0) return 0.0;
  if (K > n) K = n;
  if (K < 1) K = 1;
  if (K == n) return static_cast<double>(n - 1) / 2.0;
  const kth_key kk = kth_largest_key(n, K, [p, f](std::int64_t i) { return score_key(p[i] * f); }, vals);
  std::int64_t isum = 0, ties = K - kk.above;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t key = score_key(p[i] * f);
    if (key > kk.t || (key == kk.t && ties-- > 0)) isum += i;
  }
  return static_cast<double>(isum) / static_cast<double>(K);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
