// IWYU pragma: private, include "kvevict/cpu.hpp"
// Window attention of one query head on the CPU, computed in row blocks so that memory stays
// O(rows_per_block * seq_len) whatever the window (H2O passes the whole prompt as window).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/backends/cpu/backend.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// Rows of the window processed together (bounds the rows x L scratch).
inline constexpr std::int64_t attention_row_block = 32;

/// Per-row softmax statistics of a block, for the exact paths of the reconstruction score.
struct row_stats {
  float* max_logit;    ///< M_j: largest visible logit (0 when the row was rescaled)
  double* z_other;     ///< sum over visible m != argmax of exp(l_jm - M_j); Z_j = 1 + z_other
  std::int32_t* arg;   ///< argmax (lowest index among equal maxima)
};

/// Logits and probabilities of window rows [j0, j0 + rb) of a head with L keys and an
/// effective window of w rows. Row j is the query of slot L - w + j and sees keys
/// 0 .. L - w + j (causal mask inside the window). `q` is rb x d (fp32), `k` is L x d.
/// Outputs (row-major, leading dimension L): logits (masked entries -inf) and probs (masked
/// entries 0), plus the row statistics at offset r of `st`. Logits that overflow fp32 (huge
/// norms) are recomputed in fp64 and stored relative to the row maximum (M_j = 0 then).
inline void attention_block(const cmap_rm& q, const cmap_rm& k, std::int64_t L, std::int64_t w, std::int64_t j0,
                            float scale, float* logits, float* probs, const row_stats& st) {
  const std::int64_t rb = q.rows();
  map_rm lg(logits, rb, L, Eigen::OuterStride<>(L));
  lg.noalias() = (q * k.transpose()) * scale;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < rb; ++r) {
    const std::int64_t j = j0 + r;
    const std::int64_t vis = L - w + j + 1;  // visible keys [0, vis)
    float* l = logits + r * L;
    float* p = probs + r * L;
    for (std::int64_t n = vis; n < L; ++n) l[n] = ninf;
    // x - x == 0 exactly when x is finite: one vectorised pass instead of a branchy scan.
    const bool finite = ((Eigen::Map<const Eigen::ArrayXf>(l, vis) - Eigen::Map<const Eigen::ArrayXf>(l, vis)) == 0.0f).all();
    if (!finite) {  // fp64 recompute, stored relative to the row max
      auto dot = [&](std::int64_t n) {
        double acc = 0.0;
        for (Eigen::Index c = 0; c < q.cols(); ++c) acc += static_cast<double>(q(r, c)) * static_cast<double>(k(n, c));
        return acc * scale;
      };
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int64_t n = 0; n < vis; ++n) mx = std::max(mx, dot(n));
      for (std::int64_t n = 0; n < vis; ++n) {
        const double rel = dot(n) - mx;
        l[n] = rel < -3.0e38 ? -3.0e38f : static_cast<float>(rel);
      }
    }
    // Row maximum (vectorised), then its first occurrence: the argmax, lowest index on ties.
    const float mx = Eigen::Map<const Eigen::ArrayXf>(l, vis).maxCoeff();
    const std::int64_t am = std::find(l, l + vis, mx) - l;
    Eigen::Map<Eigen::ArrayXf> pa(p, vis);
    pa = (Eigen::Map<const Eigen::ArrayXf>(l, vis) - mx).exp();
    p[am] = 0.0f;
    const double zo = static_cast<double>(pa.sum());
    const double z = 1.0 + zo;
    const float inv = static_cast<float>(1.0 / z);
    pa *= inv;
    p[am] = inv;
    for (std::int64_t n = vis; n < L; ++n) p[n] = 0.0f;
    st.max_logit[r] = mx;
    st.z_other[r] = zo;
    st.arg[r] = static_cast<std::int32_t>(am);
  }
}

/// Mean index of the top-K entries (value desc, index asc) of p[0, n): a value selection
/// (nth_element on a contiguous copy, O(n)) gives the K-th largest value t, then one pass sums
/// the indices above t and the lowest-index entries equal to t. p must hold no NaN (softmax
/// probabilities). vals: n floats of scratch.
inline double topk_mean_index(const float* p, std::int64_t n, std::int64_t K, float* vals) {
  if (n <= 0) return 0.0;
  if (K > n) K = n;
  if (K < 1) K = 1;
  if (K == n) return static_cast<double>(n - 1) / 2.0;
  std::copy(p, p + n, vals);
  std::nth_element(vals, vals + (K - 1), vals + n, [](float a, float b) { return a > b; });
  const float t = vals[K - 1];
  double s = 0.0;
  std::int64_t above = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (p[i] > t) {
      s += static_cast<double>(i);
      ++above;
    }
  for (std::int64_t i = 0, need = K - above; i < n && need > 0; ++i)
    if (p[i] == t) {
      s += static_cast<double>(i);
      --need;
    }
  return s / static_cast<double>(K);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
