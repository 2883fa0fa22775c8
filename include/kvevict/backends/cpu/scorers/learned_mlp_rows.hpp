// IWYU pragma: private, include "kvevict/backends/cpu/learned.hpp"
// LKV-T's blockwise CPU scorer (cpu::learned_mlp_rows, arXiv 2605.06676; docs/lkv.md): the
// per-(layer, KV head) MLP of scorers::learned_mlp on blocks of 8 tokens, vectorised across
// tokens, bit-identical to the policy's definition learned_mlp::utility(). Plain C++ (no Eigen):
// cpu::scorer_impl<scorers::learned_mlp> (learned_mlp.hpp), lkv::score_tokens and the bitwise
// tests call it.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace cpu {

namespace detail {

/// learned_mlp_rows::score_rows vectorises with the GCC / Clang vector extension where available
/// (lkv_vec: 4 doubles with AVX, one ymm register; else 2, one SSE2 / NEON register), and with
/// plain loops elsewhere (other compilers, and nvcc's passes over CUDA translation units, which
/// never run it on the device). All compute the same fp64 operations in the same order
/// (bit-identical scores).
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define KVEVICT_LKV_VECTOR_EXT 1
#if defined(__AVX__)
constexpr int lkv_vec_width = 4;
#else
constexpr int lkv_vec_width = 2;
#endif
typedef double lkv_vec __attribute__((vector_size(8 * lkv_vec_width)));
#else
#define KVEVICT_LKV_VECTOR_EXT 0
#endif
}  // namespace detail

/// The blockwise LKV-T scorer of one KV head (host only). Every float equals
/// scorers::learned_mlp::utility() of its token.
struct learned_mlp_rows {
  using params = scorers::learned_mlp::params;
  using M = scorers::learned_mlp;

  /// Block sizes of score_rows: tok_block tokens x hid_block hidden units of fp64 accumulators
  /// stay in vector registers (AVX: 4 x 8 doubles = 8 ymm registers; without AVX 2 x 8 doubles
  /// = 8 xmm registers of the 16).
  static constexpr std::int64_t tok_block = 8;
#if defined(__AVX__)
  static constexpr std::int64_t hid_block = 4;
  static constexpr std::int64_t min_block_tokens = 1;
#else
  static constexpr std::int64_t hid_block = 2;
  /// A last block of fewer tokens is scored by utility_fp64 token by token (same bits): without
  /// AVX a padded block of 8 costs about two scalar tokens (lkv::score_tokens of ONE appended
  /// token per decoding step must not get slower).
  static constexpr std::int64_t min_block_tokens = 2;
#endif
  /// Largest input width 2 * head_dim that score_rows processes blockwise; its stack scratch is
  /// max_block_inputs x (tok_block + hid_block) doubles (48 KiB with AVX). Wider inputs
  /// (head_dim > 256) are scored by utility() token by token (the same floats, scalar speed).
  static constexpr std::int64_t max_block_inputs = 512;

  /// Scores of `length` tokens of KV head kv_head with the MLP of `layer` (host only): out[n] =
  /// utility(p, layer, kv_head, keys + n * row_stride, values + n * row_stride), BIT-IDENTICAL
  /// for every token, only faster. keys / values: (length, head_dim) fp32 rows, row stride
  /// `row_stride` >= head_dim elements; out: length floats. No allocation (stack scratch, see
  /// max_block_inputs). Preconditions (checked by the callers: check + check_layer, or
  /// lkv::score_tokens): host weights, 0 <= layer < num_layers, 0 <= kv_head < kv_heads,
  /// length >= 0, non-null pointers when length > 0.
  ///
  /// How it stays bit-identical: a block of tok_block tokens is staged input-major as fp64
  /// (xt[i][t] = x_t[i], an exact widening; a last, partial block is padded with zero tokens
  /// whose scores are discarded, or, below min_block_tokens tokens, scored by utility_fp64),
  /// and hid_block rows of W1 are widened to fp64 per such block.
  /// For those hidden units j, every accumulator a[j][t] starts at b1_j and adds W1[j][i] *
  /// xt[i][t] for i = 0..2d-1 in the same order as utility(); the loop that is vectorised runs
  /// across tokens t, never across i. Each product of two fp32 values is exact in fp64 (48
  /// significant bits, no overflow or underflow), so fused (FMA, -ffp-contract) and unfused
  /// multiply-adds round alike and contraction cannot change these sums. Then, per token, the
  /// activation and u += w2_j * act(a_j) in increasing j (add_unit, the code utility() runs,
  /// so a compiler contracts both alike), and the same NaN / saturation step (to_score).
  /// tests/lkv/test_lkv_scorer_bits.cpp compares the bits, of the floats and of the fp64 u
  /// (score_rows_fp64 vs utility_fp64), also in an FMA build where the host has FMA.
  static void score_rows(const params& p, int layer, std::int64_t kv_head, const float* keys, const float* values,
                         std::int64_t length, std::int64_t row_stride, float* out) {
    score_rows_impl(p, layer, kv_head, keys, values, length, row_stride, out);
  }

  /// score_rows before the last step: out[n] = utility_fp64 of token n, bit for bit (fp64,
  /// length doubles). For tests (see utility_fp64).
  static void score_rows_fp64(const params& p, int layer, std::int64_t kv_head, const float* keys, const float* values,
                              std::int64_t length, std::int64_t row_stride, double* out) {
    score_rows_impl(p, layer, kv_head, keys, values, length, row_stride, out);
  }

  /// The final store of score_rows (float: to_score) / score_rows_fp64 (double: u as is).
  static void store(float* o, double u) { *o = to_score(u); }
  static void store(double* o, double u) { *o = u; }

  /// score_rows / score_rows_fp64 (Out = float / double; see score_rows).
  template <class Out>
  static void score_rows_impl(const params& p, int layer, std::int64_t kv_head, const float* keys, const float* values,
                              std::int64_t length, std::int64_t row_stride, Out* out) {
    const std::int64_t d = p.head_dim, hid = p.hidden, in = 2 * d;
    if (in > max_block_inputs) {
      for (std::int64_t n = 0; n < length; ++n)
        store(out + n, utility_fp64(p, layer, kv_head, keys + n * row_stride, values + n * row_stride));
      return;
    }
    constexpr std::int64_t T = tok_block, J = hid_block;
    const float* W1 = p.weights + (static_cast<std::int64_t>(layer) * p.kv_heads + kv_head) * block_floats(d, hid);
    const float* b1 = W1 + hid * in;
    const float* w2 = b1 + hid;
    const double b2 = static_cast<double>(w2[hid]);
    const bool relu = p.activation == lkv_activation::relu;
#if KVEVICT_LKV_VECTOR_EXT
    using vec = detail::lkv_vec;
    constexpr std::int64_t V = detail::lkv_vec_width, Q = T / V;  // doubles per vector, vectors per block
    vec xv[max_block_inputs * Q];  // input-major tokens: xv[i * Q + t / V][t % V] = x_t[i]
#else
    double xt[max_block_inputs * T];   // input-major tokens: xt[i * T + t] = x_t[i]
#endif
    double wd[J * max_block_inputs];  // W1 rows j..j+J-1 in fp64: wd[jj * in + i]
    double u[T];
    for (std::int64_t n0 = 0; n0 < length; n0 += T) {
      const std::int64_t nt = length - n0 < T ? length - n0 : T;
      if (nt < min_block_tokens) {  // a lone last token: the scalar loop is cheaper than a padded block
        for (std::int64_t n = n0; n < length; ++n)
          store(out + n, utility_fp64(p, layer, kv_head, keys + n * row_stride, values + n * row_stride));
        break;
      }
      for (std::int64_t t = 0; t < T; ++t) {
        const float* k = t < nt ? keys + (n0 + t) * row_stride : nullptr;  // padding: no row
        const float* v = t < nt ? values + (n0 + t) * row_stride : nullptr;
        for (std::int64_t i = 0; i < in; ++i) {
          const double x = t >= nt ? 0.0 : static_cast<double>(i < d ? k[i] : v[i - d]);
#if KVEVICT_LKV_VECTOR_EXT
          xv[i * Q + t / V][t % V] = x;
#else
          xt[i * T + t] = x;
#endif
        }
      }
      for (std::int64_t t = 0; t < T; ++t) u[t] = b2;
      for (std::int64_t j = 0; j < hid; j += J) {
        const std::int64_t nj = hid - j < J ? hid - j : J;
        for (std::int64_t e = 0; e < nj * in; ++e) wd[e] = static_cast<double>(W1[j * in + e]);
        for (std::int64_t e = nj * in; e < J * in; ++e) wd[e] = 0.0;  // units past hidden: computed, never used
#if KVEVICT_LKV_VECTOR_EXT
        vec acc[J][Q];
        for (std::int64_t jj = 0; jj < J; ++jj)
          for (std::int64_t q = 0; q < Q; ++q) acc[jj][q] = vec{} + static_cast<double>(jj < nj ? b1[j + jj] : 0.0f);
        for (std::int64_t i = 0; i < in; ++i) {
          vec x[Q];
          for (std::int64_t q = 0; q < Q; ++q) x[q] = xv[i * Q + q];
          for (std::int64_t jj = 0; jj < J; ++jj) {
            const double w = wd[jj * in + i];
            for (std::int64_t q = 0; q < Q; ++q) acc[jj][q] += w * x[q];
          }
        }
        for (std::int64_t jj = 0; jj < nj; ++jj)
          for (std::int64_t t = 0; t < T; ++t) u[t] = add_unit(u[t], w2[j + jj], acc[jj][t / V][t % V], relu);
#else
        double acc[J][T];
        for (std::int64_t jj = 0; jj < J; ++jj)
          for (std::int64_t t = 0; t < T; ++t) acc[jj][t] = static_cast<double>(jj < nj ? b1[j + jj] : 0.0f);
        for (std::int64_t i = 0; i < in; ++i)
          for (std::int64_t jj = 0; jj < J; ++jj) {
            const double w = wd[jj * in + i];
            for (std::int64_t t = 0; t < T; ++t) acc[jj][t] += w * xt[i * T + t];
          }
        for (std::int64_t jj = 0; jj < nj; ++jj)
          for (std::int64_t t = 0; t < T; ++t) u[t] = add_unit(u[t], w2[j + jj], acc[jj][t], relu);
#endif
      }
      for (std::int64_t t = 0; t < nt; ++t) store(out + n0 + t, u[t]);
    }
  }
  static double utility_fp64(const params& p, int layer, std::int64_t kv_head, const float* k, const float* v) {
    return M::utility_fp64(p, layer, kv_head, k, v);
  }
  static std::int64_t block_floats(std::int64_t head_dim, std::int64_t hidden) { return M::block_floats(head_dim, hidden); }
  static double add_unit(double u, float w2j, double a, bool relu) { return M::add_unit(u, w2j, a, relu); }
  static float to_score(double u) { return M::to_score(u); }
};

}  // namespace cpu
}  // namespace kvevict
