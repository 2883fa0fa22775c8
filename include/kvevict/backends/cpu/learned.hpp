// LKV on the CPU backend: the learned budgeter and scorer (kvevict/policies/learned.hpp) with
// evictor<..., cpu::backend>, named compositions, and the artifact reader.
//
//   kvevict::io::lkv_artifact art;                                    // tools/lkv/train.py output
//   KVEVICT_TRY(kvevict::io::read_lkv_artifact(path, &art));
//   kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(kvevict::lkv::full_params(art));
//   ev.run(layer_inputs, kvevict::budget_request::fraction(0.1), selection);   // layer by layer
//
// How the pieces plug into the CPU evictor (backends/cpu/evictor.hpp):
//  - scorers::learned_mlp has the user-scorer hook `score_kv_head(params, cpu::head_inputs,
//    float*)`; the evictor stages the head's K and V as fp32 rows and calls it. It reads the
//    layer from params.layer, or from head_inputs::layer_idx when params.layer = -1.
//    `check_layer` is called by can_implement() (kv_heads / head_dim must match the table).
//  - budgeters::headwise_learned has the whole-layer hook `layer_budgets(...)`: the evictor
//    calls it once per sequence with the plans of the layer's rows; it returns the layer's
//    slice of the global allocation over all layers' KV heads.
#pragma once

#include "kvevict/cpu.hpp"
#include "kvevict/io/lkv_artifact.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace lkv {

/// Full LKV: learned budgets + learned scorer, no forced sinks or window (num_recent = 0).
struct full : eviction_policy<scorers::learned_mlp, temporal::last, spatial::none, budgeters::headwise_learned> {
  static params defaults() {
    params p;
    p.selector.num_recent = 0;
    p.check_finite = true;
    return p;
  }
};

/// Uniform budgets + learned scorer (ablation of LKV-H), no window.
struct uniform_budgets : eviction_policy<scorers::learned_mlp, temporal::last, spatial::none, budgeters::uniform> {
  static params defaults() {
    params p;
    p.selector.num_recent = 0;
    return p;
  }
};

/// Learned budgets + the ReST-KV scorer and smoothers (published ReST-KV settings; the window
/// stays protected as in ReST-KV: each head first gets its window, the rest is water-filled).
struct budgets_restkv
    : eviction_policy<scorers::output_reconstruction, temporal::ema, spatial::adaptive_window, budgeters::headwise_learned> {};

/// Learned budgets + SnapKV's attention-weight scores (sum over the window, avg-pool 5, window kept).
struct budgets_attention : eviction_policy<scorers::attention_weight, temporal::sum, spatial::avg_pool, budgeters::headwise_learned> {};

/// Parameters of `full` pointing into the artifact (which must outlive them).
inline full::params full_params(const io::lkv_artifact& a) {
  full::params p = full::defaults();
  p.scorer = io::scorer_params(a);
  p.budgeter = io::budgeter_params(a);
  return p;
}
inline uniform_budgets::params uniform_budgets_params(const io::lkv_artifact& a) {
  uniform_budgets::params p = uniform_budgets::defaults();
  p.scorer = io::scorer_params(a);
  return p;
}
inline budgets_restkv::params budgets_restkv_params(const io::lkv_artifact& a) {
  budgets_restkv::params p = budgets_restkv::defaults();
  p.budgeter = io::budgeter_params(a);
  return p;
}
inline budgets_attention::params budgets_attention_params(const io::lkv_artifact& a) {
  budgets_attention::params p = budgets_attention::defaults();
  p.budgeter = io::budgeter_params(a);
  return p;
}

/// Learned utilities of the first `length` tokens of one KV head, without an evictor (e.g. to
/// store them beside the cache for decoding "mode B"). keys/values: (length, head_dim) fp32,
/// row stride `row_stride` elements. out: length floats. Errors as learned_mlp::check /
/// check_layer (layer must be a valid table row; kv_head < kv_heads).
inline status score_tokens(const scorers::learned_mlp::params& p, int layer, std::int64_t kv_head, const float* keys,
                           const float* values, std::int64_t length, std::int64_t row_stride, float* out) {
  KVEVICT_TRY(scorers::learned_mlp::check(p));
  if (layer < 0 || layer >= p.num_layers)
    return status::error(errc::invalid_argument, "layer = %d outside [0, %d)", layer, p.num_layers);
  if (kv_head < 0 || kv_head >= p.kv_heads)
    return status::error(errc::invalid_argument, "kv_head = %lld outside [0, %d)", static_cast<long long>(kv_head), p.kv_heads);
  if (length < 0 || row_stride < p.head_dim)
    return status::error(errc::invalid_argument, "length = %lld must be >= 0 and row_stride = %lld >= head_dim = %d",
                         static_cast<long long>(length), static_cast<long long>(row_stride), p.head_dim);
  if (length > 0 && (!keys || !values || !out)) return status::error(errc::null_pointer, "keys, values or out is null");
  for (std::int64_t n = 0; n < length; ++n)
    out[n] = scorers::learned_mlp::utility(p, layer, kv_head, keys + n * row_stride, values + n * row_stride);
  return {};
}

}  // namespace lkv
}  // namespace kvevict
