// IWYU pragma: private, include "kvevict/cpu.hpp"
// Compaction of a paged KV cache in place (docs/integration.md): kept tokens move down within
// their own table row's pages; the pages that hold no token any more are reported to the engine,
// which owns allocation (kvevict never allocates or frees pages). And the union of selections
// (one token set per sequence for all heads and layers: caches whose cells are shared by every
// layer and head, as llama.cpp's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/paged.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {
namespace cpu {

// paged_cache and paged_compaction_result live in core/paged.hpp (the CUDA backend shares them).
using kvevict::paged_cache;
using kvevict::paged_compaction_result;

namespace detail {

template <class T>
inline void move_row(const kv_view<T>& pool, const std::int32_t* pages, std::int64_t h, std::int64_t from, std::int64_t to) {
  const std::int64_t ps = pool.extent[2], D = pool.extent[3];
  T* base = pool.data + h * pool.stride[1];
  const T* s = base + static_cast<std::int64_t>(pages[from / ps]) * pool.stride[0] + (from % ps) * pool.stride[2];
  T* d = base + static_cast<std::int64_t>(pages[to / ps]) * pool.stride[0] + (to % ps) * pool.stride[2];
  if (pool.stride[3] == 1) {
    std::memmove(d, s, static_cast<std::size_t>(D) * sizeof(T));
  } else {
    for (std::int64_t c = 0; c < D; ++c) d[c * pool.stride[3]] = s[c * pool.stride[3]];
  }
}

}  // namespace detail

/// Bytes of host scratch compact_paged() needs: one byte per page (per (page, KV head) for
/// per-head tables over pages that span every head), for the table's duplicate check and the
/// freed-page bookkeeping.
template <class T>
std::size_t compact_paged_workspace_size(const paged_cache<T>& cache) {
  const std::int64_t n = kvevict::detail::page_table_check_bytes(kvevict::detail::paged_cache_inputs(cache));
  return static_cast<std::size_t>(std::max<std::int64_t>(n, cache.pages.indptr ? cache.keys.extent[0] : 0));
}

/// Compact a paged cache in place with a selection of evictor::run() (indices are logical slots
/// of each (sequence, KV head), as for the contiguous view), and report the pages that became free.
/// The three modes follow from the table and the selection:
///  a. per-sequence table (pages span every KV head), sel.rows = batch * kv_heads: every head of a
///     sequence must keep the same count (uniform budgets, layer_mean); each head's kept tokens
///     move down within the sequence's pages; the tail pages become free.
///  b. per-(sequence, KV head) table (pages.per_head), sel.rows = batch * kv_heads: each head
///     compacts into its own pages, so head-wise budgets (AdaKV, PyramidKV, LKV) free pages.
///  c. one token set per sequence, sel.rows = batch (union_selections() of several heads and
///     layers): the set is applied to every KV head; call once per layer for a cache whose
///     table is shared by every layer.
/// Moves are in place and in ascending slot order: a kept token moves to a slot at or before its
/// own within its own row's pages, whatever the page order, so a page that is written before it
/// is read (shuffled, non-monotone tables) never loses a token. Tokens kept at their own slot
/// (a protected prefix: sinks, a shared prefix) are not touched, and their pages are not freed.
/// A row's start_offset stays: kept token j moves to table position start_offset + j, and the
/// result's pages_kept and last_page_len count from that offset (the engine keeps its offsets).
/// Errors (nothing written, cache untouched): the table's (as layer_inputs::pages: ids in range,
/// no page twice, last_page_len, start_offset, lengths), sel.rows not batch * kv_heads (nor batch), indices
/// not ascending or outside a row's length, unequal kept counts under a per-sequence table,
/// result buffers null or freed_capacity too small, workspace too small.
template <class T>
[[nodiscard]] status compact_paged(const paged_cache<T>& cache, const_selection_view sel, paged_compaction_result out,
                                   void* workspace, std::size_t workspace_bytes) {
  KVEVICT_TRY(kvevict::detail::validate_paged_cache_shapes(cache));
  const layer_inputs<T> in = kvevict::detail::paged_cache_inputs(cache);
  const std::size_t need = compact_paged_workspace_size(cache);
  if (!workspace || workspace_bytes < need)
    return status::error(errc::insufficient_workspace, "compact_paged: workspace_bytes = %zu < %zu needed (compact_paged_workspace_size)",
                         workspace ? workspace_bytes : std::size_t{0}, need);
  KVEVICT_TRY(kvevict::detail::check_page_table(in, static_cast<unsigned char*>(workspace), static_cast<std::int64_t>(need)));
  const page_table_view& t = cache.pages;
  const std::int64_t B = in.batch(), H = in.kv_heads(), ps = in.page_size(), R = t.rows(H);
  if (!sel.indptr || !sel.indices) return status::error(errc::null_pointer, "compact_paged: selection indptr/indices is null");
  const bool per_sequence_set = sel.rows == B && H > 1;  // mode c (with H == 1 both forms are one row per head)
  if (sel.rows != B * H && sel.rows != B)
    return status::error(errc::shape_mismatch, "compact_paged: selection rows = %lld is neither batch * kv_heads = %lld nor batch = %lld",
                         static_cast<long long>(sel.rows), static_cast<long long>(B * H), static_cast<long long>(B));
  if (sel.indptr[0] != 0) return status::error(errc::invalid_argument, "compact_paged: selection indptr[0] = %d must be 0", sel.indptr[0]);
  auto sel_row = [&](std::int64_t b, std::int64_t h) { return per_sequence_set ? b : b * H + h; };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = sel_row(b, h), L = in.length(b, h);
      const std::int32_t a = sel.indptr[r], e = sel.indptr[r + 1];
      if (e < a)
        return status::error(errc::invalid_argument, "compact_paged: selection indptr[%lld] = %d > indptr[%lld] = %d",
                             static_cast<long long>(r), a, static_cast<long long>(r + 1), e);
      for (std::int32_t i = a; i < e; ++i) {
        const std::int32_t s = sel.indices[i];
        if (s < 0 || s >= L)
          return status::error(errc::invalid_argument, "compact_paged: selection index %d of row %lld is outside the head's %lld tokens (sequence %lld, KV head %lld)",
                               s, static_cast<long long>(r), static_cast<long long>(L), static_cast<long long>(b), static_cast<long long>(h));
        if (i > a && s <= sel.indices[i - 1])
          return status::error(errc::invalid_argument, "compact_paged: selection row %lld is not strictly ascending at %d", static_cast<long long>(r), i);
      }
      const std::int64_t pre = t.prefix(b);
      if (pre > 0 && (e - a < pre || sel.indices[a + pre - 1] != pre - 1))
        return status::error(errc::invalid_argument,
                             "compact_paged: selection row %lld drops a token of sequence %lld's protected prefix [0, %lld) (shared "
                             "pages are never moved or freed: keep the prefix, e.g. num_sink >= the prefix)",
                             static_cast<long long>(r), static_cast<long long>(b), static_cast<long long>(pre));
      if (!t.per_head && h > 0 && e - a != sel.indptr[sel_row(b, 0) + 1] - sel.indptr[sel_row(b, 0)])
        return status::error(errc::invalid_argument,
                             "compact_paged: sequence %lld keeps %d tokens in KV head 0 and %d in KV head %lld under a shared "
                             "page table (one length per sequence): use uniform budgets, union_selections or pages.per_head",
                             static_cast<long long>(b), sel.indptr[sel_row(b, 0) + 1] - sel.indptr[sel_row(b, 0)], e - a,
                             static_cast<long long>(h));
    }
  if (!t.per_head && H > 1 && in.keys.stride[1] == 0)
    return status::error(errc::invalid_argument,
                         "compact_paged: keys.stride[1] = 0 (pages of one head) under a per-sequence table: every KV head would "
                         "move the same rows; use pages.per_head tables for one-head pages");
  if (!out.pages_kept || !out.last_page_len || !out.freed_pages || !out.num_freed)
    return status::error(errc::null_pointer, "compact_paged: result pages_kept, last_page_len, freed_pages or num_freed is null");
  // A page becomes free when it held tokens and no row keeps a token in it: per-head tables over
  // pages that span every head may share a page id between the heads of a sequence (each in its
  // own head slot), so a page is reported once, and only when every row that used it let it go.
  // state[page]: 0 unused, 1 used and kept by some row, 2 used and let go, 3 reported.
  unsigned char* state = static_cast<unsigned char*>(workspace);
  auto row_kept_pages = [&](std::int64_t r) {
    const std::int64_t b = t.per_head ? r / H : r, h = t.per_head ? r % H : 0;
    return t.pages_for(r, sel.indptr[sel_row(b, h) + 1] - sel.indptr[sel_row(b, h)], ps);
  };
  const std::int64_t P = in.keys.extent[0];
  for (std::int64_t i = 0; i < P; ++i) state[i] = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t used = kvevict::detail::row_pages_used(in, r), np = row_kept_pages(r);
    for (std::int64_t i = 0; i < used; ++i) {
      unsigned char& st = state[t.indices[t.indptr[r] + i]];
      st = i < np ? 1 : (st == 1 ? 1 : 2);
    }
  }
  std::int64_t freed = 0;
  for (std::int64_t i = 0; i < P; ++i) freed += state[i] == 2 ? 1 : 0;
  if (freed > out.freed_capacity)
    return status::error(errc::insufficient_capacity, "compact_paged: %lld pages become free > result freed_capacity = %lld",
                         static_cast<long long>(freed), static_cast<long long>(out.freed_capacity));
  // Every check passed: move, then report.
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = sel_row(b, h), st = t.start(t.row(b, h, H));  // slot s is table position st + s
      const std::int32_t* pages = t.indices + t.indptr[t.row(b, h, H)];
      for (std::int32_t i = 0, n = sel.indptr[r + 1] - sel.indptr[r]; i < n; ++i) {
        const std::int32_t from = sel.indices[sel.indptr[r] + i];
        if (from == i) continue;  // kept in place (a prefix): never written
        detail::move_row(cache.keys, pages, h, st + from, st + i);
        if (cache.values.data) detail::move_row(cache.values, pages, h, st + from, st + i);
      }
    }
  std::int64_t nf = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t b = t.per_head ? r / H : r, h = t.per_head ? r % H : 0;
    const std::int64_t kept = sel.indptr[sel_row(b, h) + 1] - sel.indptr[sel_row(b, h)];
    const std::int64_t np = t.pages_for(r, kept, ps), used = kvevict::detail::row_pages_used(in, r);
    out.pages_kept[r] = static_cast<std::int32_t>(np);
    out.last_page_len[r] = static_cast<std::int32_t>(t.last_len_for(r, kept, ps));
    for (std::int64_t i = np; i < used; ++i) {
      const std::int32_t pg = t.indices[t.indptr[r] + i];
      if (state[pg] == 2) {
        out.freed_pages[nf++] = pg;
        state[pg] = 3;
      }
    }
  }
  if (out.lengths)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        out.lengths[b * H + h] = sel.indptr[sel_row(b, h) + 1] - sel.indptr[sel_row(b, h)];
  *out.num_freed = nf;
  return {};
}

/// The union of several selections, row group by row group: output row r keeps every slot that
/// any of the `n` selections keeps in its rows r * group .. r * group + group - 1 (ascending).
/// group = kv_heads turns per-head selections into one token set per sequence; passing every
/// layer's selection gives one set for the whole model (mode c of compact_paged: caches whose
/// cells are shared by every layer and head, as llama.cpp's, remove the other cells per
/// sequence). The union keeps at least as many tokens as each selection, and at most their sum:
/// the kept count is out.indptr[r + 1] - out.indptr[r] (not a budget). All selections have the
/// same rows (a multiple of group). out: indptr (rows / group + 1), indices with out.capacity >=
/// the union's size (the sum of the inputs' sizes always suffices); positions are not written.
/// out may not share memory with the inputs (rows are written while later rows are read).
/// Errors: null pointers, rows that differ or are not a multiple of group, rows not ascending,
/// capacity too small (nothing written).
[[nodiscard]] inline status union_selections(const const_selection_view* sels, int n, std::int64_t group, selection_view out) {
  if (!sels || n < 1) return status::error(errc::invalid_argument, "union_selections: n = %d selections (need >= 1, non-null)", n);
  if (group < 1) return status::error(errc::invalid_argument, "union_selections: group = %lld must be >= 1", static_cast<long long>(group));
  if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "union_selections: out indptr/indices is null");
  const std::int64_t rows = sels[0].rows;
  if (rows < 1 || rows % group != 0)
    return status::error(errc::shape_mismatch, "union_selections: rows = %lld is not a positive multiple of group = %lld",
                         static_cast<long long>(rows), static_cast<long long>(group));
  std::int64_t total = 0;
  for (int k = 0; k < n; ++k) {
    const const_selection_view& s = sels[k];
    if (!s.indptr || !s.indices) return status::error(errc::null_pointer, "union_selections: selection %d indptr/indices is null", k);
    if (s.rows != rows)
      return status::error(errc::shape_mismatch, "union_selections: selection %d has %lld rows != %lld", k,
                           static_cast<long long>(s.rows), static_cast<long long>(rows));
    if (s.indptr[0] < 0)
      return status::error(errc::invalid_argument, "union_selections: selection %d indptr[0] = %d must be >= 0", k, s.indptr[0]);
    for (std::int64_t r = 0; r < rows; ++r) {
      if (s.indptr[r + 1] < s.indptr[r])
        return status::error(errc::invalid_argument, "union_selections: selection %d indptr decreases at row %lld", k, static_cast<long long>(r));
      for (std::int32_t i = s.indptr[r] + 1; i < s.indptr[r + 1]; ++i)
        if (s.indices[i] <= s.indices[i - 1])
          return status::error(errc::invalid_argument, "union_selections: selection %d row %lld is not strictly ascending at %d", k,
                               static_cast<long long>(r), i);
    }
  }
  // Sizes first (nothing written on a capacity error), then the merge.
  std::vector<std::int32_t> merged;
  for (int pass = 0; pass < 2; ++pass) {
    total = 0;
    for (std::int64_t q = 0; q < rows / group; ++q) {
      merged.clear();
      for (int k = 0; k < n; ++k)
        for (std::int64_t r = q * group; r < (q + 1) * group; ++r)
          merged.insert(merged.end(), sels[k].indices + sels[k].indptr[r], sels[k].indices + sels[k].indptr[r + 1]);
      std::sort(merged.begin(), merged.end());
      merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
      if (pass == 1) {
        out.indptr[q] = static_cast<std::int32_t>(total);
        std::copy(merged.begin(), merged.end(), out.indices + total);
      }
      total += static_cast<std::int64_t>(merged.size());
    }
    if (pass == 0 && total > 0x7fffffff)
      return status::error(errc::invalid_argument, "union_selections: the union keeps %lld tokens, more than int32 indptr holds",
                           static_cast<long long>(total));
    if (pass == 0 && total > out.capacity)
      return status::error(errc::insufficient_capacity, "union_selections: the union keeps %lld tokens > out.capacity = %lld",
                           static_cast<long long>(total), static_cast<long long>(out.capacity));
  }
  out.indptr[rows / group] = static_cast<std::int32_t>(total);  // <= out.capacity, checked below int32 by the first pass
  return {};
}

}  // namespace cpu
}  // namespace kvevict
