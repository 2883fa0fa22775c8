// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over sharded eviction (evictor::run_sharded, kvevict/distributed.hpp): one layer
// whose KV heads are split over 1-4 in-process ranks (tests/reference/thread_communicator.hpp: each
// rank a thread, each collective a rendezvous), for the presets whose budgets span the layer
// (AdaKV, AdaKV as published, CriticalAdaKV, PyramidKV, LKV) and one with per-head budgets
// (SnapKV); random shapes, lengths, budgets, parameters (fuzz_case.hpp's mutations), shard layouts
// (contiguous, strided, shuffled, uneven), values with NaN / inf (check_finite on or off); and one
// fault: a head held twice, a head held by no rank, a head outside the layer, one rank with another
// budget, sink count, GQA reduction, K/V dtype (bf16, or fp16 beside bf16), GQA group, observation window, layer index,
// global head count, a bad length or a selection capacity too small.
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * without a fault: when the single-process evictor accepts the whole layer, every rank succeeds
//    and each of its rows equals the single-process row of that global head (indices and scores,
//    bit for bit) and the kept tokens over the ranks sum to the single-process total; when it
//    refuses the layer, every rank refuses it with the same category;
//  * with a fault: every rank returns an error, all of the same category, and none writes its
//    selection; no rank is left waiting (a hang is a libFuzzer timeout);
//  * no sanitizer report (threads under ASan).
// Input format: see LLVMFuzzerTestOneInput below (bytes front to back; zeros once the input ends).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_case.hpp"
#include "kvevict/distributed.hpp"
#include "reference/thread_communicator.hpp"

namespace kvevict_fuzz {
namespace {

namespace dist = kvevict::distributed;

enum class fault { none, head_twice, head_missing, head_outside, budget, sinks, gqa, dtype, group, window, layer_idx, global_heads,
                   bad_length, capacity, count };

/// One layer held densely in fp32: K/V (B, H, S, d), queries (B, H * G, W, d), W_O (C, H * G * d)
/// row-major, lengths (B, H).
struct layer {
  std::int64_t B = 1, H = 1, G = 1, S = 1, d = 1, W = 1, C = 2;
  std::vector<float> k, v, q, wo;
  std::vector<std::int32_t> len;
};

/// What one rank holds: its heads' K/V, queries (group Gr, window Wr) and W_O columns in storage
/// type T, and its layer_inputs.
template <class T>
struct held {
  std::vector<T> k, v, q, wo;
  std::vector<std::int32_t> len;
  kvevict::layer_inputs<T> in;

  void build(const layer& L, const std::vector<std::int32_t>& heads, std::int64_t Gr, std::int64_t Wr, int layer_idx, int num_layers,
             std::uint32_t seed) {
    const std::int64_t h = static_cast<std::int64_t>(heads.size()), d = L.d, S = L.S;
    auto head = [&](std::int64_t i) { return std::min<std::int64_t>(std::max<std::int64_t>(heads[static_cast<std::size_t>(i)], 0), L.H - 1); };
    k.assign(static_cast<std::size_t>(L.B * h * S * d), T{});
    v = k;
    q.assign(static_cast<std::size_t>(L.B * h * Gr * Wr * d), T{});
    wo.assign(static_cast<std::size_t>(L.C * h * Gr * d), T{});
    len.assign(static_cast<std::size_t>(L.B * h), 0);
    kvtest::rng g(seed);
    for (std::int64_t b = 0; b < L.B; ++b)
      for (std::int64_t i = 0; i < h; ++i) {
        const std::int64_t gh = head(i);
        for (std::int64_t x = 0; x < S * d; ++x) {
          k[static_cast<std::size_t>((b * h + i) * S * d + x)] = kvevict::from_float<T>(L.k[static_cast<std::size_t>((b * L.H + gh) * S * d + x)]);
          v[static_cast<std::size_t>((b * h + i) * S * d + x)] = kvevict::from_float<T>(L.v[static_cast<std::size_t>((b * L.H + gh) * S * d + x)]);
        }
        for (std::int64_t gq = 0; gq < Gr; ++gq)
          for (std::int64_t j = 0; j < Wr; ++j)
            for (std::int64_t c = 0; c < d; ++c) {
              // the whole layer's query (the last Wr of its W rows), or random ones for a group it does not have
              const float x = gq < L.G && Wr <= L.W ? L.q[static_cast<std::size_t>((((b * L.H + gh) * L.G + gq) * L.W + (L.W - Wr + j)) * d + c)]
                                                    : static_cast<float>(g.normal());
              q[static_cast<std::size_t>((((b * h + i) * Gr + gq) * Wr + j) * d + c)] = kvevict::from_float<T>(x);
            }
        len[static_cast<std::size_t>(b * h + i)] = L.len[static_cast<std::size_t>(b * L.H + gh)];
      }
    for (std::int64_t c = 0; c < L.C; ++c)
      for (std::int64_t i = 0; i < h; ++i)
        for (std::int64_t x = 0; x < Gr * d; ++x) {
          const float w = Gr == L.G ? L.wo[static_cast<std::size_t>(c * L.H * L.G * d + head(i) * L.G * d + x)] : 0.25f;
          wo[static_cast<std::size_t>(c * h * Gr * d + i * Gr * d + x)] = kvevict::from_float<T>(w);
        }
    in = {};
    in.keys = kvevict::make_kv_view<const T>(k.data(), L.B, h, S, d, kvevict::kv_layout::hnd);
    in.values = kvevict::make_kv_view<const T>(v.data(), L.B, h, S, d, kvevict::kv_layout::hnd);
    in.queries = kvevict::make_query_view<const T>(q.data(), L.B, h * Gr, Wr, d, kvevict::kv_layout::hnd);
    in.wo = kvevict::strided_view<const T, 2>{wo.data(), {L.C, h * Gr * d}, {h * Gr * d, 1}};
    in.lengths = kvevict::per_head_lengths(len.data(), L.B, h);
    in.layer_idx = layer_idx;
    in.num_layers = num_layers;
  }
};

struct rank_result {
  std::string message = "not run";
  kvevict::errc code = kvevict::errc::ok;
  bool untouched = true;
  std::vector<std::int32_t> indptr, indices;
  std::vector<float> scores;
  std::int64_t seq = 0;
};

template <class P, class T>
void run_rank(const typename P::params& p, const kvevict::layer_inputs<T>& in, const kvevict::budget_request& req, dist::communicator* comm,
              const dist::shard& sh, std::int64_t capacity_cut, rank_result* out) {
  const kvevict::evictor<P, kvevict::cpu::backend> ev(p, kvevict::cpu::backend{1});
  kvevict::plan_options opt;
  opt.sharded = true;
  kvevict::eviction_plan pl;
  // A failed plan still calls run_sharded (with the plan it has): its error travels to every rank.
  const kvevict::status ps = ev.plan(in, req, &pl, opt);
  if (verbose() && !ps.ok()) std::fprintf(stderr, "  plan (sharded) on rank %d: %s\n", comm->rank(), ps.message());
  const std::int64_t rows = in.batch() * std::max<std::int64_t>(1, ev.out_heads(in));
  const std::int64_t cap = std::max<std::int64_t>(0, (ps.ok() ? pl.max_selected : 4) - capacity_cut);
  out->seq = std::max<std::int64_t>(1, in.capacity());
  outputs o;
  o.allocate(rows, cap, out->seq, ps.ok() ? pl.workspace_bytes : 64, 0x5a);
  kvevict::selection_view sel = o.view();
  const kvevict::status st = ev.run_sharded(pl, in, comm, sh, sel, o.ws.get(), o.ws_bytes, o.scores.get());
  out->code = st.code();
  out->message = st.ok() ? "ok" : st.message();
  if (!st.ok()) {
    for (std::int64_t i = 0; i <= rows; ++i) out->untouched = out->untouched && o.indptr[static_cast<std::size_t>(i)] == -9;
    for (std::int64_t i = 0; i < std::max<std::int64_t>(cap, 1); ++i) out->untouched = out->untouched && o.indices[static_cast<std::size_t>(i)] == -9;
    for (std::int64_t i = 0; i < rows * out->seq; ++i) out->untouched = out->untouched && std::isnan(o.scores[static_cast<std::size_t>(i)]);
    return;
  }
  out->indptr.assign(o.indptr.get(), o.indptr.get() + rows + 1);
  out->indices.assign(o.indices.get(), o.indices.get() + out->indptr.back());
  out->scores.assign(o.scores.get(), o.scores.get() + rows * out->seq);
}

/// LKV tables for `layers` layers of H KV heads (kept alive by the caller).
struct lkv_tables {
  std::vector<float> mlp, logits;
};

template <class P, class T>
void run_sharded_case(reader& r) {
  const std::uint8_t shape_byte = r.u8(), fault_byte = r.u8(), layout_byte = r.u8(), flags = r.u8();
  layer L;
  L.H = r.range(1, 6);
  const int ranks = static_cast<int>(std::min<std::int64_t>(L.H, 1 + (shape_byte & 3)));
  L.B = 1 + ((shape_byte >> 2) & 1);
  L.G = 1 + ((shape_byte >> 3) % 3);
  L.S = r.range(1, 32);
  L.W = r.range(1, std::min<std::int64_t>(L.S, 8));
  L.d = r.range(1, 8);
  L.C = L.d + 1;
  const bool ragged = flags & 1, check_finite = !(flags & 2);
  const std::uint32_t seed = r.u32();
  kvtest::rng g(seed);
  L.k.resize(static_cast<std::size_t>(L.B * L.H * L.S * L.d));
  L.v.resize(L.k.size());
  L.q.resize(static_cast<std::size_t>(L.B * L.H * L.G * L.W * L.d));
  L.wo.resize(static_cast<std::size_t>(L.C * L.H * L.G * L.d));
  for (auto* vec : {&L.k, &L.v, &L.q, &L.wo})
    for (auto& x : *vec) x = static_cast<float>(g.normal());
  // ties across heads and slots (the radix select's tie counts): repeated keys and values, and
  // odd heads copying the head before them
  if (flags & 4)
    for (std::size_t i = 0; i < L.k.size(); i += static_cast<std::size_t>(3 * L.d)) L.k[i] = 0.5f, L.v[i] = 0.25f;
  if (flags & 8)
    for (std::int64_t b = 0; b < L.B; ++b)
      for (std::int64_t h = 1; h < L.H; h += 2)
        std::copy_n(L.k.begin() + (b * L.H + h - 1) * L.S * L.d, L.S * L.d, L.k.begin() + (b * L.H + h) * L.S * L.d);
  const std::uint8_t rate = r.u8() & 7;
  for (auto& x : L.k)
    if (g.integer(0, 1023) < rate) x = special(static_cast<std::uint8_t>(g.next()));
  L.len.assign(static_cast<std::size_t>(L.B * L.H), static_cast<std::int32_t>(L.S));
  if (ragged)
    for (auto& x : L.len) x = static_cast<std::int32_t>(r.u8() % (L.S + 1));
  kvevict::budget_request req;
  const std::uint8_t bm = r.u8();
  if (bm & 1) req.keep_tokens = static_cast<std::int32_t>(r.range(0, 40));
  else req.keep_fraction = static_cast<double>(r.u8()) / 255.0;
  auto params = P::defaults();
  if (r.u8() & 1) mutate_params<P>(params, r);
  params.check_finite = check_finite;
  const int num_layers = static_cast<int>(r.range(1, 6));
  const int layer_idx = static_cast<int>(r.range(0, num_layers - 1));
  lkv_tables tabs;
  constexpr bool learned = std::is_same<typename P::scorer, kvevict::scorers::learned_mlp>::value;
  if constexpr (learned) {
    const int hid = 1 + (r.u8() & 3);
    tabs.mlp.resize(static_cast<std::size_t>(num_layers * L.H * kvevict::scorers::learned_mlp::block_floats(L.d, hid)));
    tabs.logits.resize(static_cast<std::size_t>(num_layers * L.H));
    for (auto& x : tabs.mlp) x = static_cast<float>(0.5 * g.normal());
    for (auto& x : tabs.logits) x = static_cast<float>(g.normal());
    params.scorer.weights = tabs.mlp.data();
    params.scorer.num_layers = num_layers;
    params.scorer.kv_heads = static_cast<std::int32_t>(L.H);
    params.scorer.head_dim = static_cast<std::int32_t>(L.d);
    params.scorer.hidden = hid;
    params.budgeter.logits = tabs.logits.data();
    params.budgeter.num_layers = num_layers;
    params.budgeter.kv_heads = static_cast<std::int32_t>(L.H);
    params.budgeter.num_tokens = ragged ? L.S : 0;
  }

  // The shard layout: a permutation of the heads (identity, strided or shuffled), cut into `ranks`
  // runs of at least one head each (uneven cuts from the input).
  std::vector<std::int32_t> order(static_cast<std::size_t>(L.H));
  for (std::int64_t h = 0; h < L.H; ++h) order[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h);
  if ((layout_byte & 3) == 1) std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return a % ranks < b % ranks; });
  if ((layout_byte & 3) == 2)
    for (std::int64_t i = L.H - 1; i > 0; --i) std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(g.integer(0, i))]);
  std::vector<std::vector<std::int32_t>> heads(static_cast<std::size_t>(ranks));
  {
    std::int64_t at = 0;
    for (int rk = 0; rk < ranks; ++rk) {
      const std::int64_t left = L.H - at, need_after = ranks - 1 - rk;
      const std::int64_t n = rk + 1 == ranks ? left : 1 + static_cast<std::int64_t>(layout_byte >> 2) % (left - need_after);
      heads[static_cast<std::size_t>(rk)].assign(order.begin() + at, order.begin() + at + n);
      at += n;
    }
  }

  // One fault on the last rank (or none).
  fault f = static_cast<fault>(fault_byte % static_cast<int>(fault::count));
  if ((fault_byte & 0x80) == 0) f = fault::none;  // half the inputs: no fault
  const int odd = ranks - 1;
  auto& oh = heads[static_cast<std::size_t>(odd)];
  if (ranks == 1 && (f == fault::budget || f == fault::sinks || f == fault::gqa || f == fault::dtype ||
                     f == fault::group || f == fault::window || f == fault::layer_idx || f == fault::global_heads))
    f = fault::none;  // one rank: nothing to disagree with (a head twice: its own head again, below)
  if (f == fault::head_twice) oh.push_back(heads[0][0]);
  if (f == fault::head_missing) {
    if (L.H == 1 || oh.size() < 2) f = fault::none;
    else oh.pop_back();
  }
  if (f == fault::head_outside) oh.back() = (fault_byte & 0x40) ? static_cast<std::int32_t>(L.H) : -1;
  if (f == fault::window && L.W < 2) f = fault::none;

  // The single-process reference over the whole layer.
  held<T> whole;
  std::vector<std::int32_t> all(static_cast<std::size_t>(L.H));
  for (std::int64_t h = 0; h < L.H; ++h) all[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h);
  whole.build(L, all, L.G, L.W, layer_idx, num_layers, seed);
  const kvevict::evictor<P, kvevict::cpu::backend> ev1(params, kvevict::cpu::backend{1});
  rank_result ref;
  {
    kvevict::eviction_plan pl;
    const kvevict::status ps = ev1.plan(whole.in, req, &pl);
    const std::int64_t rows = L.B * std::max<std::int64_t>(1, ev1.out_heads(whole.in));
    outputs o;
    o.allocate(rows, ps.ok() ? pl.max_selected : 4, L.S, ps.ok() ? pl.workspace_bytes : 64, 0x33);
    const kvevict::status st = ps.ok() ? ev1.run(pl, whole.in, o.view(), o.ws.get(), o.ws_bytes, o.scores.get()) : ps;
    ref.code = st.code();
    ref.message = st.ok() ? "ok" : st.message();
    if (st.ok()) {
      ref.indptr.assign(o.indptr.get(), o.indptr.get() + rows + 1);
      ref.indices.assign(o.indices.get(), o.indices.get() + ref.indptr.back());
      ref.scores.assign(o.scores.get(), o.scores.get() + rows * L.S);
      ref.seq = L.S;
    }
  }

  // The ranks.
  kvevict_test::thread_group group(ranks);
  std::vector<rank_result> res(static_cast<std::size_t>(ranks));
  std::vector<std::vector<float>> lkv_storage(static_cast<std::size_t>(ranks));
  kvevict_test::run_ranks(ranks, [&](int rk) {
    kvevict_test::thread_communicator comm(&group, rk);
    const bool is_odd = rk == odd;
    const auto& hs = heads[static_cast<std::size_t>(rk)];
    auto p = params;
    kvevict::budget_request q = req;
    if (is_odd && f == fault::budget) {
      if (q.keep_tokens > 0) q.keep_tokens += 1;
      else q = kvevict::budget_request::tokens(7);
    }
    if (is_odd && f == fault::sinks) p.selector.num_sink = p.selector.num_sink == 3 ? 5 : 3;
    if (is_odd && f == fault::gqa) p.gqa = p.gqa == kvevict::gqa_reduction::max ? kvevict::gqa_reduction::mean : kvevict::gqa_reduction::max;
    dist::shard sh{static_cast<std::int32_t>(L.H + (is_odd && f == fault::global_heads ? 1 : 0)), hs.data(), static_cast<std::int32_t>(hs.size())};
    if constexpr (learned) {
      // the rank's slice of LKV-T's table (a shard it cannot slice keeps the global table: its run refuses the shard)
      dist::shard ts{static_cast<std::int32_t>(L.H), hs.data(), static_cast<std::int32_t>(hs.size())};
      kvevict::scorers::learned_mlp::params local;
      if (dist::shard_learned_scorer(params.scorer, ts, &lkv_storage[static_cast<std::size_t>(rk)], &local).ok()) p.scorer = local;
    }
    const std::int64_t Gr = L.G + (is_odd && f == fault::group ? 1 : 0), Wr = L.W - (is_odd && f == fault::window ? 1 : 0);
    const int li = is_odd && f == fault::layer_idx ? (layer_idx + 1) % (num_layers + 1) : layer_idx;
    const int nl = is_odd && f == fault::layer_idx && li == num_layers ? num_layers + 1 : num_layers;
    const std::int64_t cut = is_odd && f == fault::capacity ? 1 : 0;
    if (is_odd && f == fault::dtype && std::is_same<T, kvevict::bfloat16_t>::value) {
      held<kvevict::half_t> part;
      part.build(L, hs, Gr, Wr, li, nl, seed);
      run_rank<P>(p, part.in, q, &comm, sh, cut, &res[static_cast<std::size_t>(rk)]);
    } else if (is_odd && f == fault::dtype) {
      held<kvevict::bfloat16_t> part;
      part.build(L, hs, Gr, Wr, li, nl, seed);
      run_rank<P>(p, part.in, q, &comm, sh, cut, &res[static_cast<std::size_t>(rk)]);
    } else {
      held<T> part;
      part.build(L, hs, Gr, Wr, li, nl, seed);
      if (is_odd && f == fault::bad_length) part.len[0] = (fault_byte & 0x40) ? static_cast<std::int32_t>(L.S + 1) : -1;
      run_rank<P>(p, part.in, q, &comm, sh, cut, &res[static_cast<std::size_t>(rk)]);
    }
  });

  if (verbose()) {
    std::fprintf(stderr, "[%s] ranks %d H %lld G %lld fault %d: single %s | rank 0 %s\n", preset_name<P>().c_str(), ranks,
                 static_cast<long long>(L.H), static_cast<long long>(L.G), static_cast<int>(f), ref.message.c_str(), res[0].message.c_str());
  }
  // Every rank: the same category, and on error nothing written.
  for (int rk = 0; rk < ranks; ++rk) {
    const rank_result& x = res[static_cast<std::size_t>(rk)];
    FUZZ_ASSERT(x.code == res[0].code, (res[0].message + " | rank " + std::to_string(rk) + ": " + x.message).c_str());
    FUZZ_ASSERT(x.code == kvevict::errc::ok || x.untouched, x.message.c_str());
  }
  // gqa = layer_mean averages over every head of the layer: refused sharded (documented, not_supported at plan time).
  if (params.gqa == kvevict::gqa_reduction::layer_mean) {
    FUZZ_ASSERT(res[0].code != kvevict::errc::ok, "gqa = layer_mean accepted sharded");
    return;
  }
  // A capacity one short is no fault when the selection needs less than the plan's bound.
  if (f == fault::capacity && res[0].code == kvevict::errc::ok) f = fault::none;
  if (f != fault::none) {
    FUZZ_ASSERT(res[0].code != kvevict::errc::ok, "a fault was accepted");
    return;
  }
  if (ref.code != kvevict::errc::ok) {
    FUZZ_ASSERT(res[0].code == ref.code, (ref.message + " | sharded: " + res[0].message).c_str());
    return;
  }
  FUZZ_ASSERT(res[0].code == kvevict::errc::ok, (std::string("single process ok, sharded: ") + res[0].message).c_str());
  const std::int64_t H1 = ev1.out_heads(whole.in), Gout = H1 / L.H;
  std::int64_t kept = 0;
  for (int rk = 0; rk < ranks; ++rk) {
    const rank_result& x = res[static_cast<std::size_t>(rk)];
    const auto& hs = heads[static_cast<std::size_t>(rk)];
    const std::int64_t Hl = static_cast<std::int64_t>(hs.size()) * Gout;
    kept += x.indptr.back();
    for (std::int64_t b = 0; b < L.B; ++b)
      for (std::int64_t h = 0; h < Hl; ++h) {
        const std::int64_t gr = b * H1 + hs[static_cast<std::size_t>(h / Gout)] * Gout + h % Gout, lr = b * Hl + h;
        const std::int32_t a0 = ref.indptr[static_cast<std::size_t>(gr)], a1 = ref.indptr[static_cast<std::size_t>(gr + 1)];
        const std::int32_t b0 = x.indptr[static_cast<std::size_t>(lr)], b1 = x.indptr[static_cast<std::size_t>(lr + 1)];
        FUZZ_ASSERT(a1 - a0 == b1 - b0, "a sharded row keeps another count than the single process");
        FUZZ_ASSERT(std::equal(ref.indices.begin() + a0, ref.indices.begin() + a1, x.indices.begin() + b0), "a sharded row differs");
        FUZZ_ASSERT(std::memcmp(ref.scores.data() + gr * ref.seq, x.scores.data() + lr * x.seq, static_cast<std::size_t>(L.S) * sizeof(float)) == 0,
                    "sharded scores differ");
      }
  }
  FUZZ_ASSERT(kept == ref.indptr.back(), "the ranks' kept tokens do not sum to the single-process total");
}

}  // namespace
}  // namespace kvevict_fuzz

namespace kvevict_fuzz {
namespace {
/// The storage type of every rank (and of the single-process reference): the preset byte's bits
/// 3-4 (0 and 3 fp32, 1 fp16, 2 bf16); the dtype fault gives the last rank another one.
template <class P>
void dispatch_sharded_type(int t, reader& r) {
  switch (t) {
    case 1: run_sharded_case<P, half_t>(r); break;
    case 2: run_sharded_case<P, bfloat16_t>(r); break;
    default: run_sharded_case<P, float>(r); break;
  }
}
}  // namespace
}  // namespace kvevict_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvevict_fuzz::reader r{data, size};
  using namespace kvevict::presets;
  using kvevict_fuzz::dispatch_sharded_type;
  const std::uint8_t b = r.u8();
  const int t = (b >> 3) & 3;
  switch (b % 8 % 6) {
    case 0: dispatch_sharded_type<adakv>(t, r); break;
    case 1: dispatch_sharded_type<critical_adakv>(t, r); break;
    case 2: dispatch_sharded_type<pyramidkv>(t, r); break;
    case 3: dispatch_sharded_type<lkv>(t, r); break;
    case 4: dispatch_sharded_type<adakv_published>(t, r); break;
    default: dispatch_sharded_type<snapkv>(t, r); break;
  }
  return 0;
}
