// Test helper: random LKV tables (learned scorer weights and head-wise budget logits) for one
// layer, applied to any preset's params (only the learned stages it has).
#pragma once

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "reference/harness.hpp"

namespace kvtest {

/// Random LKV tables for one layer of `heads` KV heads (num_layers 1).
struct lkv_tables {
  std::vector<float> mlp, logits;
  lkv_tables(std::int64_t heads, std::int64_t d, int hid, std::uint64_t seed) {
    kvtest::rng r(seed);
    const std::int64_t block = hid * 2 * d + 2 * hid + 1;
    for (std::int64_t i = 0; i < heads * block; ++i) mlp.push_back(static_cast<float>(0.5 * r.normal()));
    for (std::int64_t i = 0; i < heads; ++i) logits.push_back(static_cast<float>(r.normal()));
  }
  template <class P>
  void apply(P& p, std::int64_t heads, std::int64_t d, int hid) const {
    if constexpr (std::is_same<std::decay_t<decltype(p.scorer)>, kvevict::scorers::learned_mlp::params>::value) {
      p.scorer.weights = mlp.data();
      p.scorer.num_layers = 1;
      p.scorer.kv_heads = static_cast<std::int32_t>(heads);
      p.scorer.head_dim = static_cast<std::int32_t>(d);
      p.scorer.hidden = hid;
    }
    if constexpr (std::is_same<std::decay_t<decltype(p.budgeter)>, kvevict::budgeters::headwise_learned::params>::value) {
      p.budgeter.logits = logits.data();
      p.budgeter.num_layers = 1;
      p.budgeter.kv_heads = static_cast<std::int32_t>(heads);
      p.budgeter.num_tokens = 150;  // ragged head lengths: the budgets of a 150-token context
    }
  }
};

}  // namespace kvtest
