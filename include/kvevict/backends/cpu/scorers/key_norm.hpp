// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::key_norm (Devoto et al. 2024): s[n] = -||k_n||, fp64 sum of
// squares, the same row for every query head of the group. Query-free; no drift. A non-finite
// sum (a NaN or inf key) sets head_scratch::nonfinite_keys: run() then reports the element as the
// K scan would (detects_nonfinite_keys below), with one pass over K instead of two.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvevict/backends/cpu/scorers/common.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::key_norm> : scorer_impl_base {
  /// Its own pass over K finds a non-finite key (a row's fp64 sum of squares is finite exactly
  /// when every element is: a finite float squared stays below 1.2e77), so run() does not scan K
  /// before scoring (scorer_impl_base::detects_nonfinite_keys); the check_finite error is the same.
  static constexpr bool detects_nonfinite_keys = true;
  /// K by tiles, no queries, no window attention (no logits block).
  static constexpr bool full_kv() { return false; }
  static constexpr bool all_queries() { return false; }
  static constexpr std::int64_t block_rows_max(std::int64_t) { return 0; }
  template <class Policy, class T>
  static void score(const detail::head_job<Policy, T>& job, detail::head_scratch& s, float* rows /* G x L */, double* drift /* G */,
                    float* /*rows2*/ = nullptr) {
    using namespace detail;
    const layer_inputs<T>& in = *job.in;
    const std::int64_t L = job.L, d = in.head_dim(), b = job.b, h = job.h;
    const std::int64_t G = in.queries.data ? in.group_size() : 1;
    const row_source<T> ks = head_rows(in, in.keys, b, h);
    for (std::int64_t n0 = 0; n0 < L; n0 += attention_key_tile) {  // K staged a tile at a time
      const std::int64_t nt = std::min(attention_key_tile, L - n0);
      const cmap_rm K = ks.rows(n0, nt, s.kbuf);
      // fp64 sum of squares per row in eight interleaved partial sums (c mod 8), which the
      // compiler vectorises (one 8-wide fp64 FMA per 8 elements; a single running sum would be
      // latency-bound at a quarter of the memory bandwidth), then added pairwise.
      for (std::int64_t n = 0; n < nt; ++n) {
        const float* x = K.data() + n * K.outerStride();
        double p[8] = {};
        std::int64_t c = 0;
        for (; c + 8 <= d; c += 8)
          for (int i = 0; i < 8; ++i) p[i] += static_cast<double>(x[c + i]) * x[c + i];
        double tail = 0.0;
        for (; c < d; ++c) tail += static_cast<double>(x[c]) * x[c];
        const double acc = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7])) + tail;
        s.nonfinite_keys |= !finite_bits(acc);
        rows[n0 + n] = saturate(-std::sqrt(acc));
      }
    }
    for (std::int64_t g = 1; g < G; ++g) std::copy(rows, rows + L, rows + g * L);
    for (std::int64_t g = 0; g < G; ++g) drift[g] = 0.0;
  }
};

}  // namespace cpu
}  // namespace kvevict
