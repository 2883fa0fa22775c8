// IWYU pragma: private, include "kvevict/kvevict.hpp"
// The inputs of one eviction step for one layer, and the backend-neutral validation of their
// shapes against what a method reads (input_requirements). Policy-aware validation (parameters,
// composition rules) is the front-end's (frontend/frontend.hpp); data-dependent checks such as NaN
// scans live in the backends.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/numeric.hpp"
#include "kvevict/core/paged.hpp"
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
///   pages     page_table_view, optional: a PAGED cache (docs/integration.md). keys and values
///             are then page pools, (num_pages, kv_heads, page_size, head_dim) with any strides
///             (make_page_pool; NHD, HND, the token index innermost, a head stride of 0 for
///             pages that hold one head), and the table maps each (sequence, KV head) to its
///             pages; batch() and capacity() come from the table, the lengths from
///             pages.last_page_len or from `lengths`. Queries, lengths, positions and the
///             selection keep their logical shapes: slot t of a head is its t-th token in table
///             order, the same slot a contiguous cache would give it.
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
  page_table_view pages;

  bool paged() const { return pages.indptr != nullptr; }
  std::int64_t batch() const { return paged() ? pages.batch : keys.extent[0]; }
  std::int64_t kv_heads() const { return keys.extent[1]; }
  /// Slots per head: the seq extent, or max_pages_per_row * page_size for a paged cache.
  std::int64_t capacity() const { return paged() ? pages.max_pages_per_row * keys.extent[2] : keys.extent[2]; }
  std::int64_t head_dim() const { return keys.extent[3]; }
  /// Tokens per page of a paged cache (the pool's seq axis).
  std::int64_t page_size() const { return keys.extent[2]; }
  std::int64_t q_heads() const { return queries.data ? queries.extent[1] : keys.extent[1]; }
  std::int64_t window() const { return queries.data ? queries.extent[2] : 0; }
  std::int64_t group_size() const { return kv_heads() > 0 ? q_heads() / kv_heads() : 0; }
  /// Valid tokens of (b, h): lengths, else the page table's, else the capacity (host memory).
  std::int64_t length(std::int64_t b, std::int64_t h) const {
    if (paged() && !lengths.data) return pages.table_length(pages.row(b, h, kv_heads()), page_size());
    return length_at(lengths, capacity(), b, h);
  }
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

/// The paged form's shapes (no table data read): the pool's extents, the table's batch and
/// capacity bound, the pointers it needs.
template <class T>
inline status validate_page_table_shape(const layer_inputs<T>& in) {
  const page_table_view& t = in.pages;
  if (in.keys.extent[1] < 1 || in.keys.extent[3] < 1)
    return status::error(errc::invalid_argument, "paged keys pool kv_heads = %lld and head_dim = %lld must be >= 1",
                         static_cast<long long>(in.keys.extent[1]), static_cast<long long>(in.keys.extent[3]));
  if (in.keys.extent[0] < 1 || in.keys.extent[2] < 1)
    return status::error(errc::invalid_argument, "paged keys pool shape (num_pages %lld, kv_heads, page_size %lld, head_dim): num_pages and page_size must be >= 1",
                         static_cast<long long>(in.keys.extent[0]), static_cast<long long>(in.keys.extent[2]));
  if (in.keys.extent[0] > 0x7fffffff)
    return status::error(errc::invalid_argument, "paged keys pool num_pages = %lld exceeds int32 page ids", static_cast<long long>(in.keys.extent[0]));
  if (t.batch < 1 || t.batch > 0x7fffffff / in.keys.extent[1])
    return status::error(errc::invalid_argument, "pages.batch = %lld must be in [1, 2^31 / kv_heads]", static_cast<long long>(t.batch));
  if (t.max_pages_per_row < 0 || (t.max_pages_per_row > 0 && t.max_pages_per_row > 0x7fffffff / in.keys.extent[2]))
    return status::error(errc::invalid_argument, "pages.max_pages_per_row = %lld must be in [0, 2^31 / page_size = %lld]",
                         static_cast<long long>(t.max_pages_per_row), static_cast<long long>(0x7fffffff / in.keys.extent[2]));
  if (!t.indices) return status::error(errc::null_pointer, "pages.indices is null (pages.indptr is set)");
  if (!t.last_page_len && !in.lengths.data)
    return status::error(errc::null_pointer, "pages.last_page_len is null and layer_inputs::lengths is not set: a paged cache needs one of them for the lengths");
  return {};
}

/// A paged_cache (core/paged.hpp) as the layer_inputs that read it: keys, values, pages, lengths.
template <class T>
inline layer_inputs<T> paged_cache_inputs(const paged_cache<T>& c) {
  layer_inputs<T> in;
  in.keys = c.keys;
  in.values = c.values;
  in.pages = c.pages;
  in.lengths = c.lengths;
  return in;
}

/// The shapes compact_paged() checks on both backends before anything else (no table data read):
/// keys and the table set, the pools' strides, values of the keys' shape, the table's shape, the
/// lengths' shape (batch, kv_heads). The first error names the argument.
template <class T>
inline status validate_paged_cache_shapes(const paged_cache<T>& cache) {
  if (!cache.keys.data) return status::error(errc::null_pointer, "compact_paged: keys.data is null");
  if (!cache.pages.indptr) return status::error(errc::null_pointer, "compact_paged: pages.indptr is null (not a paged cache)");
  const layer_inputs<T> in = paged_cache_inputs(cache);
  KVEVICT_TRY(check_view_strides(in.keys, "compact_paged keys"));
  if (in.values.data) {
    KVEVICT_TRY(check_view_strides(in.values, "compact_paged values"));
    for (int k = 0; k < 4; ++k)
      if (in.values.extent[k] != in.keys.extent[k])
        return status::error(errc::shape_mismatch, "compact_paged: values.extent[%d] = %lld != keys.extent[%d] = %lld", k,
                             static_cast<long long>(in.values.extent[k]), k, static_cast<long long>(in.keys.extent[k]));
  }
  KVEVICT_TRY(validate_page_table_shape(in));
  if (in.lengths.data) {
    KVEVICT_TRY(check_view_strides(in.lengths, "compact_paged lengths"));
    if (in.lengths.extent[0] != in.batch() || in.lengths.extent[1] != in.kv_heads())
      return status::error(errc::shape_mismatch, "compact_paged: lengths shape (%lld, %lld) != (batch, kv_heads) = (%lld, %lld)",
                           static_cast<long long>(in.lengths.extent[0]), static_cast<long long>(in.lengths.extent[1]),
                           static_cast<long long>(in.batch()), static_cast<long long>(in.kv_heads()));
  }
  return {};
}

/// Pages of table row r that hold tokens: ceil(length / page_size), the longest head's for a
/// per-sequence table.
template <class T>
inline std::int64_t row_pages_used(const layer_inputs<T>& in, std::int64_t r) {
  const std::int64_t H = in.kv_heads(), ps = in.page_size();
  if (in.pages.per_head) return in.pages.pages_for(r, in.length(r / H, r % H), ps);
  std::int64_t used = 0;
  for (std::int64_t h = 0; h < H; ++h) used = std::max(used, in.pages.pages_for(r, in.length(r, h), ps));
  return used;
}

/// The page table's data against the pool and the lengths (host memory; O(rows + pages), and
/// O(num_pages) bytes of `seen` scratch when seen != null, else no duplicate check): indptr[0] = 0
/// and non-decreasing, at most max_pages_per_row pages per row, last_page_len in [1, page_size],
/// lengths within a row's pages (and equal to the table's when both are given), page ids of the
/// pages that hold tokens in [0, num_pages), no page twice in one row (nor, for per-sequence tables
/// and per-head tables over pages that hold every head, in two rows). The first error names the row.
template <class T>
inline status check_page_table(const layer_inputs<T>& in, unsigned char* seen, std::int64_t seen_bytes) {
  const page_table_view& t = in.pages;
  const std::int64_t H = in.kv_heads(), R = t.rows(H), P = in.keys.extent[0], ps = in.page_size();
  if (t.indptr[0] != 0) return status::error(errc::invalid_argument, "pages.indptr[0] = %d must be 0", t.indptr[0]);
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t n = t.pages(r);
    if (n < 0 || n > t.max_pages_per_row)
      return status::error(errc::invalid_argument, "pages row %lld holds indptr[%lld] - indptr[%lld] = %lld pages, outside [0, max_pages_per_row = %lld]",
                           static_cast<long long>(r), static_cast<long long>(r + 1), static_cast<long long>(r), static_cast<long long>(n),
                           static_cast<long long>(t.max_pages_per_row));
    if (t.last_page_len && n > 0 && (t.last_page_len[r] < 1 || t.last_page_len[r] > ps))
      return status::error(errc::invalid_argument, "pages.last_page_len[%lld] = %d must be in [1, page_size = %lld]",
                           static_cast<long long>(r), t.last_page_len[r], static_cast<long long>(ps));
    if (t.start_offset && (t.start_offset[r] < 0 || t.start_offset[r] >= ps))
      return status::error(errc::invalid_argument, "pages.start_offset[%lld] = %d must be in [0, page_size = %lld)",
                           static_cast<long long>(r), t.start_offset[r], static_cast<long long>(ps));
    if (t.start_offset && t.last_page_len && n == 1 && t.last_page_len[r] <= t.start_offset[r])
      return status::error(errc::invalid_argument,
                           "pages.start_offset[%lld] = %d >= last_page_len = %d of a row of one page: the row holds no token",
                           static_cast<long long>(r), t.start_offset[r], t.last_page_len[r]);
  }
  for (std::int64_t b = 0; b < t.batch; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = t.row(b, h, H);
      if (in.lengths.data) {
        const std::int64_t L = in.lengths(b, h);
        if (t.last_page_len && L != t.table_length(r, ps))
          return status::error(errc::invalid_argument, "lengths(%lld, %lld) = %lld != the page table's %lld tokens of row %lld ((pages - 1) * page_size + last_page_len - start_offset)",
                               static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(L),
                               static_cast<long long>(t.table_length(r, ps)), static_cast<long long>(r));
        if (L < 0 || L > t.row_capacity(r, ps))
          return status::error(errc::invalid_argument,
                               "lengths(%lld, %lld) = %lld is outside [0, pages * page_size - start_offset = %lld] of page table row %lld",
                               static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(L),
                               static_cast<long long>(t.row_capacity(r, ps)), static_cast<long long>(r));
      }
      // After the lengths: a bad length is named as such, not as a prefix outside [0, length].
      if (t.prefix(b) < 0 || t.prefix(b) > in.length(b, h))
        return status::error(errc::invalid_argument, "pages.protected_prefix[%lld] = %lld is outside [0, %lld], the tokens of sequence %lld (KV head %lld)",
                             static_cast<long long>(b), static_cast<long long>(t.prefix(b)), static_cast<long long>(in.length(b, h)),
                             static_cast<long long>(b), static_cast<long long>(h));
    }
  // Page ids of the pages that hold tokens; repeats through a bitmap of (page[, head]) slots.
  const bool head_slots = t.per_head && in.keys.stride[1] != 0;  // per-head rows in pages that span every head
  const std::int64_t slots = head_slots ? P * H : P;
  const bool dup_check = seen && seen_bytes >= slots;
  if (dup_check)
    for (std::int64_t i = 0; i < slots; ++i) seen[i] = 0;
  // seen: 0 unused, 1 used by one row, 2 a shared prefix page (any number of rows, prefix only).
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t h = t.per_head ? r % H : 0;
    const std::int64_t used = row_pages_used(in, r), shared = t.shared_pages(r, t.per_head ? r / H : r, ps);
    for (std::int64_t i = 0; i < used; ++i) {
      const std::int32_t pg = t.indices[t.indptr[r] + i];
      if (pg < 0 || pg >= P)
        return status::error(errc::invalid_argument, "pages.indices[%lld] = %d (row %lld, page %lld) is outside [0, num_pages = %lld)",
                             static_cast<long long>(t.indptr[r] + i), pg, static_cast<long long>(r), static_cast<long long>(i),
                             static_cast<long long>(P));
      if (dup_check) {
        unsigned char& s = seen[head_slots ? pg * H + h : pg];
        const unsigned char use = i < shared ? 2 : 1;
        if (s == 1 || (s == 2 && use == 1))
          return status::error(errc::invalid_argument, "pages.indices[%lld] = %d (row %lld, page %lld) repeats a page already in the table%s",
                               static_cast<long long>(t.indptr[r] + i), pg, static_cast<long long>(r), static_cast<long long>(i),
                               s == 2 || use == 2 ? " (only pages wholly inside a protected prefix may be shared)" : "");
        s = use;
      }
    }
  }
  return {};
}

/// Bytes of `seen` scratch check_page_table needs for its duplicate check.
template <class T>
inline std::int64_t page_table_check_bytes(const layer_inputs<T>& in) {
  if (!in.paged()) return 0;
  const bool head_slots = in.pages.per_head && in.keys.stride[1] != 0;
  return head_slots ? in.keys.extent[0] * in.kv_heads() : in.keys.extent[0];
}

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
  if (in.paged()) KVEVICT_TRY(validate_page_table_shape(in));
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
    if (in.queries.extent[0] != in.batch())
      return status::error(errc::shape_mismatch, "queries batch = %lld != %s = %lld", static_cast<long long>(in.queries.extent[0]),
                           in.paged() ? "pages.batch" : "keys batch", static_cast<long long>(in.batch()));
    if (in.queries.extent[3] != in.keys.extent[3])
      return status::error(errc::shape_mismatch, "queries head_dim = %lld != keys head_dim = %lld",
                           static_cast<long long>(in.queries.extent[3]), static_cast<long long>(in.keys.extent[3]));
    if (in.queries.extent[1] < 1 || in.queries.extent[1] % in.keys.extent[1] != 0)
      return status::error(errc::invalid_argument, "q_heads = %lld is not a positive multiple of kv_heads = %lld",
                           static_cast<long long>(in.queries.extent[1]), static_cast<long long>(in.keys.extent[1]));
    if (in.queries.extent[2] < 1)
      return status::error(errc::invalid_argument, "window = %lld must be >= 1", static_cast<long long>(in.queries.extent[2]));
    if (in.queries.extent[2] > in.capacity())
      return status::error(errc::invalid_argument, "window = %lld > %s = %lld (the window queries' keys must be cached)",
                           static_cast<long long>(in.queries.extent[2]),
                           in.paged() ? "capacity (max_pages_per_row * page_size)" : "seq_len", static_cast<long long>(in.capacity()));
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
