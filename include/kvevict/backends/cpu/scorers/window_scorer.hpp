// IWYU pragma: private, include "kvevict/cpu.hpp"
// window_scorer<Hooks>: the window-attention loop every attention-based CPU scorer shares
// (SnapKV's attention_weight, H2O's accumulated_attention, TOVA's last_query, CriticalKV's
// attention_value_norm, ReST-KV's output_reconstruction). For one (sequence, KV head) it stages
// K, computes the temporal weights c_j, runs the window attention of the whole GQA group block of
// window rows by block (attention_block: one GEMM per key tile, K packed once), accumulates the
// temporal aggregate a_bar[n] = sum_j c_j A[j, n] (a row-maximum smoother: max_j A[j, n]) into the
// output rows, and the adaptive-window
// drift when asked. What differs between the scorers is in its Hooks (the scorer's
// scorer_impl), each optional (window_hooks defaults):
//   static constexpr bool last_only            only the newest window row (TOVA)
//   static void prepare(ctx&, scratch&)         before the loop: values, weights, flags
//   static void on_block(ctx&, scratch&, g, j0, rb, probs, logits, stats, Pb, out)
//                                               per head and block of rows (ReST-KV "before")
//   static void finish_head(ctx&, scratch&, g, out, rows2)   per head after the loop
//   static void finish_group(ctx&, scratch&, rows)           once after the heads
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/backends/cpu/scorers/common.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// The state of one (sequence, KV head) shared by the loop and the hooks.
template <class Policy, class T>
struct window_ctx {
  window_ctx(const detail::head_job<Policy, T>& j, float* kbuf)
      : job(j), in(*j.in), P(*j.p), L(j.L), d(j.in->head_dim()), b(j.b), h(j.h), G(j.in->queries.data ? j.in->group_size() : 1),
        w(j.w), rb(std::max<std::int64_t>(1, std::min(j.rows_per_block, std::min(attention_row_block, std::max<std::int64_t>(j.w, 1))))),
        scale(static_cast<float>(1.0 / std::sqrt(static_cast<double>(j.in->head_dim())))),
        ksrc(head_rows(*j.in, j.in->keys, j.b, j.h)),
        keys{ksrc, kbuf} {}
  window_ctx(const window_ctx&) = delete;
  const detail::head_job<Policy, T>& job;
  const layer_inputs<T>& in;
  const typename Policy::params& P;
  std::int64_t L, d, b, h, G, w;
  std::int64_t rb;  ///< window rows per block (head_job::rows_per_block, within the window)
  float scale;
  std::int64_t row_begin = 0;
  /// The head's keys, staged one tile of attention_key_tile keys at a time (never as a whole).
  row_source<T> ksrc;
  key_tiles<T> keys;
  /// The head's values as stored (row_source; a hook that reads them sets vsrc.scale_exp).
  row_source<T> vsrc{};
  /// The head's values staged in fp32 as a whole (only the reconstruction scorer's "before" mode).
  cmap_rm V{nullptr, 0, 0, Eigen::OuterStride<>(1)};
  double vscale = 1.0;  ///< the values were divided by vscale (ReST-KV: 2^e in fp64)
  int vexp = 0;         ///< ... or by 2^vexp (CriticalKV)
  float tau = 1.0f;
  double out_scale = 1.0;
  /// The softmax keeps normalised probabilities and the logits (ReST-KV "before" mode); otherwise
  /// the weights stay unnormalised in place of the logits (fl(e * inv_z) is the probability).
  bool before = false;
  bool use_r = false;
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rcat;
  const float* y_base = nullptr;
  std::int64_t y_stride = 0;
};

/// Defaults of the Hooks of window_scorer.
struct window_hooks {
  static constexpr bool last_only = false;
  /// The hooks weight the window rows linearly themselves (reading head_scratch::st_c), so a
  /// row-maximum temporal smoother (temporal::maximum, temporal::defensive) cannot run with them.
  static constexpr bool linear_temporal_only = false;
  template <class Ctx>
  static void prepare(Ctx&, head_scratch&) {}
  template <class Ctx>
  static void on_block(Ctx&, head_scratch&, std::int64_t, std::int64_t, std::int64_t, const float*, const float*, const row_stats&,
                       const cmap_rm&, float*) {}
  /// Default per-head end: the aggregate a_bar saturated to the finite fp32 range.
  template <class Ctx>
  static void finish_head(Ctx& c, head_scratch&, std::int64_t, float* out, float*) {
    for (std::int64_t n = 0; n < c.L; ++n) out[n] = saturate(out[n]);
  }
  template <class Ctx>
  static void finish_group(Ctx&, head_scratch&, float*) {}
};

/// See the file comment. Hooks: the scorer's implementation (derives from window_hooks).
template <class Hooks>
struct window_scorer : scorer_impl_base {
  /// The newest window row sees every valid key, and a NaN or inf key makes its logit non-finite
  /// (attention_block's nonfinite_inputs): with check_finite, a head whose keys are not all finite
  /// sets head_scratch::nonfinite_keys and stops (its rows zero), and run() names the element.
  static constexpr bool detects_nonfinite_keys = true;
  /// K and V by tiles; queries one block at a time.
  static constexpr bool full_kv() { return false; }
  static constexpr bool all_queries() { return false; }
  /// Rows of one block: the window's, up to attention_row_block; TOVA's last row only.
  static constexpr std::int64_t block_rows_max(std::int64_t w) {
    return Hooks::last_only ? 1 : std::min(attention_row_block, std::max<std::int64_t>(w, 1));
  }
  template <class Policy, class T>
  static void score(const head_job<Policy, T>& job, head_scratch& s, float* rows /* G x L */, double* drift /* G */,
                    float* rows2 = nullptr /* G x L */) {
    const layer_inputs<T>& in = *job.in;
    const auto& P = *job.p;
    const std::int64_t L = job.L, d = in.head_dim(), b = job.b, h = job.h;
    const std::int64_t G = in.queries.data ? in.group_size() : 1;
    // A row-maximum temporal smoother: the loop's aggregate is max_j p_j[n] instead of sum_j c_j p_j[n].
    constexpr bool row_max = kvevict::detail::temporal_row_max<typename Policy::temporal_smoother>::value;
    static_assert(!(row_max && Hooks::linear_temporal_only),
                  "kvevict: this scorer weights the window rows linearly (output_reconstruction, defensive_attention): "
                  "temporal::maximum / temporal::defensive cannot run with it");
    // Keys of this head, fp32.
    window_ctx<Policy, T> c(job, s.kbuf);
    const std::int64_t w = c.w, rbk = c.rb;
    c.vsrc = head_rows(in, in.values, b, h);  // base null when the values are not set
    // Temporal weights c_j over the effective window.
    if constexpr (Hooks::last_only) {
      for (std::int64_t j = 0; j < w; ++j) s.st_c[j] = j == w - 1 ? 1.0f : 0.0f;
    } else {
      temporal_impl<typename Policy::temporal_smoother>::weights(P.temporal, w, s.st_c);
    }
    c.row_begin = Hooks::last_only ? w - 1 : 0;
    c.y_base = s.ybuf;
    c.y_stride = d;
    Hooks::prepare(c, s);
    const std::int64_t row_begin = c.row_begin;

    // The window attention runs for the whole GQA group at once, block of window rows by
    // block: one (G rb x d)(d x L) product per block, so K is packed once, not G times. The
    // per-head accumulators live in the output rows out_g = rows + g L: the temporal aggregate
    // a_bar, or in "before" mode the sum of the rows' scores.
    std::fill(rows, rows + G * L, 0.0f);
    const bool want_drift = job.drift_topk > 0;
    const bool before = c.before;
    std::fill(s.dsum, s.dsum + 2 * G, 0.0);  // per head: drift sums of the front and rear rows
    std::int64_t n_front = 0, n_rear = 0;   // rows in each half (the same for every head)

    for (std::int64_t j0 = row_begin; j0 < w; j0 += rbk) {
      const std::int64_t rb = std::min(rbk, w - j0);
      // "before" mode reads the normalised probabilities and the logits afterwards; every other
      // path only needs the weights: the softmax runs in place over the logits and leaves them
      // unnormalised, fl(e * inv_z) = the probability is folded into the consumers below.
      float* const pbase = before ? s.probs : s.logits;
      bool nonfinite = false;
      attention_block(stage_group_queries(in, b, h, G, w, j0, rb, s.qbuf), c.keys, L, w, j0, rb, c.scale, s.logits, pbase,
                      row_stats{s.st_max, s.st_zo, s.st_arg, s.st_inv}, before, &nonfinite);
      if (nonfinite && P.check_finite) {  // a NaN or inf key (the queries were checked): run() reports it
        s.nonfinite_keys = true;
        std::fill(rows, rows + G * L, 0.0f);
        if (rows2) std::fill(rows2, rows2 + G * L, 0.0f);
        std::fill(drift, drift + G, 0.0);
        return;
      }
      if (want_drift)
        for (std::int64_t r = 0; r < rb; ++r) ++(j0 + r < w / 2 ? n_front : n_rear);

      for (std::int64_t g = 0; g < G; ++g) {
        float* out = rows + g * L;
        const float* pg = pbase + g * rb * L;   // head g's rows of the block
        const float* lgg = s.logits + g * rb * L;
        const row_stats st{s.st_max + g * rb, s.st_zo + g * rb, s.st_arg + g * rb, s.st_inv + g * rb};
        cmap_rm Pb(pg, rb, L, Eigen::OuterStride<>(L));
        if constexpr (row_max) {
          // a[n] = max over the rows of p_r[n] = fl(e_r[n] / Z_r) (the rows start at 0: probabilities are >= 0)
          for (std::int64_t r = 0; r < rb; ++r) {
            const float* e = pg + r * L;
            const float iz = st.inv_z[r];
            for (std::int64_t n = 0; n < L; ++n) out[n] = std::max(out[n], e[n] * iz);
          }
        } else if (!before) {
          // a_bar += sum_r c_j p_r = sum_r (c_j / Z_r) e_r
          float cz[attention_row_block];
          for (std::int64_t r = 0; r < rb; ++r) cz[r] = s.st_c[j0 + r] * st.inv_z[r];
          vec_map(out, L).noalias() += Pb.transpose() * Eigen::Map<const Eigen::VectorXf>(cz, rb);
        }
        if (want_drift) {
          for (std::int64_t r = 0; r < rb; ++r) {
            const std::int64_t j = j0 + r;
            s.dsum[2 * g + (j < w / 2 ? 0 : 1)] +=
                topk_mean_index(pg + r * L, L - w + j + 1, job.drift_topk, s.rowtmp, before ? 1.0f : st.inv_z[r]);
          }
        }
        Hooks::on_block(c, s, g, j0, rb, pg, lgg, st, Pb, out);
      }
    }

    for (std::int64_t g = 0; g < G; ++g) {
      float* out = rows + g * L;
      Hooks::finish_head(c, s, g, out, rows2);
      drift[g] = (n_front > 0 && n_rear > 0) ? s.dsum[2 * g] / static_cast<double>(n_front) - s.dsum[2 * g + 1] / static_cast<double>(n_rear)
                                             : 0.0;
    }
    Hooks::finish_group(c, s, rows);
  }
};

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
