// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over the evictor reading a paged cache, a token pool or a cell table in place
// (layer_inputs::pages: page sizes 1-64, NHD / HND / token-innermost pools, one table per
// sequence or per (sequence, KV head), pages that span every head or hold one, shuffled or
// descending page ids with unused pages between them, start offsets, lengths from last_page_len or
// from layer_inputs::lengths, protected prefixes), and over dense compaction (cpu::compact, into
// another buffer and in place) of the selections it returns. Every preset and storage type, with
// the values, parameters and budgets of fuzz_evictor (tests/fuzz/fuzz_case.hpp).
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * the paged view of the same tokens gives the contiguous view's result: the same error
//    category, or bit for bit the same indptr, indices, positions and scores over the valid slots
//    (unused pool slots hold NaN: never read, never scanned);
//  * a protected prefix is kept whole (every head of the sequence keeps its first prefix tokens);
//  * one table field made invalid (indptr, indices out of range or repeated, last_page_len,
//    start_offset, lengths, protected_prefix, max_pages_per_row) is refused by plan() and run()
//    with a message that names that field, and nothing is written;
//  * cpu::compact gathers exactly the selected rows (into a dense buffer in NHD or HND, and in
//    place), and refuses a selection that is not ascending, out of range or longer than the
//    destination with the destination untouched.
// Input format: run_view_case below (bytes front to back; zeros once the input ends): preset, type,
// flags, view, view options, corruption, its row, then the problem as in fuzz_evictor.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_case.hpp"
#include "reference/paged.hpp"

namespace kvevict_fuzz {
namespace {

/// The one-field corruptions of a valid page table, and the text the error must contain.
enum class corrupt { none, indptr_first, indptr_negative, indptr_too_many, index_out_of_range, index_repeated, last_page_len,
                     start_offset, lengths, prefix, max_pages, count };

const char* expected_text(corrupt c) {
  switch (c) {
    case corrupt::indptr_first: return "pages.indptr[0]";
    case corrupt::indptr_negative:
    case corrupt::indptr_too_many: return "indptr[";
    case corrupt::index_out_of_range:
    case corrupt::index_repeated: return "pages.indices[";
    case corrupt::last_page_len: return "pages.last_page_len[";
    case corrupt::start_offset: return "pages.start_offset[";
    case corrupt::lengths: return "lengths(";
    case corrupt::prefix: return "pages.protected_prefix[";
    case corrupt::max_pages: return "max_pages_per_row";
    default: return "";
  }
}

struct run_out {
  kvevict::status st;
  std::vector<std::int32_t> indptr, indices, positions;
  std::vector<float> scores;
  std::int64_t rows = 0, seq = 0;
};

/// run() with plan `pl` (planned: whether plan() accepted it) on an exactly sized workspace and
/// outputs filled with sentinels; on error checks that nothing was written (indptr, indices,
/// positions, scores).
template <class Ev, class T>
run_out run_with(const Ev& ev, const kvevict::eviction_plan& pl, bool planned, const kvevict::layer_inputs<T>& in, unsigned char fill,
                 run_out o) {
  o.rows = in.batch() * std::max<std::int64_t>(1, ev.out_heads(in));
  o.seq = std::max<std::int64_t>(1, in.capacity());
  const std::int64_t cap = planned ? pl.max_selected : 4;
  outputs buf;
  buf.allocate(o.rows, cap, o.seq, planned ? pl.workspace_bytes : 64, fill);
  const kvevict::status rs = ev.run(pl, in, buf.view(), buf.ws.get(), buf.ws_bytes, buf.scores.get());
  if (planned) o.st = rs;
  FUZZ_ASSERT(planned || !rs.ok(), "run() accepted a plan that plan() refused");
  if (!o.st.ok()) {
    for (std::int64_t i = 0; i <= o.rows; ++i) FUZZ_ASSERT(buf.indptr[static_cast<std::size_t>(i)] == -9, "indptr written on error");
    for (std::int64_t i = 0; i < std::max<std::int64_t>(cap, 1); ++i)
      FUZZ_ASSERT(buf.indices[static_cast<std::size_t>(i)] == -9 && buf.positions[static_cast<std::size_t>(i)] == -9,
                  "indices or positions written on error");
    for (std::int64_t i = 0; i < o.rows * o.seq; ++i) FUZZ_ASSERT(std::isnan(buf.scores[static_cast<std::size_t>(i)]), "scores written on error");
    return o;
  }
  o.indptr.assign(buf.indptr.get(), buf.indptr.get() + o.rows + 1);
  o.indices.assign(buf.indices.get(), buf.indices.get() + o.indptr.back());
  o.positions.assign(buf.positions.get(), buf.positions.get() + o.indptr.back());
  o.scores.assign(buf.scores.get(), buf.scores.get() + o.rows * o.seq);
  return o;
}

/// plan() then run_with(); the plan is returned in *plan (when plan() accepted the inputs).
template <class Ev, class T>
run_out run_exact(const Ev& ev, const kvevict::layer_inputs<T>& in, const kvevict::budget_request& budget, unsigned char fill,
                  kvevict::eviction_plan* plan = nullptr) {
  run_out o;
  kvevict::eviction_plan pl;
  o.st = ev.plan(in, budget, &pl);
  const bool planned = o.st.ok();
  if (plan) *plan = pl;
  return run_with(ev, pl, planned, in, fill, o);
}

/// Dense compaction of a valid selection: cpu::compact into a (batch, out_heads, kept_max,
/// head_dim) buffer in NHD or HND, and in place; a corrupted selection is refused, dst untouched.
template <class T>
void check_dense_compact(const problem<T>& pr, const run_out& a, reader& r) {
  const std::uint8_t m = r.u8();
  const auto& s = pr.sh;
  const std::int64_t rows = a.rows, out_heads = rows / s.B, G = out_heads / s.Hkv;
  std::int64_t kmax = 0;
  for (std::int64_t i = 0; i < rows; ++i) kmax = std::max<std::int64_t>(kmax, a.indptr[static_cast<std::size_t>(i + 1)] - a.indptr[static_cast<std::size_t>(i)]);
  if (kmax == 0) return;
  std::vector<std::int32_t> indptr = a.indptr, indices = a.indices;
  const int bad = (m >> 2) & 3;  // 0 valid, 1 not ascending, 2 out of range, 3 a row longer than dst
  if (bad == 1 || bad == 2) {
    // bad 1: swap two neighbours of one row (rows are strictly ascending); bad 2: one index out of range
    std::vector<char> row_start(indices.size() + 1, 0);
    for (std::int64_t x = 0; x <= rows; ++x) row_start[static_cast<std::size_t>(indptr[static_cast<std::size_t>(x)])] = 1;
    std::size_t at = indices.size();
    for (std::size_t i = 0; i < indices.size() && at == indices.size(); ++i)
      if (bad == 2 || !row_start[i]) at = i;
    if (at == indices.size()) return;
    if (bad == 1) std::swap(indices[at - 1], indices[at]);
    else indices[at] = (m & 16) ? -1 : static_cast<std::int32_t>(s.S);
  }
  const std::int64_t dst_seq = bad == 3 ? kmax - 1 : kmax + (m >> 6);
  const bool nhd = m & 1;
  std::vector<T> dbuf(static_cast<std::size_t>(s.B * out_heads * std::max<std::int64_t>(dst_seq, 1) * s.D), kvevict::from_float<T>(-7.0f));
  kvevict::kv_view<T> dst = kvevict::make_kv_view(dbuf.data(), s.B, out_heads, dst_seq, s.D, nhd ? kvevict::kv_layout::nhd : kvevict::kv_layout::hnd);
  const kvevict::const_selection_view sel(indptr.data(), indices.data(), rows);
  const std::vector<T> before = dbuf;
  const kvevict::status st = kvevict::cpu::compact<T>(pr.in.keys, sel, dst);
  if (bad != 0) {
    FUZZ_ASSERT(!st.ok(), "compact accepted a bad selection");
    FUZZ_ASSERT(std::strstr(st.message(), "compact") != nullptr, st.message());
    FUZZ_ASSERT(std::memcmp(before.data(), dbuf.data(), dbuf.size() * sizeof(T)) == 0, "compact wrote dst on error");
    return;
  }
  const bool broadcast = pr.in.keys.stride[1] == 0;
  FUZZ_ASSERT(st.ok(), st.message());
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < out_heads; ++h) {
      const std::int64_t row = b * out_heads + h;
      for (std::int32_t i = 0; i < indptr[static_cast<std::size_t>(row + 1)] - indptr[static_cast<std::size_t>(row)]; ++i)
        for (std::int64_t d = 0; d < s.D; ++d) {
          const T x = dst(b, h, i, d), y = pr.in.keys(b, h / G, indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(row)] + i)], d);
          FUZZ_ASSERT(std::memcmp(&x, &y, sizeof(T)) == 0, "compact gathered the wrong row");
        }
    }
  // In place over a copy of the keys (same strides; one row per KV head).
  if (G != 1 || broadcast || (m & 2) == 0) return;
  std::vector<T> kcopy(pr.k.data.begin(), pr.k.data.end());
  kvevict::kv_view<T> self;
  self.data = kcopy.data() + (pr.in.keys.data - pr.k.data.data());
  for (int k = 0; k < 4; ++k) self.extent[k] = pr.in.keys.extent[k], self.stride[k] = pr.in.keys.stride[k];
  kvevict::kv_view<const T> self_src;
  self_src.data = self.data;
  for (int k = 0; k < 4; ++k) self_src.extent[k] = self.extent[k], self_src.stride[k] = self.stride[k];
  const kvevict::status ip = kvevict::cpu::compact<T>(self_src, sel, self);
  FUZZ_ASSERT(ip.ok(), ip.message());
  for (std::int64_t row = 0; row < rows; ++row)
    for (std::int32_t i = 0; i < indptr[static_cast<std::size_t>(row + 1)] - indptr[static_cast<std::size_t>(row)]; ++i)
      for (std::int64_t d = 0; d < s.D; ++d) {
        const T x = self(row / s.Hkv, row % s.Hkv, i, d);
        const T y = pr.in.keys(row / s.Hkv, row % s.Hkv, indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(row)] + i)], d);
        FUZZ_ASSERT(std::memcmp(&x, &y, sizeof(T)) == 0, "in-place compact moved the wrong row");
      }
}

template <class P, class T>
void run_view_case(reader& r) {
  using ev_t = kvevict::evictor<P, kvevict::cpu::backend>;
  // The problem (a subset of fuzz_evictor's case: no broadcast strides, no W_O views).
  // The view and the corruption first: a short input still reaches every kind of table.
  const std::uint8_t flags = r.u8(), pm = r.u8(), pm2 = r.u8(), cm = r.u8(), row_byte = r.u8();
  shape s;
  s.layout = (flags & 1) ? kvevict::kv_layout::nhd : kvevict::kv_layout::hnd;
  s.with_queries = traits<P>::needs_queries || (flags & 2);
  const bool ragged = flags & 4;
  const bool check_finite = (flags & 8) == 0;
  const bool with_positions = (flags & 16) != 0;
  s.B = r.range(1, 3);
  s.Hkv = r.range(1, 3);
  s.G = r.range(1, 3);
  s.S = r.range(1, 40);
  s.W = r.range(1, s.S);
  s.D = r.range(1, 9);
  s.pad = r.range(0, 2);
  if (ragged)
    for (std::int64_t i = 0; i < s.B * s.Hkv; ++i) s.lengths.push_back(static_cast<std::int32_t>(r.u8() % (s.S + 1)));
  kvevict::budget_request budget;
  const std::uint8_t bm = r.u8();
  if (bm & 1) budget.keep_tokens = static_cast<std::int32_t>(r.range(0, 48));
  else budget.keep_fraction = static_cast<double>(r.u8()) / 255.0;
  auto params = P::defaults();
  if (r.u8() & 1) mutate_params<P>(params, r);
  params.check_finite = check_finite;
  const int num_layers = static_cast<int>(r.range(1, 8));
  const int layer_idx = static_cast<int>(r.range(0, num_layers - 1));
  const std::uint32_t seed = r.u32();
  const float poison = special(r.u8());
  const std::uint8_t rate = r.u8() & 7;
  problem<T> pr;
  pr.init(s, seed, 1.0f, poison);
  inject(pr.k, r, rate, seed + 1);
  inject(pr.v, r, rate, seed + 2);
  if (with_positions) {
    pr.pos.assign(static_cast<std::size_t>(s.B * s.Hkv * s.S), 0);
    kvtest::rng g(seed + 4);
    for (auto& x : pr.pos) x = static_cast<std::int32_t>(g.next());
  }
  pr.rebuild_views();
  pr.in.num_layers = num_layers;
  pr.in.layer_idx = layer_idx;
  lkv_case tables;
  tables.apply<P>(params, r, s.Hkv, s.D, num_layers, s.S, seed);

  // The paged copy.
  const std::int64_t page_sizes[] = {1, 1, 2, 3, 4, 8, 16, 64};
  const std::int64_t ps = page_sizes[pm & 7];
  const auto pool = static_cast<kvtest::pool_layout>(((pm >> 3) & 3) % 3);
  const bool per_head = pm & 32, one_head_pages = per_head && (pm & 64), with_last = !(pm & 128);
  const int with_start = pm2 % 3;
  const bool reversed = pm2 & 4;
  const std::int64_t spare = 1 + ((pm2 >> 3) & 3);  // unused pages (>= 1: a pool of no page has a null data pointer)
  const bool with_prefix = pm2 & 32;
  kvtest::paged_copy<T> pg;
  kvtest::make_paged(pr.in, ps, pool, per_head, one_head_pages, seed, pg, with_last, spare, reversed, with_start);
  if (!per_head && with_start == 0) {  // the same table through the public constructor (FlashInfer's paged_kv_t)
    const kvevict::page_table_view t = kvevict::make_page_table(pg.indptr.data(), pg.indices.data(), pg.in.pages.last_page_len, s.B,
                                                                pg.in.pages.max_pages_per_row);
    pg.in.pages = t;
  }
  const std::int64_t R = per_head ? s.B * s.Hkv : s.B;
  // Slack behind the table's indices (a corrupted indptr may point past indptr[rows]).
  const std::size_t used = pg.indices.size();
  pg.indices.resize(used + static_cast<std::size_t>(pg.in.pages.max_pages_per_row + 2), 0);
  pg.in.pages.indices = pg.indices.data();
  std::vector<std::int32_t> ppos, prefix, starts_extra;
  if (with_positions) {  // positions (batch, kv_heads, capacity): the source's, garbage behind them
    const std::int64_t C = pg.in.capacity();
    ppos.assign(static_cast<std::size_t>(s.B * s.Hkv * C), -123456);
    for (std::int64_t bh = 0; bh < s.B * s.Hkv; ++bh)
      for (std::int64_t t = 0; t < s.S && t < C; ++t) ppos[static_cast<std::size_t>(bh * C + t)] = pr.pos[static_cast<std::size_t>(bh * s.S + t)];
    pg.in.positions = kvevict::make_positions_view(ppos.data(), s.B, s.Hkv, C);
  }
  if (with_prefix) {
    prefix.assign(static_cast<std::size_t>(s.B), 0);
    for (std::int64_t b = 0; b < s.B; ++b) {
      std::int64_t mn = s.S;
      for (std::int64_t h = 0; h < s.Hkv; ++h) mn = std::min(mn, pr.length(b, h));
      prefix[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(r.u8() % (mn + 1));
    }
    pg.in.pages.protected_prefix = prefix.data();
  }

  const ev_t ev(params, kvevict::cpu::backend{static_cast<int>(flags >> 6)});
  const unsigned char fill = r.u8();
  kvevict::eviction_plan plan0;
  const run_out b0 = run_exact(ev, pg.in, budget, fill, &plan0);  // the valid table

  // One corruption, or none.
  corrupt c = static_cast<corrupt>(cm % static_cast<int>(corrupt::count));
  const std::int64_t row = static_cast<std::int64_t>(row_byte) % R;
  const bool hi = cm & 128;
  auto row_pages = [&](std::int64_t x) { return static_cast<std::int64_t>(pg.indptr[static_cast<std::size_t>(x + 1)]) - pg.indptr[static_cast<std::size_t>(x)]; };
  switch (c) {
    case corrupt::indptr_first: pg.indptr[0] = hi ? 1 : -1; break;
    case corrupt::indptr_negative:
      if (row_pages(row) == 0) c = corrupt::none;
      else pg.indptr[static_cast<std::size_t>(row + 1)] = pg.indptr[static_cast<std::size_t>(row)] - 1;
      break;
    case corrupt::indptr_too_many:
      if (row + 1 != R) c = corrupt::none;  // the last row: the other rows' offsets stay as they were
      else pg.indptr[static_cast<std::size_t>(row + 1)] = static_cast<std::int32_t>(pg.indptr[static_cast<std::size_t>(row)] + pg.in.pages.max_pages_per_row + 1);
      break;
    case corrupt::index_out_of_range:
      if (used == 0) c = corrupt::none;
      else pg.indices[cm % used] = hi ? static_cast<std::int32_t>(pg.num_pages) : -1;
      break;
    case corrupt::index_repeated:
      // two pages of one row, or of two rows of a per-sequence table (not prefix-shareable: no prefix)
      if (used < 2 || with_prefix || (per_head && !one_head_pages)) c = corrupt::none;
      else pg.indices[1 + cm % (used - 1)] = pg.indices[0];
      break;
    case corrupt::last_page_len:
      if (!pg.in.pages.last_page_len || row_pages(row) == 0) c = corrupt::none;
      else pg.last_page_len[static_cast<std::size_t>(row)] = hi ? static_cast<std::int32_t>(ps + 1) : 0;
      break;
    case corrupt::start_offset:
      if (!pg.in.pages.start_offset) {
        starts_extra.assign(static_cast<std::size_t>(R), 0);
        pg.in.pages.start_offset = starts_extra.data();
      }
      const_cast<std::int32_t*>(pg.in.pages.start_offset)[row] = hi ? static_cast<std::int32_t>(ps) : -1;
      break;
    case corrupt::lengths:
      if (!pg.in.lengths.data) c = corrupt::none;
      else pg.lens[static_cast<std::size_t>(cm % pg.lens.size())] = hi ? static_cast<std::int32_t>(pg.in.capacity() + 1) : -1;
      break;
    case corrupt::prefix:
      if (!with_prefix) c = corrupt::none;
      else prefix[static_cast<std::size_t>(row % s.B)] = hi ? static_cast<std::int32_t>(s.S + 1) : -1;
      break;
    case corrupt::max_pages: {
      std::int64_t need = 0;
      for (std::int64_t x = 0; x < R; ++x) need = std::max(need, row_pages(x));
      if (need == 0) c = corrupt::none;
      else {
        pg.in.pages.max_pages_per_row = need - 1;
        if (pg.in.positions.data) pg.in.positions.extent[2] = pg.in.capacity();
      }
      break;
    }
    default: c = corrupt::none;
  }

  const run_out b = c == corrupt::none ? b0 : run_exact(ev, pg.in, budget, fill);
  if (verbose())
    std::fprintf(stderr, "[%s %s] page_size %lld per_head %d corrupt %d prefix %d: %s\n", preset_name<P>().c_str(), type_name<T>().c_str(),
                 static_cast<long long>(ps), per_head ? 1 : 0, static_cast<int>(c), with_prefix ? 1 : 0, b.st.ok() ? "ok" : b.st.message());
  if (c != corrupt::none) {
    // The error names the corrupted field, unless the valid table is refused for the same reason
    // (a check that comes before the table's contents: parameters, budget, layer index).
    FUZZ_ASSERT(!b.st.ok(), expected_text(c));
    const std::string msg = b.st.message();
    FUZZ_ASSERT(msg.find(expected_text(c)) != std::string::npos || (!b0.st.ok() && msg == b0.st.message()), msg.c_str());
    // run() checks the table itself: the valid table's plan, reused with the corrupted table (an
    // engine that plans once per shape), is refused naming the field, nothing written.
    if (b0.st.ok()) {
      run_out r0;
      r0.st = kvevict::status{};
      const run_out rb = run_with(ev, plan0, true, pg.in, fill, r0);
      FUZZ_ASSERT(!rb.st.ok(), "run() with a reused plan accepted a corrupted table");
      if (verbose() && std::strstr(rb.st.message(), expected_text(c)) == nullptr) std::fprintf(stderr, "reused plan, corrupt %d: %s\n", static_cast<int>(c), rb.st.message());
      // (a corrupted max_pages_per_row changes the capacity, and a start_offset array where the
      // table had none is a view the plan did not see: the plan's signature refuses both first)
      const bool new_shape = c == corrupt::max_pages || (c == corrupt::start_offset && !starts_extra.empty());
      FUZZ_ASSERT(std::strstr(rb.st.message(), expected_text(c)) != nullptr ||
                      (new_shape && std::strstr(rb.st.message(), "do not match the plan") != nullptr),
                  rb.st.message());
    }
    return;
  }
  const run_out a = run_exact(ev, pr.in, budget, fill);
  if (!a.st.ok()) {
    // The same category (the paged table adds no error of its own: it is valid).
    FUZZ_ASSERT(!b.st.ok() || with_prefix, a.st.message());
    // (unless the table's capacity, its longest row, is below the window: refused first)
    const bool window_refused = s.W > pg.in.capacity() && std::strstr(b.st.message(), "window =") != nullptr;
    if (!b.st.ok() && !with_prefix && !window_refused) FUZZ_ASSERT(a.st.code() == b.st.code(), (std::string(a.st.message()) + " | " + b.st.message()).c_str());
    return;
  }
  if (with_prefix) {
    if (!b.st.ok()) {  // the contiguous view was accepted: only the table's capacity below the window may refuse
      FUZZ_ASSERT(s.W > pg.in.capacity() && std::strstr(b.st.message(), "window =") != nullptr, b.st.message());
      return;
    }
    const std::int64_t out_heads = b.rows / s.B;
    for (std::int64_t x = 0; x < b.rows; ++x) {
      const std::int64_t bb = x / out_heads, h = (x % out_heads) * s.Hkv / out_heads, P0 = prefix[static_cast<std::size_t>(bb)];
      const std::int32_t lo = b.indptr[static_cast<std::size_t>(x)], e = b.indptr[static_cast<std::size_t>(x + 1)];
      FUZZ_ASSERT(e - lo >= std::min<std::int64_t>(P0, pr.length(bb, h)), "a protected prefix was evicted");
      for (std::int64_t t = 0; t < P0 && t < pr.length(bb, h); ++t) FUZZ_ASSERT(b.indices[static_cast<std::size_t>(lo + t)] == t, "a protected prefix token was evicted");
    }
    return;
  }
  if (!b.st.ok() && s.W > pg.in.capacity()) {  // the table's capacity (its longest row) is below the window
    FUZZ_ASSERT(std::strstr(b.st.message(), "window =") != nullptr, b.st.message());
    return;
  }
  FUZZ_ASSERT(b.st.ok(), b.st.message());
  FUZZ_ASSERT(a.indptr == b.indptr, "paged indptr differs from the contiguous view's");
  FUZZ_ASSERT(a.indices == b.indices, "paged indices differ from the contiguous view's");
  FUZZ_ASSERT(a.positions == b.positions, "paged positions differ from the contiguous view's");
  const std::int64_t out_heads = a.rows / s.B;
  for (std::int64_t x = 0; x < a.rows; ++x) {
    const std::int64_t L = pr.length(x / out_heads, (x % out_heads) * s.Hkv / out_heads);
    FUZZ_ASSERT(std::memcmp(a.scores.data() + x * a.seq, b.scores.data() + x * b.seq, static_cast<std::size_t>(L) * sizeof(float)) == 0,
                "paged scores differ from the contiguous view's");
  }
  check_dense_compact(pr, a, r);
}

template <class P>
void dispatch_view_type(reader& r) {
  visit_storage_type(r.u8() % 3, [&](auto t) { run_view_case<P, typename decltype(t)::type>(r); });
}

}  // namespace
}  // namespace kvevict_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvevict_fuzz::reader r{data, size};
  using namespace kvevict::presets;
  using kvevict_fuzz::dispatch_view_type;
  switch (r.u8() % 15) {  // fuzz_evictor's numbering (fuzz_case.hpp)
    case 0: dispatch_view_type<restkv>(r); break;
    case 1: dispatch_view_type<snapkv>(r); break;
    case 2: dispatch_view_type<pyramidkv>(r); break;
    case 3: dispatch_view_type<adakv>(r); break;
    case 4: dispatch_view_type<h2o>(r); break;
    case 5: dispatch_view_type<tova>(r); break;
    case 6: dispatch_view_type<streaming_llm>(r); break;
    case 7: dispatch_view_type<key_norm>(r); break;
    case 8: dispatch_view_type<criticalkv>(r); break;
    case 9: dispatch_view_type<critical_adakv>(r); break;
    case 10: dispatch_view_type<adakv_published>(r); break;
    case 11: dispatch_view_type<lkv>(r); break;
    case 12: dispatch_view_type<lkv_uniform_budgets>(r); break;
    case 13: dispatch_view_type<lkv_budgets_restkv>(r); break;
    default: dispatch_view_type<lkv_budgets_attention>(r); break;
  }
  return 0;
}
