// IWYU pragma: private, include "kvevict/distributed.hpp"
// LKV on a sharded layer (docs/distributed.md): LKV-T's per-(layer, KV head) MLPs are sliced to
// the heads a rank holds; LKV-H's logits stay global (its allocation is over all heads of all
// layers, and every rank computes the same one in run_sharded from the gathered head plans).
#pragma once

#include <cstdint>
#include <vector>

#include "kvevict/core/status.hpp"
#include "kvevict/distributed/communicator.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace distributed {

/// LKV-T's table for the heads of a shard. global: params over the whole model's table, fp32
/// host weights (num_layers, global_kv_heads, block), block = learned_mlp::block_floats(head_dim,
/// hidden). Writes *storage = (num_layers, sh.num_heads, block), local head h being global head
/// sh.heads[h] (every layer kept: a pipeline stage uses its own layer_idx rows), and *out =
/// global with weights = storage->data() and kv_heads = sh.num_heads. *out is valid while
/// *storage is. Errors (nothing written): null pointers, device weights, a table whose kv_heads
/// is not sh.global_kv_heads (a table of another model), heads outside [0, global_kv_heads).
inline status shard_learned_scorer(const scorers::learned_mlp::params& global, const shard& sh, std::vector<float>* storage,
                                   scorers::learned_mlp::params* out) {
  if (!storage || !out) return status::error(errc::null_pointer, "shard_learned_scorer: storage or out is null");
  KVEVICT_TRY(scorers::learned_mlp::check(global));
  if (global.on_device)
    return status::error(errc::invalid_argument, "shard_learned_scorer: scorer.on_device = true; slice the host table");
  if (global.kv_heads != sh.global_kv_heads)
    return status::error(errc::shape_mismatch, "scorer table kv_heads = %d != shard.global_kv_heads = %d", global.kv_heads,
                         sh.global_kv_heads);
  if (sh.num_heads < 1 || !sh.heads) return status::error(errc::invalid_argument, "shard.num_heads = %d (heads %s)", sh.num_heads,
                                                          sh.heads ? "set" : "null");
  for (std::int32_t h = 0; h < sh.num_heads; ++h)
    if (sh.heads[h] < 0 || sh.heads[h] >= sh.global_kv_heads)
      return status::error(errc::invalid_argument, "shard.heads[%d] = %d is outside [0, global_kv_heads = %d)", h, sh.heads[h],
                           sh.global_kv_heads);
  const std::int64_t block = scorers::learned_mlp::block_floats(global.head_dim, global.hidden);
  std::vector<float> t(static_cast<std::size_t>(static_cast<std::int64_t>(global.num_layers) * sh.num_heads * block));
  for (std::int32_t l = 0; l < global.num_layers; ++l)
    for (std::int32_t h = 0; h < sh.num_heads; ++h) {
      const float* src = global.weights + (static_cast<std::int64_t>(l) * global.kv_heads + sh.heads[h]) * block;
      float* dst = t.data() + (static_cast<std::int64_t>(l) * sh.num_heads + h) * block;
      for (std::int64_t i = 0; i < block; ++i) dst[i] = src[i];
    }
  *storage = std::move(t);
  *out = global;
  out->weights = storage->data();
  out->kv_heads = sh.num_heads;
  return {};
}

}  // namespace distributed
}  // namespace kvevict
