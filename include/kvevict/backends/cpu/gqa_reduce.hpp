// IWYU pragma: private, include "kvevict/cpu.hpp"
// GQA reduction on the CPU (gqa_reduction, policies/policy.hpp): how the G query-head score rows
// of a KV head become its selection rows, and layer_mean's average over all heads of a sequence.
// A runtime choice of the policy's params, so functions rather than a trait.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvevict/policies/policy.hpp"

namespace kvevict {
namespace cpu {
namespace detail {

/// One KV head: its Gq query-head rows grows (Gq x L) and drifts gdrift (Gq) into its Gout out
/// rows out (Gout rows of stride S) and out_drift (Gout). Gout == Gq (per_query_head, or G = 1):
/// copies; else one row: mean (fp64 sum, rounded once) or max; the drift is always the mean.
inline void reduce_group(gqa_reduction gqa, const float* grows, const double* gdrift, std::int64_t Gq, std::int64_t Gout,
                         std::int64_t L, std::int64_t S, float* out, double* out_drift) {
  if (Gout == Gq) {  // per query head (or G == 1)
    for (std::int64_t g = 0; g < Gq; ++g) {
      std::copy(grows + g * L, grows + (g + 1) * L, out + g * S);
      out_drift[g] = gdrift[g];
    }
    return;
  }
  double dsum = 0.0;
  for (std::int64_t g = 0; g < Gq; ++g) dsum += gdrift[g];
  out_drift[0] = dsum / static_cast<double>(Gq);
  if (gqa == gqa_reduction::max) {
    for (std::int64_t n = 0; n < L; ++n) {
      float m = grows[n];
      for (std::int64_t g = 1; g < Gq; ++g) m = std::max(m, grows[g * L + n]);
      out[n] = m;
    }
  } else {
    const double inv = 1.0 / static_cast<double>(Gq);
    for (std::int64_t n = 0; n < L; ++n) {
      double s = 0.0;
      for (std::int64_t g = 0; g < Gq; ++g) s += grows[g * L + n];
      out[n] = static_cast<float>(s * inv);
    }
  }
}

/// temporal::defensive's floor: x[n] = max(x[n], mean of x[0, n_c)) for n < n_c (the mean in fp64,
/// rounded once); nothing when n_c <= 0. The columns from n_c on (the window) are left as they are.
inline void floor_at_mean(float* x, std::int64_t n_c) {
  if (n_c <= 0) return;
  double s = 0.0;
  for (std::int64_t n = 0; n < n_c; ++n) s += x[n];
  const float m = static_cast<float>(s / static_cast<double>(n_c));
  for (std::int64_t n = 0; n < n_c; ++n) x[n] = std::max(x[n], m);
}

/// The secondary rows (CriticalKV's value norms) of one KV head by the same rule (mean: fp64 sum
/// divided by Gq; max), never smoothed.
inline void reduce_group_secondary(gqa_reduction gqa, const float* grows2, std::int64_t Gq, std::int64_t Gout, std::int64_t L,
                                   std::int64_t S, float* out) {
  if (Gout == Gq) {
    for (std::int64_t g = 0; g < Gq; ++g) std::copy(grows2 + g * L, grows2 + (g + 1) * L, out + g * S);
    return;
  }
  for (std::int64_t n = 0; n < L; ++n) {
    if (gqa == gqa_reduction::max) {
      float m = grows2[n];
      for (std::int64_t g = 1; g < Gq; ++g) m = std::max(m, grows2[g * L + n]);
      out[n] = m;
    } else {
      double sum = 0.0;
      for (std::int64_t g = 0; g < Gq; ++g) sum += grows2[g * L + n];
      out[n] = static_cast<float>(sum / static_cast<double>(Gq));
    }
  }
}

/// gqa_reduction::layer_mean for one sequence: its H rows (stride S, L tokens each, equal
/// lengths) and drifts become their mean, fp32 sum in head order (as CUDA), fp64 where it
/// overflows; scores2 (or null): the secondary rows, fp64 mean.
inline void layer_mean_rows(float* scores, double* drift, float* scores2, std::int64_t H, std::int64_t L, std::int64_t S) {
  float* o0 = scores;
  double dsum = drift[0];
  for (std::int64_t h = 1; h < H; ++h) dsum += drift[h];
  for (std::int64_t n = 0; n < L; ++n) {  // fp32 sum in head order (as CUDA); fp64 where it overflows
    float acc = o0[n];
    double dacc = o0[n];
    for (std::int64_t h = 1; h < H; ++h) {
      acc += scores[h * S + n];
      dacc += scores[h * S + n];
    }
    acc /= static_cast<float>(H);
    o0[n] = std::isfinite(acc) ? acc : static_cast<float>(dacc / static_cast<double>(H));
  }
  for (std::int64_t h = 1; h < H; ++h) {
    std::copy(o0, o0 + L, scores + h * S);
    drift[h] = dsum / static_cast<double>(H);
  }
  drift[0] = dsum / static_cast<double>(H);
  if (scores2) {  // the group means of the secondary rows, averaged the same way
    float* u0 = scores2;
    for (std::int64_t n = 0; n < L; ++n) {
      double sum = 0.0;
      for (std::int64_t h = 0; h < H; ++h) sum += scores2[h * S + n];
      u0[n] = static_cast<float>(sum / static_cast<double>(H));
    }
    for (std::int64_t h = 1; h < H; ++h) std::copy(u0, u0 + L, scores2 + h * S);
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
