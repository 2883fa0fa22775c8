// Sharded eviction over a real MPI (kvevict/distributed.hpp, docs/distributed.md), run by ctest
// under mpiexec at 1, 2, 3 and 4 ranks. Every rank builds the same whole layer (same seed, or
// the same stories260K prefill), runs the single-process evictor on it, then run_sharded on the
// heads its shard holds: each of its rows must equal the single-process row of that global head,
// bit for bit, and the kept tokens summed over ranks must equal the single-process total.
// Bad shard descriptions and bad inputs on one rank must give an error on every rank, and the
// next collective must still work (no rank left waiting: a hang would hit ctest's timeout).
// Only CHECKs (no REQUIRE that could stop one rank alone): every rank calls the same collectives.
#include <mpi.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/distributed/mpi.hpp>
#include <kvevict/backends/cpu/learned.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "engine/engine_fixture.hpp"
#include "reference/paged.hpp"
#include "reference/thread_communicator.hpp"

namespace {

using kvevict::budget_request;
using kvevict::status;
namespace dist = kvevict::distributed;

int g_rank = 0, g_size = 1;

/// One layer held densely: K/V (batch, kv_heads, seq, d) row-major, queries (batch, q_heads,
/// window, d), per-head lengths (batch, kv_heads), optional W_O factor (q_heads, d, d) and W_O
/// (hidden, q_heads * d).
struct dense_layer {
  std::int64_t B = 1, H = 1, G = 1, S = 0, d = 0, W = 0, C = 0;
  int layer = 0, num_layers = 1;
  std::vector<float> k, v, q, wof, wo;
  std::vector<std::int32_t> len;

  kvevict::layer_inputs<float> inputs() const {
    kvevict::layer_inputs<float> in;
    in.keys = kvevict::make_kv_view<const float>(k.data(), B, H, S, d, kvevict::kv_layout::hnd);
    in.values = kvevict::make_kv_view<const float>(v.data(), B, H, S, d, kvevict::kv_layout::hnd);
    if (W > 0) in.queries = kvevict::make_query_view<const float>(q.data(), B, H * G, W, d, kvevict::kv_layout::hnd);
    in.lengths = kvevict::per_head_lengths(len.data(), B, H);
    if (!wof.empty()) in.wo_factor = kvevict::strided_view<const float, 3>{wof.data(), {H * G, d, d}, {d * d, d, 1}};
    if (!wo.empty()) in.wo = kvevict::strided_view<const float, 2>{wo.data(), {C, H * G * d}, {H * G * d, 1}};
    in.layer_idx = layer;
    in.num_layers = num_layers;
    return in;
  }

  /// The heads of a shard, in its order (a copy: what the rank holds).
  dense_layer slice(const std::vector<std::int32_t>& heads) const {
    dense_layer o = *this;
    const std::int64_t h = static_cast<std::int64_t>(heads.size());
    o.H = h;
    o.k.assign(static_cast<std::size_t>(B * h * S * d), 0.0f);
    o.v = o.k;
    o.q.assign(static_cast<std::size_t>(B * h * G * W * d), 0.0f);
    o.len.assign(static_cast<std::size_t>(B * h), 0);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < h; ++i) {
        const std::int64_t g = heads[static_cast<std::size_t>(i)];
        std::copy_n(k.begin() + (b * H + g) * S * d, S * d, o.k.begin() + (b * h + i) * S * d);
        std::copy_n(v.begin() + (b * H + g) * S * d, S * d, o.v.begin() + (b * h + i) * S * d);
        if (W > 0) std::copy_n(q.begin() + (b * H + g) * G * W * d, G * W * d, o.q.begin() + (b * h + i) * G * W * d);
        o.len[static_cast<std::size_t>(b * h + i)] = len[static_cast<std::size_t>(b * H + g)];
      }
    if (!wof.empty()) {
      o.wof.assign(static_cast<std::size_t>(h * G * d * d), 0.0f);
      for (std::int64_t i = 0; i < h; ++i)
        std::copy_n(wof.begin() + heads[static_cast<std::size_t>(i)] * G * d * d, G * d * d, o.wof.begin() + i * G * d * d);
    }
    if (!wo.empty()) {
      o.wo.assign(static_cast<std::size_t>(C * h * G * d), 0.0f);
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t i = 0; i < h; ++i)
          std::copy_n(wo.begin() + c * H * G * d + heads[static_cast<std::size_t>(i)] * G * d, G * d,
                      o.wo.begin() + c * h * G * d + i * G * d);
    }
    return o;
  }
};

dense_layer random_layer(std::uint64_t seed, std::int64_t B, std::int64_t H, std::int64_t G, std::int64_t S, std::int64_t d,
                         std::int64_t W, bool ragged, bool with_wo) {
  kvtest::rng r(seed);
  dense_layer L;
  L.B = B, L.H = H, L.G = G, L.S = S, L.d = d, L.W = W, L.C = with_wo ? 2 * d : 0;
  L.layer = 1;
  L.num_layers = 3;
  for (std::int64_t i = 0; i < B * H * S * d; ++i) L.k.push_back(static_cast<float>(r.normal()));
  for (std::int64_t i = 0; i < B * H * S * d; ++i) L.v.push_back(static_cast<float>(r.normal()));
  for (std::int64_t i = 0; i < B * H * G * W * d; ++i) L.q.push_back(static_cast<float>(r.normal()));
  // ragged: sequence 0 short (W + 1 .. 24 tokens: with a 24-token budget every head passes
  // through, no choice) beside longer sequences (a choice): one batch, both kinds
  for (std::int64_t i = 0; i < B * H; ++i)
    L.len.push_back(static_cast<std::int32_t>(!ragged ? S : (i < H ? r.integer(W + 1, 24) : r.integer(S / 2, S))));
  if (with_wo)
    for (std::int64_t i = 0; i < L.C * H * G * d; ++i) L.wo.push_back(static_cast<float>(0.3 * r.normal()));
  // scores tied across heads and slots: repeated keys and values (the radix select's ties)
  for (std::int64_t i = 0; i < B * H * S * d; i += 5 * d)
    for (std::int64_t c = 0; c < d; ++c) {
      L.k[static_cast<std::size_t>(i + c)] = 0.25f;
      L.v[static_cast<std::size_t>(i + c)] = 0.5f;
    }
  // odd heads repeat the head before them (keys, values, queries, lengths): equal score rows in
  // two heads, so the threshold's ties span heads and their order (lower global row first) counts
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 1; h < H; h += 2) {
      std::copy_n(L.k.begin() + (b * H + h - 1) * S * d, S * d, L.k.begin() + (b * H + h) * S * d);
      std::copy_n(L.v.begin() + (b * H + h - 1) * S * d, S * d, L.v.begin() + (b * H + h) * S * d);
      std::copy_n(L.q.begin() + (b * H + h - 1) * G * W * d, G * W * d, L.q.begin() + (b * H + h) * G * W * d);
      L.len[static_cast<std::size_t>(b * H + h)] = L.len[static_cast<std::size_t>(b * H + h - 1)];
    }
  return L;
}

/// The shard layouts tried: contiguous blocks, interleaved heads, a permuted split.
std::vector<std::int32_t> shard_heads(int layout, int rank, int size, std::int64_t H) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h) all[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h);
  std::vector<std::int32_t> out;
  if (layout == 0) {
    for (std::int64_t h = rank * H / size; h < (rank + 1) * H / size; ++h) out.push_back(static_cast<std::int32_t>(h));
  } else if (layout == 1) {
    for (std::int64_t h = rank; h < H; h += size) out.push_back(static_cast<std::int32_t>(h));
  } else {
    kvtest::rng r(77);
    for (std::int64_t i = H - 1; i > 0; --i) std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(r.integer(0, i))]);
    // uneven: rank 0 gets the remainder
    const std::int64_t base = H / size, extra = H - base * size;
    const std::int64_t first = rank == 0 ? 0 : extra + rank * base, n = base + (rank == 0 ? extra : 0);
    for (std::int64_t i = first; i < first + n; ++i) out.push_back(all[static_cast<std::size_t>(i)]);
  }
  return out;
}

struct csr {
  std::vector<std::int32_t> indptr, indices;
  std::vector<float> scores;
  kvevict::selection_view view() {
    kvevict::selection_view s;
    s.indptr = indptr.data();
    s.indices = indices.data();
    s.capacity = static_cast<std::int64_t>(indices.size());
    return s;
  }
  std::vector<std::int32_t> row(std::int64_t r) const {
    return std::vector<std::int32_t>(indices.begin() + indptr[static_cast<std::size_t>(r)], indices.begin() + indptr[static_cast<std::size_t>(r) + 1]);
  }
};

/// Runs the single-process evictor on `whole` and run_sharded on this rank's heads; checks every
/// local row against its global row. Returns the sharded run's status (after the checks).
/// page_size > 0: the rank's heads are read through a page pool (one-head pages, per-(sequence,
/// KV head) tables, shuffled ids, rows starting inside their first page) instead of a dense copy.
template <class Policy>
status check_equal(const char* what, const dense_layer& whole, const typename Policy::params& global_params,
                   const typename Policy::params& local_params, const std::vector<std::int32_t>& heads, const budget_request& req,
                   dist::communicator* comm, dist::exchange_stats* stats = nullptr, std::int64_t page_size = 0) {
  kvevict::evictor<Policy, kvevict::cpu::backend> ev1(global_params, kvevict::cpu::backend{1});
  const kvevict::layer_inputs<float> in1 = whole.inputs();
  const std::int64_t H1 = ev1.out_heads(in1), G = H1 / whole.H, S = whole.S;
  csr ref;
  ref.indptr.assign(static_cast<std::size_t>(whole.B * H1 + 1), 0);
  ref.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(1, ev1.max_selected(in1, req))), -1);
  ref.scores.assign(static_cast<std::size_t>(whole.B * H1 * S), 0.0f);
  const status s1 = ev1.run(in1, req, ref.view(), ref.scores.data());

  const dense_layer part = whole.slice(heads);
  kvevict::layer_inputs<float> in = part.inputs();
  kvtest::paged_copy<float> pg;
  if (page_size > 0) {
    kvtest::make_paged(in, page_size, kvtest::pool_layout::nhd, true, true, 11 + static_cast<std::uint64_t>(g_rank), pg, true, 3, false, true);
    in = pg.in;
  }
  const std::int64_t Sl = in.capacity();  // the paged view's capacity may exceed S
  kvevict::evictor<Policy, kvevict::cpu::backend> ev(local_params, kvevict::cpu::backend{1});
  kvevict::plan_options opt;
  opt.sharded = true;
  kvevict::eviction_plan pl;
  status st = ev.plan(in, req, &pl, opt);
  const std::int64_t H = static_cast<std::int64_t>(heads.size()) * G;
  csr got;
  got.indptr.assign(static_cast<std::size_t>(whole.B * H + 1), 0);
  got.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(1, st.ok() ? pl.max_selected : 1)), -1);
  got.scores.assign(static_cast<std::size_t>(whole.B * H * Sl), 0.0f);
  std::vector<unsigned char> ws(st.ok() ? pl.workspace_bytes : 0);
  dist::shard sh;
  sh.global_kv_heads = static_cast<std::int32_t>(whole.H);
  sh.heads = heads.data();
  sh.num_heads = static_cast<std::int32_t>(heads.size());
  // a plan error still calls run_sharded (with the plan it has): the error travels to every rank
  st = ev.run_sharded(pl, in, comm, sh, got.view(), ws.data(), ws.size(), got.scores.data(), stats);
  CAPTURE(what);
  CAPTURE(g_rank);
  CAPTURE(g_size);
  CHECK_MESSAGE(s1.ok(), s1.message());
  CHECK_MESSAGE(st.ok(), st.message());
  if (!(s1.ok() && st.ok())) return st;
  std::int64_t mismatched = 0, scores_differ = 0;
  for (std::int64_t b = 0; b < whole.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t gr = b * H1 + heads[static_cast<std::size_t>(h / G)] * G + h % G, lr = b * H + h;
      if (got.row(lr) != ref.row(gr)) ++mismatched;
      const std::int64_t n = page_size > 0 ? part.len[static_cast<std::size_t>(b * part.H + h / G)] : S;  // paged: the valid slots
      if (std::memcmp(got.scores.data() + lr * Sl, ref.scores.data() + gr * S, static_cast<std::size_t>(n) * sizeof(float)) != 0)
        ++scores_differ;
    }
  CHECK(mismatched == 0);
  CHECK(scores_differ == 0);
  // budgets sum exactly: the kept tokens over all ranks = the single-process total
  std::int64_t kept = got.indptr.back();
  CHECK(comm->all_reduce_sum(&kept, 1).ok());
  CHECK(kept == static_cast<std::int64_t>(ref.indptr.back()));
  return st;
}

/// Random LKV tables for 3 layers of H KV heads: LKV-T's MLP blocks and LKV-H's logits.
void random_lkv_tables(std::uint64_t seed, std::int64_t H, std::int64_t d, int hid, std::vector<float>* mlp, std::vector<float>* logits) {
  kvtest::rng r(seed);
  const std::int64_t block = kvevict::scorers::learned_mlp::block_floats(d, hid);
  for (std::int64_t i = 0; i < 3 * H * block; ++i) mlp->push_back(static_cast<float>(0.5 * r.normal()));
  for (std::int64_t i = 0; i < 3 * H; ++i) logits->push_back(static_cast<float>(r.normal()));
}

template <class P>
void set_lkv(P& p, const std::vector<float>& mlp, const std::vector<float>& logits, int layers, std::int64_t H, std::int64_t d, int hid,
             std::int64_t num_tokens) {
  p.scorer.weights = mlp.data();
  p.scorer.num_layers = layers;
  p.scorer.kv_heads = static_cast<std::int32_t>(H);
  p.scorer.head_dim = static_cast<std::int32_t>(d);
  p.scorer.hidden = hid;
  p.budgeter.logits = logits.data();
  p.budgeter.num_layers = layers;
  p.budgeter.kv_heads = static_cast<std::int32_t>(H);
  p.budgeter.num_tokens = num_tokens;
}

/// LKV params sliced for a shard (LKV-T's table; LKV-H stays global).
kvevict::lkv::full::params lkv_local(const kvevict::lkv::full::params& global, const std::vector<std::int32_t>& heads,
                                     std::vector<float>* storage) {
  dist::shard sh;
  sh.global_kv_heads = global.scorer.kv_heads;
  sh.heads = heads.data();
  sh.num_heads = static_cast<std::int32_t>(heads.size());
  kvevict::lkv::full::params p = global;
  const status st = dist::shard_learned_scorer(global.scorer, sh, storage, &p.scorer);
  CHECK_MESSAGE(st.ok(), st.message());
  return p;
}

/// LKV (params ll, sliced for `heads`) run sharded at 30% on this rank's heads of L; the status.
status run_lkv_sharded(const dense_layer& L, const kvevict::lkv::full::params& ll, const std::vector<std::int32_t>& heads,
                       dist::communicator* comm) {
  kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(ll);
  const dense_layer part = L.slice(heads);
  kvevict::plan_options opt;
  opt.sharded = true;
  kvevict::eviction_plan pl;
  CHECK(ev.plan(part.inputs(), budget_request::fraction(0.3), &pl, opt).ok());
  std::vector<std::int32_t> indptr(heads.size() + 1), idx(static_cast<std::size_t>(pl.max_selected + 1));
  kvevict::selection_view sel;
  sel.indptr = indptr.data();
  sel.indices = idx.data();
  sel.capacity = static_cast<std::int64_t>(idx.size());
  std::vector<unsigned char> ws(pl.workspace_bytes);
  dist::shard sh{static_cast<std::int32_t>(L.H), heads.data(), static_cast<std::int32_t>(heads.size())};
  return ev.run_sharded(pl, part.inputs(), comm, sh, sel, ws.data(), ws.size());
}

}  // namespace

TEST_CASE("sharded == single process: AdaKV, CriticalAdaKV, PyramidKV, LKV on random layers, three shard layouts") {
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const std::int64_t B = 2, H = 6, G = 2, S = 96, d = 16, W = 8;
  const int hid = 8;
  std::vector<float> mlp, logits;
  random_lkv_tables(5, H, d, hid, &mlp, &logits);
  for (int ragged = 0; ragged < 2; ++ragged)
    for (int layout = 0; layout < 3; ++layout) {
      const std::vector<std::int32_t> heads = shard_heads(layout, g_rank, g_size, H);
      const dense_layer L = random_layer(100 + ragged, B, H, G, S, d, W, ragged != 0, true);
      for (const budget_request& req : {budget_request::fraction(0.2), budget_request::tokens(24)}) {
        CAPTURE(ragged);
        CAPTURE(layout);
        dist::exchange_stats st;
        (void)check_equal<kvevict::presets::adakv>("adakv", L, {}, {}, heads, req, &comm, &st);
        // the exchange: 2 rounds, then the radix select (4) and the tie counts (1) when there is a choice
        CHECK(st.rounds == 8);
        CHECK(st.radix_rounds == 4);
        CHECK(st.bytes == 8 * (19 + B * H * (1 + 5) + 4 * B * 256 + B * H * 2 + 1));
        auto a0 = kvevict::presets::adakv::defaults();
        a0.budgeter.alpha = 0.0f;
        (void)check_equal<kvevict::presets::adakv>("adakv alpha 0", L, a0, a0, heads, req, &comm);
        auto pq = kvevict::presets::adakv::defaults();
        pq.gqa = kvevict::gqa_reduction::per_query_head;
        (void)check_equal<kvevict::presets::adakv>("adakv per_query_head", L, pq, pq, heads, req, &comm, &st);
        CHECK(st.bytes == 8 * (19 + B * H * (1 + 5 * G) + 4 * B * 256 + B * H * G * 2 + 1));
        (void)check_equal<kvevict::presets::critical_adakv>("critical_adakv", L, {}, {}, heads, req, &comm);
        (void)check_equal<kvevict::presets::pyramidkv>("pyramidkv", L, {}, {}, heads, req, &comm, &st);
        CHECK(st.rounds == 3);
        CHECK(st.radix_rounds == 0);
        CHECK(st.bytes == 8 * (19 + B * H * (1 + 5) + 1));
        kvevict::lkv::full::params lg = kvevict::lkv::full::defaults();
        set_lkv(lg, mlp, logits, 3, H, d, hid, ragged ? S : 0);
        std::vector<float> storage;
        const auto ll = lkv_local(lg, heads, &storage);
        (void)check_equal<kvevict::lkv::full>("lkv", L, lg, ll, heads, req, &comm, &st);
        CHECK(st.rounds == 3);
        CHECK(st.bytes == 8 * (19 + B * H * (1 + 5) + 1));
        // NaN scores (check_finite off): NaN ranks below every score, on one device and sharded
        dense_layer nan_layer = L;
        nan_layer.k[static_cast<std::size_t>((1 * H + 2) * S * d + 5 * d + 1)] = NAN;  // sequence 1, head 2, slot 5
        auto pn = kvevict::presets::adakv::defaults();
        pn.check_finite = false;
        (void)check_equal<kvevict::presets::adakv>("adakv NaN scores", nan_layer, pn, pn, heads, req, &comm);
      }
    }
}

TEST_CASE("sharded over paged caches (per-head tables, start offsets) == single process: AdaKV, PyramidKV, LKV") {
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const std::int64_t B = 2, H = 6, G = 2, S = 96, d = 16, W = 8;
  const int hid = 8;
  std::vector<float> mlp, logits;
  random_lkv_tables(6, H, d, hid, &mlp, &logits);
  const dense_layer L = random_layer(103, B, H, G, S, d, W, true, true);
  for (int layout = 0; layout < 3; ++layout)
    for (std::int64_t ps : {1, 16}) {
      CAPTURE(layout);
      CAPTURE(ps);
      const std::vector<std::int32_t> heads = shard_heads(layout, g_rank, g_size, H);
      const budget_request req = budget_request::fraction(0.2);
      dist::exchange_stats st;
      (void)check_equal<kvevict::presets::adakv>("adakv paged", L, {}, {}, heads, req, &comm, &st, ps);
      CHECK(st.rounds == 8);
      (void)check_equal<kvevict::presets::pyramidkv>("pyramidkv paged", L, {}, {}, heads, req, &comm, nullptr, ps);
      kvevict::lkv::full::params lg = kvevict::lkv::full::defaults();
      set_lkv(lg, mlp, logits, 3, H, d, hid, S);
      std::vector<float> storage;
      (void)check_equal<kvevict::lkv::full>("lkv paged", L, lg, lkv_local(lg, heads, &storage), heads, req, &comm, nullptr, ps);
    }
}

TEST_CASE("KV-head replication: each replica group (MPI_Comm_split) gives the single-process selection") {
  // Ranks r and r + 2, ... hold the same heads (TP > KV heads); each run_sharded call uses the
  // group of one replica of every head, as docs/distributed.md says to wire it.
  MPI_Comm group;
  MPI_Comm_split(MPI_COMM_WORLD, g_size > 1 ? g_rank % 2 : 0, g_rank, &group);
  {
    dist::mpi_communicator comm(group);
    const std::int64_t B = 1, H = 4, G = 2, S = 64, d = 8, W = 8;
    const dense_layer L = random_layer(31, B, H, G, S, d, W, true, true);
    const std::vector<std::int32_t> heads = shard_heads(2, comm.rank(), comm.size(), H);
    CAPTURE(comm.rank());
    CAPTURE(comm.size());
    (void)check_equal<kvevict::presets::adakv>("replica adakv", L, {}, {}, heads, budget_request::fraction(0.3), &comm);
    (void)check_equal<kvevict::presets::critical_adakv>("replica critical_adakv", L, {}, {}, heads, budget_request::fraction(0.3), &comm);
  }
  MPI_Comm_free(&group);
}

TEST_CASE("sharded LKV refuses ragged heads without num_tokens on every rank, as one process does") {
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const std::int64_t B = 1, H = 4, G = 1, S = 64, d = 8, W = 4;
  const int hid = 4;
  dense_layer L = random_layer(9, B, H, G, S, d, W, false, false);
  L.len[static_cast<std::size_t>(H - 1)] = 40;  // the last head (on the last rank) is shorter
  std::vector<float> mlp(static_cast<std::size_t>(3 * H * kvevict::scorers::learned_mlp::block_floats(d, hid)), 0.1f), logits(3 * H, 0.0f);
  kvevict::lkv::full::params lg = kvevict::lkv::full::defaults();
  set_lkv(lg, mlp, logits, 3, H, d, hid, 0);
  const std::vector<std::int32_t> heads = shard_heads(0, g_rank, g_size, H);
  std::vector<float> storage;
  const auto ll = lkv_local(lg, heads, &storage);
  const status st = run_lkv_sharded(L, ll, heads, &comm);
  CHECK(!st.ok());
  CHECK(std::string(st.message()).find("head lengths differ") != std::string::npos);
}

TEST_CASE("bad shard descriptions and bad inputs on one rank: an error on every rank, none left waiting") {
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const std::int64_t B = 1, H = 4, G = 2, S = 48, d = 8, W = 4;
  const dense_layer L = random_layer(21, B, H, G, S, d, W, false, false);
  const budget_request req = budget_request::fraction(0.25);
  using ev_t = kvevict::evictor<kvevict::presets::adakv, kvevict::cpu::backend>;
  const int last = g_size - 1;
  // one sharded run with a given shard / input on this rank; returns the status
  auto run = [&](std::vector<std::int32_t> heads, std::int32_t global, const dense_layer& whole, bool sharded_plan,
                 const kvevict::presets::adakv::params& p, std::int64_t capacity = -1) {
    ev_t ev(p);
    // the layer this rank holds: its heads, or head 0 for indices the test made invalid
    std::vector<std::int32_t> take = heads;
    for (auto& h : take) h = (h >= 0 && h < whole.H) ? h : 0;
    const dense_layer part = whole.slice(take);
    kvevict::plan_options opt;
    opt.sharded = sharded_plan;
    kvevict::eviction_plan pl;
    (void)ev.plan(part.inputs(), req, &pl, opt);
    std::vector<std::int32_t> indptr(heads.size() * G + 1, -7), idx(static_cast<std::size_t>(part.H * G * S), -7);
    std::vector<float> scores(static_cast<std::size_t>(part.H * G * S), -7.0f);
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = idx.data();
    sel.capacity = capacity >= 0 ? capacity : static_cast<std::int64_t>(idx.size());
    std::vector<unsigned char> ws(pl.workspace_bytes + 64);
    dist::shard sh{global, heads.data(), static_cast<std::int32_t>(heads.size())};
    const status st = ev.run_sharded(pl, part.inputs(), &comm, sh, sel, ws.data(), ws.size(), scores.data());
    if (!st.ok()) {  // outputs untouched on error
      CHECK(std::all_of(indptr.begin(), indptr.end(), [](std::int32_t x) { return x == -7; }));
      CHECK(std::all_of(idx.begin(), idx.end(), [](std::int32_t x) { return x == -7; }));
      CHECK(std::all_of(scores.begin(), scores.end(), [](float x) { return x == -7.0f; }));
    }
    return st;
  };
  auto contains = [](const status& s, const char* what) { return std::string(s.message()).find(what) != std::string::npos; };
  const auto def = kvevict::presets::adakv::defaults();
  const std::vector<std::int32_t> mine = shard_heads(0, g_rank, g_size, H);
  // the good run works (and works again after each bad one: the group is in step)
  auto good = [&]() {
    const status s = run(mine, static_cast<std::int32_t>(H), L, true, def);
    CHECK_MESSAGE(s.ok(), s.message());
  };
  good();
  SUBCASE("overlapping heads") {
    std::vector<std::int32_t> h = mine;
    if (g_rank == last) h[0] = g_size > 1 ? 0 : h.back();  // rank last also claims head 0 (one rank: a local repeat)
    if (g_size == 1 && h.size() > 1) h[0] = h[1];
    const status s = run(h, static_cast<std::int32_t>(H), L, true, def);
    CHECK(!s.ok());
    CHECK((contains(s, "held by 2 ranks") || contains(s, "held twice") || contains(s, "failed")));
    good();
  }
  SUBCASE("a missing head") {
    std::vector<std::int32_t> h = mine;
    if (g_rank == last) h.pop_back();
    if (!h.empty()) {
      const status s = run(h, static_cast<std::int32_t>(H), L, true, def);
      CHECK(!s.ok());
      CHECK((contains(s, "KV heads in all") || contains(s, "failed")));
    } else {
      // this rank now holds no head of the layer; it still takes part (its layer_inputs cannot
      // be empty, so it passes one head and a shard of none: its own error, sent to the others)
      const dense_layer none = L.slice({0});
      ev_t ev(def);
      kvevict::plan_options opt;
      opt.sharded = true;
      kvevict::eviction_plan pl;
      (void)ev.plan(none.inputs(), req, &pl, opt);
      std::vector<std::int32_t> indptr(G + 1), idx(static_cast<std::size_t>(G * S));
      kvevict::selection_view sel;
      sel.indptr = indptr.data();
      sel.indices = idx.data();
      sel.capacity = static_cast<std::int64_t>(idx.size());
      std::vector<unsigned char> ws(pl.workspace_bytes + 64);
      dist::shard sh{static_cast<std::int32_t>(H), h.data(), 0};
      const status s = ev.run_sharded(pl, none.inputs(), &comm, sh, sel, ws.data(), ws.size());
      CHECK(!s.ok());
      CHECK(contains(s, "shard.num_heads = 0"));
    }
    good();
  }
  SUBCASE("a head outside the layer") {
    std::vector<std::int32_t> h = mine;
    if (g_rank == last) h[0] = static_cast<std::int32_t>(H);
    const status s = run(h, static_cast<std::int32_t>(H), L, true, def);
    CHECK(!s.ok());
    CHECK(contains(s, g_rank == last ? "outside [0, global_kv_heads" : "failed"));
    good();
  }
  SUBCASE("ranks disagree on the layer's head count") {
    const status s = run(mine, static_cast<std::int32_t>(g_rank == last ? H + 1 : H), L, true, def);
    CHECK(!s.ok());
    CHECK((g_size == 1 ? contains(s, "KV heads in all") : contains(s, "disagree on shard.global_kv_heads")));
    good();
  }
  SUBCASE("ranks disagree on the budgeter (mismatched tables)") {
    auto p = def;
    if (g_rank == last) p.budgeter.alpha = 0.5f;
    const status s = run(mine, static_cast<std::int32_t>(H), L, true, p);
    if (g_size > 1) {
      CHECK(!s.ok());
      CHECK(contains(s, "ranks disagree on the budgeter's parameters: rank 0 has hash "));
    } else {
      CHECK(s.ok());
    }
    good();
  }
  SUBCASE("NaN in one rank's keys") {
    dense_layer bad = L;
    for (std::int32_t h : mine) bad.k[static_cast<std::size_t>(h * S * d + 3)] = g_rank == last ? NAN : bad.k[static_cast<std::size_t>(h * S * d + 3)];
    const status s = run(mine, static_cast<std::int32_t>(H), bad, true, def);
    CHECK(!s.ok());
    CHECK(s.code() == kvevict::errc::non_finite_input);
    CHECK(contains(s, g_rank == last ? "is not finite" : "failed (non_finite_input)"));
    good();
  }
  SUBCASE("one rank's selection capacity is too small: no rank writes") {
    const status s = run(mine, static_cast<std::int32_t>(H), L, true, def, g_rank == last ? 3 : -1);
    CHECK(!s.ok());
    CHECK(s.code() == kvevict::errc::insufficient_capacity);
    CHECK(contains(s, g_rank == last ? "selection.capacity = 3" : "failed after the budgets"));
    good();
  }
  SUBCASE("run() refuses a sharded plan (no collective: it is not a sharded call)") {
    ev_t ev(def);
    const dense_layer part = L.slice(mine);
    kvevict::plan_options opt;
    opt.sharded = true;
    kvevict::eviction_plan pl;
    CHECK(ev.plan(part.inputs(), req, &pl, opt).ok());
    CHECK(!pl.max_selected_exact);
    std::vector<std::int32_t> indptr(mine.size() * G + 1), idx(static_cast<std::size_t>(pl.max_selected));
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = idx.data();
    sel.capacity = pl.max_selected;
    std::vector<unsigned char> ws(pl.workspace_bytes);
    const status s = ev.run(pl, part.inputs(), sel, ws.data(), ws.size());
    CHECK(contains(s, "call run_sharded()"));
    good();
  }
  SUBCASE("a plan made without plan_options::sharded") {
    const status s = run(mine, static_cast<std::int32_t>(H), L, g_rank != last, def);
    CHECK(!s.ok());
    CHECK(contains(s, g_rank == last ? "needs a plan made with plan_options::sharded" : "failed"));
    good();
  }
}

TEST_CASE("sharded LKV: mismatched budget tables are refused on every rank") {
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const std::int64_t B = 1, H = 4, G = 1, S = 40, d = 8, W = 4;
  const int hid = 4;
  const dense_layer L = random_layer(3, B, H, G, S, d, W, false, false);
  std::vector<float> mlp(static_cast<std::size_t>(3 * H * kvevict::scorers::learned_mlp::block_floats(d, hid)), 0.1f), logits(3 * H, 0.0f);
  if (g_rank == g_size - 1 && g_size > 1) logits[5] = 0.5f;  // another artifact on the last rank
  kvevict::lkv::full::params lg = kvevict::lkv::full::defaults();
  set_lkv(lg, mlp, logits, 3, H, d, hid, 0);
  const std::vector<std::int32_t> heads = shard_heads(1, g_rank, g_size, H);
  std::vector<float> storage;
  const auto ll = lkv_local(lg, heads, &storage);
  const status st = run_lkv_sharded(L, ll, heads, &comm);
  CHECK(st.ok() == (g_size == 1));
  if (g_size > 1) CHECK(std::string(st.message()).find("ranks disagree on the budgeter's parameters") != std::string::npos);
  // and a scorer table of another shape
  std::vector<float> st2;
  dist::shard wrong{static_cast<std::int32_t>(H + 1), heads.data(), static_cast<std::int32_t>(heads.size())};
  kvevict::scorers::learned_mlp::params outp;
  const status e = dist::shard_learned_scorer(lg.scorer, wrong, &st2, &outp);
  CHECK(e.code() == kvevict::errc::shape_mismatch);
}

/// A layer's K/V/queries as another storage type (a rank that holds bf16 while the others hold fp32).
template <class T>
struct typed_layer {
  std::vector<T> k, v, q;
  kvevict::layer_inputs<T> in;
  explicit typed_layer(const dense_layer& L) {
    for (float x : L.k) k.push_back(kvevict::from_float<T>(x));
    for (float x : L.v) v.push_back(kvevict::from_float<T>(x));
    for (float x : L.q) q.push_back(kvevict::from_float<T>(x));
    const auto f = L.inputs();
    in.keys = kvevict::make_kv_view<const T>(k.data(), L.B, L.H, L.S, L.d, kvevict::kv_layout::hnd);
    in.values = kvevict::make_kv_view<const T>(v.data(), L.B, L.H, L.S, L.d, kvevict::kv_layout::hnd);
    in.queries = kvevict::make_query_view<const T>(q.data(), L.B, L.H * L.G, L.W, L.d, kvevict::kv_layout::hnd);
    in.lengths = f.lengths;
    in.layer_idx = f.layer_idx;
    in.num_layers = f.num_layers;
  }
};

TEST_CASE("sharding faults in one rank's terms are refused on every rank, naming the field (thread ranks)") {
  // In-process ranks (kvevict_test::thread_communicator), run once (not under every MPI rank). Rank
  // `ranks - 1` differs from the others in one term; every rank must get "ranks disagree on <field>"
  // with both values, and leave its selection untouched.
  if (g_rank != 0) return;
  using adakv_ev = kvevict::evictor<kvevict::presets::adakv, kvevict::cpu::backend>;
  const std::int64_t H = 4, S = 48, d = 8;
  const dense_layer L2 = random_layer(9, 1, H, 2, S, d, 6, false, false);  // G = 2, window 6
  const dense_layer L4 = random_layer(9, 1, H, 4, S, d, 6, false, false);  // G = 4
  const dense_layer LW = random_layer(9, 1, H, 2, S, d, 5, false, false);  // window 5
  struct fault {
    const char* name;
    const char* message;  // on every rank
  };
  const fault faults[] = {
      {"dtype", "ranks disagree on the K/V storage dtype: rank 0 has fp32, rank R has bf16"},
      {"group", "ranks disagree on the GQA group size (q_heads / kv_heads): rank 0 has 2, rank R has 4"},
      {"window", "ranks disagree on the observation window (query rows): rank 0 has 6, rank R has 5"},
      {"budget kind", "ranks disagree on budget.keep_tokens: rank 0 has 24, rank R has 0"},
      {"budget value", "ranks disagree on budget.keep_tokens: rank 0 has 24, rank R has 25"},
      {"sinks", "ranks disagree on selector.num_sink: rank 0 has 0, rank R has 4"},
      {"recent", "ranks disagree on selector.num_recent: rank 0 has -1, rank R has 3"},
      {"gqa", "ranks disagree on params.gqa: rank 0 has mean, rank R has max"},
      {"alpha", "ranks disagree on the budgeter's parameters: rank 0 has hash "},
      {"policy", "ranks disagree on the policy's stages (the names of its scorer, smoothers, budgeter and selector): rank 0 has hash "},
  };
  for (int ranks : {2, 3, 4}) {
    for (const fault& f : faults) {
      CAPTURE(ranks);
      const std::string name = f.name;
      CAPTURE(name);
      kvevict_test::thread_group group(ranks);
      std::vector<std::string> msg(static_cast<std::size_t>(ranks));
      std::vector<int> untouched(static_cast<std::size_t>(ranks), 0);
      kvevict_test::run_ranks(ranks, [&](int r) {
        kvevict_test::thread_communicator comm(&group, r);
        const bool odd = r == ranks - 1;
        const std::vector<std::int32_t> heads = shard_heads(0, r, ranks, H);
        const dense_layer& whole = odd && name == "group" ? L4 : odd && name == "window" ? LW : L2;
        const dense_layer part = whole.slice(heads);
        auto p = kvevict::presets::adakv::defaults();
        if (odd && name == "sinks") p.selector.num_sink = 4;
        if (odd && name == "recent") p.selector.num_recent = 3;
        if (odd && name == "gqa") p.gqa = kvevict::gqa_reduction::max;
        if (odd && name == "alpha") p.budgeter.alpha = 0.5f;
        budget_request req = budget_request::tokens(24);
        if (odd && name == "budget kind") req = budget_request::fraction(0.5);
        if (odd && name == "budget value") req = budget_request::tokens(25);
        dist::shard sh{static_cast<std::int32_t>(H), heads.data(), static_cast<std::int32_t>(heads.size())};
        kvevict::plan_options opt;
        opt.sharded = true;
        std::vector<std::int32_t> indptr(heads.size() + 1, -7), idx(static_cast<std::size_t>(H * S), -7);
        kvevict::selection_view sel;
        sel.indptr = indptr.data();
        sel.indices = idx.data();
        sel.capacity = static_cast<std::int64_t>(idx.size());
        status st;
        auto go = [&](const auto& ev, const auto& in) {
          kvevict::eviction_plan pl;
          (void)ev.plan(in, req, &pl, opt);  // a failed plan is run_sharded's round-1 error: every rank still meets
          std::vector<unsigned char> ws(pl.workspace_bytes + 64);
          st = ev.run_sharded(pl, in, &comm, sh, sel, ws.data(), ws.size());
        };
        if (odd && name == "dtype") {
          const typed_layer<kvevict::bfloat16_t> t(part);
          go(adakv_ev(p), t.in);
        } else if (odd && name == "policy") {
          go(kvevict::evictor<kvevict::presets::pyramidkv, kvevict::cpu::backend>(), part.inputs());
        } else {
          go(adakv_ev(p), part.inputs());
        }
        msg[static_cast<std::size_t>(r)] = st.ok() ? "ok" : st.message();
        untouched[static_cast<std::size_t>(r)] = std::all_of(indptr.begin(), indptr.end(), [](std::int32_t x) { return x == -7; }) &&
                                                std::all_of(idx.begin(), idx.end(), [](std::int32_t x) { return x == -7; });
      });
      std::string want = f.message;
      if (want.find("rank R") != std::string::npos) want.replace(want.find("rank R"), 6, "rank " + std::to_string(ranks - 1));
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        CHECK_MESSAGE(msg[static_cast<std::size_t>(r)].find(want) != std::string::npos, msg[static_cast<std::size_t>(r)]);
        CHECK(untouched[static_cast<std::size_t>(r)] == 1);
      }
    }
  }
}

TEST_CASE("ranks that fail for different reasons all return the lowest failing rank's category (thread ranks)") {
  // Found by tests/fuzz/fuzz_sharded.cpp: each failing rank returned its own error, so the ranks of
  // one layer disagreed on the category. Rank 0: NaN keys (non_finite_input); rank 2: a length of
  // -1 (invalid_argument); rank 1: no error of its own.
  if (g_rank != 0) return;
  const int ranks = 3;
  const std::int64_t H = 3, S = 32, d = 8;
  const dense_layer L = random_layer(21, 1, H, 2, S, d, 4, false, false);
  kvevict_test::thread_group group(ranks);
  std::vector<std::string> msg(ranks);
  std::vector<int> code(ranks, 0), untouched(ranks, 0);
  kvevict_test::run_ranks(ranks, [&](int r) {
    kvevict_test::thread_communicator comm(&group, r);
    const std::vector<std::int32_t> heads = {static_cast<std::int32_t>(r)};
    dense_layer part = L.slice(heads);
    if (r == 0) part.k[5] = NAN;
    if (r == 2) part.len[0] = -1;
    const kvevict::evictor<kvevict::presets::adakv, kvevict::cpu::backend> ev;
    const kvevict::layer_inputs<float> in = part.inputs();
    kvevict::plan_options opt;
    opt.sharded = true;
    kvevict::eviction_plan pl;
    (void)ev.plan(in, budget_request::tokens(8), &pl, opt);  // rank 2's plan fails: its run_sharded still meets the others
    std::vector<unsigned char> ws(pl.workspace_bytes + 64);
    std::vector<std::int32_t> indptr(3, -7), idx(static_cast<std::size_t>(2 * S), -7);
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = idx.data();
    sel.capacity = static_cast<std::int64_t>(idx.size());
    const dist::shard sh{static_cast<std::int32_t>(H), heads.data(), 1};
    const status st = ev.run_sharded(pl, in, &comm, sh, sel, ws.data(), ws.size());
    msg[static_cast<std::size_t>(r)] = st.message();
    code[static_cast<std::size_t>(r)] = static_cast<int>(st.code());
    untouched[static_cast<std::size_t>(r)] = std::all_of(indptr.begin(), indptr.end(), [](std::int32_t x) { return x == -7; });
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(code[static_cast<std::size_t>(r)] == static_cast<int>(kvevict::errc::non_finite_input));
    CHECK(untouched[static_cast<std::size_t>(r)] == 1);
  }
  CHECK_MESSAGE(msg[0].find("keys(b=0, h=0") != std::string::npos, msg[0]);
  CHECK_MESSAGE(msg[1].find("rank 0 of 3 failed (non_finite_input); rank 1 did not run the layer") != std::string::npos, msg[1]);
  CHECK_MESSAGE(msg[2].find("rank 0 of 3 failed (non_finite_input); rank 2 did not run the layer either: ") != std::string::npos, msg[2]);
  CHECK_MESSAGE(msg[2].find("sharded") != std::string::npos, msg[2]);  // its own error: the plan it was given was refused
}

TEST_CASE("score_key orders scores as the single-device comparator: NaN lowest, -0 == +0") {
  using dist::detail::score_key;
  const float v[] = {-INFINITY, -3.0e38f, -1.0f, -1e-38f, -1e-45f, -0.0f, 0.0f, 1e-45f, 1e-38f, 1.0f, 3.0e38f, INFINITY};
  CHECK(score_key(NAN) < score_key(-INFINITY));
  CHECK(score_key(-NAN) == score_key(NAN));
  CHECK(score_key(-0.0f) == score_key(0.0f));
  for (std::size_t i = 0; i + 1 < sizeof v / sizeof v[0]; ++i) {
    CAPTURE(v[i]);
    CAPTURE(v[i + 1]);
    if (v[i] == v[i + 1]) CHECK(score_key(v[i]) == score_key(v[i + 1]));
    else CHECK(score_key(v[i]) < score_key(v[i + 1]));
  }
  kvtest::rng r(3);
  for (int i = 0; i < 10000; ++i) {
    const float a = static_cast<float>(r.normal() * std::pow(10.0, r.integer(-30, 30)));
    const float b = static_cast<float>(r.normal() * std::pow(10.0, r.integer(-30, 30)));
    CHECK((a < b) == (score_key(a) < score_key(b)));
  }
}

TEST_CASE("stories260K: every layer, sharded == single process (AdaKV, CriticalAdaKV, PyramidKV, LKV)") {
  REQUIRE_MODEL_OR_SKIP();
  using namespace kvevict_engine;
  dist::mpi_communicator comm(MPI_COMM_WORLD);
  const auto& f = ::kvevict_engine_test::fx();
  const config& c = f.m.cfg;
  std::string text;
  {
    const std::string path = std::string(KVEVICT_SOURCE_DIR) + "/../shared/data/text/sherlock.txt";
    FILE* fp = std::fopen(path.c_str(), "rb");
    if (fp) {
      char buf[4096];
      const size_t n = std::fread(buf, 1, sizeof buf, fp);
      text.assign(buf, n);
      std::fclose(fp);
    }
    if (text.size() < 1200) text = std::string(1200, ' ') + "It was a dark and stormy night; the rain fell in torrents.";
  }
  const std::vector<int> prompt = f.tok.encode(text.substr(200, 900));
  const int n = static_cast<int>(prompt.size());
  kv_cache cache(c, n);
  query_log log(c, 32);
  forward_options fo;
  fo.on_query = log.hook();
  std::vector<float> logits;
  CHECK(prefill(f.m, cache, prompt, logits, fo));
  const std::int64_t H = c.n_kv_heads, G = c.n_heads / c.n_kv_heads, d = c.head_dim(), W = std::min(32, log.count(0));
  MESSAGE("stories260K: " << n << " tokens, " << c.n_layers << " layers, " << H << " KV heads, " << g_size << " ranks");
  std::int64_t layers_checked = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    dense_layer L;
    L.B = 1, L.H = H, L.G = G, L.S = n, L.d = d, L.W = W, L.layer = l, L.num_layers = c.n_layers;
    for (std::int64_t h = 0; h < H; ++h)
      for (int s = 0; s < n; ++s) {
        L.k.insert(L.k.end(), cache.key(l, static_cast<int>(h), s), cache.key(l, static_cast<int>(h), s) + d);
        L.v.insert(L.v.end(), cache.value(l, static_cast<int>(h), s), cache.value(l, static_cast<int>(h), s) + d);
      }
    const kvevict::query_view<const float> qv = log.view(l, static_cast<int>(W));
    for (std::int64_t hq = 0; hq < H * G; ++hq)
      for (std::int64_t w = 0; w < W; ++w)
        for (std::int64_t c2 = 0; c2 < d; ++c2) L.q.push_back(qv(0, hq, w, c2));
    L.len.assign(static_cast<std::size_t>(H), n);
    const matrix& wo = f.m.wo(l);
    L.C = wo.rows();
    L.wo.assign(wo.data(), wo.data() + wo.rows() * wo.cols());
    for (const int layout : {0, 1}) {
      const std::vector<std::int32_t> heads = shard_heads(layout, g_rank, g_size, H);
      CAPTURE(l);
      CAPTURE(layout);
      for (const budget_request& req : {budget_request::fraction(0.1), budget_request::fraction(0.3)}) {
        (void)check_equal<kvevict::presets::adakv>("stories adakv", L, {}, {}, heads, req, &comm);
        (void)check_equal<kvevict::presets::critical_adakv>("stories critical_adakv", L, {}, {}, heads, req, &comm);
        (void)check_equal<kvevict::presets::pyramidkv>("stories pyramidkv", L, {}, {}, heads, req, &comm);
        if (f.have_lkv) {
          const auto lg = kvevict::lkv::full_params(f.art);
          std::vector<float> storage;
          const auto ll = lkv_local(lg, heads, &storage);
          (void)check_equal<kvevict::lkv::full>("stories lkv", L, lg, ll, heads, req, &comm);
        }
      }
    }
    ++layers_checked;
  }
  CHECK(layers_checked == c.n_layers);
  if (!f.have_lkv) MESSAGE("LKV rows skipped: artifacts/lkv/stories260K.lkv missing or of another model");
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  doctest::Context ctx(argc, argv);
  if (g_rank != 0) ctx.setOption("no-intro", true);
  const int rc = ctx.run();
  MPI_Finalize();
  return rc;
}
