// The CPU implementation of value_norm_scorer (value_norm.hpp). cpu::head_scorer hands it one
// (sequence, KV head) at a time as fp32 row-major copies (cpu::head_inputs): out[n] for
// n < in.length; in.values is in.length x d (a tile of the head's tokens: per_token below). (A scorer that reads the window queries gets in.queries and
// the policy's temporal weights in.temporal_weights.) The row is saturated to the finite fp32
// range and given to every query head of the GQA group.
#pragma once

#include <kvevict/cpu.hpp>

#include <cmath>
#include <cstdint>

#include "value_norm.hpp"

template <>
struct kvevict::cpu::scorer_impl<value_norm_scorer> : kvevict::cpu::head_scorer<kvevict::cpu::scorer_impl<value_norm_scorer>> {
  // Each token's score reads only its own value: head_scorer may hand over tiles of tokens
  // (in.length = the tile's), so the copies stay 2 x 1024 x head_dim floats at any context length.
  static constexpr bool per_token = true;
  static void score_head(const value_norm_scorer::params& p, const kvevict::cpu::head_inputs& in, float* out) {
    for (std::int64_t n = 0; n < in.length; ++n) {
      double s = 0.0;
      for (std::int64_t c = 0; c < in.head_dim; ++c) {
        const double x = static_cast<double>(in.values[n * in.head_dim + c]);
        s += x * x;
      }
      out[n] = static_cast<float>(std::pow(std::sqrt(s), static_cast<double>(p.power)));
    }
  }
};
