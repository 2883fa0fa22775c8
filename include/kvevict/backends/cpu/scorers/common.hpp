// IWYU pragma: private, include "kvevict/cpu.hpp"
// What every CPU scorer shares: the per-head inputs a simple scorer sees (head_inputs), the
// per-thread scratch the evictor carves for the scorers (head_scratch), and small kernels
// (distances, power-of-two rescaling, query staging).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/window_attention.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/workspace.hpp"

namespace kvevict {
namespace cpu {

/// What a user-defined CPU scorer sees for one (sequence, KV head): fp32 row-major copies of
/// the head's first L keys and values (L x head_dim; for a per_token scorer, a tile of them:
/// see head_scorer) and of its group's window queries (G x w x head_dim, may be empty when the
/// policy has no window). Plain pointers, no Eigen.
struct head_inputs {
  std::int64_t batch_index = 0, kv_head = 0;
  std::int64_t length = 0;     ///< L (a per_token scorer: the tile's tokens)
  std::int64_t head_dim = 0;   ///< d
  std::int64_t group_size = 0; ///< G
  std::int64_t window = 0;     ///< w rows per query head (0 if no queries)
  std::int32_t layer_idx = 0;  ///< layer_inputs::layer_idx (for per-layer learned scorers)
  const float* keys = nullptr;     ///< L x d
  const float* values = nullptr;   ///< L x d (null if the layer has no values)
  const float* queries = nullptr;  ///< G x w x d
  /// w weights c_j of the policy's temporal smoother over the window rows (oldest first; null
  /// without queries). A scorer that scores window rows separately combines them with these
  /// (sum_j c_j x_j); one that ignores them ignores the policy's temporal smoother.
  const float* temporal_weights = nullptr;
};

namespace detail {

/// Tokens per tile of the reconstruction scorer's "after" mode: the tile's value projections
/// (lor_token_tile x G d floats, 512 KiB for G = 4, d = 128) stay in the core's L2 cache between
/// the GEMM that writes them and the distance pass that reads them.
inline constexpr std::int64_t lor_token_tile = 256;

/// Tokens per staged tile of values (the fp32 copy of value_tile x d floats the scorers read V
/// through; K is staged by attention_key_tile keys).
inline constexpr std::int64_t value_tile = attention_key_tile;

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

/// Per-thread scratch for scoring one KV head with up to `cap` tokens, window `w`, dim `d`.
/// K and V are read a tile at a time and the logits of a block of window rows take
/// block_logits_floats (bounded by the backend's score_block_bytes beyond one row per head), so
/// only the drift row (rowtmp) and the one-row minimum of the logits grow with the context;
/// except with options::full_kv (whole K and V copies: a user's scorer_impl by default, a
/// head_scorer over an Impl that is not per_token) or full_y (ReST-KV's "before" mode: all values
/// and their projections).
struct head_scratch {
  float* kbuf = nullptr;   // min(cap, attention_key_tile) x d (full_kv: cap x d)
  float* vbuf = nullptr;   // min(cap, max(value_tile, lor_token_tile)) x d (full_kv or full_y: cap x d)
  float* ybuf = nullptr;   // "before" mode: cap x (G d) (V [R_1 .. R_G]^T, one GEMM per GQA
                           // group); "after" mode: lor_token_tile x (G d), one token tile
  float* rzs = nullptr;    // G x d ("after" mode: R_g z_g of every query head of the group)
  float* adom = nullptr;   // G     ("after" mode: a_bar of each head's dominant token)
  std::int64_t* dom = nullptr;  // G
  float* qbuf = nullptr;   // G rb x d (one block of staged queries; all_queries: G w x d)
  float* logits = nullptr; // block_logits_floats: max(G, 2) rb x L for a block of rb window rows
                           // of the whole GQA group (the softmax weights in place, except in
                           // "before" mode); the reconstruction scorer's exact limit uses rows
                           // [0, rb) for one head's logits and [rb, 2 rb) for its weights
  float* probs = nullptr;  // "before" mode: G rb x L probabilities (else empty)
  float* cross = nullptr;  // rb x L ("before" mode only: one head's cross products)
  std::uint32_t* rowtmp = nullptr; // cap (adaptive-window drift: one attention row's top-K keys)
  float* st_max = nullptr;      // G rb (row statistics of one block, attention_block)
  double* st_zo = nullptr;      // G rb
  std::int32_t* st_arg = nullptr;  // G rb
  float* st_inv = nullptr;      // G rb
  double* dsum = nullptr;       // 2 G (adaptive-window drift: front and rear sums per head)
  float* st_c = nullptr;        // w (temporal weights)
  float* wbuf = nullptr;        // C x d   (W_O^h staged, attention_value_norm only)
  float* pbuf = nullptr;        // value_norm_token_block x C (projected values of a token block)
  bool nonfinite_keys = false;  // set by a scorer with detects_nonfinite_keys that met a non-finite key

  /// What the scorer's scratch must hold beyond its tiles (the defaults hold everything, as a
  /// scorer written before the tiles expects).
  struct options {
    /// The value projections of all `cap` tokens at once, with the values (the reconstruction
    /// scorer's "before" mode); otherwise one tile of lor_token_tile tokens.
    bool full_y = true;
    /// The backend's score_block_bytes: head_job::rows_per_block must be block_rows(block_bytes,
    /// G, L, w) or less. The default keeps blocks of attention_row_block rows at every length.
    std::size_t block_bytes = ~std::size_t{0};
    /// fp32 copies of all `cap` keys and values (scorer_impl::full_kv(): head_scorer's whole-head form).
    bool full_kv = true;
    /// The G w window rows of queries (scorer_impl::all_queries(), head_scorer); else one block.
    bool all_queries = true;
    /// The most window rows one block holds (scorer_impl::block_rows_max(w): 0 without window
    /// attention, 1 for TOVA's last row; < 0: min(w, attention_row_block)).
    std::int64_t rows_max = -1;
    /// One row of `cap` floats for the adaptive-window drift (spatial needs_attention_drift).
    bool drift_row = true;
  };

  /// The scratch of a scorer that holds everything but the value projections of every token
  /// when full_y is false (the form before options existed).
  template <class Carver>
  void carve(Carver& c, std::int64_t cap, std::int64_t w, std::int64_t d, std::int64_t G, bool full_y = true) {
    options o;
    o.full_y = full_y;
    carve(c, cap, w, d, G, o);
  }

  template <class Carver>
  void carve(Carver& c, std::int64_t cap, std::int64_t w, std::int64_t d, std::int64_t G, const options& o) {
    const bool full_y = o.full_y, full_kv = o.full_kv, all_queries = o.all_queries;
    const std::size_t block_bytes = o.block_bytes;
    const std::int64_t rows_max = o.rows_max;
    const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(cap, 0));
    const std::size_t g1 = static_cast<std::size_t>(std::max<std::int64_t>(G, 1));
    const std::size_t dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1));
    const std::int64_t rall = std::min(attention_row_block, std::max<std::int64_t>(w, 1));
    const std::int64_t rmax = rows_max < 0 ? rall : std::min(rows_max, rall);
    // rows x L of one head at the block size the bytes allow (the most over L <= cap)
    const std::size_t lg = block_logits_floats(block_bytes, G, cap, rmax);
    const std::size_t rowsL = lg / std::max<std::size_t>(g1, 2);
    const std::size_t vt = static_cast<std::size_t>(std::max(value_tile, lor_token_tile));
    const std::size_t n1 = std::max<std::size_t>(n, 1);
    kbuf = c.template carve<float>((full_kv ? n1 : std::min<std::size_t>(n1, attention_key_tile)) * dd);
    vbuf = c.template carve<float>((full_kv || full_y ? n1 : std::min(n1, vt)) * dd);
    ybuf = c.template carve<float>((full_y ? n : std::min<std::size_t>(n, lor_token_tile)) * dd * g1);
    rzs = c.template carve<float>(g1 * dd);
    adom = c.template carve<float>(g1);
    dom = c.template carve<std::int64_t>(g1);
    qbuf = c.template carve<float>(static_cast<std::size_t>(G * (all_queries ? std::max<std::int64_t>(w, 1) : std::max<std::int64_t>(rmax, 1))) * dd);
    logits = c.template carve<float>(lg);
    probs = c.template carve<float>(full_y ? g1 * rowsL : 0);  // "before": the group's probabilities
    cross = c.template carve<float>(full_y ? rowsL : 0);       // "before" mode only
    rowtmp = c.template carve<std::uint32_t>(o.drift_row ? n : 0);
    const std::size_t ws = static_cast<std::size_t>(std::max<std::int64_t>(w, 1));
    const std::size_t sb = g1 * static_cast<std::size_t>(std::max<std::int64_t>(rmax, 1));
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

/// Norm of a d-vector in fp64 (no overflow for any finite fp32 input).
inline double norm2_d(const float* x, std::int64_t d) {
  double s = 0.0;
  for (std::int64_t i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

/// Whether Scorer's per-thread scratch must hold the value projections of every token
/// (head_scratch::carve full_y): scorer_impl<Scorer>::full_projection (only the reconstruction
/// scorer's "before" mode; its "after" mode works in tiles of lor_token_tile tokens).
template <class Scorer>
bool needs_full_projection(const typename Scorer::params& p) {
  return scorer_impl<Scorer>::full_projection(p);
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
