// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::learned_mlp (LKV-T, arXiv 2605.06676; docs/lkv.md): the
// per-(layer, KV head) MLP u = w2 . act(W1 [k ; v] + b1) + b2 of every cached token, scored by
// learned_mlp_rows (learned_mlp_rows.hpp), bit-identical to the policy's definition
// learned_mlp::utility(). Query-free: the same row for every query head.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvevict/backends/cpu/scorers/head_scorer.hpp"
#include "kvevict/backends/cpu/scorers/learned_mlp_rows.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace cpu {

/// scorers::learned_mlp on the CPU: learned_mlp_rows over the head's staged fp32 K and V; the
/// layer is params.layer, or layer_inputs::layer_idx when params.layer = -1.
template <>
struct scorer_impl<scorers::learned_mlp> : head_scorer<scorer_impl<scorers::learned_mlp>> {
  /// A token's score reads its own key and value only: K and V are staged a tile at a time.
  static constexpr bool per_token = true;
  static void score_head(const scorers::learned_mlp::params& p, const head_inputs& hi, float* out) {
    const int l = p.layer >= 0 ? p.layer : static_cast<int>(hi.layer_idx);
    learned_mlp_rows::score_rows(p, l, hi.kv_head, hi.keys, hi.values, hi.length, hi.head_dim, out);
  }
  // The tables are checked against the layer by the policy's own learned_mlp::check_layer (plan time).
};

}  // namespace cpu
}  // namespace kvevict
