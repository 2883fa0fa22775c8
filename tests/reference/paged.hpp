// Test helper: a contiguous layer_inputs copied into a paged cache (a page pool and a page table),
// token for token, so that the paged and the contiguous views of the same data can be compared.
// Page ids are assigned in a shuffled, non-monotone order with unused pages in between.
#pragma once

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace kvtest {

/// Pool layouts: NHD [page][slot][head][dim], HND [page][head][slot][dim], or the token index
/// innermost ([page][head][dim][slot], llama.cpp's transposed V).
enum class pool_layout { nhd, hnd, token_innermost };
inline const char* to_string(pool_layout l) {
  return l == pool_layout::nhd ? "nhd" : (l == pool_layout::hnd ? "hnd" : "token_innermost");
}

template <class T>
struct paged_copy {
  std::vector<T> kpool, vpool;
  std::vector<std::int32_t> indptr, indices, last_page_len, lens, starts;
  std::int64_t num_pages = 0, page_size = 0;
  kvevict::layer_inputs<T> in;  ///< the paged inputs (queries, W_O, positions as the source's)

  /// The pool view of `pool` for the layout (kv_heads heads, or one head per page for per_head
  /// tables with one_head_pages).
  static kvevict::kv_view<const T> pool_view(const std::vector<T>& pool, std::int64_t P, std::int64_t H, std::int64_t ps,
                                             std::int64_t d, pool_layout l, bool one_head_pages) {
    kvevict::kv_view<const T> v;
    v.data = pool.data();
    v.extent[0] = P, v.extent[1] = H, v.extent[2] = ps, v.extent[3] = d;
    const std::int64_t Hs = one_head_pages ? 1 : H;
    switch (l) {
      case pool_layout::nhd: v.stride[3] = 1, v.stride[1] = d, v.stride[2] = Hs * d, v.stride[0] = ps * Hs * d; break;
      case pool_layout::hnd: v.stride[3] = 1, v.stride[2] = d, v.stride[1] = ps * d, v.stride[0] = Hs * ps * d; break;
      default: v.stride[2] = 1, v.stride[3] = ps, v.stride[1] = d * ps, v.stride[0] = Hs * d * ps; break;
    }
    if (one_head_pages) v.stride[1] = 0;
    return v;
  }
};

/// Copy `src` (a contiguous layer_inputs) into pages of `page_size` tokens.
///  - per_head = false: one table per sequence covering its longest head; lengths from
///    src.lengths (per-head, ragged) and no last_page_len, or last_page_len when every head of
///    every sequence has the same length and with_last_page_len is set.
///  - per_head = true: one table per (sequence, KV head) with last_page_len; one_head_pages: pages
///    hold one head (the pool's head stride is 0), else pages span every head.
/// Unused pool slots are NaN; page ids are shuffled with `seed` (or descending with `reversed`),
/// with `spare` unused pages. with_start = 1: every row r starts at offset (5 r + 3) % page_size
/// of its first page (pages.start_offset; a left-padded first page), the slots before it NaN;
/// 2: the same offsets, lowered where a row would need one page more than without them.
template <class T>
void make_paged(const kvevict::layer_inputs<T>& src, std::int64_t page_size, pool_layout l, bool per_head, bool one_head_pages,
                std::uint64_t seed, paged_copy<T>& out, bool with_last_page_len = true, std::int64_t spare = 3,
                bool reversed = false, int with_start = 0) {
  const std::int64_t B = src.batch(), H = src.kv_heads(), d = src.head_dim(), ps = page_size;
  const std::int64_t R = per_head ? B * H : B;
  out.starts.assign(static_cast<std::size_t>(R), 0);
  auto start = [&](std::int64_t r) -> std::int64_t { return out.starts[static_cast<std::size_t>(r)]; };
  std::vector<std::int64_t> row_len(static_cast<std::size_t>(R));
  for (std::int64_t r = 0; r < R; ++r) {
    if (per_head) {
      row_len[static_cast<std::size_t>(r)] = src.length(r / H, r % H);
    } else {
      std::int64_t m = 0;
      for (std::int64_t h = 0; h < H; ++h) m = std::max(m, src.length(r, h));
      row_len[static_cast<std::size_t>(r)] = m;
    }
  }
  if (with_start)
    for (std::int64_t r = 0; r < R; ++r) {
      std::int64_t s = (5 * r + 3) % ps;
      const std::int64_t L = row_len[static_cast<std::size_t>(r)];
      if (with_start == 2 && L > 0) s = std::min(s, (L + ps - 1) / ps * ps - L);  // no extra page
      out.starts[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(s);
    }
  out.indptr.assign(1, 0);
  std::int64_t total = 0, maxp = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t L = row_len[static_cast<std::size_t>(r)], n = L > 0 ? (start(r) + L + ps - 1) / ps : 0;
    total += n;
    maxp = std::max(maxp, n);
    out.indptr.push_back(static_cast<std::int32_t>(total));
  }
  const std::int64_t P = total + spare;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(P));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 g(seed);
  if (reversed) {  // descending ids: every kept token moves into a page at a higher address, read later
    std::reverse(ids.begin(), ids.end());
  } else {
    std::shuffle(ids.begin(), ids.end(), g);
  }
  out.indices.assign(ids.begin(), ids.begin() + total);
  out.num_pages = P;
  out.page_size = ps;
  const bool ohp = per_head && one_head_pages;
  const std::int64_t Hs = ohp ? 1 : H;
  const T nan = kvevict::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  out.kpool.assign(static_cast<std::size_t>(P * Hs * ps * d), nan);
  out.vpool.assign(out.kpool.size(), nan);
  const auto kv = paged_copy<T>::pool_view(out.kpool, P, H, ps, d, l, ohp);
  const auto vv = paged_copy<T>::pool_view(out.vpool, P, H, ps, d, l, ohp);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = per_head ? b * H + h : b;
      for (std::int64_t t = 0; t < src.length(b, h); ++t) {
        const std::int64_t m = start(r) + t;  // table position
        const std::int64_t pg = out.indices[static_cast<std::size_t>(out.indptr[static_cast<std::size_t>(r)] + m / ps)];
        for (std::int64_t c = 0; c < d; ++c) {
          const std::int64_t o = pg * kv.stride[0] + h * kv.stride[1] + (m % ps) * kv.stride[2] + c * kv.stride[3];
          out.kpool[static_cast<std::size_t>(o)] = src.keys(b, h, t, c);
          if (src.values.data) out.vpool[static_cast<std::size_t>(o)] = src.values(b, h, t, c);
        }
      }
    }
  out.in = src;
  out.in.keys = kv;
  out.in.values = src.values.data ? vv : kvevict::kv_view<const T>{};
  out.in.pages.indptr = out.indptr.data();
  out.in.pages.indices = out.indices.data();
  out.in.pages.batch = B;
  out.in.pages.max_pages_per_row = maxp;
  out.in.pages.per_head = per_head;
  out.in.pages.start_offset = with_start ? out.starts.data() : nullptr;
  bool equal_lengths = true;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) equal_lengths = equal_lengths && src.length(b, h) == src.length(b, 0);
  if (with_last_page_len && (per_head || equal_lengths)) {
    out.last_page_len.clear();
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int64_t m = start(r) + row_len[static_cast<std::size_t>(r)];  // table positions in use
      out.last_page_len.push_back(static_cast<std::int32_t>(m == start(r) ? 0 : m - (m - 1) / ps * ps));
    }
    out.in.pages.last_page_len = out.last_page_len.data();
    out.in.lengths = {};
  } else {
    out.lens.clear();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) out.lens.push_back(static_cast<std::int32_t>(src.length(b, h)));
    out.in.lengths = kvevict::per_head_lengths(out.lens.data(), B, H);
  }
}

}  // namespace kvtest
