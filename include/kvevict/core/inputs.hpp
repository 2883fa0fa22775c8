// IWYU pragma: private, include "kvevict/kvevict.hpp"
// The inputs of one eviction step for one layer, and the backend-neutral validation of their
// shapes against what a method reads (input_requirements). Policy-aware validation (parameters,
// composition rules) is the front-end's (frontend/frontend.hpp); data-dependent checks such as NaN
// scans live in the backends.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/numeric.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {

/// One layer's eviction inputs. T is the storage type of Q, K, V: float, half_t or bfloat16_t
/// (arithmetic is always fp32). Shapes (logical axes; any strides, in elements):
///   queries   (batch, q_heads, window, head_dim)  observation-window queries, RoPE applied;
///             required by scorers with needs_queries; otherwise optional (its window extent
///             is then only used for protecting the recent window). q_heads = G * kv_heads.
///   keys      (batch, kv_heads, seq, head_dim)    required
///   values    (batch, kv_heads, seq, head_dim)    required by scorers with needs_values
///   lengths   (batch, kv_heads) int32, optional   valid tokens per head (padded batches,
///             ragged per-head caches); default: seq for every head. Slots >= length are
///             never read, never kept, never counted.
///   positions (batch, kv_heads, seq) int32, optional: logical position of each slot; copied to
///             selection_view::positions for the kept slots. Default: position = slot.
///   wo_factor (q_heads, head_dim, head_dim) fp32, row-major R_h with ||R_h x|| = ||x W_O^h||,
///             required when the scorer uses W_O (see cpu::compute_wo_factors()).
///   layer_idx / num_layers: for per-layer budgeters (PyramidKV); 0 <= layer_idx < num_layers.
///   wo        (hidden, q_heads * head_dim) in storage type T: the layer's full output projection
///             as the model stores it, [out][in] (PyTorch nn.Linear o_proj.weight, llama2.c wo,
///             y = W x); columns hq*head_dim .. hq*head_dim + head_dim - 1 belong to query head hq;
///             any non-negative strides (row-major: stride {q_heads * head_dim, 1}). Required by
///             scorers with needs_wo_matrix (scorers::attention_value_norm, CriticalKV), whose
///             L1 norm ||v W_O^h||_1 has no d x d equivalent; ignored otherwise. Finite
///             (checked with check_finite).
template <class T>
struct layer_inputs {
  query_view<const T> queries;
  kv_view<const T> keys;
  kv_view<const T> values;
  lengths_view lengths;
  positions_view positions;
  strided_view<const float, 3> wo_factor;
  std::int32_t layer_idx = 0;
  std::int32_t num_layers = 1;
  strided_view<const T, 2> wo;

  std::int64_t batch() const { return keys.extent[0]; }
  std::int64_t kv_heads() const { return keys.extent[1]; }
  std::int64_t capacity() const { return keys.extent[2]; }
  std::int64_t head_dim() const { return keys.extent[3]; }
  std::int64_t q_heads() const { return queries.data ? queries.extent[1] : keys.extent[1]; }
  std::int64_t window() const { return queries.data ? queries.extent[2] : 0; }
  std::int64_t group_size() const { return kv_heads() > 0 ? q_heads() / kv_heads() : 0; }
  std::int64_t length(std::int64_t b, std::int64_t h) const { return length_at(lengths, capacity(), b, h); }
};

namespace detail {

template <class V>
inline status check_view_strides(const V& v, const char* name) {
  for (int k = 0; k < V::rank; ++k) {
    if (v.extent[k] < 0)
      return status::error(errc::invalid_argument, "%s.extent[%d] = %lld must be >= 0", name, k,
                           static_cast<long long>(v.extent[k]));
    if (v.stride[k] < 0)
      return status::error(errc::invalid_argument, "%s.stride[%d] = %lld must be >= 0", name, k,
                           static_cast<long long>(v.stride[k]));
  }
  return {};
}

/// Validate a budget request against the selector's protection parameters (`Protection`: any
/// type with int32 num_sink, int32 num_recent, float recent_share, as selectors::topk::params)
/// and the window.
template <class Protection>
inline status validate_budget(const budget_request& b, const Protection& sp, std::int64_t window) {
  const bool tok = b.keep_tokens != 0;
  const bool frac = b.keep_fraction != 0.0;
  if (tok && frac)
    return status::error(errc::invalid_argument,
                         "budget: keep_tokens = %d and keep_fraction = %g are both set; set exactly one",
                         b.keep_tokens, b.keep_fraction);
  if (!tok && !frac)
    return status::error(errc::invalid_argument, "budget: neither keep_tokens nor keep_fraction is set");
  if (tok && b.keep_tokens < 1)
    return status::error(errc::invalid_argument, "budget.keep_tokens = %d must be >= 1", b.keep_tokens);
  if (frac && !(b.keep_fraction > 0.0 && b.keep_fraction <= 1.0))
    return status::error(errc::invalid_argument, "budget.keep_fraction = %g must be in (0, 1]", b.keep_fraction);
  if (tok) {
    const std::int64_t fixed_recent = sp.recent_share >= 0.0f ? 0 : (sp.num_recent >= 0 ? sp.num_recent : window);
    if (b.keep_tokens < sp.num_sink + fixed_recent)
      return status::error(errc::invalid_argument,
                           "budget.keep_tokens = %d < num_sink + protected recent tokens = %d + %lld (the "
                           "window and sinks are always kept, so the budget must hold them)",
                           b.keep_tokens, sp.num_sink, static_cast<long long>(fixed_recent));
  }
  return {};
}

/// What a method reads from layer_inputs (filled by the front-end from the policy's stages).
struct input_requirements {
  const char* scorer_name = "";  ///< for the error messages
  bool needs_queries = false;    ///< queries must be set
  bool needs_values = false;     ///< values must be set
  bool needs_wo_factor = false;  ///< wo_factor (q_heads, d, d) must be set
  bool needs_wo_matrix = false;  ///< wo (hidden, q_heads * d) must be set
  bool per_query_head = false;   ///< gqa_reduction::per_query_head: q_heads comes from the queries
};

/// Shape validation shared by every backend: null pointers, extents, strides, the agreement of
/// every view with keys, layer_idx / num_layers. The first error names the view and the value.
/// Reads no data (lengths are checked by the front-end or on the device).
template <class T>
inline status validate_layer_shapes(const layer_inputs<T>& in, const input_requirements& rq) {
  static_assert(is_storage_type_v<T>, "kvevict: T must be float, half_t or bfloat16_t");
  if (!in.keys.data) return status::error(errc::null_pointer, "keys.data is null");
  KVEVICT_TRY(check_view_strides(in.keys, "keys"));
  if (in.keys.extent[0] < 1 || in.keys.extent[1] < 1 || in.keys.extent[3] < 1)
    return status::error(errc::invalid_argument, "keys shape (%lld, %lld, %lld, %lld): batch, kv_heads and head_dim must be >= 1",
                         static_cast<long long>(in.keys.extent[0]), static_cast<long long>(in.keys.extent[1]),
                         static_cast<long long>(in.keys.extent[2]), static_cast<long long>(in.keys.extent[3]));
  if (in.keys.extent[2] > 0x7fffffff)
    return status::error(errc::invalid_argument, "keys seq extent = %lld exceeds int32 indices", static_cast<long long>(in.keys.extent[2]));
  if (rq.needs_values && !in.values.data)
    return status::error(errc::null_pointer, "values.data is null (scorer %s reads V)", rq.scorer_name);
  if (in.values.data) {
    KVEVICT_TRY(check_view_strides(in.values, "values"));
    for (int k = 0; k < 4; ++k)
      if (in.values.extent[k] != in.keys.extent[k])
        return status::error(errc::shape_mismatch, "values.extent[%d] = %lld != keys.extent[%d] = %lld", k,
                             static_cast<long long>(in.values.extent[k]), k, static_cast<long long>(in.keys.extent[k]));
  }
  if (rq.needs_queries && !in.queries.data)
    return status::error(errc::null_pointer, "queries.data is null (scorer %s reads the window queries)", rq.scorer_name);
  if (in.queries.data) {
    KVEVICT_TRY(check_view_strides(in.queries, "queries"));
    if (in.queries.extent[0] != in.keys.extent[0])
      return status::error(errc::shape_mismatch, "queries batch = %lld != keys batch = %lld",
                           static_cast<long long>(in.queries.extent[0]), static_cast<long long>(in.keys.extent[0]));
    if (in.queries.extent[3] != in.keys.extent[3])
      return status::error(errc::shape_mismatch, "queries head_dim = %lld != keys head_dim = %lld",
                           static_cast<long long>(in.queries.extent[3]), static_cast<long long>(in.keys.extent[3]));
    if (in.queries.extent[1] < 1 || in.queries.extent[1] % in.keys.extent[1] != 0)
      return status::error(errc::invalid_argument, "q_heads = %lld is not a positive multiple of kv_heads = %lld",
                           static_cast<long long>(in.queries.extent[1]), static_cast<long long>(in.keys.extent[1]));
    if (in.queries.extent[2] < 1)
      return status::error(errc::invalid_argument, "window = %lld must be >= 1", static_cast<long long>(in.queries.extent[2]));
    if (in.queries.extent[2] > in.keys.extent[2])
      return status::error(errc::invalid_argument, "window = %lld > seq_len = %lld (the window queries' keys must be cached)",
                           static_cast<long long>(in.queries.extent[2]), static_cast<long long>(in.keys.extent[2]));
  }
  if (rq.per_query_head && !in.queries.data)
    return status::error(errc::invalid_argument, "gqa = per_query_head needs the queries (for q_heads)");
  if (rq.needs_wo_factor) {
    if (!in.wo_factor.data)
      return status::error(errc::null_pointer, "wo_factor.data is null (scorer.use_wo = true needs the W_O factor; "
                                               "set scorer.use_wo = false for value space)");
    KVEVICT_TRY(check_view_strides(in.wo_factor, "wo_factor"));
    if (in.wo_factor.extent[0] != in.q_heads() || in.wo_factor.extent[1] != in.head_dim() ||
        in.wo_factor.extent[2] != in.head_dim())
      return status::error(errc::shape_mismatch, "wo_factor shape (%lld, %lld, %lld) != (q_heads, head_dim, head_dim) = (%lld, %lld, %lld)",
                           static_cast<long long>(in.wo_factor.extent[0]), static_cast<long long>(in.wo_factor.extent[1]),
                           static_cast<long long>(in.wo_factor.extent[2]), static_cast<long long>(in.q_heads()),
                           static_cast<long long>(in.head_dim()), static_cast<long long>(in.head_dim()));
  }
  if (rq.needs_wo_matrix) {
    if (!in.wo.data)
      return status::error(errc::null_pointer,
                           "wo.data is null (scorer %s projects the values through the layer's output projection: set "
                           "layer_inputs::wo to W_O as (hidden, q_heads * head_dim), [out][in])",
                           rq.scorer_name);
    KVEVICT_TRY(check_view_strides(in.wo, "wo"));
    if (in.wo.extent[0] > 0x7fffffff)  // the scorer's workspace holds 64 x hidden floats per thread
      return status::error(errc::invalid_argument, "wo.extent[0] = %lld (hidden) exceeds int32", static_cast<long long>(in.wo.extent[0]));
    if (in.wo.extent[0] < 1 || in.wo.extent[1] != in.q_heads() * in.head_dim())
      return status::error(errc::shape_mismatch, "wo shape (%lld, %lld) != (hidden >= 1, q_heads * head_dim = %lld)",
                           static_cast<long long>(in.wo.extent[0]), static_cast<long long>(in.wo.extent[1]),
                           static_cast<long long>(in.q_heads() * in.head_dim()));
  }
  if (in.lengths.data) {
    KVEVICT_TRY(check_view_strides(in.lengths, "lengths"));
    if (in.lengths.extent[0] != in.batch() || in.lengths.extent[1] != in.kv_heads())
      return status::error(errc::shape_mismatch, "lengths shape (%lld, %lld) != (batch, kv_heads) = (%lld, %lld)",
                           static_cast<long long>(in.lengths.extent[0]), static_cast<long long>(in.lengths.extent[1]),
                           static_cast<long long>(in.batch()), static_cast<long long>(in.kv_heads()));
  }
  if (in.positions.data) {
    KVEVICT_TRY(check_view_strides(in.positions, "positions"));
    if (in.positions.extent[0] != in.batch() || in.positions.extent[1] != in.kv_heads() ||
        in.positions.extent[2] != in.capacity())
      return status::error(errc::shape_mismatch, "positions shape (%lld, %lld, %lld) != (batch, kv_heads, seq)",
                           static_cast<long long>(in.positions.extent[0]), static_cast<long long>(in.positions.extent[1]),
                           static_cast<long long>(in.positions.extent[2]));
  }
  if (in.num_layers < 1 || in.layer_idx < 0 || in.layer_idx >= in.num_layers)
    return status::error(errc::invalid_argument, "layer_idx = %d must be in [0, num_layers = %d)", in.layer_idx, in.num_layers);
  return {};
}

}  // namespace detail
}  // namespace kvevict
