// Compaction of paged caches (cpu::compact_paged, cpu::union_selections): the compacted paged
// cache equals the compacted contiguous cache (cpu::compact) token for token, in the three modes
// (a: per-sequence tables with uniform budgets, b: per-(sequence, KV head) tables with head-wise
// budgets, c: one token set per sequence for every head and layer); shuffled and descending page
// ids (pages written before they are read); the freed pages are exactly the table's tail pages;
// bad input leaves the cache untouched.
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/presets.hpp>

#include "reference/harness.hpp"
#include "reference/lkv_tables.hpp"
#include "reference/paged.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace kv = kvevict;

namespace {

struct compacted {
  std::vector<std::int32_t> pages_kept, last_page_len, lengths, freed;
  std::int64_t num_freed = -1;
  kv::status st;
};

template <class T>
compacted compact_pool(kvtest::paged_copy<T>& pg, kv::const_selection_view sel) {
  kv::cpu::paged_cache<T> c;
  c.keys = kv::kv_view<T>{pg.kpool.data(), {}, {}};
  for (int k = 0; k < 4; ++k) c.keys.extent[k] = pg.in.keys.extent[k], c.keys.stride[k] = pg.in.keys.stride[k];
  c.values = c.keys;
  c.values.data = pg.vpool.data();
  c.pages = pg.in.pages;
  c.lengths = pg.in.lengths;
  const std::int64_t R = c.pages.rows(c.keys.extent[1]);
  compacted r;
  r.pages_kept.assign(static_cast<std::size_t>(R), -7);
  r.last_page_len.assign(static_cast<std::size_t>(R), -7);
  r.lengths.assign(static_cast<std::size_t>(pg.in.batch() * pg.in.kv_heads()), -7);
  r.freed.assign(pg.indices.size() + 1, -7);
  std::vector<unsigned char> ws(kv::cpu::compact_paged_workspace_size(c) + 1);
  kv::cpu::paged_compaction_result out{r.pages_kept.data(), r.last_page_len.data(), r.lengths.data(), r.freed.data(),
                                       static_cast<std::int64_t>(r.freed.size()), &r.num_freed};
  r.st = kv::cpu::compact_paged(c, sel, out, ws.data(), ws.size());
  return r;
}

/// Token (b, h, i) of the compacted paged cache equals token i of row (b, h) of the compacted
/// contiguous cache, for i < the kept count, bit for bit (K and V); the freed pages are the table's
/// pages past pages_kept among those that held tokens, and nothing else.
template <class T>
void check_same_cache(const kvtest::paged_copy<T>& pg, const compacted& r, const std::vector<T>& kc, const std::vector<T>& vc,
                      std::int64_t B, std::int64_t H, std::int64_t cap, std::int64_t d, const std::vector<std::int32_t>& kept,
                      const std::vector<std::int64_t>& used_pages) {
  REQUIRE(r.st.ok());
  const auto& t = pg.in.pages;
  const std::int64_t ps = pg.page_size;
  bool same = true;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = t.per_head ? b * H + h : b, st = t.start(row);  // slot i at table position st + i
      const std::int64_t n = kept[static_cast<std::size_t>(b * H + h)];
      CHECK(r.lengths[static_cast<std::size_t>(b * H + h)] == n);
      const auto& kv = pg.in.keys;
      for (std::int64_t m = 0; m < st && n > 0; ++m) {  // the first page's slots before the offset: never written (NaN)
        const std::int64_t page = pg.indices[static_cast<std::size_t>(pg.indptr[static_cast<std::size_t>(row)])];
        const std::int64_t o = page * kv.stride[0] + h * kv.stride[1] + m * kv.stride[2];
        same = same && std::isnan(kvevict::to_float(pg.kpool[static_cast<std::size_t>(o)])) && std::isnan(kvevict::to_float(pg.vpool[static_cast<std::size_t>(o)]));
      }
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t page = pg.indices[static_cast<std::size_t>(pg.indptr[static_cast<std::size_t>(row)] + (st + i) / ps)];
        for (std::int64_t c = 0; c < d; ++c) {
          const std::int64_t o = page * kv.stride[0] + h * kv.stride[1] + ((st + i) % ps) * kv.stride[2] + c * kv.stride[3];
          const std::size_t oc = static_cast<std::size_t>(((b * H + h) * cap + i) * d + c);
          same = same && std::memcmp(&pg.kpool[static_cast<std::size_t>(o)], &kc[oc], sizeof(T)) == 0;
          same = same && std::memcmp(&pg.vpool[static_cast<std::size_t>(o)], &vc[oc], sizeof(T)) == 0;
        }
      }
    }
  CHECK(same);
  std::vector<std::int32_t> expect_freed;
  for (std::int64_t row = 0; row < t.rows(H); ++row) {
    std::int64_t n = 0;
    if (t.per_head) {
      n = kept[static_cast<std::size_t>(row)];
    } else {
      for (std::int64_t h = 0; h < H; ++h) n = std::max<std::int64_t>(n, kept[static_cast<std::size_t>(row * H + h)]);
    }
    const std::int64_t st = t.start(row), np = n == 0 ? 0 : (st + n + ps - 1) / ps;
    CHECK(r.pages_kept[static_cast<std::size_t>(row)] == np);
    CHECK(r.last_page_len[static_cast<std::size_t>(row)] == (n == 0 ? 0 : st + n - (np - 1) * ps));
    for (std::int64_t i = np; i < used_pages[static_cast<std::size_t>(row)]; ++i)
      expect_freed.push_back(pg.indices[static_cast<std::size_t>(pg.indptr[static_cast<std::size_t>(row)] + i)]);
  }
  REQUIRE(r.num_freed == static_cast<std::int64_t>(expect_freed.size()));
  CHECK(std::vector<std::int32_t>(r.freed.begin(), r.freed.begin() + r.num_freed) == expect_freed);
}

template <class T>
struct fixture {
  kvtest::problem p;
  kvtest::stored<T> st;
  std::int64_t B, H, cap, d;
  fixture(std::vector<std::int32_t> lens, std::uint64_t seed, std::int64_t group = 2) {
    kvtest::shape sh;
    sh.batch = 2, sh.kv_heads = 2, sh.group = group, sh.cap = 150, sh.d = 16, sh.window = 8, sh.hidden = 32;
    p = kvtest::make_problem(sh, seed, 1.0, 1.5, 1.0, lens);
    kvtest::quantize<T>(p);
    kvtest::quantize_wo<T>(p);
    kvtest::store(p, kvtest::layout::hnd, st);
    B = sh.batch, H = sh.kv_heads, cap = sh.cap, d = sh.d;
  }
  /// The contiguous cache compacted with cpu::compact into a dense HND copy.
  void contiguous_compacted(const std::vector<std::int32_t>& indptr, const std::vector<std::int32_t>& idx, std::vector<T>& kc,
                            std::vector<T>& vc) const {
    kc.assign(static_cast<std::size_t>(B * H * cap * d), kv::from_float<T>(0.0f));
    vc = kc;
    const kv::const_selection_view sel(indptr.data(), idx.data(), B * H);
    REQUIRE(kv::cpu::compact(st.in.keys, sel, kv::make_kv_view(kc.data(), B, H, cap, d, kv::kv_layout::hnd)).ok());
    REQUIRE(kv::cpu::compact(st.in.values, sel, kv::make_kv_view(vc.data(), B, H, cap, d, kv::kv_layout::hnd)).ok());
  }
  std::vector<std::int64_t> used_pages(const kvtest::paged_copy<T>& pg) const {
    std::vector<std::int64_t> u;
    for (std::int64_t r = 0; r < pg.in.pages.rows(H); ++r) {
      std::int64_t L = 0;
      if (pg.in.pages.per_head) {
        L = st.in.length(r / H, r % H);
      } else {
        for (std::int64_t h = 0; h < H; ++h) L = std::max(L, st.in.length(r, h));
      }
      u.push_back(L == 0 ? 0 : (pg.in.pages.start(r) + L + pg.page_size - 1) / pg.page_size);
    }
    return u;
  }
};

template <class Policy, class T>
void check_mode_ab(const char* name, const fixture<T>& f, typename Policy::params params, kv::budget_request budget, std::int64_t ps,
                   kvtest::pool_layout pool, bool per_head, bool one_head_pages, bool reversed, std::uint64_t seed, bool start = false) {
  INFO(std::string(name) << " page_size " << ps << " pool " << std::string(kvtest::to_string(pool)) << " per_head " << per_head
                         << " one_head_pages " << one_head_pages << " reversed " << reversed << " start_offset " << start);
  kvtest::paged_copy<T> pg;
  kvtest::make_paged(f.st.in, ps, pool, per_head, one_head_pages, seed, pg, true, 3, reversed, start);
  kv::evictor<Policy, kv::cpu::backend> ev(params);
  const auto a = kvtest::run_lib(ev, f.st.in, budget);
  const auto b = kvtest::run_lib(ev, pg.in, budget);
  REQUIRE(a.st.ok());
  REQUIRE(b.st.ok());
  REQUIRE(a.indices == b.indices);
  std::vector<T> kc, vc;
  f.contiguous_compacted(a.indptr, a.indices, kc, vc);
  const auto used = f.used_pages(pg);
  const compacted r = compact_pool(pg, kv::const_selection_view(b.indptr.data(), b.indices.data(), f.B * f.H));
  INFO(std::string(r.st.message()));
  std::vector<std::int32_t> kept;
  for (std::int64_t i = 0; i < f.B * f.H; ++i) kept.push_back(a.indptr[static_cast<std::size_t>(i + 1)] - a.indptr[static_cast<std::size_t>(i)]);
  check_same_cache(pg, r, kc, vc, f.B, f.H, f.cap, f.d, kept, used);
}

/// Mode c: the union of SnapKV's and AdaKV's selections of pg (two "layers") equals a brute-force
/// set union, and compacting pg with it equals cpu::compact of the contiguous cache with the same
/// set for every head.
void check_mode_c(const fixture<float>& f, kvtest::paged_copy<float>& pg) {
  // two "layers": SnapKV and AdaKV selections of the same cache
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> e0;
  kv::evictor<kv::presets::adakv, kv::cpu::backend> e1;
  const auto s0 = kvtest::run_lib(e0, pg.in, kv::budget_request::fraction(0.2));
  const auto s1 = kvtest::run_lib(e1, pg.in, kv::budget_request::fraction(0.2));
  REQUIRE(s0.st.ok());
  REQUIRE(s1.st.ok());
  const kv::const_selection_view in_sels[2] = {{s0.indptr.data(), s0.indices.data(), f.B * f.H},
                                               {s1.indptr.data(), s1.indices.data(), f.B * f.H}};
  std::vector<std::int32_t> uptr(static_cast<std::size_t>(f.B + 1)), uidx(s0.indices.size() + s1.indices.size());
  kv::selection_view u{uptr.data(), uidx.data(), nullptr, static_cast<std::int64_t>(uidx.size())};
  REQUIRE(kv::cpu::union_selections(in_sels, 2, f.H, u).ok());
  // the union by brute force
  for (std::int64_t b = 0; b < f.B; ++b) {
    std::set<std::int32_t> want;
    for (const auto* s : {&s0, &s1})
      for (std::int64_t h = 0; h < f.H; ++h)
        for (auto x : s->kept(b * f.H + h)) want.insert(x);
    CHECK(std::vector<std::int32_t>(uidx.begin() + uptr[static_cast<std::size_t>(b)], uidx.begin() + uptr[static_cast<std::size_t>(b + 1)]) ==
          std::vector<std::int32_t>(want.begin(), want.end()));
  }
  // the contiguous reference: the same set for every head
  std::vector<std::int32_t> rptr(1, 0), ridx, kept;
  for (std::int64_t b = 0; b < f.B; ++b)
    for (std::int64_t h = 0; h < f.H; ++h) {
      ridx.insert(ridx.end(), uidx.begin() + uptr[static_cast<std::size_t>(b)], uidx.begin() + uptr[static_cast<std::size_t>(b + 1)]);
      rptr.push_back(static_cast<std::int32_t>(ridx.size()));
      kept.push_back(uptr[static_cast<std::size_t>(b + 1)] - uptr[static_cast<std::size_t>(b)]);
    }
  std::vector<float> kc, vc;
  f.contiguous_compacted(rptr, ridx, kc, vc);
  const compacted r = compact_pool(pg, kv::const_selection_view(uptr.data(), uidx.data(), f.B));
  INFO(std::string(r.st.message()));
  check_same_cache(pg, r, kc, vc, f.B, f.H, f.cap, f.d, kept, f.used_pages(pg));
}

}  // namespace

TEST_CASE("compact_paged mode a: per-sequence tables, uniform budgets: the paged cache compacts to the contiguous one") {
  std::uint64_t seed = 1;
  const fixture<float> f({150, 150, 97, 97}, 11);
  for (std::int64_t ps : {1, 16, 64})
    for (auto pool : {kvtest::pool_layout::nhd, kvtest::pool_layout::hnd, kvtest::pool_layout::token_innermost})
      for (bool rev : {false, true}) {
        check_mode_ab<kv::presets::snapkv>("snapkv", f, kv::presets::snapkv::defaults(), kv::budget_request::tokens(40), ps, pool, false,
                                           false, rev, seed++);
        auto rp = kv::presets::restkv::defaults();
        rp.gqa = kv::gqa_reduction::layer_mean;
        check_mode_ab<kv::presets::restkv>("restkv layer_mean", f, rp, kv::budget_request::fraction(0.3), ps, pool, false, false, rev,
                                           seed++);
      }
  const fixture<kv::half_t> fh({150, 150, 97, 97}, 12);
  check_mode_ab<kv::presets::h2o>("h2o", fh, kv::presets::h2o::defaults(), kv::budget_request::tokens(33), 16, kvtest::pool_layout::nhd,
                                  false, false, true, seed++);
  check_mode_ab<kv::presets::streaming_llm>("streaming_llm", fh, kv::presets::streaming_llm::defaults(), kv::budget_request::tokens(20),
                                            1, kvtest::pool_layout::token_innermost, false, false, false, seed++);
  const fixture<kv::bfloat16_t> fb({150, 150, 97, 97}, 13);
  check_mode_ab<kv::presets::tova>("tova", fb, kv::presets::tova::defaults(), kv::budget_request::tokens(64), 64, kvtest::pool_layout::hnd,
                                   false, false, true, seed++);
}

TEST_CASE("compact_paged mode b: per-(sequence, KV head) tables, head-wise budgets free pages per head") {
  std::uint64_t seed = 100;
  const std::vector<std::int32_t> ragged = {150, 97, 33, 150};
  const fixture<float> f(ragged, 21);
  const kvtest::lkv_tables tabs(2, 16, 4, 7);
  for (std::int64_t ps : {1, 16, 64})
    for (bool one_head_pages : {true, false})
      for (bool rev : {false, true}) {
        const auto pool = one_head_pages ? kvtest::pool_layout::nhd : kvtest::pool_layout::hnd;
        check_mode_ab<kv::presets::adakv>("adakv", f, kv::presets::adakv::defaults(), kv::budget_request::fraction(0.2), ps, pool, true,
                                          one_head_pages, rev, seed++);
        check_mode_ab<kv::presets::pyramidkv>("pyramidkv", f, kv::presets::pyramidkv::defaults(), kv::budget_request::fraction(0.3), ps,
                                              pool, true, one_head_pages, rev, seed++);
        auto lp = kv::presets::lkv::defaults();
        tabs.apply(lp, 2, 16, 4);
        check_mode_ab<kv::presets::lkv>("lkv", f, lp, kv::budget_request::fraction(0.25), ps, pool, true, one_head_pages, rev, seed++);
      }
  const fixture<kv::bfloat16_t> fb(ragged, 22);
  check_mode_ab<kv::presets::critical_adakv>("critical_adakv", fb, kv::presets::critical_adakv::defaults(),
                                             kv::budget_request::fraction(0.2), 16, kvtest::pool_layout::token_innermost, true, true, true,
                                             seed++);
}

TEST_CASE("compact_paged mode c: one token set per sequence for every head and layer (union_selections)") {
  const fixture<float> f({150, 150, 97, 97}, 31);
  for (std::int64_t ps : {1, 16, 64})
    for (bool rev : {false, true}) {
      INFO("page_size " << ps << " reversed " << rev);
      kvtest::paged_copy<float> pg;
      kvtest::make_paged(f.st.in, ps, kvtest::pool_layout::nhd, false, false, 5 + static_cast<std::uint64_t>(ps), pg, true, 2, rev);
      check_mode_c(f, pg);
    }
}

TEST_CASE("compact_paged with rows that start inside their first page (pages.start_offset): modes a, b and c keep the offset") {
  std::uint64_t seed = 300;
  const fixture<float> f({150, 150, 97, 97}, 51);
  const fixture<float> fr({150, 97, 33, 150}, 52);
  const fixture<kv::bfloat16_t> fb({150, 97, 33, 150}, 53);
  for (std::int64_t ps : {16, 64})
    for (bool rev : {false, true}) {
      // mode a: per-sequence tables, uniform budgets
      check_mode_ab<kv::presets::snapkv>("snapkv", f, kv::presets::snapkv::defaults(), kv::budget_request::tokens(40), ps,
                                         kvtest::pool_layout::nhd, false, false, rev, seed++, true);
      check_mode_ab<kv::presets::streaming_llm>("streaming_llm", f, kv::presets::streaming_llm::defaults(), kv::budget_request::tokens(20),
                                                ps, kvtest::pool_layout::token_innermost, false, false, rev, seed++, true);
      // mode b: per-(sequence, KV head) tables, head-wise budgets, each row its own offset
      check_mode_ab<kv::presets::adakv>("adakv", fr, kv::presets::adakv::defaults(), kv::budget_request::fraction(0.2), ps,
                                        kvtest::pool_layout::nhd, true, true, rev, seed++, true);
      check_mode_ab<kv::presets::pyramidkv>("pyramidkv", fb, kv::presets::pyramidkv::defaults(), kv::budget_request::fraction(0.3), ps,
                                            kvtest::pool_layout::hnd, true, false, rev, seed++, true);
    }
  // mode c: one set per sequence (the union of SnapKV's and AdaKV's heads) on a table with offsets
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(f.st.in, 16, kvtest::pool_layout::hnd, false, false, 77, pg, true, 2, false, true);
  check_mode_c(f, pg);
}

TEST_CASE("compact_paged and union_selections: bad input is a named error and leaves the cache untouched") {
  const fixture<float> f({150, 150, 97, 97}, 41);
  const fixture<float> fr({150, 97, 33, 150}, 42);
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(fr.st.in, 16, kvtest::pool_layout::nhd, false, false, 3, pg, false);
  kv::evictor<kv::presets::adakv, kv::cpu::backend> ev;
  const auto s = kvtest::run_lib(ev, pg.in, kv::budget_request::fraction(0.2));
  REQUIRE(s.st.ok());
  const auto k0 = pg.kpool, v0 = pg.vpool;
  auto expect = [&](kv::const_selection_view sel, kv::errc code, const std::string& frag) {
    const compacted r = compact_pool(pg, sel);
    INFO(std::string(r.st.message()));
    CHECK(r.st.code() == code);
    CHECK(std::string(r.st.message()).find(frag) != std::string::npos);
    CHECK(std::memcmp(pg.kpool.data(), k0.data(), k0.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(pg.vpool.data(), v0.data(), v0.size() * sizeof(float)) == 0);
    CHECK(r.num_freed == -1);
    CHECK(r.pages_kept[0] == -7);
  };
  // head-wise budgets under a per-sequence table: unequal counts
  expect(kv::const_selection_view(s.indptr.data(), s.indices.data(), fr.B * fr.H), kv::errc::invalid_argument,
         "sequence 0 keeps 14 tokens in KV head 0 and 35 in KV head 1 under a shared page table");
  // an index past a head's length (sequence 1, head 0 holds 33 tokens)
  std::vector<std::int32_t> ip = {0, 2, 4, 6, 8}, ix = {0, 1, 0, 1, 0, 40, 0, 1};
  expect(kv::const_selection_view(ip.data(), ix.data(), 4), kv::errc::invalid_argument, "selection index 40 of row 2 is outside the head's 33 tokens");
  std::vector<std::int32_t> ix2 = {1, 0, 0, 1, 0, 1, 0, 1};
  expect(kv::const_selection_view(ip.data(), ix2.data(), 4), kv::errc::invalid_argument, "not strictly ascending");
  expect(kv::const_selection_view(ip.data(), ix.data(), 3), kv::errc::shape_mismatch, "neither batch * kv_heads = 4 nor batch = 2");
  {  // a repeated page in the table
    auto saved = pg.indices;
    pg.indices[4] = pg.indices[0];
    expect(kv::const_selection_view(ip.data(), ix2.data(), 4), kv::errc::invalid_argument, "repeats a page");
    pg.indices = saved;
    pg.in.pages.indices = pg.indices.data();
  }
  {  // freed capacity too small, workspace too small
    kv::cpu::paged_cache<float> c;
    c.keys = kv::kv_view<float>{pg.kpool.data(), {}, {}};
    for (int k = 0; k < 4; ++k) c.keys.extent[k] = pg.in.keys.extent[k], c.keys.stride[k] = pg.in.keys.stride[k];
    c.pages = pg.in.pages;
    c.lengths = pg.in.lengths;
    std::vector<std::int32_t> one = {0, 1, 0, 1, 0, 1, 0, 1};
    std::vector<std::int32_t> a(4, -7), bb(4, -7), fr2(1, -7);
    std::int64_t nf = -1;
    std::vector<unsigned char> ws(kv::cpu::compact_paged_workspace_size(c));
    kv::cpu::paged_compaction_result out{a.data(), bb.data(), nullptr, fr2.data(), 1, &nf};
    const kv::status st = kv::cpu::compact_paged(c, kv::const_selection_view(ip.data(), one.data(), 4), out, ws.data(), ws.size());
    CHECK(st.code() == kv::errc::insufficient_capacity);
    CHECK(std::string(st.message()).find("pages become free > result freed_capacity = 1") != std::string::npos);
    CHECK(nf == -1);
    const kv::status st2 = kv::cpu::compact_paged(c, kv::const_selection_view(ip.data(), one.data(), 4), out, ws.data(), ws.size() - 1);
    CHECK(st2.code() == kv::errc::insufficient_workspace);
    CHECK(std::memcmp(pg.kpool.data(), k0.data(), k0.size() * sizeof(float)) == 0);
  }
  {  // union_selections: rows that differ, not a multiple of the group, capacity
    std::vector<std::int32_t> p3 = {0, 1, 2, 3}, i3 = {0, 0, 0};
    const kv::const_selection_view two[2] = {{ip.data(), ix2.data(), 4}, {p3.data(), i3.data(), 3}};
    std::vector<std::int32_t> op(8, -7), oi(16, -7);
    kv::selection_view o{op.data(), oi.data(), nullptr, 16};
    CHECK(kv::cpu::union_selections(two, 2, 2, o).code() == kv::errc::invalid_argument);  // row 0 of ix2 descends
    const kv::const_selection_view two_b[2] = {{ip.data(), ix.data(), 4}, {p3.data(), i3.data(), 3}};
    CHECK(kv::cpu::union_selections(two_b, 2, 2, o).code() == kv::errc::shape_mismatch);
    CHECK(kv::cpu::union_selections(two_b + 1, 1, 2, o).code() == kv::errc::shape_mismatch);
    kv::selection_view small{op.data(), oi.data(), nullptr, 2};
    CHECK(kv::cpu::union_selections(two_b, 1, 2, small).code() == kv::errc::insufficient_capacity);
    CHECK(op[0] == -7);
  }
  (void)f;
}

TEST_CASE("compact_paged mode b: heads that share page ids (per-head tables over pages spanning every head) free a page once, when no head keeps it") {
  // B = 1, H = 2, page size 4, NHD pool of 3 pages; both heads' rows use pages {2, 0}, 8 tokens each
  const std::int64_t H = 2, ps = 4, d = 2, P = 3;
  std::vector<float> k(static_cast<std::size_t>(P * ps * H * d)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i), v[i] = -static_cast<float>(i);
  std::vector<std::int32_t> indptr = {0, 2, 4}, indices = {2, 0, 2, 0}, last = {4, 4};
  kv::cpu::paged_cache<float> c;
  c.keys = kv::make_page_pool(k.data(), P, H, ps, d, kv::kv_layout::nhd);
  c.values = kv::make_page_pool(v.data(), P, H, ps, d, kv::kv_layout::nhd);
  c.pages = kv::make_page_table(indptr.data(), indices.data(), last.data(), 1, 2);
  c.pages.per_head = true;
  std::vector<unsigned char> ws(kv::cpu::compact_paged_workspace_size(c));
  auto run = [&](std::vector<std::int32_t> sp, std::vector<std::int32_t> si, std::vector<std::int32_t>* freed) {
    std::vector<std::int32_t> kept(2), lastp(2);
    freed->assign(4, -7);
    std::int64_t nf = -1;
    kv::cpu::paged_compaction_result out{kept.data(), lastp.data(), nullptr, freed->data(), 4, &nf};
    REQUIRE(kv::cpu::compact_paged(c, kv::const_selection_view(sp.data(), si.data(), 2), out, ws.data(), ws.size()).ok());
    freed->resize(static_cast<std::size_t>(nf));
  };
  std::vector<std::int32_t> freed;
  run({0, 2, 10}, {0, 1, 0, 1, 2, 3, 4, 5, 6, 7}, &freed);  // head 0 lets page 0 go, head 1 keeps it
  CHECK(freed.empty());
  run({0, 2, 5}, {0, 1, 0, 1, 2}, &freed);  // both let page 0 go: reported once
  CHECK(freed == std::vector<std::int32_t>{0});
  // a per-sequence table over one-head pages (head stride 0) is refused: the heads would move the same rows
  kv::cpu::paged_cache<float> c1 = c;
  c1.keys = kv::page_pool_per_head(k.data(), P, H, ps, d);
  c1.values = kv::page_pool_per_head(v.data(), P, H, ps, d);
  c1.pages.per_head = false;
  c1.pages.batch = 1;
  std::vector<std::int32_t> ip1 = {0, 2}, last1 = {4};
  c1.pages.indptr = ip1.data();
  c1.pages.last_page_len = last1.data();
  std::vector<std::int32_t> kept(1), lastp(1), fr(4);
  std::int64_t nf = -1;
  std::vector<std::int32_t> sp = {0, 1, 2}, si = {0, 1};
  std::vector<unsigned char> ws1(kv::cpu::compact_paged_workspace_size(c1));
  const kv::status st = kv::cpu::compact_paged(c1, kv::const_selection_view(sp.data(), si.data(), 2),
                                               kv::cpu::paged_compaction_result{kept.data(), lastp.data(), nullptr, fr.data(), 4, &nf},
                                               ws1.data(), ws1.size());
  CHECK(st.code() == kv::errc::invalid_argument);
  CHECK(std::string(st.message()).find("keys.stride[1] = 0") != std::string::npos);
}

TEST_CASE("paged protected prefix: shared prefix pages are read by several sequences, never moved or freed; dropping one is refused") {
  // two sequences whose first 8 tokens are the same (a cached prompt), in the same two 4-token pages
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = 2, sh.cap = 60, sh.d = 8, sh.window = 4;
  kvtest::problem p = kvtest::make_problem(sh, 51, 1.0, 1.0, 1.0, {60, 60, 45, 45});
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t n = 0; n < 8; ++n)
      for (std::int64_t c = 0; c < 8; ++c) {
        p.K[p.kv_idx(1, h, n, c)] = p.K[p.kv_idx(0, h, n, c)];
        p.V[p.kv_idx(1, h, n, c)] = p.V[p.kv_idx(0, h, n, c)];
      }
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(st.in, 4, kvtest::pool_layout::nhd, false, false, 17, pg, true);
  pg.indices[static_cast<std::size_t>(pg.indptr[1])] = pg.indices[0];  // sequence 1 reads sequence 0's prefix pages
  pg.indices[static_cast<std::size_t>(pg.indptr[1]) + 1] = pg.indices[1];
  auto params = kv::presets::snapkv::defaults();
  params.selector.num_sink = 8;  // the evictor keeps the prefix
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev(params);
  // without the prefix declared the shared pages are repeated pages
  CHECK(std::string(kvtest::run_lib(ev, pg.in, kv::budget_request::tokens(20)).st.message()).find("repeats a page") != std::string::npos);
  std::vector<std::int32_t> prefix = {8, 8};
  pg.in.pages.protected_prefix = prefix.data();
  const auto a = kvtest::run_lib(ev, st.in, kv::budget_request::tokens(20));
  const auto b = kvtest::run_lib(ev, pg.in, kv::budget_request::tokens(20));
  INFO(std::string(b.st.message()));
  REQUIRE(a.st.ok());
  REQUIRE(b.st.ok());
  CHECK(a.indices == b.indices);
  // compaction: the contiguous reference, the prefix pages untouched and not freed
  std::vector<float> kc(static_cast<std::size_t>(2 * 2 * 60 * 8)), vc(kc.size());
  const kv::const_selection_view sel(a.indptr.data(), a.indices.data(), 4);
  REQUIRE(kv::cpu::compact(st.in.keys, sel, kv::make_kv_view(kc.data(), 2, 2, 60, 8, kv::kv_layout::hnd)).ok());
  REQUIRE(kv::cpu::compact(st.in.values, sel, kv::make_kv_view(vc.data(), 2, 2, 60, 8, kv::kv_layout::hnd)).ok());
  const auto pool_before = pg.kpool;
  kv::cpu::paged_cache<float> c;
  c.keys = kv::make_page_pool(pg.kpool.data(), pg.num_pages, 2, 4, 8, kv::kv_layout::nhd);
  c.values = kv::make_page_pool(pg.vpool.data(), pg.num_pages, 2, 4, 8, kv::kv_layout::nhd);
  c.pages = pg.in.pages;
  std::vector<unsigned char> ws(kv::cpu::compact_paged_workspace_size(c));
  std::vector<std::int32_t> kept(2), lastp(2), freed(64), lens(4);
  std::int64_t nf = -1;
  kv::cpu::paged_compaction_result out{kept.data(), lastp.data(), lens.data(), freed.data(), 64, &nf};
  {  // a selection that drops a prefix token is refused, the cache untouched
    std::vector<std::int32_t> ip = {0, 2, 4, 6, 8}, ix = {1, 2, 1, 2, 0, 9, 0, 9};
    const kv::status s = kv::cpu::compact_paged(c, kv::const_selection_view(ip.data(), ix.data(), 4), out, ws.data(), ws.size());
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(std::string(s.message()).find("drops a token of sequence 0's protected prefix [0, 8)") != std::string::npos);
    CHECK(std::memcmp(pg.kpool.data(), pool_before.data(), pool_before.size() * sizeof(float)) == 0);  // NaN-safe
  }
  REQUIRE(kv::cpu::compact_paged(c, kv::const_selection_view(b.indptr.data(), b.indices.data(), 4), out, ws.data(), ws.size()).ok());
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t e = 0; e < 4 * 2 * 8; ++e) {
      const std::size_t o = static_cast<std::size_t>(pg.indices[static_cast<std::size_t>(i)] * 4 * 2 * 8 + e);
      REQUIRE(std::memcmp(&pg.kpool[o], &pool_before[o], sizeof(float)) == 0);  // the shared pages are never written
    }
  for (std::int64_t q = 0; q < nf; ++q) CHECK((freed[static_cast<std::size_t>(q)] != pg.indices[0] && freed[static_cast<std::size_t>(q)] != pg.indices[1]));
  std::vector<std::int32_t> kept_counts;
  for (std::int64_t r = 0; r < 4; ++r) kept_counts.push_back(a.indptr[static_cast<std::size_t>(r + 1)] - a.indptr[static_cast<std::size_t>(r)]);
  for (std::int64_t bq = 0; bq < 2; ++bq)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < kept_counts[static_cast<std::size_t>(bq * 2 + h)]; ++i) {
        const std::int64_t page = pg.indices[static_cast<std::size_t>(pg.indptr[static_cast<std::size_t>(bq)] + i / 4)];
        for (std::int64_t cc = 0; cc < 8; ++cc)
          REQUIRE(pg.kpool[static_cast<std::size_t>(((page * 4 + i % 4) * 2 + h) * 8 + cc)] ==
                  kc[static_cast<std::size_t>(((bq * 2 + h) * 60 + i) * 8 + cc)]);
      }
  // a prefix longer than a sequence; a prefix page used as an ordinary page by another row
  std::vector<std::int32_t> too_long = {8, 46};
  pg.in.pages.protected_prefix = too_long.data();
  CHECK(std::string(kvtest::run_lib(ev, pg.in, kv::budget_request::tokens(20)).st.message())
            .find("pages.protected_prefix[1] = 46 is outside [0, 45]") != std::string::npos);
  std::vector<std::int32_t> only_first = {8, 0};
  pg.in.pages.protected_prefix = only_first.data();
  CHECK(std::string(kvtest::run_lib(ev, pg.in, kv::budget_request::tokens(20)).st.message())
            .find("only pages wholly inside a protected prefix may be shared") != std::string::npos);
}
