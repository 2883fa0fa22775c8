// The cost of sharded budgets (docs/distributed.md): run under mpiexec with 2 ranks,
//   mpiexec -n 2 build/bench/distributed/kvevict_bench_exchange
// (scripts/run_bench.sh does). Layer: batch 1, 8 KV heads, 32 query heads, d 128, window 32,
// bf16, AdaKV (SnapKV scores + AdaKV budgets) at budget bench_budget(L); rank r holds KV heads
// 4r..4r+3 (a view into the shared test layer, no copy).
//   adakv_local/L:<n>     evictor::run on this rank's 4 heads as if they were the whole layer:
//                         the scoring and selection work a rank does, without any exchange
//   adakv_sharded/L:<n>   evictor::run_sharded on the same heads as half of the 8-head layer:
//                         the same work plus the exchange (8 collectives, local radix passes)
//   exchange/L:<n>        the exchange alone (layer_exchange: rounds 1-7 and the radix passes over
//                         this rank's candidates) on random fp32 scores of the same shapes
// All on every rank with the same fixed iteration count (collectives must match); rank 0
// reports. exchange / adakv_local is the exchange's share of a layer's eviction (sharded - local is
// the same, but within the noise). Counters: rounds,
// bytes (sent per rank per layer).
#include <mpi.h>

#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <cstdint>
#include <vector>

#include "common/bench_data.hpp"
#include "kvevict/cpu.hpp"
#include "kvevict/distributed.hpp"
#include "kvevict/distributed/mpi.hpp"

namespace kb = kvevict_bench;
using kvevict::bfloat16_t;

namespace {

int g_rank = 0, g_size = 1;

/// This rank's heads of the shared layer (views; heads 4r..4r+3 of 8).
kvevict::layer_inputs<bfloat16_t> my_heads(const kb::layer_data<bfloat16_t>& d, std::int64_t per_rank) {
  kvevict::layer_inputs<bfloat16_t> in = d.inputs();
  const std::int64_t h0 = g_rank * per_rank, G = in.group_size();
  in.keys.data += h0 * in.keys.stride[1];
  in.values.data += h0 * in.values.stride[1];
  in.keys.extent[1] = in.values.extent[1] = per_rank;
  in.queries.data += h0 * G * in.queries.stride[1];
  in.queries.extent[1] = per_rank * G;
  return in;
}

template <bool Sharded>
void BM_adakv(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads, per = H / g_size;
  const kb::layer_data<bfloat16_t>& d = kb::get_layer<bfloat16_t>(L);
  const kvevict::layer_inputs<bfloat16_t> in = my_heads(d, per);
  kvevict::evictor<kvevict::presets::adakv, kvevict::cpu::backend> ev;
  kvevict::plan_options opt;
  opt.sharded = Sharded;
  kvevict::eviction_plan pl;
  const kvevict::budget_request req = kvevict::budget_request::tokens(static_cast<std::int32_t>(kb::bench_budget(L)));
  if (!ev.plan(in, req, &pl, opt).ok()) {
    st.SkipWithError("plan failed");
    return;
  }
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(per + 1)), idx(static_cast<std::size_t>(pl.max_selected));
  kvevict::selection_view sel;
  sel.indptr = indptr.data();
  sel.indices = idx.data();
  sel.capacity = pl.max_selected;
  std::vector<unsigned char> ws(pl.workspace_bytes);
  std::vector<std::int32_t> heads(static_cast<std::size_t>(per));
  for (std::int64_t h = 0; h < per; ++h) heads[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(g_rank * per + h);
  kvevict::distributed::mpi_communicator comm(MPI_COMM_WORLD);
  const kvevict::distributed::shard sh{static_cast<std::int32_t>(per * g_size), heads.data(), static_cast<std::int32_t>(per)};
  kvevict::distributed::exchange_stats stats;
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : st) {
    kvevict::status s = Sharded ? ev.run_sharded(pl, in, &comm, sh, sel, ws.data(), ws.size(), nullptr, &stats)
                                : ev.run(pl, in, sel, ws.data(), ws.size());
    if (!s.ok()) {
      st.SkipWithError(s.message());
      break;
    }
    benchmark::DoNotOptimize(idx.data());
  }
  st.counters["rounds"] = stats.rounds;
  st.counters["bytes"] = static_cast<double>(stats.bytes);
  st.counters["ranks"] = g_size;
}

/// The exchange alone (rounds 1-7 and the local radix passes), on the plans and on random fp32
/// scores of the same shapes: what run_sharded adds to a rank's work.
void BM_exchange(benchmark::State& st) {
  const std::int64_t L = st.range(0), H = kb::kKvHeads, per = H / g_size;
  const kvevict::budget_request req = kvevict::budget_request::tokens(static_cast<std::int32_t>(kb::bench_budget(L)));
  const auto p = kvevict::presets::adakv::defaults();
  std::vector<kvevict::detail::head_plan> plans(static_cast<std::size_t>(per),
                                                kvevict::detail::plan_head(req, p.selector, L, kb::kWindow));
  std::vector<float> scores(static_cast<std::size_t>(per * L));
  std::mt19937 g(static_cast<unsigned>(11 + g_rank));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (float& x : scores) x = u(g);
  std::vector<const float*> rows(static_cast<std::size_t>(per));
  for (std::int64_t h = 0; h < per; ++h) rows[static_cast<std::size_t>(h)] = scores.data() + h * L;
  std::vector<std::int32_t> heads(static_cast<std::size_t>(per));
  for (std::int64_t h = 0; h < per; ++h) heads[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(g_rank * per + h);
  kvevict::distributed::mpi_communicator comm(MPI_COMM_WORLD);
  const kvevict::distributed::shard sh{static_cast<std::int32_t>(H), heads.data(), static_cast<std::int32_t>(per)};
  // round 1's terms; the shape terms come from an empty layer (the same on every rank: no tensor here)
  const auto terms = kvevict::distributed::detail::layer_terms_of<kvevict::presets::adakv>(p, req, kvevict::layer_inputs<float>{});
  std::vector<std::int64_t> win(static_cast<std::size_t>(H)), T(1);
  kvevict::distributed::exchange_stats stats;
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : st) {
    kvevict::distributed::detail::layer_exchange ex(&comm, sh, &stats);
    kvevict::status s = ex.agree(kvevict::status{}, 1, 1, 0, 1, terms, plans.data());
    if (s.ok()) s = ex.winners(rows.data(), win.data(), T.data());
    if (!s.ok()) {
      st.SkipWithError(s.message());
      break;
    }
    benchmark::DoNotOptimize(win.data());
  }
  st.counters["rounds"] = stats.rounds;
  st.counters["bytes"] = static_cast<double>(stats.bytes);
  st.counters["ranks"] = g_size;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  if (kb::kKvHeads % g_size != 0) {
    if (g_rank == 0) std::fprintf(stderr, "kvevict_bench_exchange: %d ranks do not divide %d KV heads\n", g_size, int(kb::kKvHeads));
    MPI_Finalize();
    return 1;
  }
  if (g_rank != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;
  const auto iters = [](std::int64_t L) -> benchmark::IterationCount { return L >= 16384 ? 10 : 40; };
  for (std::int64_t L : {std::int64_t(4096), std::int64_t(32768)}) {
    benchmark::RegisterBenchmark("adakv_local/bf16", BM_adakv<false>)->Arg(L)->ArgName("L")->Iterations(iters(L))->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("adakv_sharded/bf16", BM_adakv<true>)->Arg(L)->ArgName("L")->Iterations(iters(L))->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("exchange", BM_exchange)->Arg(L)->ArgName("L")->Iterations(200)->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  benchmark::AddCustomContext("mpi_ranks", std::to_string(g_size));
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
