// Paged and indirect KV caches on the CPU backend (layer_inputs::pages): every preset reads its
// keys and values through a page table and gives exactly the selection (and bit for bit the
// scores) of the contiguous view of the same data: page sizes 1, 16 and 64; shuffled,
// non-monotone page ids with unused pages between them; NHD, HND and token-innermost pools;
// fp32, fp16 and bf16; ragged batches; one table per sequence (lengths from `lengths` or from
// last_page_len) or per (sequence, KV head) over pages that hold one head or every head. And the
// page table's bad input: clear errors, outputs untouched.
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/presets.hpp>

#include "reference/harness.hpp"
#include "reference/lkv_tables.hpp"
#include "reference/paged.hpp"

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace kv = kvevict;

namespace {

struct paged_case {
  std::int64_t page_size = 16;
  kvtest::pool_layout pool = kvtest::pool_layout::nhd;
  bool per_head = false, one_head_pages = false, last_page_len = true;
  std::uint64_t seed = 1;
  bool start = false;  ///< rows start inside their first page (pages.start_offset)
};

template <class Policy, class T>
void check_paged_equals_contiguous(const char* name, const kvtest::stored<T>& st, const typename Policy::params& params,
                                   const paged_case& pc) {
  kvtest::paged_copy<T> pg;
  kvtest::make_paged(st.in, pc.page_size, pc.pool, pc.per_head, pc.one_head_pages, pc.seed, pg, pc.last_page_len, 3, false, pc.start);
  if (pc.start) REQUIRE(pg.in.pages.start_offset != nullptr);
  kv::evictor<Policy, kv::cpu::backend> ev(params);
  for (double f : {0.15, 0.5}) {
    const auto a = kvtest::run_lib(ev, st.in, kv::budget_request::fraction(f));
    const auto b = kvtest::run_lib(ev, pg.in, kv::budget_request::fraction(f));
    INFO(std::string(name) << " page_size " << pc.page_size << " pool " << std::string(kvtest::to_string(pc.pool)) << " per_head " << pc.per_head
              << " one_head_pages " << pc.one_head_pages << " last_page_len " << pc.last_page_len << " start " << pc.start << " keep " << f << ": "
              << std::string(a.st.message()) << " | " << std::string(b.st.message()));
    REQUIRE(a.st.ok());
    REQUIRE(b.st.ok());
    CHECK(a.indptr == b.indptr);
    CHECK(a.indices == b.indices);
    CHECK(a.positions == b.positions);
    // scores bit for bit over each row's valid slots (the capacities may differ)
    bool same = true;
    for (std::int64_t r = 0; r < a.rows; ++r) {
      const std::int64_t L = st.in.length(r / ev.out_heads(st.in), (r % ev.out_heads(st.in)) * st.in.kv_heads() / ev.out_heads(st.in));
      same = same && std::memcmp(a.row_scores(r), b.row_scores(r), static_cast<std::size_t>(L) * sizeof(float)) == 0;
    }
    CHECK(same);
  }
}

/// Threshold selection (budgeters::threshold, the mass rule at 0.6) on SnapKV's scores: heads keep
/// fewer tokens than their cap, decided by the scores.
struct threshold_snapkv : kv::eviction_policy<kv::scorers::attention_weight, kv::temporal::mean, kv::spatial::avg_pool,
                                              kv::budgeters::threshold> {
  static params defaults() {
    params p;
    p.budgeter.mode = kv::budgeters::threshold::rule::mass;
    p.budgeter.threshold = 0.6f;
    return p;
  }
};

template <class T>
void check_every_preset(const paged_case& pc, kvtest::layout src_layout, std::vector<std::int32_t> lens, std::int64_t group = 2,
                        kv::gqa_reduction gqa = kv::gqa_reduction::mean) {
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = group, sh.cap = 150, sh.d = 16, sh.window = 8, sh.hidden = 32;
  kvtest::problem p = kvtest::make_problem(sh, 900 + pc.seed, 1.0, 1.5, 1.0, lens);
  kvtest::quantize<T>(p);
  kvtest::quantize_wo<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, src_layout, st);
  auto run = [&](auto tag, const char* name) {
    using P = typename decltype(tag)::type;
    auto params = P::defaults();
    params.gqa = gqa;
    check_paged_equals_contiguous<P, T>(name, st, params, pc);
  };
  run(std::common_type<kv::presets::restkv>{}, "restkv");
  run(std::common_type<kv::presets::snapkv>{}, "snapkv");
  run(std::common_type<kv::presets::pyramidkv>{}, "pyramidkv");
  run(std::common_type<kv::presets::adakv>{}, "adakv");
  run(std::common_type<kv::presets::criticalkv>{}, "criticalkv");
  run(std::common_type<kv::presets::critical_adakv>{}, "critical_adakv");
  if (gqa == kv::gqa_reduction::mean) run(std::common_type<kv::presets::defensivekv>{}, "defensivekv");  // aggregates the group itself
  run(std::common_type<threshold_snapkv>{}, "threshold_snapkv");
  run(std::common_type<kv::presets::h2o>{}, "h2o");
  run(std::common_type<kv::presets::tova>{}, "tova");
  run(std::common_type<kv::presets::streaming_llm>{}, "streaming_llm");
  run(std::common_type<kv::presets::key_norm>{}, "key_norm");
  const int hid = 4;
  const kvtest::lkv_tables tabs(sh.kv_heads, sh.d, hid, 5 + pc.seed);
  auto run_lkv = [&](auto tag, const char* name) {
    using P = typename decltype(tag)::type;
    auto params = P::defaults();
    tabs.apply(params, sh.kv_heads, sh.d, hid);
    params.gqa = gqa;
    check_paged_equals_contiguous<P, T>(name, st, params, pc);
  };
  run_lkv(std::common_type<kv::presets::lkv>{}, "lkv");
  run_lkv(std::common_type<kv::presets::lkv_uniform_budgets>{}, "lkv_uniform_budgets");
  run_lkv(std::common_type<kv::presets::lkv_budgets_restkv>{}, "lkv_budgets_restkv");
  run_lkv(std::common_type<kv::presets::lkv_budgets_attention>{}, "lkv_budgets_attention");
}

}  // namespace

TEST_CASE("paged: every preset through a per-sequence page table equals the contiguous view (ragged lengths)") {
  const std::vector<std::int32_t> ragged = {150, 97, 33, 150};
  std::uint64_t seed = 1;
  for (std::int64_t ps : {1, 16, 64})
    for (auto pool : {kvtest::pool_layout::nhd, kvtest::pool_layout::hnd, kvtest::pool_layout::token_innermost}) {
      paged_case pc{ps, pool, false, false, false, seed++};
      check_every_preset<float>(pc, kvtest::layout::hnd, ragged);
    }
  check_every_preset<kv::half_t>({16, kvtest::pool_layout::nhd, false, false, false, seed++}, kvtest::layout::nhd, ragged);
  check_every_preset<kv::bfloat16_t>({64, kvtest::pool_layout::hnd, false, false, false, seed++}, kvtest::layout::interleaved, ragged);
  check_every_preset<kv::bfloat16_t>({1, kvtest::pool_layout::token_innermost, false, false, false, seed++}, kvtest::layout::padded, ragged);
}

TEST_CASE("paged: lengths from last_page_len (FlashInfer's table), equal lengths per sequence, layer_mean and per_query_head") {
  const std::vector<std::int32_t> per_seq = {150, 150, 61, 61};
  std::uint64_t seed = 40;
  for (std::int64_t ps : {1, 16, 64}) {
    check_every_preset<float>({ps, kvtest::pool_layout::hnd, false, false, true, seed++}, kvtest::layout::nhd, per_seq);
    check_every_preset<kv::half_t>({ps, kvtest::pool_layout::nhd, false, false, true, seed++}, kvtest::layout::hnd, per_seq, 2,
                                   kv::gqa_reduction::layer_mean);
  }
  check_every_preset<float>({16, kvtest::pool_layout::nhd, false, false, true, seed++}, kvtest::layout::hnd, per_seq, 2,
                            kv::gqa_reduction::per_query_head);
  check_every_preset<float>({16, kvtest::pool_layout::hnd, false, false, true, seed++}, kvtest::layout::hnd, per_seq, 1);
}

TEST_CASE("paged: per-(sequence, KV head) page tables over one-head pages and over pages spanning every head") {
  const std::vector<std::int32_t> ragged = {150, 97, 33, 150};
  std::uint64_t seed = 70;
  for (std::int64_t ps : {1, 16, 64}) {
    check_every_preset<float>({ps, kvtest::pool_layout::nhd, true, true, true, seed++}, kvtest::layout::hnd, ragged);
    check_every_preset<kv::bfloat16_t>({ps, kvtest::pool_layout::hnd, true, false, true, seed++}, kvtest::layout::hnd, ragged);
  }
  check_every_preset<kv::half_t>({16, kvtest::pool_layout::token_innermost, true, true, true, seed++}, kvtest::layout::nhd, ragged);
}

namespace {

/// run() on bad paged inputs: the error's code and a fragment of its message, the selection and
/// the scores untouched (plan() gives the same error).
template <class Policy>
void check_paged_error(const kv::layer_inputs<float>& in, kv::errc code, const std::string& fragment) {
  kv::evictor<Policy, kv::cpu::backend> ev;
  std::vector<std::int32_t> indptr(64, -7), idx(4096, -7);
  std::vector<float> scores(4096 * 4, -7.0f);
  kv::selection_view sel{indptr.data(), idx.data(), nullptr, 4096};
  const kv::status st = ev.run(in, kv::budget_request::fraction(0.3), sel, scores.data());
  INFO(std::string(st.message()));
  CHECK(st.code() == code);
  CHECK(std::string(st.message()).find(fragment) != std::string::npos);
  for (auto x : indptr) CHECK(x == -7);
  for (auto x : idx) REQUIRE(x == -7);
  for (auto x : scores) REQUIRE(x == -7.0f);
  kv::eviction_plan pl;
  if (code != kv::errc::non_finite_input) CHECK(ev.plan(in, kv::budget_request::fraction(0.3), &pl).code() == code);  // plan reads no K/V
}

}  // namespace

TEST_CASE("paged: bad page tables are named errors and leave the outputs untouched") {
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = 2, sh.cap = 40, sh.d = 8, sh.window = 4;
  kvtest::problem p = kvtest::make_problem(sh, 3, 1.0, 1.0, 1.0, {40, 40, 21, 21});
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(st.in, 16, kvtest::pool_layout::nhd, false, false, 9, pg, true);
  using snap = kv::presets::snapkv;
  {
    kv::evictor<snap, kv::cpu::backend> ev;
    REQUIRE(kvtest::run_lib(ev, pg.in, kv::budget_request::fraction(0.3)).st.ok());
  }
  auto with = [&](auto edit) {
    kvtest::paged_copy<float> q = pg;
    q.in.keys.data = q.kpool.data();
    q.in.values.data = q.vpool.data();
    q.in.pages.indptr = q.indptr.data();
    q.in.pages.indices = q.indices.data();
    q.in.pages.last_page_len = q.last_page_len.empty() ? nullptr : q.last_page_len.data();
    edit(q);
    return q;
  };
  {  // a page id outside the pool
    auto q = with([](kvtest::paged_copy<float>& c) { c.indices[1] = static_cast<std::int32_t>(c.num_pages); });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "is outside [0, num_pages");
  }
  {  // a negative page id
    auto q = with([](kvtest::paged_copy<float>& c) { c.indices[0] = -1; });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "pages.indices[0] = -1");
  }
  {  // a page twice: in two sequences, and twice in one sequence
    auto q = with([](kvtest::paged_copy<float>& c) { c.indices[3] = c.indices[0]; });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "repeats a page");
    auto r = with([](kvtest::paged_copy<float>& c) { c.indices[1] = c.indices[0]; });
    check_paged_error<snap>(r.in, kv::errc::invalid_argument, "repeats a page");
  }
  {  // last_page_len outside [1, page_size]
    auto q = with([](kvtest::paged_copy<float>& c) { c.last_page_len[1] = 0; });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "pages.last_page_len[1] = 0 must be in [1, page_size = 16]");
    auto r = with([](kvtest::paged_copy<float>& c) { c.last_page_len[0] = 17; });
    check_paged_error<snap>(r.in, kv::errc::invalid_argument, "pages.last_page_len[0] = 17");
  }
  {  // lengths that disagree with the table, and lengths beyond a row's pages
    std::vector<std::int32_t> lens = {40, 40, 20, 21};
    auto q = with([&](kvtest::paged_copy<float>& c) { c.in.lengths = kv::per_head_lengths(lens.data(), 2, 2); });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "lengths(1, 0) = 20 != the page table's 21 tokens");
    std::vector<std::int32_t> long_lens = {40, 49, 21, 21};
    auto r = with([&](kvtest::paged_copy<float>& c) {
      c.in.lengths = kv::per_head_lengths(long_lens.data(), 2, 2);
      c.in.pages.last_page_len = nullptr;
    });
    check_paged_error<snap>(r.in, kv::errc::invalid_argument, "lengths(0, 1) = 49 is outside [0, pages * page_size - start_offset = 48]");
    // a negative length with no protected prefix set is named as the length (the prefix check follows it)
    std::vector<std::int32_t> neg_lens = {40, 40, -1, 21};
    auto n = with([&](kvtest::paged_copy<float>& c) {
      c.in.lengths = kv::per_head_lengths(neg_lens.data(), 2, 2);
      c.in.pages.last_page_len = nullptr;
    });
    check_paged_error<snap>(n.in, kv::errc::invalid_argument, "lengths(1, 0) = -1 is outside [0, pages * page_size - start_offset");
  }
  {  // indptr: not starting at 0, decreasing, more pages than max_pages_per_row
    auto q = with([](kvtest::paged_copy<float>& c) { c.indptr[0] = 1; });
    check_paged_error<snap>(q.in, kv::errc::invalid_argument, "pages.indptr[0] = 1 must be 0");
    auto r = with([](kvtest::paged_copy<float>& c) { c.indptr[1] = 5; });
    check_paged_error<snap>(r.in, kv::errc::invalid_argument, "outside [0, max_pages_per_row = 3]");
    auto s = with([](kvtest::paged_copy<float>& c) { c.in.pages.max_pages_per_row = 2; });
    check_paged_error<snap>(s.in, kv::errc::invalid_argument, "outside [0, max_pages_per_row = 2]");
  }
  {  // shapes: no indices, no lengths source, page size 0, batch 0, queries of another batch
    auto q = with([](kvtest::paged_copy<float>& c) { c.in.pages.indices = nullptr; });
    check_paged_error<snap>(q.in, kv::errc::null_pointer, "pages.indices is null");
    auto r = with([](kvtest::paged_copy<float>& c) { c.in.pages.last_page_len = nullptr; });
    check_paged_error<snap>(r.in, kv::errc::null_pointer, "pages.last_page_len is null and layer_inputs::lengths is not set");
    auto s = with([](kvtest::paged_copy<float>& c) { c.in.keys.extent[2] = 0; c.in.values.extent[2] = 0; });
    check_paged_error<snap>(s.in, kv::errc::invalid_argument, "num_pages and page_size must be >= 1");
    auto t = with([](kvtest::paged_copy<float>& c) { c.in.pages.batch = 0; });
    check_paged_error<snap>(t.in, kv::errc::invalid_argument, "pages.batch = 0 must be in [1, 2^31 / kv_heads]");
    auto u = with([](kvtest::paged_copy<float>& c) { c.in.pages.batch = 1; });
    check_paged_error<snap>(u.in, kv::errc::shape_mismatch, "queries batch = 2 != pages.batch = 1");
  }
  {  // a NaN in a page that holds a token is named by its logical slot and its page
    auto q = with([](kvtest::paged_copy<float>& c) {
      const std::int64_t pgid = c.indices[2];  // sequence 0's third page: slots 32..39
      c.kpool[static_cast<std::size_t>(pgid * 16 * 2 * 8 + (35 - 32) * 2 * 8 + 1 * 8 + 4)] = std::nanf("");
    });
    check_paged_error<snap>(q.in, kv::errc::non_finite_input, "keys(b=0, h=1, s=35, d=4)");
  }
}

TEST_CASE("paged: every page that holds a token is checked, whichever head is longest; a plan does not outlive its table's pointers") {
  kvtest::shape sh;
  sh.batch = 1, sh.kv_heads = 2, sh.group = 1, sh.cap = 8, sh.d = 4, sh.window = 1;
  kvtest::problem p = kvtest::make_problem(sh, 5, 1.0, 1.0, 1.0, {1, 8});
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(st.in, 4, kvtest::pool_layout::nhd, false, false, 3, pg, false);  // lengths {1, 8}: 2 pages, head 1 needs both
  pg.indices[1] = 1 << 30;  // a page only the longer head reads
  check_paged_error<kv::presets::snapkv>(pg.in, kv::errc::invalid_argument, "pages.indices[1] = 1073741824");
  kvtest::make_paged(st.in, 4, kvtest::pool_layout::nhd, false, false, 3, pg, false);
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev;
  kv::eviction_plan pl;
  REQUIRE(ev.plan(pg.in, kv::budget_request::tokens(2), &pl).ok());
  auto in = pg.in;
  in.pages.indices = nullptr;
  std::vector<std::int32_t> ip(3), ix(16);
  std::vector<unsigned char> ws(pl.workspace_bytes);
  const kv::status s = ev.run(pl, in, kv::selection_view{ip.data(), ix.data(), nullptr, 16}, ws.data(), ws.size());
  CHECK(s.code() == kv::errc::invalid_argument);  // the signature differs: plan again
  // shapes that fail validation need no workspace
  auto bad = pg.in;
  bad.pages.batch = -1;
  CHECK(ev.workspace_size(bad) == 0);
  bad = pg.in;
  bad.pages.max_pages_per_row = -3;
  CHECK(ev.workspace_size(bad) == 0);
}

TEST_CASE_TEMPLATE("paged: the NaN scan's pool-order pass finds a NaN in every slot that holds a token and in no other slot", T,
                   float, kv::half_t) {
  // cpu::detail::any_nonfinite_paged reads page by page (the heads of a shared page together);
  // scan_finite_paged names the first bad element in (b, h, s, d) order. Every valid element of K
  // in turn holds a NaN (the pool's unused slots, the slots before a row's start offset and after
  // its last token are NaN throughout): found and named exactly; with none, nothing is found.
  // Ragged lengths (per-head runs, an empty head), equal ones (a shared NHD page's valid slots
  // read as one block; lengths from `lengths` and from last_page_len) and one KV head.
  struct shape_case {
    std::int64_t kv_heads;
    std::vector<std::int32_t> lens;
    bool last_page_len;
  };
  const std::vector<shape_case> shapes = {
      {3, {5, 13, 0, 9, 1, 9}, false}, {3, std::vector<std::int32_t>(6, 13), false}, {3, {11, 11, 11, 6, 6, 6}, true}, {1, {13, 6}, true}};
  const T nan = kv::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  int cases = 0, expected = 0;
  std::uint64_t seed = 7;
  for (const shape_case& sc : shapes) {
    kvtest::shape sh;
    sh.batch = 2, sh.kv_heads = sc.kv_heads, sh.group = 1, sh.cap = 13, sh.d = 3, sh.window = 1;
    const kvtest::problem p = kvtest::make_problem(sh, 41, 1.0, 1.0, 1.0, sc.lens);
    kvtest::stored<T> st;
    kvtest::store(p, kvtest::layout::hnd, st);
    for (auto pool : {kvtest::pool_layout::nhd, kvtest::pool_layout::hnd, kvtest::pool_layout::token_innermost})
      for (int table = 0; table < 3; ++table)  // per sequence, per head over every-head pages, per head over one-head pages
        for (std::int64_t ps : {1, 4}) {
          const bool per_head = table > 0, ohp = table == 2;
          kvtest::paged_copy<T> pg;
          kvtest::make_paged(st.in, ps, pool, per_head, ohp, seed++, pg, sc.last_page_len, 3, false, 1);
          CAPTURE(kvtest::to_string(pool));
          CAPTURE(table);
          CAPTURE(ps);
          CAPTURE(sc.kv_heads);
          REQUIRE(pg.in.pages.last_page_len == (sc.last_page_len ? pg.last_page_len.data() : nullptr));
          REQUIRE_FALSE(kv::cpu::detail::any_nonfinite_paged(pg.in, pg.in.keys));
          REQUIRE(kv::cpu::detail::scan_finite_paged(pg.in, pg.in.keys, "keys").ok());
          const auto& k = pg.in.keys;
          for (std::int64_t b = 0; b < 2; ++b)
            for (std::int64_t h = 0; h < sc.kv_heads; ++h) {
              const auto rs = kv::cpu::detail::head_rows(pg.in, k, b, h);
              for (std::int64_t s = 0; s < pg.in.length(b, h); ++s)
                for (std::int64_t c = 0; c < 3; ++c) {
                  T& x = pg.kpool[static_cast<std::size_t>(rs.row_ptr(s) + c * rs.col_stride - pg.kpool.data())];
                  const T keep = x;
                  x = nan;
                  const bool found = kv::cpu::detail::any_nonfinite_paged(pg.in, k);
                  const kv::status e = kv::cpu::detail::scan_finite_paged(pg.in, k, "keys");
                  // the head filter (the evictor's scan of the heads it did not score): the
                  // element's own head alone finds it, every other head does not
                  auto own = [&](std::int64_t b2, std::int64_t h2) { return b2 == b && h2 == h; };
                  auto others = [&](std::int64_t b2, std::int64_t h2) { return !own(b2, h2); };
                  const bool found_own = kv::cpu::detail::any_nonfinite_paged(pg.in, k, own);
                  const kv::status e_own = kv::cpu::detail::scan_finite_paged(pg.in, k, "keys", own);
                  const bool found_others = kv::cpu::detail::any_nonfinite_paged(pg.in, k, others);
                  const kv::status e_others = kv::cpu::detail::scan_finite_paged(pg.in, k, "keys", others);
                  x = keep;
                  CHECK(found);
                  CHECK(found_own);
                  CHECK_FALSE(found_others);
                  CHECK(e_others.ok());
                  const std::string want = "keys(b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", s=" + std::to_string(s) +
                                           ", d=" + std::to_string(c) + ") = nan";
                  CHECK(std::string(e.message()).find(want) != std::string::npos);
                  CHECK(std::string(e_own.message()).find(want) != std::string::npos);
                  ++cases;
                }
            }
          for (std::int32_t L : sc.lens) expected += 3 * L;
        }
  }
  CHECK(cases == expected);
  CHECK(cases > 5000);
}

TEST_CASE("paged: the scorers that check K in their own pass name a NaN key as the scan does, scored heads and heads kept whole") {
  // cpu::scorer_impl<S>::detects_nonfinite_keys over a paged cache: no K scan before scoring; a
  // NaN key in a scored head is met by the scorer (key norm's sum, SnapKV's newest window row)
  // and named by scan_finite_paged; a head kept whole (length <= budget) is scanned after
  // scoring with the head filter. Every valid element of K in turn; outputs untouched.
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 3, sh.group = 2, sh.cap = 13, sh.d = 3, sh.window = 2;
  const std::vector<std::int32_t> lens = {5, 13, 0, 9, 1, 9};
  const kvtest::problem p = kvtest::make_problem(sh, 43, 1.0, 1.0, 1.0, lens);
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  kv::evictor<kv::presets::key_norm, kv::cpu::backend> kn;
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> snap;
  const auto budget = kv::budget_request::tokens(6);
  int cases = 0, whole = 0;
  std::uint64_t seed = 11;
  for (auto pool : {kvtest::pool_layout::nhd, kvtest::pool_layout::hnd})
    for (int table = 0; table < 3; ++table) {  // per sequence, per head, per sequence with rows starting inside a page
      const bool per_head = table == 1;
      CAPTURE(kvtest::to_string(pool));
      CAPTURE(table);
      kvtest::paged_copy<float> pg;
      kvtest::make_paged(st.in, 4, pool, per_head, false, seed++, pg, false, 3, false, table == 2 ? 1 : 0);
      REQUIRE(kvtest::run_lib(kn, pg.in, budget).st.ok());
      REQUIRE(kvtest::run_lib(snap, pg.in, budget).st.ok());
      const auto& k = pg.in.keys;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t h = 0; h < 3; ++h) {
          const auto rs = kv::cpu::detail::head_rows(pg.in, k, b, h);
          for (std::int64_t s = 0; s < pg.in.length(b, h); ++s)
            for (std::int64_t c = 0; c < 3; ++c) {
              float& x = pg.kpool[static_cast<std::size_t>(rs.row_ptr(s) + c * rs.col_stride - pg.kpool.data())];
              const float keep = x;
              x = std::nanf("");
              const auto r1 = kvtest::run_lib(kn, pg.in, budget);
              const auto r2 = kvtest::run_lib(snap, pg.in, budget);
              x = keep;
              const std::string want = "keys(b=" + std::to_string(b) + ", h=" + std::to_string(h) + ", s=" + std::to_string(s) +
                                       ", d=" + std::to_string(c) + ") = nan (page ";
              for (const auto* r : {&r1, &r2}) {
                CHECK(r->st.code() == kv::errc::non_finite_input);
                CHECK_MESSAGE(std::string(r->st.message()).find(want) != std::string::npos, r->st.message());
                for (std::int64_t v : r->indptr) CHECK(v == -7);
                for (float v : r->scores) CHECK(v == -7.0f);
              }
              whole += pg.in.length(b, h) <= 6;
              ++cases;
            }
        }
    }
  CHECK(cases == 6 * 3 * (5 + 13 + 0 + 9 + 1 + 9));
  CHECK(whole == 6 * 3 * (5 + 1));
}

TEST_CASE("paged: rows that start inside their first page (pages.start_offset) equal the contiguous view, every preset") {
  const std::vector<std::int32_t> ragged = {150, 97, 33, 150}, per_seq = {150, 150, 61, 61};
  std::uint64_t seed = 120;
  for (std::int64_t ps : {16, 64}) {
    // per-sequence tables, lengths from `lengths` (ragged) and from last_page_len
    check_every_preset<float>({ps, kvtest::pool_layout::nhd, false, false, false, seed++, true}, kvtest::layout::hnd, ragged);
    check_every_preset<kv::half_t>({ps, kvtest::pool_layout::hnd, false, false, true, seed++, true}, kvtest::layout::nhd, per_seq);
    // per-(sequence, KV head) tables, each row its own offset
    check_every_preset<kv::bfloat16_t>({ps, kvtest::pool_layout::token_innermost, true, true, true, seed++, true}, kvtest::layout::hnd,
                                       ragged);
    check_every_preset<float>({ps, kvtest::pool_layout::hnd, true, false, true, seed++, true}, kvtest::layout::padded, ragged);
  }
  check_every_preset<float>({16, kvtest::pool_layout::nhd, false, false, true, seed++, true}, kvtest::layout::hnd, per_seq, 2,
                            kv::gqa_reduction::layer_mean);
  {  // a NaN is named by its logical slot and the page that holds it (slot 14 of a row starting at 3: its second page)
    kvtest::shape sh;
    sh.batch = 1, sh.kv_heads = 2, sh.group = 2, sh.cap = 40, sh.d = 8, sh.window = 4, sh.hidden = 16;
    const kvtest::problem p = kvtest::make_problem(sh, 77, 1.0, 1.0, 1.0, {40, 40});
    kvtest::stored<float> st;
    kvtest::store(p, kvtest::layout::hnd, st);
    kvtest::paged_copy<float> pg;
    kvtest::make_paged(st.in, 16, kvtest::pool_layout::nhd, false, false, 5, pg, true, 3, false, 1);
    REQUIRE(pg.starts[0] == 3);
    const std::int32_t page = pg.indices[1];
    pg.kpool[static_cast<std::size_t>(((page * 16 + (3 + 14) % 16) * 2 + 1) * 8 + 2)] = std::nanf("");
    check_paged_error<kv::presets::snapkv>(pg.in, kv::errc::non_finite_input,
                                           "keys(b=0, h=1, s=14, d=2) = nan (page " + std::to_string(page) + ")");
  }
}

/// A problem's K and V left-padded in [batch][kv_heads][cap][d] fp32 buffers (HND): sequence b's
/// tokens start at slot pad[b], the slots before hold NaN (never read).
void left_padded(const kvtest::problem& p, const std::int32_t* pad, std::vector<float>* kbuf, std::vector<float>* vbuf) {
  const std::int64_t B = p.s.batch, H = p.s.kv_heads, S = p.s.cap, d = p.s.d;
  kbuf->assign(static_cast<std::size_t>(B * H * S * d), std::nanf(""));
  vbuf->assign(kbuf->size(), std::nanf(""));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < S - pad[b]; ++t)
        for (std::int64_t c = 0; c < d; ++c) {
          const std::size_t o = static_cast<std::size_t>(((b * H + h) * S + pad[b] + t) * d + c);
          (*kbuf)[o] = static_cast<float>(p.K[p.kv_idx(b, h, t, c)]);
          (*vbuf)[o] = static_cast<float>(p.V[p.kv_idx(b, h, t, c)]);
        }
}

TEST_CASE("paged: a left-padded contiguous batch (HF-style) read in place as one page per sequence with start_offset") {
  // reference: sequences of 50 and 43 (and 31) tokens, contiguous HND with lengths
  kvtest::shape sh;
  sh.batch = 3, sh.kv_heads = 2, sh.group = 2, sh.cap = 50, sh.d = 8, sh.window = 4, sh.hidden = 16;
  kvtest::problem p = kvtest::make_problem(sh, 62, 1.0, 1.0, 1.0, {50, 50, 43, 43, 31, 31});
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  // the same batch left-padded in one [3][2][50][8] buffer: sequence b starts at slot pad[b], NaN before
  const std::int64_t B = 3, H = 2, S = 50, d = 8;
  const std::int32_t pad[3] = {0, 7, 19};
  std::vector<float> kbuf, vbuf;
  left_padded(p, pad, &kbuf, &vbuf);
  // the buffer is a pool of B pages of page_size S (HND), one page per sequence, its row starting at pad[b]
  const std::vector<std::int32_t> indptr = {0, 1, 2, 3}, indices = {0, 1, 2}, last = {50, 50, 50};
  const std::vector<std::int32_t> start(pad, pad + 3);
  kv::layer_inputs<float> in = st.in;
  in.lengths = {};
  in.keys = kv::make_page_pool<const float>(kbuf.data(), B, H, S, d, kv::kv_layout::hnd);
  in.values = kv::make_page_pool<const float>(vbuf.data(), B, H, S, d, kv::kv_layout::hnd);
  in.pages = kv::make_page_table(indptr.data(), indices.data(), last.data(), B, 1);
  in.pages.start_offset = start.data();
  auto check = [&](auto tag, const char* name) {
    using P = typename decltype(tag)::type;
    kv::evictor<P, kv::cpu::backend> ev;
    for (double f : {0.3, 0.7}) {
      const auto a = kvtest::run_lib(ev, st.in, kv::budget_request::fraction(f));
      const auto b = kvtest::run_lib(ev, in, kv::budget_request::fraction(f));
      INFO(name << " keep " << f << ": " << std::string(b.st.message()));
      REQUIRE(a.st.ok());
      REQUIRE(b.st.ok());
      CHECK(a.indptr == b.indptr);
      CHECK(a.indices == b.indices);
      CHECK(a.positions == b.positions);
      bool same = true;  // scores bit for bit over each row's valid slots
      for (std::int64_t r = 0; r < a.rows; ++r)
        same = same && std::memcmp(a.row_scores(r), b.row_scores(r), static_cast<std::size_t>(st.in.length(r / H, r % H)) * sizeof(float)) == 0;
      CHECK(same);
    }
  };
  check(std::common_type<kv::presets::snapkv>{}, "snapkv");
  check(std::common_type<kv::presets::restkv>{}, "restkv");
  check(std::common_type<kv::presets::adakv>{}, "adakv");
  check(std::common_type<kv::presets::pyramidkv>{}, "pyramidkv");
  check(std::common_type<kv::presets::h2o>{}, "h2o");
  check(std::common_type<kv::presets::key_norm>{}, "key_norm");
  // bad offsets: named, nothing written
  kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev;
  auto expect = [&](const std::vector<std::int32_t>& so, const std::vector<std::int32_t>& lp, const char* what) {
    kv::layer_inputs<float> bad = in;
    bad.pages.start_offset = so.data();
    bad.pages.last_page_len = lp.data();
    const auto r = kvtest::run_lib(ev, bad, kv::budget_request::fraction(0.3));
    INFO(std::string(r.st.message()));
    CHECK(r.st.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.st.message()).find(what) != std::string::npos);
  };
  expect({0, 50, 19}, last, "pages.start_offset[1] = 50 must be in [0, page_size = 50)");
  expect({0, -1, 19}, last, "pages.start_offset[1] = -1 must be in [0, page_size = 50)");
  expect({0, 7, 19}, {50, 7, 50}, "pages.start_offset[1] = 7 >= last_page_len = 7 of a row of one page");
  {  // a row without pages keeps its offset (a compaction that kept nothing): length 0 is valid
    const std::vector<std::int32_t> ip2 = {0, 1, 2, 2}, lens0 = {50, 50, 43, 43, 0, 0};
    kv::layer_inputs<float> e = in, c0 = st.in;
    e.pages.indptr = ip2.data();
    e.pages.last_page_len = nullptr;
    e.lengths = kv::per_head_lengths(lens0.data(), B, H);
    c0.lengths = kv::per_head_lengths(lens0.data(), B, H);
    const auto a = kvtest::run_lib(ev, c0, kv::budget_request::fraction(0.3));
    const auto r = kvtest::run_lib(ev, e, kv::budget_request::fraction(0.3));
    INFO(std::string(a.st.message()) << " | " << std::string(r.st.message()));
    CHECK(a.st.code() == r.st.code());
    CHECK(a.indptr == r.indptr);
    CHECK(a.indices == r.indices);
  }
  // lengths given instead of last_page_len must fit after the offset
  {
    kv::layer_inputs<float> bad = in;
    bad.pages.last_page_len = nullptr;
    const std::vector<std::int32_t> lens = {50, 50, 44, 43, 31, 31};
    bad.lengths = kv::per_head_lengths(lens.data(), B, H);
    const auto r = kvtest::run_lib(ev, bad, kv::budget_request::fraction(0.3));
    INFO(std::string(r.st.message()));
    CHECK(r.st.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.st.message()).find("lengths(1, 0) = 44 is outside [0, pages * page_size - start_offset = 43]") != std::string::npos);
  }
}

TEST_CASE("paged: a left-padded batch through a token-slot table (docs/integration.md) selects as the unpadded sequences") {
  // reference: sequences of 50 and 43 tokens, contiguous HND with lengths
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = 2, sh.cap = 50, sh.d = 8, sh.window = 4, sh.hidden = 16;
  kvtest::problem p = kvtest::make_problem(sh, 61, 1.0, 1.0, 1.0, {50, 50, 43, 43});
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  // the same batch left-padded: sequence 1 starts at slot 7 of a [2][2][50][8] buffer, NaN padding
  const std::int64_t B = 2, H = 2, S = 50, d = 8;
  const std::int32_t pad[2] = {0, 7};
  std::vector<float> kbuf, vbuf;
  left_padded(p, pad, &kbuf, &vbuf);
  std::vector<std::int32_t> indptr(1, 0), indices, last;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t s = pad[b]; s < S; ++s) indices.push_back(static_cast<std::int32_t>((b * H + h) * S + s));
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(1);
    }
  kv::layer_inputs<float> in = st.in;
  in.lengths = {};
  in.keys = kv::page_pool_per_head<const float>(kbuf.data(), B * H * S, H, 1, d);
  in.values = kv::page_pool_per_head<const float>(vbuf.data(), B * H * S, H, 1, d);
  in.pages = kv::make_page_table(indptr.data(), indices.data(), last.data(), B, S);
  in.pages.per_head = true;
  auto check = [&](auto tag) {
    using P = typename decltype(tag)::type;
    kv::evictor<P, kv::cpu::backend> ev;
    const auto a = kvtest::run_lib(ev, st.in, kv::budget_request::fraction(0.3));
    const auto b = kvtest::run_lib(ev, in, kv::budget_request::fraction(0.3));
    INFO(std::string(b.st.message()));
    REQUIRE(a.st.ok());
    REQUIRE(b.st.ok());
    CHECK(a.indptr == b.indptr);
    CHECK(a.indices == b.indices);
  };
  check(std::common_type<kv::presets::snapkv>{});
  check(std::common_type<kv::presets::restkv>{});
  check(std::common_type<kv::presets::adakv>{});
}

namespace {

/// Row r of a selection keeps slots 0 .. pre - 1 (and maybe more).
bool keeps_prefix(const kvtest::lib_result& res, std::int64_t r, std::int32_t pre) {
  const std::int32_t beg = res.indptr[static_cast<std::size_t>(r)], end = res.indptr[static_cast<std::size_t>(r) + 1];
  bool keeps = end - beg >= pre;
  for (std::int32_t i = 0; keeps && i < pre; ++i) keeps = res.indices[static_cast<std::size_t>(beg + i)] == i;
  return keeps;
}

/// A paged copy with a protected prefix of P tokens in every sequence: the evictor keeps them as
/// sinks (plan_head_protected), exactly as the contiguous view with selector.num_sink = P when the
/// budget already holds them, and raises a smaller token budget to them.
template <class Policy>
void check_protected_prefix(const char* name, const kvtest::stored<float>& st, typename Policy::params params, std::int32_t P,
                            long& rows_checked) {
  kvtest::paged_copy<float> pg;
  kvtest::make_paged(st.in, 16, kvtest::pool_layout::hnd, false, false, 41, pg, true);
  std::vector<std::int32_t> prefix(static_cast<std::size_t>(st.in.batch()), P);
  pg.in.pages.protected_prefix = prefix.data();
  kv::evictor<Policy, kv::cpu::backend> paged_ev(params);
  auto ref_params = params;
  ref_params.selector.num_sink = P;
  kv::evictor<Policy, kv::cpu::backend> ref_ev(ref_params);
  for (double f : {0.3, 0.6}) {
    INFO(std::string(name) << " prefix " << P << " keep " << f);
    const auto a = kvtest::run_lib(ref_ev, st.in, kv::budget_request::fraction(f));
    const auto b = kvtest::run_lib(paged_ev, pg.in, kv::budget_request::fraction(f));
    REQUIRE_MESSAGE(a.st.ok(), std::string(a.st.message()));
    REQUIRE_MESSAGE(b.st.ok(), std::string(b.st.message()));
    CHECK(a.indptr == b.indptr);
    CHECK(a.indices == b.indices);
    // every row keeps [0, P)
    for (std::int64_t r = 0; r < b.rows; ++r, ++rows_checked) CHECK(keeps_prefix(b, r, P));
  }
  // prefixes that differ per sequence: each sequence's rows keep their own prefix
  std::vector<std::int32_t> mixed = {P, P / 2};
  pg.in.pages.protected_prefix = mixed.data();
  {
    const auto m = kvtest::run_lib(paged_ev, pg.in, kv::budget_request::fraction(0.3));
    REQUIRE_MESSAGE(m.st.ok(), std::string(m.st.message()));
    const std::int64_t H = paged_ev.out_heads(pg.in);
    for (std::int64_t r = 0; r < m.rows; ++r) CHECK(keeps_prefix(m, r, mixed[static_cast<std::size_t>(r / H)]));
  }
  pg.in.pages.protected_prefix = prefix.data();
  // a token budget below the prefix and the window: raised to them (the contiguous view refuses it)
  const std::int64_t window = st.in.window();
  const auto small = kv::budget_request::tokens(std::max<std::int32_t>(1, P / 2) + static_cast<std::int32_t>(window));
  const auto c = kvtest::run_lib(paged_ev, pg.in, small);
  REQUIRE_MESSAGE(c.st.ok(), std::string(c.st.message()));
  for (std::int64_t r = 0; r < c.rows; ++r) CHECK(keeps_prefix(c, r, P));
}

}  // namespace

TEST_CASE("paged: the protected prefix (pages.protected_prefix) is kept by the evictor, as sinks") {
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = 2, sh.cap = 150, sh.d = 16, sh.window = 8, sh.hidden = 32;
  kvtest::problem p = kvtest::make_problem(sh, 977, 1.0, 1.5, 1.0, {150, 150, 120, 120});
  kvtest::stored<float> st;
  kvtest::store(p, kvtest::layout::hnd, st);
  long rows = 0;
  for (std::int32_t P : {16, 32}) {  // whole pages: shared prefix pages
    check_protected_prefix<kv::presets::snapkv>("snapkv", st, kv::presets::snapkv::defaults(), P, rows);
    check_protected_prefix<kv::presets::adakv>("adakv", st, kv::presets::adakv::defaults(), P, rows);
    check_protected_prefix<kv::presets::restkv>("restkv", st, kv::presets::restkv::defaults(), P, rows);
    check_protected_prefix<kv::presets::pyramidkv>("pyramidkv", st, kv::presets::pyramidkv::defaults(), P, rows);
  }
  CHECK(rows > 50);
}
