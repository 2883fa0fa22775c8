// IWYU pragma: private, include "kvevict/cpu.hpp"
// Compaction: gather the kept K/V rows of a selection into a dense or ragged buffer, or in place.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {
namespace cpu {

namespace detail {
inline status check_selection(const_selection_view sel, std::int64_t rows, std::int64_t src_seq, const char* who) {
  if (!sel.indptr || !sel.indices) return status::error(errc::null_pointer, "%s: selection indptr/indices is null", who);
  if (sel.rows != rows)
    return status::error(errc::shape_mismatch, "%s: selection rows = %lld != batch * heads = %lld", who,
                         static_cast<long long>(sel.rows), static_cast<long long>(rows));
  if (sel.indptr[0] != 0) return status::error(errc::invalid_argument, "%s: selection indptr[0] = %d must be 0", who, sel.indptr[0]);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t a = sel.indptr[r], b = sel.indptr[r + 1];
    if (b < a) return status::error(errc::invalid_argument, "%s: selection indptr[%lld] = %d > indptr[%lld] = %d", who,
                                    static_cast<long long>(r), a, static_cast<long long>(r + 1), b);
    for (std::int32_t i = a; i < b; ++i) {
      const std::int32_t s = sel.indices[i];
      if (s < 0 || s >= src_seq)
        return status::error(errc::invalid_argument, "%s: selection index %d of row %lld is outside [0, %lld)", who, s,
                             static_cast<long long>(r), static_cast<long long>(src_seq));
      if (i > a && s <= sel.indices[i - 1])
        return status::error(errc::invalid_argument, "%s: selection row %lld is not strictly ascending at %d", who,
                             static_cast<long long>(r), i);
    }
  }
  return {};
}

/// Byte range [lo, hi) touched by a view (non-negative strides); lo == hi when empty.
template <class V>
inline void byte_span(const V& v, std::uintptr_t* lo, std::uintptr_t* hi) {
  *lo = *hi = reinterpret_cast<std::uintptr_t>(v.data);
  std::int64_t last = 0;
  for (int k = 0; k < V::rank; ++k) {
    if (v.extent[k] <= 0) return;
    last += (v.extent[k] - 1) * v.stride[k];
  }
  *hi = *lo + static_cast<std::uintptr_t>(last + 1) * sizeof(*v.data);
}
inline bool spans_overlap(std::uintptr_t a0, std::uintptr_t a1, std::uintptr_t b0, std::uintptr_t b1) {
  return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}
}  // namespace detail

/// Gather kept rows into `dst`: dst(b, h, i, :) = src(b, h / G, indices[indptr[r] + i], :) for
/// row r = b * out_heads + h and i < count(r). out_heads = dst.extent[1]; G = out_heads /
/// src.extent[1] (G > 1 only for per-query-head selections). Slots of dst beyond a row's count
/// are left untouched; the count per head is the selection's (indptr) - pass it to the engine
/// as the new lengths.
///  - Dense: dst is (batch, out_heads, budget_max, head_dim) in any layout.
///  - In place: dst may alias src exactly (same data and strides) when out_heads ==
///    src.extent[1]: kept indices are ascending, so row i is moved down from indices[i] >= i.
/// Errors: shape mismatch, null pointers, a row longer than dst's seq extent, indices out of
/// range or not ascending, a partial overlap of src and dst (by address range: two views
/// interleaved in one buffer count as overlapping). Storage type: any T (copied as is).
template <class T>
[[nodiscard]] status compact(kv_view<const T> src, const_selection_view sel, kv_view<T> dst) {
  if (!src.data || !dst.data) return status::error(errc::null_pointer, "compact: src.data or dst.data is null");
  KVEVICT_TRY(kvevict::detail::check_view_strides(src, "compact src"));
  KVEVICT_TRY(kvevict::detail::check_view_strides(dst, "compact dst"));
  if (src.extent[0] != dst.extent[0] || src.extent[3] != dst.extent[3])
    return status::error(errc::shape_mismatch, "compact: src (batch %lld, head_dim %lld) != dst (batch %lld, head_dim %lld)",
                         static_cast<long long>(src.extent[0]), static_cast<long long>(src.extent[3]),
                         static_cast<long long>(dst.extent[0]), static_cast<long long>(dst.extent[3]));
  if (src.extent[1] < 1 || dst.extent[1] % src.extent[1] != 0)
    return status::error(errc::shape_mismatch, "compact: dst heads = %lld is not a multiple of src heads = %lld",
                         static_cast<long long>(dst.extent[1]), static_cast<long long>(src.extent[1]));
  const std::int64_t B = dst.extent[0], H = dst.extent[1], G = H / src.extent[1], D = dst.extent[3];
  KVEVICT_TRY(detail::check_selection(sel, B * H, src.extent[2], "compact"));
  const bool same = static_cast<const void*>(src.data) == static_cast<const void*>(dst.data);
  if (same) {
    for (int k = 0; k < 4; ++k)
      if (src.stride[k] != dst.stride[k] || G != 1)
        return status::error(errc::invalid_argument, "compact: in-place compaction needs dst == src (same strides, no GQA expansion)");
  } else {
    std::uintptr_t s0, s1, d0, d1;
    detail::byte_span(src, &s0, &s1);
    detail::byte_span(dst, &d0, &d1);
    if (detail::spans_overlap(s0, s1, d0, d1))
      return status::error(errc::invalid_argument, "compact: dst partially overlaps src (use dst == src for in place, or disjoint buffers)");
  }
  for (std::int64_t r = 0; r < B * H; ++r)
    if (sel.indptr[r + 1] - sel.indptr[r] > dst.extent[2])
      return status::error(errc::insufficient_capacity, "compact: row %lld keeps %d tokens > dst seq extent %lld",
                           static_cast<long long>(r), sel.indptr[r + 1] - sel.indptr[r], static_cast<long long>(dst.extent[2]));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = b * H + h;
      const T* s = src.data + b * src.stride[0] + (h / G) * src.stride[1];
      T* d = dst.data + b * dst.stride[0] + h * dst.stride[1];
      for (std::int32_t i = 0, n = sel.indptr[r + 1] - sel.indptr[r]; i < n; ++i) {
        const std::int32_t from = sel.indices[sel.indptr[r] + i];
        if (same && from == i) continue;
        const T* sp = s + from * src.stride[2];
        T* dp = d + static_cast<std::int64_t>(i) * dst.stride[2];
        if (src.stride[3] == 1 && dst.stride[3] == 1) {
          std::memmove(dp, sp, static_cast<std::size_t>(D) * sizeof(T));
        } else {
          for (std::int64_t c = 0; c < D; ++c) dp[c * dst.stride[3]] = sp[c * src.stride[3]];
        }
      }
    }
  return {};
}

/// Gather kept rows into a ragged per-head buffer: row r's tokens go to
/// dst[(indptr[r] + i) * head_dim + c] - the selection's own CSR offsets, so heads with
/// smaller (head-wise) budgets take less memory. dst holds indptr[rows] * head_dim elements
/// (dst_elems). src may not overlap dst.
template <class T>
[[nodiscard]] status compact_ragged(kv_view<const T> src, const_selection_view sel, T* dst, std::int64_t dst_elems) {
  if (!src.data || !dst) return status::error(errc::null_pointer, "compact_ragged: src.data or dst is null");
  KVEVICT_TRY(kvevict::detail::check_view_strides(src, "compact_ragged src"));
  if (sel.rows < 1 || sel.rows % (src.extent[0] * src.extent[1]) != 0)
    return status::error(errc::shape_mismatch, "compact_ragged: selection rows = %lld is not a multiple of batch * kv_heads = %lld",
                         static_cast<long long>(sel.rows), static_cast<long long>(src.extent[0] * src.extent[1]));
  KVEVICT_TRY(detail::check_selection(sel, sel.rows, src.extent[2], "compact_ragged"));
  const std::int64_t B = src.extent[0], H = sel.rows / B, G = H / src.extent[1], D = src.extent[3];
  if (static_cast<std::int64_t>(sel.indptr[sel.rows]) * D > dst_elems)
    return status::error(errc::insufficient_capacity, "compact_ragged: dst holds %lld elements, selection needs %lld",
                         static_cast<long long>(dst_elems), static_cast<long long>(sel.indptr[sel.rows]) * D);
  {
    std::uintptr_t s0, s1;
    detail::byte_span(src, &s0, &s1);
    const std::uintptr_t d0 = reinterpret_cast<std::uintptr_t>(dst);
    const std::uintptr_t d1 = d0 + static_cast<std::uintptr_t>(sel.indptr[sel.rows] * D) * sizeof(T);
    if (detail::spans_overlap(s0, s1, d0, d1))
      return status::error(errc::invalid_argument, "compact_ragged: dst overlaps src");
  }
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = b * H + h;
      const T* s = src.data + b * src.stride[0] + (h / G) * src.stride[1];
      for (std::int32_t i = sel.indptr[r]; i < sel.indptr[r + 1]; ++i) {
        const T* sp = s + static_cast<std::int64_t>(sel.indices[i]) * src.stride[2];
        T* dp = dst + static_cast<std::int64_t>(i) * D;
        for (std::int64_t c = 0; c < D; ++c) dp[c] = sp[c * src.stride[3]];
      }
    }
  return {};
}

}  // namespace cpu
}  // namespace kvevict
