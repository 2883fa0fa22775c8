// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Paged and indirect KV caches: the page table of one layer (FlashInfer's CSR vocabulary:
// indptr, indices, last_page_len) and its host-side validation. The page pool itself is a
// kv_view whose axes are read as (num_pages, kv_heads, page_size, head_dim); see
// layer_inputs::pages and docs/integration.md.
#pragma once

#include <cstdint>

#include "kvevict/core/config.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {

/// The page table of one layer's paged K/V cache, CSR as in FlashInfer (kv_indptr,
/// kv_indices, kv_last_page_len). int32 everywhere, host memory on the CPU backend.
///
///   rows          = batch (one table per sequence, shared by its KV heads: vLLM, FlashInfer,
///                   TensorRT-LLM) or batch * kv_heads with per_head (one table per (sequence,
///                   KV head), row b * kv_heads + h: compactor-vllm, vllm-kvcompress).
///   indptr        (rows + 1): row r owns indices[indptr[r] .. indptr[r+1]); indptr[0] = 0,
///                 non-decreasing; a row holds at most max_pages_per_row pages.
///   indices       (indptr[rows]): page ids into the pool, in logical order: logical slot t of
///                 row r lies in page indices[indptr[r] + t / page_size] at offset t % page_size.
///                 Any order (shuffled, non-monotone); a page may not appear twice among the
///                 pages that hold a row's tokens, nor in two rows of a per-sequence table.
///   last_page_len (rows), optional: tokens in the row's last page, in [1, page_size] (FlashInfer);
///                 a row's length is (pages - 1) * page_size + last_page_len (0 without pages).
///                 Without it the lengths come from layer_inputs::lengths (vLLM's seq_lens with
///                 a block table: indptr[b] = b * max_blocks_per_seq), which must then be set; with
///                 both, they must agree.
///   max_pages_per_row: the capacity bound: layer_inputs::capacity() = max_pages_per_row *
///                 page_size (vLLM's max_blocks_per_seq; FlashInfer: the largest row).
///   start_offset  (rows), optional: row r's first token lies at offset start_offset[r] of its
///                 first page, in [0, page_size): logical slot t is the row's token at table
///                 position start_offset[r] + t (page indices[indptr[r] + (start + t) /
///                 page_size], offset (start + t) % page_size), and the table's length is
///                 (pages - 1) * page_size + last_page_len - start_offset[r] (at least 1 for a
///                 row with pages). Left-padded batches (HF-style batched generation): a
///                 contiguous (batch, kv_heads, seq, head_dim) cache whose sequence b starts at
///                 slot pad[b] is a pool of `batch` pages of page_size = seq, with indptr
///                 [0, 1, ..., batch], indices [0, ..., batch - 1], last_page_len seq and
///                 start_offset pad (no copy; docs/integration.md). Slots, positions and
///                 selections are logical (slot 0 = the first real token); compaction keeps the
///                 offset (kept token j moves to table position start_offset[r] + j).
///
///   protected_prefix (batch), optional: sequence b's first protected_prefix[b] tokens are a
///                 prefix shared with other sequences (prefix caching): the pages that hold only
///                 prefix tokens (the first (start_offset + protected_prefix[b]) / page_size of each of its
///                 rows; rows that share them must have the same start_offset) may
///                 appear in several rows, never as a non-prefix page of any row; compaction
///                 (cpu::compact_paged) never moves, drops or frees them, and refuses a selection
///                 that drops a prefix token. At most every head's length. The evictor keeps them
///                 as sinks (every head of b protects max(num_sink, prefix) first tokens; a budget
///                 below them is raised: detail::plan_head_protected).
///
/// A token-slot table (SGLang's req_to_token, llama.cpp's cells) is the same view with page size
/// 1: indices are the slot ids of each sequence's tokens in logical order.
struct page_table_view {
  const std::int32_t* indptr = nullptr;
  const std::int32_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  const std::int32_t* protected_prefix = nullptr;
  std::int64_t batch = 0;
  std::int64_t max_pages_per_row = 0;
  bool per_head = false;
  const std::int32_t* start_offset = nullptr;  ///< (rows), optional: see above (last: aggregate order kept)

  KVEVICT_HOST_DEVICE bool empty() const { return indptr == nullptr; }
  /// Rows of the table for `kv_heads` KV heads.
  KVEVICT_HOST_DEVICE std::int64_t rows(std::int64_t kv_heads) const { return per_head ? batch * kv_heads : batch; }
  /// The table row of (sequence b, KV head h).
  KVEVICT_HOST_DEVICE std::int64_t row(std::int64_t b, std::int64_t h, std::int64_t kv_heads) const {
    return per_head ? b * kv_heads + h : b;
  }
  /// Pages of row r.
  KVEVICT_HOST_DEVICE std::int64_t pages(std::int64_t r) const { return static_cast<std::int64_t>(indptr[r + 1]) - indptr[r]; }
  /// Protected prefix tokens of sequence b (0 without protected_prefix).
  KVEVICT_HOST_DEVICE std::int64_t prefix(std::int64_t b) const { return protected_prefix ? protected_prefix[b] : 0; }
  /// Offset of row r's first token in its first page (0 without start_offset).
  KVEVICT_HOST_DEVICE std::int64_t start(std::int64_t r) const { return start_offset ? start_offset[r] : 0; }
  /// Tokens of row r from the table (needs last_page_len).
  KVEVICT_HOST_DEVICE std::int64_t table_length(std::int64_t r, std::int64_t page_size) const {
    const std::int64_t n = pages(r);
    return n > 0 ? (n - 1) * page_size + last_page_len[r] - start(r) : 0;
  }
  /// Tokens row r's pages can hold after its start offset (0 for a row without pages).
  KVEVICT_HOST_DEVICE std::int64_t row_capacity(std::int64_t r, std::int64_t page_size) const {
    return pages(r) > 0 ? pages(r) * page_size - start(r) : 0;
  }
  /// Pages row r needs for its first n tokens: ceil((start + n) / page_size), 0 for n <= 0.
  KVEVICT_HOST_DEVICE std::int64_t pages_for(std::int64_t r, std::int64_t n, std::int64_t page_size) const {
    return n > 0 ? (start(r) + n + page_size - 1) / page_size : 0;
  }
  /// last_page_len of row r when it holds n tokens (0 for none).
  KVEVICT_HOST_DEVICE std::int64_t last_len_for(std::int64_t r, std::int64_t n, std::int64_t page_size) const {
    return n > 0 ? start(r) + n - (pages_for(r, n, page_size) - 1) * page_size : 0;
  }
  /// Leading pages of row r that hold only protected-prefix tokens of sequence b (shareable).
  KVEVICT_HOST_DEVICE std::int64_t shared_pages(std::int64_t r, std::int64_t b, std::int64_t page_size) const {
    return prefix(b) > 0 ? (start(r) + prefix(b)) / page_size : 0;
  }
};

/// A per-sequence page table (FlashInfer's paged_kv_t: one table per sequence, every KV head in
/// the same pages).
inline page_table_view make_page_table(const std::int32_t* indptr, const std::int32_t* indices,
                                       const std::int32_t* last_page_len, std::int64_t batch,
                                       std::int64_t max_pages_per_row) {
  page_table_view t;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last_page_len;
  t.batch = batch;
  t.max_pages_per_row = max_pages_per_row;
  return t;
}

/// A page pool view, (num_pages, kv_heads, page_size, head_dim) in the given layout:
///  - nhd: [num_pages][page_size][kv_heads][head_dim] (vLLM, FlashInfer NHD)
///  - hnd: [num_pages][kv_heads][page_size][head_dim] (FlashInfer HND, TensorRT-LLM)
/// For a combined K/V pool ([num_pages][2][...], FlashInfer's single tensor) pass the K and V
/// halves as two views with twice the page stride (fill extent and stride yourself); for pages
/// that hold one KV head's tokens (per_head tables) see page_pool_per_head().
template <class T>
KVEVICT_HOST_DEVICE inline kv_view<T> make_page_pool(T* data, std::int64_t num_pages, std::int64_t kv_heads,
                                                     std::int64_t page_size, std::int64_t head_dim, kv_layout layout) {
  return make_kv_view(data, num_pages, kv_heads, page_size, head_dim, layout);
}

/// A pool of pages that each hold one KV head's tokens ([num_pages][page_size][head_dim]),
/// addressed by per-(sequence, KV head) tables: the view's head axis has stride 0 (every head
/// reads its own pages through its own table row).
template <class T>
KVEVICT_HOST_DEVICE inline kv_view<T> page_pool_per_head(T* data, std::int64_t num_pages, std::int64_t kv_heads,
                                                         std::int64_t page_size, std::int64_t head_dim) {
  kv_view<T> v = make_kv_view(data, num_pages, std::int64_t{1}, page_size, head_dim, kv_layout::hnd);
  v.extent[1] = kv_heads;
  v.stride[1] = 0;
  return v;
}

/// What compact_paged() (cpu:: and cuda::) reports; caller-allocated (host memory for cpu::,
/// device memory for cuda::), written only on success.
///   pages_kept    int32 (rows): pages each table row still uses (its first pages_kept entries of
///                 indices; the engine drops the rest from its table)
///   last_page_len int32 (rows): the row's new last_page_len, in [1, page_size], 0 for a row
///                 left without tokens
///   lengths       int32 (batch, kv_heads) row-major, optional: the new length of every
///                 (sequence, KV head), for engines that keep lengths (vLLM's seq_lens)
///   freed_pages   int32 (freed_capacity): the ids of the pages that held tokens and hold none
///                 now, each once, in table order on the CPU and in ascending page id on CUDA
///                 (deterministic either way); a page shared by several rows (per-head tables
///                 over pages that span every head) only when every row let it go. *num_freed
///                 receives their count
/// freed_capacity >= indptr[rows] always suffices.
struct paged_compaction_result {
  std::int32_t* pages_kept = nullptr;
  std::int32_t* last_page_len = nullptr;
  std::int32_t* lengths = nullptr;
  std::int32_t* freed_pages = nullptr;
  std::int64_t freed_capacity = 0;
  std::int64_t* num_freed = nullptr;
};

/// The paged cache compact_paged() (cpu:: and cuda::) works on: one layer's K and V pools (V optional), as
/// layer_inputs reads them ((num_pages, kv_heads, page_size, head_dim), any strides; K and V may
/// be the two halves of one combined buffer), its page table and, when the table has no
/// last_page_len, the lengths (batch, kv_heads).
template <class T>
struct paged_cache {
  kv_view<T> keys;
  kv_view<T> values;
  page_table_view pages;
  lengths_view lengths;
};

}  // namespace kvevict
