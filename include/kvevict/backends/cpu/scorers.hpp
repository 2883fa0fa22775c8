// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementations of the scorer policies, one (sequence, KV head) at a time.
// Output: G score rows (one per query head of the GQA group; query-free scorers write the
// same row G times) of length L, fp32, finite; plus, on request, the adaptive-window drift
// statistic of each query head.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/window_attention.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"

namespace kvevict {
namespace cpu {

/// What a user-defined CPU scorer sees for one (sequence, KV head): fp32 row-major copies of
/// the head's first L keys and values (L x head_dim) and of its group's window queries
/// (G x w x head_dim, may be empty when the policy has no window). Plain pointers, no Eigen.
struct head_inputs {
  std::int64_t batch_index = 0, kv_head = 0;
  std::int64_t length = 0;     ///< L
  std::int64_t head_dim = 0;   ///< d
  std::int64_t group_size = 0; ///< G
  std::int64_t window = 0;     ///< w rows per query head (0 if no queries)
  std::int32_t layer_idx = 0;  ///< layer_inputs::layer_idx (for per-layer learned scorers)
  const float* keys = nullptr;     ///< L x d
  const float* values = nullptr;   ///< L x d (null if the layer has no values)
  const float* queries = nullptr;  ///< G x w x d
};

namespace detail {

/// Detects a user scorer's CPU hook:
///   static void score_kv_head(const params&, const cpu::head_inputs&, float* out /* L */);
template <class S, class = void>
struct has_cpu_hook : std::false_type {};
template <class S>
struct has_cpu_hook<S, std::void_t<decltype(S::score_kv_head(std::declval<const typename S::params&>(),
                                                             std::declval<const head_inputs&>(),
                                                             std::declval<float*>()))>> : std::true_type {};

/// Tokens per tile of the reconstruction scorer's "after" mode: the tile's value projections
/// (lor_token_tile x G d floats, 512 KiB for G = 4, d = 128) stay in the core's L2 cache between
/// the GEMM that writes them and the distance pass that reads them.
inline constexpr std::int64_t lor_token_tile = 256;

/// ||a - b||^2 of two d-vectors, fp32 differences with squares summed in fp64 (the squares
/// neither overflow nor underflow; a difference of two finite fp32 values beyond FLT_MAX
/// saturates to inf, which saturate() later clamps). The exact fallback of the vectorised fp32
/// pass.
inline double sq_dist_fp64(const float* a, const float* b, std::int64_t d) {
  double s = 0.0;
  for (std::int64_t c = 0; c < d; ++c) {
    const double e = static_cast<double>(a[c] - b[c]);
    s += e * e;
  }
  return s;
}

/// ||a - b||^2 of two d-vectors in fp32: differences and squares summed in 16 independent lanes
/// (a loop the compiler vectorises: one zmm, two ymm or four xmm registers), then a pairwise
/// sum of the lanes. Relative error ~1e-6; the caller falls back to sq_dist_fp64 where the sum
/// overflowed or underflowed.
inline float sq_dist_f32(const float* a, const float* b, std::int64_t d) {
  constexpr std::int64_t lanes = 16;
  float acc[lanes] = {};
  std::int64_t c = 0;
  for (; c + lanes <= d; c += lanes)
    for (std::int64_t l = 0; l < lanes; ++l) {
      const float e = a[c + l] - b[c + l];
      acc[l] += e * e;
    }
  for (std::int64_t l = 0; c < d; ++c, ++l) {
    const float e = a[c] - b[c];
    acc[l] += e * e;
  }
  for (std::int64_t half = lanes / 2; half > 0; half /= 2)
    for (std::int64_t l = 0; l < half; ++l) acc[l] += acc[l + half];
  return acc[0];
}

/// Whether Scorer's per-thread scratch must hold the value projections of every token
/// (head_scratch::carve full_y): only the reconstruction scorer's "before" mode does; its "after"
/// mode works in tiles of lor_token_tile tokens and the other scorers do not use them.
template <class Scorer>
bool needs_full_projection(const typename Scorer::params& p) {
  if constexpr (std::is_same<Scorer, scorers::output_reconstruction>::value)
    return p.aggregation == scorers::output_reconstruction::mode::before;
  (void)p;
  return false;
}

/// Per-thread scratch for scoring one KV head with up to `cap` tokens, window `w`, dim `d`.
struct head_scratch {
  float* kbuf = nullptr;   // cap x d
  float* vbuf = nullptr;   // cap x d
  float* ybuf = nullptr;   // "before" mode: cap x (G d) (V [R_1 .. R_G]^T, one GEMM per GQA
                           // group); "after" mode: lor_token_tile x (G d), one token tile
  float* rzs = nullptr;    // G x d ("after" mode: R_g z_g of every query head of the group)
  float* adom = nullptr;   // G     ("after" mode: a_bar of each head's dominant token)
  std::int64_t* dom = nullptr;  // G
  float* qbuf = nullptr;   // G * w x d (staged queries)
  float* logits = nullptr; // G rb x cap (a block of window rows of the whole GQA group; the
                           // softmax weights in place, except in "before" mode)
  float* probs = nullptr;  // "before" mode: G rb x cap probabilities; otherwise rb x cap (phase 3)
  float* cross = nullptr;  // rb x cap  ("before" mode only: one head's cross products)
  float* rowtmp = nullptr; // cap
  float* st_max = nullptr;      // G rb (row statistics of one block, attention_block)
  double* st_zo = nullptr;      // G rb
  std::int32_t* st_arg = nullptr;  // G rb
  float* st_inv = nullptr;      // G rb
  double* dsum = nullptr;       // 2 G (adaptive-window drift: front and rear sums per head)
  float* st_c = nullptr;        // w (temporal weights)
  float* wbuf = nullptr;        // C x d   (W_O^h staged, attention_value_norm only)
  float* pbuf = nullptr;        // value_norm_token_block x C (projected values of a token block)

  /// full_y: the value projections of all `cap` tokens are held at once (the reconstruction
  /// scorer's "before" mode); otherwise one tile of lor_token_tile tokens.
  template <class Carver>
  void carve(Carver& c, std::int64_t cap, std::int64_t w, std::int64_t d, std::int64_t G, bool full_y = true) {
    // Rows of one window block: attention_row_block, or the whole window when it is smaller.
    const std::int64_t rb = std::min(attention_row_block, std::max<std::int64_t>(w, 1));
    const std::size_t n = static_cast<std::size_t>(cap);
    const std::size_t g1 = static_cast<std::size_t>(std::max<std::int64_t>(G, 1));
    kbuf = c.template carve<float>(n * d);
    vbuf = c.template carve<float>(n * d);
    ybuf = c.template carve<float>((full_y ? n : std::min<std::size_t>(n, lor_token_tile)) * d * g1);
    rzs = c.template carve<float>(g1 * static_cast<std::size_t>(d));
    adom = c.template carve<float>(g1);
    dom = c.template carve<std::int64_t>(g1);
    qbuf = c.template carve<float>(static_cast<std::size_t>(G * std::max<std::int64_t>(w, 1) * d));
    logits = c.template carve<float>(g1 * rb * n);
    probs = c.template carve<float>((full_y ? g1 : 1) * rb * n);  // "before": the group's; else phase 3's (one head)
    cross = c.template carve<float>(full_y ? rb * n : 0);  // "before" mode only
    rowtmp = c.template carve<float>(n);
    const std::size_t ws = static_cast<std::size_t>(std::max<std::int64_t>(w, 1));
    const std::size_t sb = g1 * static_cast<std::size_t>(rb);
    st_max = c.template carve<float>(sb);
    st_zo = c.template carve<double>(sb);
    st_arg = c.template carve<std::int32_t>(sb);
    st_inv = c.template carve<float>(sb);
    dsum = c.template carve<double>(2 * g1);
    st_c = c.template carve<float>(ws);
  }

  /// Scratch of the projected value norms (scorers with needs_wo_matrix): hidden size C, dim d.
  template <class Carver>
  void carve_projection(Carver& c, std::int64_t C, std::int64_t d);
};

/// Tokens projected to the hidden size per GEMM by value_l1_norms (bounds its scratch to
/// value_norm_token_block x C floats per thread).
inline constexpr std::int64_t value_norm_token_block = 64;

template <class Carver>
void head_scratch::carve_projection(Carver& c, std::int64_t C, std::int64_t d) {
  wbuf = c.template carve<float>(static_cast<std::size_t>(std::max<std::int64_t>(C, 1) * std::max<std::int64_t>(d, 1)));
  pbuf = c.template carve<float>(static_cast<std::size_t>(value_norm_token_block * std::max<std::int64_t>(C, 1)));
}

/// Power-of-two exponent e such that x / 2^e lies in a safe fp32 range for a GEMM (0 when x is
/// already within [2^-32, 2^32] or zero).
inline int safe_exponent(float x) {
  if (!(x > 0.0f) || (x <= 0x1p32f && x >= 0x1p-32f)) return 0;
  int e;
  std::frexp(x, &e);
  return e;
}

/// x[0, n) *= 2^e, exact for every e in [-300, 300] (the factor is formed in fp64: 2^e alone can
/// overflow or vanish in fp32 while the products are representable).
inline void scale_pow2(float* x, std::int64_t n, int e) {
  const double f = std::ldexp(1.0, e);
  for (std::int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<double>(x[i]) * f);
}

/// CriticalKV's secondary score of query head hq (scorers::attention_value_norm):
///   u[n] = || v_n W_O^hq ||_1 = sum_{c < C} | sum_{i < d} wo(c, hq d + i) v_n[i] |,  n < L.
/// V: the head's L x d values in fp32, already divided by 2^vexp (vexp from safe_exponent, so the
/// products cannot overflow). The W_O slice (C x d) is widened to fp32 into s.wbuf and scaled
/// the same way; the projection runs as fp32 GEMMs of value_norm_token_block tokens into s.pbuf,
/// |y_c| is summed in fp64, then multiplied back by 2^(vexp + wexp) and saturated to FLT_MAX.
template <class T>
inline void value_l1_norms(const layer_inputs<T>& in, std::int64_t hq, const cmap_rm& V, int vexp, head_scratch& s,
                           float* u) {
  const std::int64_t L = V.rows(), d = V.cols(), C = in.wo.extent[0];
  float wmax = 0.0f;
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t i = 0; i < d; ++i) {
      const float x = to_float(in.wo(c, hq * d + i));
      s.wbuf[c * d + i] = x;
      wmax = std::max(wmax, std::fabs(x));
    }
  const int wexp = safe_exponent(wmax);
  if (wexp != 0) scale_pow2(s.wbuf, C * d, -wexp);
  cmap_rm W(s.wbuf, C, d, Eigen::OuterStride<>(d));
  const double back = std::ldexp(1.0, vexp + wexp);
  for (std::int64_t n0 = 0; n0 < L; n0 += value_norm_token_block) {
    const std::int64_t nb = std::min(value_norm_token_block, L - n0);
    map_rm Y(s.pbuf, nb, C, Eigen::OuterStride<>(C));
    Y.noalias() = V.middleRows(n0, nb) * W.transpose();
    for (std::int64_t t = 0; t < nb; ++t) {
      const float* y = s.pbuf + t * C;
      double acc = 0.0;
      for (std::int64_t c = 0; c < C; ++c) acc += std::fabs(static_cast<double>(y[c]));
      u[n0 + t] = saturate(acc * back);
    }
  }
}

/// Window rows [j0, j0 + rb) of the effective window (its last w rows) of the G query heads of
/// KV head h in sequence b, widened to fp32 into dst: (G rb) x d row-major, head after head (row
/// g rb + r = head h G + g, window row j0 + r), the layout attention_block takes. Any strides.
template <class T>
inline cmap_rm stage_group_queries(const layer_inputs<T>& in, std::int64_t b, std::int64_t h, std::int64_t G, std::int64_t w,
                                   std::int64_t j0, std::int64_t rb, float* dst) {
  const std::int64_t d = in.head_dim();
  for (std::int64_t g = 0; g < G; ++g) {
    const T* qb = in.queries.data + b * in.queries.stride[0] + (h * G + g) * in.queries.stride[1] +
                  (in.window() - w + j0) * in.queries.stride[2];
    for (std::int64_t r = 0; r < rb; ++r)
      for (std::int64_t c = 0; c < d; ++c)
        dst[(g * rb + r) * d + c] = to_float(qb[r * in.queries.stride[2] + c * in.queries.stride[3]]);
  }
  return cmap_rm(dst, G * rb, d, Eigen::OuterStride<>(d));
}

/// Everything the scorer of one KV head needs.
template <class Policy, class T>
struct head_job {
  const layer_inputs<T>* in;
  const typename Policy::params* p;
  std::int64_t b, h;        ///< sequence, KV head
  std::int64_t L;           ///< valid tokens
  std::int64_t w;           ///< effective window rows min(W, L)
  std::int64_t drift_topk;  ///< K for the adaptive-window drift (<= 0: not needed)
};

/// Norm of a d-vector in fp64 (no overflow for any finite fp32 input).
inline double norm2_d(const float* x, std::int64_t d) {
  double s = 0.0;
  for (std::int64_t i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

/// Scores of one (sequence, KV head): `rows` G x L primary scores, `drift` G adaptive-window
/// statistics, and for scorers with secondary_scores `rows2` G x L secondary scores (else unused).
template <class Scorer, class Temporal, class Policy, class T>
void score_kv_head(const head_job<Policy, T>& job, head_scratch& s, float* rows /* G x L */, double* drift /* G */,
                   float* rows2 = nullptr /* G x L */) {
  const layer_inputs<T>& in = *job.in;
  const auto& P = *job.p;
  const std::int64_t L = job.L, d = in.head_dim(), b = job.b, h = job.h;
  const std::int64_t G = in.queries.data ? in.group_size() : 1;
  const std::int64_t Gout = in.queries.data ? in.group_size() : 1;
  (void)Gout;
  // Keys of this head, fp32.
  const T* kbase = in.keys.data + b * in.keys.stride[0] + h * in.keys.stride[1];
  cmap_rm K = stage_rows(kbase, L, d, in.keys.stride[2], in.keys.stride[3], s.kbuf);

  if constexpr (has_cpu_hook<Scorer>::value) {
    head_inputs hi;
    hi.batch_index = b;
    hi.kv_head = h;
    hi.length = L;
    hi.head_dim = d;
    hi.group_size = G;
    hi.window = in.queries.data ? job.w : 0;
    hi.layer_idx = in.layer_idx;
    // hooks get contiguous copies
    if (K.data() != s.kbuf) {
      for (std::int64_t r = 0; r < L; ++r)
        for (std::int64_t c = 0; c < d; ++c) s.kbuf[r * d + c] = K(r, c);
    }
    hi.keys = s.kbuf;
    if (in.values.data) {
      const T* vb = in.values.data + b * in.values.stride[0] + h * in.values.stride[1];
      for (std::int64_t r = 0; r < L; ++r)
        for (std::int64_t c = 0; c < d; ++c) s.vbuf[r * d + c] = to_float(vb[r * in.values.stride[2] + c * in.values.stride[3]]);
      hi.values = s.vbuf;
    }
    if (in.queries.data) {
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < job.w; ++j) {
          const std::int64_t qrow = in.window() - job.w + j;
          for (std::int64_t c = 0; c < d; ++c)
            s.qbuf[(g * job.w + j) * d + c] = to_float(in.queries(b, h * G + g, qrow, c));
        }
      hi.queries = s.qbuf;
    }
    Scorer::score_kv_head(P.scorer, hi, rows);
    for (std::int64_t n = 0; n < L; ++n) rows[n] = saturate(rows[n]);
    for (std::int64_t g = 1; g < G; ++g) std::copy(rows, rows + L, rows + g * L);
    for (std::int64_t g = 0; g < G; ++g) drift[g] = 0.0;
    return;
  } else if constexpr (std::is_same<Scorer, scorers::key_norm>::value) {
    for (std::int64_t n = 0; n < L; ++n) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < d; ++c) acc += static_cast<double>(K(n, c)) * K(n, c);
      rows[n] = saturate(-std::sqrt(acc));
    }
    for (std::int64_t g = 1; g < G; ++g) std::copy(rows, rows + L, rows + g * L);
    for (std::int64_t g = 0; g < G; ++g) drift[g] = 0.0;
    return;
  } else if constexpr (Scorer::window_attention) {
    constexpr bool is_lor = std::is_same<Scorer, scorers::output_reconstruction>::value;
    constexpr bool is_last = std::is_same<Scorer, scorers::last_query>::value;
    constexpr bool is_avn = std::is_same<Scorer, scorers::attention_value_norm>::value;
    const std::int64_t w = job.w;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    // Temporal weights c_j over the effective window.
    for (std::int64_t j = 0; j < w; ++j)
      s.st_c[j] = is_last ? (j == w - 1 ? 1.0f : 0.0f)
                          : static_cast<float>(Temporal::weight(P.temporal, static_cast<int>(j), static_cast<int>(w)));
    const std::int64_t row_begin = is_last ? w - 1 : 0;
    if constexpr (is_lor) {
      // The reconstruction score needs a = a convex combination of attention rows (odds a/(1-a),
      // exact limit): normalise the weights (temporal::sum then ranks like temporal::mean).
      double csum = 0.0;
      for (std::int64_t j = 0; j < w; ++j) csum += s.st_c[j];
      if (csum > 0.0)
        for (std::int64_t j = 0; j < w; ++j) s.st_c[j] = static_cast<float>(s.st_c[j] / csum);
    }

    // Values (scaled by a power of two into a safe range) and their projections.
    double vscale = 1.0;  // 2^e in fp64: for max |v| in [2^127, FLT_MAX] 2^128 is inf in fp32
    cmap_rm V(nullptr, 0, 0, Eigen::OuterStride<>(1));
    if constexpr (is_lor) {
      const T* vbase = in.values.data + b * in.values.stride[0] + h * in.values.stride[1];
      new (&V) cmap_rm(stage_rows(vbase, L, d, in.values.stride[2], in.values.stride[3], s.vbuf));
      const float vmax = max_abs(V);
      if (vmax > 0.0f && (vmax > 0x1p32f || vmax < 0x1p-32f)) {
        int e;
        std::frexp(vmax, &e);
        vscale = std::ldexp(1.0, e);
        map_rm vs(s.vbuf, L, d, Eigen::OuterStride<>(d));
        if (V.data() != s.vbuf) vs = V;
        scale_pow2(s.vbuf, L * d, -e);
        new (&V) cmap_rm(s.vbuf, L, d, Eigen::OuterStride<>(d));
      }
    }
    // CriticalKV: the head's values, rescaled by 2^-vexp into a safe range, for value_l1_norms.
    int vexp = 0;
    (void)vexp;
    if constexpr (is_avn) {
      const T* vbase = in.values.data + b * in.values.stride[0] + h * in.values.stride[1];
      new (&V) cmap_rm(stage_rows(vbase, L, d, in.values.stride[2], in.values.stride[3], s.vbuf));
      vexp = safe_exponent(max_abs(V));
      if (vexp != 0) {
        map_rm vs(s.vbuf, L, d, Eigen::OuterStride<>(d));
        if (V.data() != s.vbuf) vs = V;
        scale_pow2(s.vbuf, L * d, -vexp);
        new (&V) cmap_rm(s.vbuf, L, d, Eigen::OuterStride<>(d));
      }
    }
    const float tau = [&] {
      if constexpr (is_lor) return P.scorer.tau;
      return 1.0f;
    }();
    const double out_scale = std::pow(vscale, static_cast<double>(tau));

    // Value projections of the whole GQA group in one GEMM: Y_all = V [R_1; ..; R_G]^T, an
    // L x (G d) matrix whose columns [g d, g d + d) are Y_g = V R_g^T (V is packed once, not G
    // times). In value space Y = V for every head.
    // "before" mode holds them for all L tokens (y_stride = G d; value space: Y = V itself);
    // "after" mode computes them tile by tile after the loop over the group's heads.
    const bool before_mode = [&] {
      if constexpr (is_lor) return P.scorer.aggregation == scorers::output_reconstruction::mode::before;
      return false;
    }();
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rcat;
    const float* y_base = s.ybuf;
    std::int64_t y_stride = d;
    if constexpr (is_lor) {
      if (P.scorer.use_wo) {
        rcat.resize(G * d, d);
        for (std::int64_t g = 0; g < G; ++g)
          for (std::int64_t r = 0; r < d; ++r)
            for (std::int64_t c = 0; c < d; ++c) rcat(g * d + r, c) = in.wo_factor(h * G + g, r, c);
        y_stride = G * d;
        if (before_mode) {
          map_rm Yall(s.ybuf, L, G * d, Eigen::OuterStride<>(G * d));
          Yall.noalias() = V * rcat.transpose();
        }
      } else {
        y_base = V.data();
        y_stride = V.outerStride();
      }
    }

    // The window attention runs for the whole GQA group at once, block of window rows by
    // block: one (G rb x d)(d x L) product per block, so K is packed once, not G times. The
    // per-head accumulators live in the output rows out_g = rows + g L: the temporal aggregate
    // a_bar, or in "before" mode the sum of the rows' scores.
    std::fill(rows, rows + G * L, 0.0f);
    const bool want_drift = job.drift_topk > 0;
    const bool before = before_mode;
    const bool use_r = [&] {
      if constexpr (is_lor) return P.scorer.use_wo;
      return false;
    }();
    std::fill(s.dsum, s.dsum + 2 * G, 0.0);  // per head: drift sums of the front and rear rows
    std::int64_t n_front = 0, n_rear = 0;   // rows in each half (the same for every head)

    for (std::int64_t j0 = row_begin; j0 < w; j0 += attention_row_block) {
      const std::int64_t rb = std::min(attention_row_block, w - j0);
      // "before" mode reads the normalised probabilities and the logits afterwards; every other
      // path only needs the weights: the softmax runs in place over the logits and leaves them
      // unnormalised, fl(e * inv_z) = the probability is folded into the consumers below.
      float* const pbase = before ? s.probs : s.logits;
      attention_block(stage_group_queries(in, b, h, G, w, j0, rb, s.qbuf), K, L, w, j0, rb, scale, s.logits, pbase,
                      row_stats{s.st_max, s.st_zo, s.st_arg, s.st_inv}, before);
      if (want_drift)
        for (std::int64_t r = 0; r < rb; ++r) ++(j0 + r < w / 2 ? n_front : n_rear);

      for (std::int64_t g = 0; g < G; ++g) {
        float* out = rows + g * L;
        const float* pg = pbase + g * rb * L;   // head g's rows of the block
        const float* lgg = s.logits + g * rb * L;
        const row_stats st{s.st_max + g * rb, s.st_zo + g * rb, s.st_arg + g * rb, s.st_inv + g * rb};
        cmap_rm Pb(pg, rb, L, Eigen::OuterStride<>(L));
        if (!before) {
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
        if constexpr (is_lor) {
          if (before) {
            // z_j = A_j V, RZ_j = R z_j; dist^2 = |RZ_j|^2 - 2 RZ_j . Y_n + |Y_n|^2, Y = V R^T
            // (columns [g d, g d + d) of the group's projections; V itself in value space).
            cmap_rm Y(y_base + (use_r ? g * d : 0), L, d, Eigen::OuterStride<>(y_stride));
            const Eigen::VectorXf ynorm2 = Y.rowwise().squaredNorm();
            mat_rm Zb = Pb * V;
            mat_rm RZ = use_r ? mat_rm(Zb * rcat.middleRows(g * d, d).transpose()) : Zb;
            map_rm cross(s.cross, rb, L, Eigen::OuterStride<>(L));
            cross.noalias() = RZ * Y.transpose();
            for (std::int64_t r = 0; r < rb; ++r) {
              const std::int64_t j = j0 + r;
              const std::int64_t vis = L - w + j + 1;
              const double rz2 = static_cast<double>(RZ.row(r).squaredNorm());
              const float c = s.st_c[j];
              if (c == 0.0f) continue;
              const float* pr = pg + r * L;
              const float* cr = s.cross + r * L;
              const std::int32_t am = st.arg[r];
              for (std::int64_t n = 0; n < vis; ++n) {
                if (n == am || pr[n] == 0.0f) continue;
                const double d2 = std::max(0.0, rz2 - 2.0 * cr[n] + ynorm2[n]);
                const double dist = tau == 1.0f ? std::sqrt(d2) : std::pow(d2, 0.5 * tau);
                out[n] += c * static_cast<float>(pr[n] / (1.0 - pr[n]) * dist);
              }
              // Row argmax: a/(1-a) ||R(z - v)|| = a ||R(z_{-n} - v)||, z_{-n} without cancellation.
              const float pm = pr[am];
              double sc;
              if (pm <= 15.0f / 16.0f) {
                const double d2 = std::max(0.0, rz2 - 2.0 * cr[am] + ynorm2[am]);
                const double dist = tau == 1.0f ? std::sqrt(d2) : std::pow(d2, 0.5 * tau);
                sc = pm / (1.0 - pm) * dist;
              } else {
                const float* lr = lgg + r * L;
                float m2 = -std::numeric_limits<float>::infinity();
                for (std::int64_t n = 0; n < vis; ++n)
                  if (n != am) m2 = std::max(m2, lr[n]);
                Eigen::VectorXd zhat = Eigen::VectorXd::Zero(d);
                double den = 0.0;
                for (std::int64_t n = 0; n < vis; ++n) {
                  if (n == am) continue;
                  const double e = std::exp(static_cast<double>(lr[n]) - m2);
                  if (e == 0.0) continue;
                  den += e;
                  zhat += e * V.row(n).transpose().cast<double>();
                }
                if (den > 0.0) zhat /= den;
                Eigen::VectorXd diff = zhat - V.row(am).transpose().cast<double>();
                const double dist = use_r ? (rcat.middleRows(g * d, d).cast<double>() * diff).norm() : diff.norm();
                // log(1 - a) = log(z_other) - log(1 + z_other), z_other = e^(m2 - M) * den
                const double log_zo = (static_cast<double>(m2) - st.max_logit[r]) + std::log(den);
                const double log1m = log_zo - std::log1p(std::exp(log_zo));
                const double a = 1.0 / (1.0 + std::exp(log_zo));
                sc = a * std::exp((tau - 1.0) * log1m) * std::pow(dist, static_cast<double>(tau));
                // Only the token itself is visible (e.g. row 0 when L == w): nothing to renormalise,
                // no contribution (log(den) = -inf made sc NaN and zeroed the token's whole score).
                if (!(den > 0.0)) sc = 0.0;
              }
              out[am] += c * static_cast<float>(sc);
            }
          }
        }
      }
    }

    for (std::int64_t g = 0; g < G; ++g) {
      float* out = rows + g * L;
      if constexpr (is_lor) {
        if (before) {
          for (std::int64_t n = 0; n < L; ++n) out[n] = saturate(static_cast<double>(out[n]) * out_scale);
        } else {
          // "after", phase 1 (per head): a_bar (held in the output row) and the dominant token.
          // The scores s[n] = a/(1-a) ||R z - Y_n||^tau, z = sum_{n < zlim} a[n] v_n, are
          // computed below for the whole GQA group: z of every head in one pass over V, then
          // Y_n = R v_n tile by tile (phase 2), then the exact limit of dominant tokens (phase 3).
          std::int64_t dom = 0;
          for (std::int64_t n = 1; n < L; ++n)
            if (out[n] > out[dom]) dom = n;
          s.dom[g] = dom;
          s.adom[g] = L > 0 ? out[dom] : 0.0f;
        }
      } else {
        if constexpr (std::is_same<Scorer, scorers::accumulated_attention>::value) {
          if (P.scorer.normalize_by_visible) {
            for (std::int64_t n = 0; n < L; ++n) {
              const std::int64_t first_row = std::max<std::int64_t>(0, n - (L - w));
              const std::int64_t cnt = w - first_row;
              out[n] = cnt > 0 ? out[n] / static_cast<float>(cnt) : 0.0f;
            }
          }
        }
        for (std::int64_t n = 0; n < L; ++n) out[n] = saturate(out[n]);
        if constexpr (is_avn) value_l1_norms(in, h * G + g, V, vexp, s, rows2 + g * L);
      }
      drift[g] = (n_front > 0 && n_rear > 0) ? s.dsum[2 * g] / static_cast<double>(n_front) - s.dsum[2 * g + 1] / static_cast<double>(n_rear)
                                             : 0.0;
    }
    if constexpr (is_lor) {
      if (!before_mode) {
        // "after", phase 2: z_g = V^T a_bar_g for the G heads at once (one pass over V) and R_g z_g;
        // then per tile of lor_token_tile tokens, Y = V_tile [R_1 .. R_G]^T (one GEMM for the
        // group; the tile stays in L2) and for every head g and token n of the tile
        // s[n] = a/(1-a) ||R_g z_g - Y_n||^tau, a = a_bar_g[n] (held in the output row). In value
        // space Y_n = v_n (read in place).
        const std::int64_t zlim = P.scorer.include_window_in_output ? L : L - w;
        {
          Eigen::MatrixXf Z = Eigen::MatrixXf::Zero(d, G);
          if (zlim > 0) Z.noalias() = V.topRows(zlim).transpose() * cmap_rm(rows, G, zlim, Eigen::OuterStride<>(L)).transpose();
          for (std::int64_t g = 0; g < G; ++g) {
            Eigen::Map<Eigen::VectorXf> rz(s.rzs + g * d, d);
            if (use_r) rz.noalias() = rcat.middleRows(g * d, d) * Z.col(g);
            else rz = Z.col(g);
          }
        }
        for (std::int64_t n0 = 0; n0 < L; n0 += lor_token_tile) {
          const std::int64_t nb = std::min(lor_token_tile, L - n0);
          const float* yb = y_base + n0 * y_stride;
          if (use_r) {
            map_rm Yt(s.ybuf, nb, G * d, Eigen::OuterStride<>(G * d));
            Yt.noalias() = V.middleRows(n0, nb) * rcat.transpose();
            yb = s.ybuf;
          }
          for (std::int64_t g = 0; g < G; ++g) {
            float* out = rows + g * L;
            const float* rz = s.rzs + g * d;
            const float* yg = yb + (use_r ? g * d : 0);
            // ||R z - Y_n||^2 of the tile's tokens in fp32 (vectorised over d; relative error
            // ~1e-6). A sum that overflowed or fell below 2^-100 (|differences| near the fp32
            // range limits) is recomputed with fp64 squares.
            for (std::int64_t t = 0; t < nb; ++t) {
              const std::int64_t n = n0 + t;
              const float a = out[n];
              if (a <= 0.0f) {
                out[n] = 0.0f;
                continue;
              }
              double d2 = static_cast<double>(sq_dist_f32(rz, yg + t * y_stride, d));
              if (!(d2 <= 3.0e38) || d2 < 0x1p-100) d2 = sq_dist_fp64(rz, yg + t * y_stride, d);
              const double dist = std::sqrt(d2);
              const double dd = tau == 1.0f ? dist : std::pow(dist, static_cast<double>(tau));
              out[n] = saturate(static_cast<double>(a) / (1.0 - static_cast<double>(a)) * dd * out_scale);
            }
          }
        }
        // Phase 3: a dominant token (a_bar > 15/16) gets its exact limit, recomputed from the
        // attention rows of its head (rare: only heads with such a token pay for it).
        for (std::int64_t g = 0; g < G; ++g) {
          if (!(s.adom[g] > 15.0f / 16.0f)) continue;
          const std::int64_t hq = h * G + g;
          float* out = rows + g * L;
          const T* qbase = in.queries.data + b * in.queries.stride[0] + hq * in.queries.stride[1] +
                           (in.window() - w) * in.queries.stride[2];
          cmap_rm Q = stage_rows(qbase, w, d, in.queries.stride[2], in.queries.stride[3], s.qbuf);
          {
            // Exact limit for the dominant token: a * (1-a)^(tau-1) * ||R(z_{-n} - v_n)||^tau with
            // weights of the other tokens computed relative to their largest log-weight E.
            const std::int64_t n0 = s.dom[g];
            Eigen::VectorXd num = Eigen::VectorXd::Zero(d);
            double den = 0.0, E = -std::numeric_limits<double>::infinity();
            for (std::int64_t j0 = row_begin; j0 < w; j0 += attention_row_block) {
              const std::int64_t rb = std::min(attention_row_block, w - j0);
              const row_stats st{s.st_max, s.st_zo, s.st_arg, s.st_inv};  // only the logits and z_other are read
              attention_block(cmap_rm(Q.data() + j0 * Q.outerStride(), rb, d, Eigen::OuterStride<>(Q.outerStride())), K,
                              L, w, j0, rb, scale, s.logits, s.probs, st, false);
              for (std::int64_t r = 0; r < rb; ++r) {
                const std::int64_t j = j0 + r;
                const double c = s.st_c[j];
                if (c <= 0.0) continue;
                const std::int64_t vis = L - w + j + 1;
                const double lam = std::log(c) - std::log1p(st.z_other[r]) - st.max_logit[r];
                const float* lr = s.logits + r * L;
                double rmax = -std::numeric_limits<double>::infinity();
                for (std::int64_t n = 0; n < vis; ++n)
                  if (n != n0) rmax = std::max(rmax, static_cast<double>(lr[n]) + lam);
                if (rmax == -std::numeric_limits<double>::infinity()) continue;
                if (rmax > E) {
                  const double f = std::exp(E - rmax);
                  num *= f;
                  den *= f;
                  E = rmax;
                }
                for (std::int64_t n = 0; n < vis; ++n) {
                  if (n == n0) continue;
                  const double wgt = std::exp(static_cast<double>(lr[n]) + lam - E);
                  if (wgt == 0.0) continue;
                  den += wgt;
                  if (n < zlim) num += wgt * V.row(n).transpose().cast<double>();
                }
              }
            }
            if (den > 0.0) {
              // v_n0 is part of z only when n0 < zlim. A window token left out of z (possible
              // candidate when fewer than w recent tokens are protected) has no cancellation:
              // s = a / (1-a) * ||R(z - v_n0)||^tau, z = num * e^E, with the exact 1 - a.
              const bool in_z = n0 < zlim;
              Eigen::VectorXd diff = (in_z ? Eigen::VectorXd(num / den) : Eigen::VectorXd(num * std::exp(E))) -
                                     V.row(n0).transpose().cast<double>();
              const double dist = use_r ? (rcat.middleRows(g * d, d).cast<double>() * diff).norm() : diff.norm();
              const double log1m = std::log(den) + E;
              const double a = s.adom[g];
              const double sc = a * std::exp((in_z ? tau - 1.0 : -1.0) * log1m) * std::pow(dist, static_cast<double>(tau));
              out[n0] = saturate(sc * out_scale);
            } else {
              // No other token has weight (a head of one visible token): nothing to renormalise,
              // no contribution, as in "before" mode (phase 2's odds a/(1-a) saturated here).
              out[n0] = 0.0f;
            }
          }
        }
      }
    }
  } else {
    static_assert(kvevict::detail::dependent_false<Scorer>,
                  "kvevict: this Scorer has no CPU implementation (give it a static score_kv_head(params, "
                  "cpu::head_inputs, float*) hook, see examples/custom_policy.cpp)");
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
