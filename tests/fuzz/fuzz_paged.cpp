// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over paged-cache compaction (cpu::compact_paged, include/kvevict/backends/cpu/
// compact_paged.hpp) and the union of selections (cpu::union_selections): random page tables
// (per-sequence or per-(sequence, KV head); NHD, HND or one-head pages; shuffled, repeated and
// out-of-range page ids; last_page_len, lengths, start_offset, protected_prefix each present or
// not, in or out of range), random selections (per head, or one set per sequence from
// union_selections; sometimes unsorted, out of range or unequal across a shared table's heads),
// short workspaces and short freed-page buffers.
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * an error leaves every byte of the pools, the table, the selection and the result buffers as
//    they were, and its message names the function or the table field;
//  * a success keeps exactly the selected tokens, readable through the table: kept token j of
//    (sequence b, KV head h) is at table position start_offset + j of its row's pages, with the
//    contents of its old slot (every element of K and V is a unique value); pages_kept and
//    last_page_len describe the kept tokens; the freed pages are exactly the pages that held tokens
//    before and hold none now, each reported once; lengths are the kept counts;
//  * union_selections: each output row is the sorted union of its group's rows, or an error and
//    nothing written.
// Input format: see read_case below (bytes read front to back; zeros once the input ends).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "fuzz/fuzz_common.hpp"
#include <kvevict/backends/cpu/compact_paged.hpp>

namespace {

using kvevict_fuzz::reader;
using kvevict_fuzz::verbose;

/// Element (page, head, slot, d) of a pool view.
float& at(const kvevict::kv_view<float>& v, std::int64_t page, std::int64_t h, std::int64_t slot, std::int64_t d) {
  return v.data[page * v.stride[0] + h * v.stride[1] + slot * v.stride[2] + d * v.stride[3]];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader r{data, size};
  // Shape: batch 1-3, KV heads 1-3, page size 1-8, head_dim 1-4, pages 1-24.
  const std::int64_t B = 1 + r.u8() % 3, H = 1 + r.u8() % 3, ps = 1 + r.u8() % 8, D = 1 + r.u8() % 4, P = 1 + r.u8() % 24;
  const std::uint8_t flags = r.u8();
  const bool per_head = flags & 1, one_head_pages = per_head && (flags & 2), nhd = flags & 4;
  const bool has_last = !(flags & 8), has_lengths = flags & 16, has_start = flags & 32, has_prefix = flags & 64;
  const bool with_values = !(flags & 128);
  // Pools: every element a unique value (exact in fp32).
  const std::int64_t heads_in_page = one_head_pages ? 1 : H;
  std::vector<float> kbuf(static_cast<std::size_t>(P * heads_in_page * ps * D)), vbuf(kbuf.size());
  kvevict::kv_view<float> kv, vv;
  if (one_head_pages) {
    kv = kvevict::page_pool_per_head(kbuf.data(), P, H, ps, D);
    vv = kvevict::page_pool_per_head(vbuf.data(), P, H, ps, D);
  } else {
    const auto layout = nhd ? kvevict::kv_layout::nhd : kvevict::kv_layout::hnd;
    kv = kvevict::make_page_pool(kbuf.data(), P, H, ps, D, layout);
    vv = kvevict::make_page_pool(vbuf.data(), P, H, ps, D, layout);
  }
  for (std::int64_t pg = 0; pg < P; ++pg)
    for (std::int64_t h = 0; h < heads_in_page; ++h)
      for (std::int64_t s = 0; s < ps; ++s)
        for (std::int64_t d = 0; d < D; ++d) {
          const float x = static_cast<float>((((pg * 4 + h) * 8 + s) * 4 + d) + 1);
          at(kv, pg, h, s, d) = x;
          at(vv, pg, h, s, d) = -x;
        }
  // Table: rows of 0-5 pages, ids mostly distinct (a permutation walk), sometimes repeated or out of range.
  const std::int64_t R = per_head ? B * H : B;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(R + 1), 0), indices, last(static_cast<std::size_t>(R)),
      start(static_cast<std::size_t>(R)), prefix(static_cast<std::size_t>(B)), lens(static_cast<std::size_t>(B * H));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(P));
  for (std::int64_t i = 0; i < P; ++i) perm[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
  for (std::int64_t i = P - 1; i > 0; --i) std::swap(perm[static_cast<std::size_t>(i)], perm[r.u8() % (i + 1)]);
  std::size_t next = 0;
  for (std::int64_t row = 0; row < R; ++row) {
    const std::uint8_t np = r.u8();
    const int n = np % 6;
    for (int i = 0; i < n; ++i) {
      const std::uint8_t m = r.u8();
      std::int32_t id;
      if (m < 232 && next < perm.size()) id = perm[next++];
      else if (m < 244) id = indices.empty() ? 0 : indices[m % indices.size()];  // a repeat
      else id = m < 250 ? static_cast<std::int32_t>(P + m % 3) : -1 - m % 3;     // out of range
      indices.push_back(id);
    }
    indptr[static_cast<std::size_t>(row + 1)] = static_cast<std::int32_t>(indices.size());
    const std::uint8_t l = r.u8();
    last[static_cast<std::size_t>(row)] = l < 240 ? static_cast<std::int32_t>(1 + l % ps) : static_cast<std::int32_t>(l % 3 == 0 ? 0 : ps + 1);
    const std::uint8_t so = has_start ? r.u8() : 0;
    start[static_cast<std::size_t>(row)] = so < 250 ? static_cast<std::int32_t>(so % ps) : static_cast<std::int32_t>(so % 2 ? ps : -1);
  }
  indices.reserve(indices.size() + 1);  // never a null data() (an empty table row set is still a table)
  const std::int32_t max_pages = static_cast<std::int32_t>(r.u8() % 7);
  kvevict::page_table_view t;
  t.indptr = indptr.data();
  t.indices = indices.data();
  t.last_page_len = has_last ? last.data() : nullptr;
  t.start_offset = has_start ? start.data() : nullptr;
  t.batch = B;
  t.max_pages_per_row = max_pages == 0 ? 5 : max_pages;
  t.per_head = per_head;
  // The lengths the table describes (guessed when the table is bad): the selection is drawn from them.
  auto row_len = [&](std::int64_t row) -> std::int64_t {
    const std::int64_t n = indptr[static_cast<std::size_t>(row + 1)] - indptr[static_cast<std::size_t>(row)];
    if (n <= 0) return 0;
    const std::int64_t L = has_last ? (n - 1) * ps + last[static_cast<std::size_t>(row)] - (has_start ? start[static_cast<std::size_t>(row)] : 0)
                                    : n * ps - (has_start ? start[static_cast<std::size_t>(row)] : 0);
    return std::max<std::int64_t>(0, std::min<std::int64_t>(L, 40));
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::uint8_t m = has_lengths ? r.u8() : 0;
      std::int64_t L = row_len(per_head ? b * H + h : b);
      if (m >= 240) L += m % 2 ? 1 : -1 - L;  // one past the table, or negative
      else if (!has_last && m % 4 == 1 && L > 0) L -= m % L;  // shorter than the pages hold
      lens[static_cast<std::size_t>(b * H + h)] = static_cast<std::int32_t>(L);
    }
  if (has_lengths) {
    // per-sequence tables hold one length per sequence: make the heads agree unless the input says otherwise
    if (!per_head && !(flags & 2))
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 1; h < H; ++h) lens[static_cast<std::size_t>(b * H + h)] = lens[static_cast<std::size_t>(b * H)];
  }
  for (std::int64_t b = 0; b < B; ++b) {
    const std::uint8_t m = has_prefix ? r.u8() : 0;
    prefix[static_cast<std::size_t>(b)] = m < 250 ? static_cast<std::int32_t>(m % 6) : (m % 2 ? 1000 : -1);
  }
  t.protected_prefix = has_prefix ? prefix.data() : nullptr;
  kvevict::paged_cache<float> cache;
  cache.keys = kv;
  if (with_values) cache.values = vv;
  cache.pages = t;
  if (has_lengths) cache.lengths = kvevict::per_head_lengths(lens.data(), B, H);
  auto head_len = [&](std::int64_t b, std::int64_t h) -> std::int64_t {
    if (has_lengths) return lens[static_cast<std::size_t>(b * H + h)];
    return row_len(per_head ? b * H + h : b);
  };

  // Selections: one per (sequence, KV head), kept with probability byte / 256; the protected prefix kept.
  const std::uint8_t smode = r.u8();
  const bool union_mode = smode % 4 == 0 && H > 1;  // mode c: one set per sequence through union_selections
  const bool equal_counts = !per_head && smode % 8 != 1;
  std::vector<std::int32_t> sptr(1, 0), sidx;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t first_count = -1;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t L = std::max<std::int64_t>(0, std::min<std::int64_t>(head_len(b, h), 40));
      const std::uint8_t keep = r.u8();
      std::vector<std::int32_t> row;
      const std::int64_t pre = has_prefix ? prefix[static_cast<std::size_t>(b)] : 0;
      for (std::int64_t s = 0; s < L; ++s)
        if (s < pre || ((s * 37 + keep * 11 + h) % 256) < keep) row.push_back(static_cast<std::int32_t>(s));
      if (equal_counts && !union_mode) {  // a shared table needs equal counts across heads
        if (first_count < 0) first_count = static_cast<std::int64_t>(row.size());
        while (static_cast<std::int64_t>(row.size()) > first_count) row.pop_back();
        for (std::int64_t s = 0; static_cast<std::int64_t>(row.size()) < first_count && s < L; ++s)
          if (!std::binary_search(row.begin(), row.end(), static_cast<std::int32_t>(s))) {
            row.insert(std::lower_bound(row.begin(), row.end(), static_cast<std::int32_t>(s)), static_cast<std::int32_t>(s));
          }
      }
      const std::uint8_t bad = r.u8();
      if (bad >= 248 && !row.empty()) {
        if (bad % 3 == 0) std::swap(row.front(), row.back());
        else if (bad % 3 == 1) row.back() = static_cast<std::int32_t>(L + bad % 2);
        else row.front() = -1;
      }
      sidx.insert(sidx.end(), row.begin(), row.end());
      sptr.push_back(static_cast<std::int32_t>(sidx.size()));
    }
  }
  sidx.reserve(sidx.size() + 1);  // a selection that keeps nothing still has an indices buffer
  const std::int64_t srows = B * H;
  kvevict::const_selection_view sel(sptr.data(), sidx.data(), srows);
  std::vector<std::int32_t> uptr, uidx;
  if (union_mode) {
    // union_selections of the per-head selection with itself shifted: group = kv_heads gives one row per sequence
    uptr.assign(static_cast<std::size_t>(B + 1), -7);
    const std::uint8_t cap = r.u8();
    uidx.assign(cap >= 240 ? static_cast<std::size_t>(cap % 4) : sidx.size() + 1, -7);
    const std::vector<std::int32_t> uptr0 = uptr, uidx0 = uidx;
    kvevict::selection_view uo;
    uo.indptr = uptr.data();
    uo.indices = uidx.data();
    uo.capacity = static_cast<std::int64_t>(uidx.size());
    const kvevict::const_selection_view ins[2] = {sel, sel};
    const kvevict::status us = kvevict::cpu::union_selections(ins, 1 + smode % 2, H, uo);
    if (!us.ok()) {
      FUZZ_ASSERT(std::strstr(us.message(), "union_selections") != nullptr, us.message());
      FUZZ_ASSERT(uptr == uptr0 && uidx == uidx0, "union_selections wrote on error");
      if (verbose()) std::printf("union: %s\n", us.message());
      return 0;
    }
    for (std::int64_t b = 0; b < B; ++b) {  // the sorted union of the group's rows
      std::set<std::int32_t> want;
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int32_t i = sptr[static_cast<std::size_t>(b * H + h)]; i < sptr[static_cast<std::size_t>(b * H + h + 1)]; ++i)
          want.insert(sidx[static_cast<std::size_t>(i)]);
      const std::vector<std::int32_t> got(uidx.begin() + uptr[static_cast<std::size_t>(b)], uidx.begin() + uptr[static_cast<std::size_t>(b + 1)]);
      FUZZ_ASSERT(got == std::vector<std::int32_t>(want.begin(), want.end()), "union_selections is not the union");
    }
    sel = kvevict::const_selection_view(uptr.data(), uidx.data(), B);
  }

  // Result buffers and workspace, sometimes short.
  const std::uint8_t wsm = r.u8(), fcm = r.u8();
  const std::size_t need = kvevict::cpu::compact_paged_workspace_size(cache);
  std::vector<unsigned char> ws(wsm >= 248 && need > 0 ? need - 1 : need + wsm % 4, 0xAB);
  std::vector<std::int32_t> pages_kept(static_cast<std::size_t>(R), -7), last_out(static_cast<std::size_t>(R), -7),
      len_out(static_cast<std::size_t>(B * H), -7), freed(static_cast<std::size_t>(fcm >= 240 ? fcm % 3 : indices.size() + 1), -7);
  std::int64_t num_freed = -7;
  kvevict::paged_compaction_result out;
  out.pages_kept = pages_kept.data();
  out.last_page_len = last_out.data();
  out.lengths = len_out.data();
  out.freed_pages = freed.data();
  out.freed_capacity = static_cast<std::int64_t>(freed.size());
  out.num_freed = &num_freed;
  const std::vector<float> k0 = kbuf, v0 = vbuf;
  const std::vector<std::int32_t> indptr0 = indptr, indices0 = indices, last0 = last, start0 = start, prefix0 = prefix, lens0 = lens,
                                  sptr0 = sptr, sidx0 = sidx, uptr1 = uptr, uidx1 = uidx;
  const kvevict::status st = kvevict::cpu::compact_paged(cache, sel, out, ws.data(), ws.size());
  FUZZ_ASSERT(indptr == indptr0 && indices == indices0 && last == last0 && start == start0 && prefix == prefix0 && lens == lens0,
              "the page table changed");
  FUZZ_ASSERT(sptr == sptr0 && sidx == sidx0 && uptr == uptr1 && uidx == uidx1, "the selection changed");
  if (!st.ok()) {
    FUZZ_ASSERT(std::strlen(st.message()) > 0, "");
    FUZZ_ASSERT(std::strstr(st.message(), "compact_paged") || std::strstr(st.message(), "pages") || std::strstr(st.message(), "lengths"),
                st.message());
    FUZZ_ASSERT(kbuf == k0 && vbuf == v0, "compact_paged wrote the pools on error");
    FUZZ_ASSERT(num_freed == -7, st.message());
    for (auto* vec : {&pages_kept, &last_out, &len_out, &freed})
      FUZZ_ASSERT(std::all_of(vec->begin(), vec->end(), [](std::int32_t x) { return x == -7; }), st.message());
    if (verbose()) std::printf("error: %s\n", st.message());
    return 0;
  }
  // Success: every kept token is readable at its new table position with its old contents.
  const bool set_per_seq = sel.rows == B && H > 1;
  std::set<std::int32_t> kept_pages, freed_set;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = per_head ? b * H + h : b, srow = set_per_seq ? b : b * H + h;
      const std::int32_t* pages = indices.data() + indptr[static_cast<std::size_t>(row)];
      const std::int64_t off = has_start ? start[static_cast<std::size_t>(row)] : 0;
      const std::int64_t ph = one_head_pages ? 0 : h;
      const std::int32_t a = sel.indptr[srow], e = sel.indptr[srow + 1];
      for (std::int32_t j = 0; j < e - a; ++j) {
        const std::int64_t from = off + sel.indices[a + j], to = off + j;
        for (std::int64_t d = 0; d < D; ++d) {
          // the old contents of `from`, by the unique-value encoding of the original pool
          const std::int64_t opg = pages[from / ps];
          const float want = k0[static_cast<std::size_t>(&at(kv, opg, ph, from % ps, d) - kbuf.data())];
          FUZZ_ASSERT(at(kv, pages[to / ps], ph, to % ps, d) == want, "a kept key is not at its new position");
          if (with_values) FUZZ_ASSERT(at(vv, pages[to / ps], ph, to % ps, d) == -want, "a kept value is not at its new position");
        }
      }
      FUZZ_ASSERT(len_out[static_cast<std::size_t>(b * H + h)] == e - a, "lengths");
    }
  for (std::int64_t row = 0; row < R; ++row) {
    const std::int64_t b = per_head ? row / H : row, h = per_head ? row % H : 0, srow = set_per_seq ? b : b * H + h;
    const std::int64_t n = sel.indptr[srow + 1] - sel.indptr[srow];
    FUZZ_ASSERT(pages_kept[static_cast<std::size_t>(row)] == t.pages_for(row, n, ps), "pages_kept");
    FUZZ_ASSERT(last_out[static_cast<std::size_t>(row)] == t.last_len_for(row, n, ps), "last_page_len");
    for (std::int32_t i = 0; i < pages_kept[static_cast<std::size_t>(row)]; ++i)
      kept_pages.insert(indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(row)] + i)]);
  }
  FUZZ_ASSERT(num_freed >= 0 && num_freed <= static_cast<std::int64_t>(freed.size()), "num_freed");
  for (std::int64_t i = 0; i < num_freed; ++i) {
    const std::int32_t pg = freed[static_cast<std::size_t>(i)];
    FUZZ_ASSERT(pg >= 0 && pg < P, "a freed page id is out of range");
    FUZZ_ASSERT(freed_set.insert(pg).second, "a page freed twice");
  }
  // Exactly the pages that held tokens before (a row's first ceil((start + L) / page_size) pages, the
  // longest head's under a per-sequence table) and hold none now (no row keeps a token in them).
  std::set<std::int32_t> want_freed;
  for (std::int64_t row = 0; row < R; ++row) {
    std::int64_t used = 0;
    for (std::int64_t h = 0; h < H; ++h)
      if (!per_head || h == row % H) used = std::max(used, t.pages_for(row, head_len(per_head ? row / H : row, h), ps));
    for (std::int64_t i = 0; i < used; ++i) {
      const std::int32_t pg = indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(row)] + i)];
      if (!kept_pages.count(pg)) want_freed.insert(pg);
    }
  }
  FUZZ_ASSERT(freed_set == want_freed, "the freed pages are not exactly the pages left without tokens");
  if (verbose())
    std::printf("ok: B %lld H %lld ps %lld %s%s, %zu kept rows, %lld pages freed\n", static_cast<long long>(B), static_cast<long long>(H),
                static_cast<long long>(ps), per_head ? "per-head" : "per-sequence", set_per_seq ? " (one set per sequence)" : "",
                static_cast<std::size_t>(sel.rows), static_cast<long long>(num_freed));
  return 0;
}
