// Paged caches (layer_inputs::pages; issue "Paged and indirect KV caches"): the same preset run
// on the same data through a contiguous view and through a page table, and compaction of a
// paged cache against the contiguous one.
//
//   paged_<preset>/<dtype>/L:<n>       evictor<Preset>::run() at L tokens (batch 1, q_heads 32,
//                                      kv_heads 8, d 128, w 32, budget bench_budget(L)) with K and
//                                      V in an NHD page pool of 16-token pages, one table per
//                                      sequence, page ids shuffled (seeded); the pool holds the
//                                      same values as preset_<preset>'s contiguous HND layer. The
//                                      ratio paged / contiguous is the cost of the indirection.
//   compact_paged/<dtype>/L:<n>        cpu::compact_paged, mode a: a uniform selection of 1024
//                                      tokens per head (SnapKV's, computed once) moved in place in
//                                      the paged K and V pools, freed pages reported
//   compact_contiguous/<dtype>/L:<n>   cpu::compact in place on the contiguous HND K and V with
//                                      the same selection (the baseline)
// Compaction modifies the cache, so each iteration first restores it from a copy (untimed, with
// PauseTiming). bytes: the kept rows read and written (2 x K and V), flops 0.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "common/bench_data.hpp"
#include "common/cpu_stage.hpp"
#include "kvevict/cpu.hpp"

namespace kb = kvevict_bench;
using kvevict::bfloat16_t;

namespace {

constexpr std::int64_t kPageSize = 16;

/// A layer_data's K and V copied into an NHD pool of kPageSize-token pages, one table per
/// sequence (batch 1), shuffled page ids.
template <class T>
struct paged_layer {
  std::vector<T> kpool, vpool;
  std::vector<std::int32_t> indptr, indices, last;
  std::int64_t pages = 0;
  kvevict::kv_layout layout = kvevict::kv_layout::nhd;
  explicit paged_layer(const kb::layer_data<T>& d, kvevict::kv_layout l = kvevict::kv_layout::nhd) : layout(l) {
    const std::int64_t L = d.L, H = kb::kKvHeads, D = kb::kHeadDim;
    pages = (L + kPageSize - 1) / kPageSize;
    indices.resize(static_cast<std::size_t>(pages));
    std::iota(indices.begin(), indices.end(), 0);
    std::mt19937_64 g(7);
    std::shuffle(indices.begin(), indices.end(), g);
    indptr = {0, static_cast<std::int32_t>(pages)};
    last = {static_cast<std::int32_t>(L - (pages - 1) * kPageSize)};
    kpool.assign(static_cast<std::size_t>(pages * kPageSize * H * D), kvevict::from_float<T>(0.0f));
    vpool = kpool;
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < L; ++t) {
        const std::int64_t pg = indices[static_cast<std::size_t>(t / kPageSize)], slot = t % kPageSize;
        const std::int64_t o = layout == kvevict::kv_layout::nhd ? ((pg * kPageSize + slot) * H + h) * D : ((pg * H + h) * kPageSize + slot) * D;
        std::copy_n(d.k.begin() + (h * L + t) * D, D, kpool.begin() + o);
        std::copy_n(d.v.begin() + (h * L + t) * D, D, vpool.begin() + o);
      }
  }
  template <class U>
  kvevict::kv_view<U> pool(U* p) const {
    return kvevict::make_page_pool(p, pages, kb::kKvHeads, kPageSize, kb::kHeadDim, layout);
  }
  kvevict::page_table_view table() const {
    return kvevict::make_page_table(indptr.data(), indices.data(), last.data(), 1, pages);
  }
  kvevict::layer_inputs<T> inputs(const kb::layer_data<T>& d) const {
    kvevict::layer_inputs<T> in = d.inputs();
    in.keys = pool<const T>(kpool.data());
    in.values = pool<const T>(vpool.data());
    in.pages = table();
    return in;
  }
};

/// The layer's K and V as one contiguous NHD buffer ([L][kv_heads][d]: the same row stride as an
/// NHD page pool, without the table).
template <class T>
struct nhd_layer {
  std::vector<T> k, v;
  explicit nhd_layer(const kb::layer_data<T>& d) {
    const std::int64_t L = d.L, H = kb::kKvHeads, D = kb::kHeadDim;
    k.resize(d.k.size());
    v.resize(d.v.size());
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < L; ++t) {
        std::copy_n(d.k.begin() + (h * L + t) * D, D, k.begin() + (t * H + h) * D);
        std::copy_n(d.v.begin() + (h * L + t) * D, D, v.begin() + (t * H + h) * D);
      }
  }
};

/// Layout: 0 = paged NHD pool, 1 = paged HND pool, 2 = contiguous NHD (the baseline of 0;
/// preset_<name> is the contiguous HND baseline of 1).
template <class Preset, class T, int Layout>
void BM_paged(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<T>(L, kb::kWindow);
  const paged_layer<T> pg(data, Layout == 1 ? kvevict::kv_layout::hnd : kvevict::kv_layout::nhd);
  std::unique_ptr<nhd_layer<T>> nhd;
  auto in = pg.inputs(data);
  if (Layout == 2) {
    nhd = std::make_unique<nhd_layer<T>>(data);
    in = data.inputs();
    in.keys = kvevict::make_kv_view<const T>(nhd->k.data(), 1, kb::kKvHeads, L, kb::kHeadDim, kvevict::kv_layout::nhd);
    in.values = kvevict::make_kv_view<const T>(nhd->v.data(), 1, kb::kKvHeads, L, kb::kHeadDim, kvevict::kv_layout::nhd);
  }
  kvevict::evictor<Preset, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(static_cast<std::int32_t>(kb::bench_budget(L)));
  const std::int64_t cap = ev.max_selected(in, budget);
  kb::aligned_buffer ws(ev.workspace_size(in));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(kb::kKvHeads + 1)), indices(static_cast<std::size_t>(std::max<std::int64_t>(cap, 1)));
  kvevict::selection_view sel{indptr.data(), indices.data(), nullptr, cap};
  kvevict::status s = ev.run(in, budget, sel, ws.data, ws.bytes);
  if (!s.ok()) {
    st.SkipWithError(s.message());
    return;
  }
  for (auto _ : st) {
    s = ev.run(in, budget, sel, ws.data, ws.bytes);
    benchmark::DoNotOptimize(indices.data());
    benchmark::ClobberMemory();
  }
  const double sz = sizeof(T), d = kb::kHeadDim;
  double bytes = kb::D(kb::kKvHeads * L) * d * sz + kb::D(kb::kQHeads * kb::kWindow) * d * sz + static_cast<double>(cap) * 4.0;
  if (Preset::scorer::needs_values) bytes += kb::D(kb::kKvHeads * L) * d * sz;
  kb::set_cost(st, kb::D(L), bytes, 0.0);
}

/// SnapKV's selection of the layer (1024 tokens per head, uniform), computed once.
template <class T>
void snap_selection(const kvevict::layer_inputs<T>& in, std::vector<std::int32_t>& indptr, std::vector<std::int32_t>& indices) {
  kvevict::evictor<kvevict::presets::snapkv, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(1024);
  const std::int64_t cap = ev.max_selected(in, budget);
  indptr.assign(static_cast<std::size_t>(kb::kKvHeads + 1), 0);
  indices.assign(static_cast<std::size_t>(cap), 0);
  kvevict::selection_view sel{indptr.data(), indices.data(), nullptr, cap};
  (void)ev.run(in, budget, sel);
}

template <class T, bool Paged>
void BM_compact(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads, D = kb::kHeadDim;
  const auto& data = kb::get_layer<T>(L, kb::kWindow);
  paged_layer<T> pg(data);
  std::vector<std::int32_t> indptr, indices;
  snap_selection(data.inputs(), indptr, indices);
  const kvevict::const_selection_view sel(indptr.data(), indices.data(), H);
  std::vector<T> k = data.k, v = data.v;  // the contiguous cache, compacted in place
  const std::vector<T> k0 = Paged ? pg.kpool : data.k, v0 = Paged ? pg.vpool : data.v;
  std::vector<std::int32_t> kept(1), lastp(1), freed(static_cast<std::size_t>(pg.pages));
  std::int64_t nfreed = 0;
  kvevict::cpu::paged_cache<T> cache;
  cache.keys = pg.template pool<T>(pg.kpool.data());
  cache.values = pg.template pool<T>(pg.vpool.data());
  cache.pages = pg.table();
  std::vector<unsigned char> ws(kvevict::cpu::compact_paged_workspace_size(cache));
  kvevict::cpu::paged_compaction_result out{kept.data(), lastp.data(), nullptr, freed.data(), pg.pages, &nfreed};
  kvevict::status s;
  for (auto _ : st) {
    st.PauseTiming();
    if (Paged) {
      std::copy(k0.begin(), k0.end(), pg.kpool.begin());
      std::copy(v0.begin(), v0.end(), pg.vpool.begin());
    } else {
      std::copy(k0.begin(), k0.end(), k.begin());
      std::copy(v0.begin(), v0.end(), v.begin());
    }
    st.ResumeTiming();
    if (Paged) {
      s = kvevict::cpu::compact_paged(cache, sel, out, ws.data(), ws.size());
    } else {
      const auto kv = kvevict::make_kv_view(k.data(), 1, H, L, D, kvevict::kv_layout::hnd);
      const auto vv = kvevict::make_kv_view(v.data(), 1, H, L, D, kvevict::kv_layout::hnd);
      s = kvevict::cpu::compact<T>(kv, sel, kv);
      if (s.ok()) s = kvevict::cpu::compact<T>(vv, sel, vv);
    }
    benchmark::ClobberMemory();
  }
  if (!s.ok()) st.SkipWithError(s.message());
  st.counters["freed_pages"] = static_cast<double>(nfreed);
  kb::set_cost(st, kb::D(L), 2.0 * 2.0 * kb::D(indptr.back()) * kb::D(D) * sizeof(T), 0.0);
}

int iters_32k(std::int64_t) { return 3; }

struct registrar {
  registrar() {
    kb::register_seq("paged_restkv/f32", BM_paged<kvevict::presets::restkv, float, 0>, {32768}, iters_32k);
    kb::register_seq("paged_restkv/bf16", BM_paged<kvevict::presets::restkv, bfloat16_t, 0>, {32768}, iters_32k);
    kb::register_seq("paged_snapkv/f32", BM_paged<kvevict::presets::snapkv, float, 0>, {32768}, iters_32k);
    kb::register_seq("paged_snapkv/bf16", BM_paged<kvevict::presets::snapkv, bfloat16_t, 0>, {32768}, iters_32k);
    kb::register_seq("contiguous_nhd_restkv/f32", BM_paged<kvevict::presets::restkv, float, 2>, {32768}, iters_32k);
    kb::register_seq("contiguous_nhd_restkv/bf16", BM_paged<kvevict::presets::restkv, bfloat16_t, 2>, {32768}, iters_32k);
    kb::register_seq("contiguous_nhd_snapkv/f32", BM_paged<kvevict::presets::snapkv, float, 2>, {32768}, iters_32k);
    kb::register_seq("contiguous_nhd_snapkv/bf16", BM_paged<kvevict::presets::snapkv, bfloat16_t, 2>, {32768}, iters_32k);
    kb::register_seq("paged_hnd_restkv/f32", BM_paged<kvevict::presets::restkv, float, 1>, {32768}, iters_32k);
    kb::register_seq("paged_hnd_restkv/bf16", BM_paged<kvevict::presets::restkv, bfloat16_t, 1>, {32768}, iters_32k);
    kb::register_seq("paged_hnd_snapkv/f32", BM_paged<kvevict::presets::snapkv, float, 1>, {32768}, iters_32k);
    kb::register_seq("paged_hnd_snapkv/bf16", BM_paged<kvevict::presets::snapkv, bfloat16_t, 1>, {32768}, iters_32k);
    kb::register_seq("compact_paged/f32", BM_compact<float, true>, {32768}, nullptr);
    kb::register_seq("compact_contiguous/f32", BM_compact<float, false>, {32768}, nullptr);
    kb::register_seq("compact_paged/bf16", BM_compact<bfloat16_t, true>, {32768}, nullptr);
    kb::register_seq("compact_contiguous/bf16", BM_compact<bfloat16_t, false>, {32768}, nullptr);
  }
} the_registrar;

}  // namespace
