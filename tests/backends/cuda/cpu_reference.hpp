// CPU reference runs for the CUDA backend test: the Eigen evictor (kvevict::cpu) compiled in
// its own C++ translation unit (cpu_reference.cpp), called from test_cuda.cu on host copies of
// the same inputs. Every (policy, storage type) pair used is explicitly instantiated there.
#pragma once

#include <cstdint>
#include <vector>

#include "user_scorer.hpp"
#include "kvevict/distributed/communicator.hpp"
#include "kvevict/kvevict.hpp"

namespace kvevict_test {

/// Result of one CPU evictor run: CSR selection and the final scores (batch, out_heads, seq).
struct cpu_result {
  kvevict::status st;
  std::vector<std::int32_t> indptr, indices, positions;
  std::vector<float> scores;
};

/// Run evictor<P, cpu::backend> on host views.
template <class P, class T>
cpu_result cpu_run(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget);

/// evictor<P, cpu::backend>::max_selected (exact: the CPU reads the host lengths), -1 on error.
/// Instantiated for presets::snapkv (uniform budgets), pyramidkv, adakv and lkv::uniform_budgets
/// with float.
template <class P, class T>
std::int64_t cpu_max_selected(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget);

/// kvevict::cpu::compact_paged on host memory (the CPU compaction the CUDA one is compared with);
/// instantiated for float and bfloat16_t.
template <class T>
kvevict::status cpu_compact_paged(const kvevict::paged_cache<T>& cache, kvevict::const_selection_view sel,
                                  kvevict::paged_compaction_result out);

/// evictor<P, cpu::backend>::run_sharded on this rank's host views (plan_options::sharded,
/// capacity = the plan's max_selected), for the CUDA sharded test's harness. Instantiated for
/// presets::adakv and presets::pyramidkv with float.
template <class P, class T>
cpu_result cpu_run_sharded(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget,
                           kvevict::distributed::communicator* comm, const kvevict::distributed::shard& sh);

/// kvevict::cpu::union_selections (host memory), for the device union's tests.
kvevict::status cpu_union_selections(const kvevict::const_selection_view* sels, int n, std::int64_t group, kvevict::selection_view out);

/// The policies the test instantiates (besides the presets; user_scorer_policy: float and bf16).
using maxpool_policy = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::mean, kvevict::spatial::max_pool>;

/// LKV compositions (kvevict::lkv::full, uniform_budgets, budgets_restkv, budgets_attention)
/// are defined once in kvevict/presets.hpp; cpu_run is instantiated for lkv::full with every
/// storage type and for the other three with one type each (uniform_budgets: bf16,
/// budgets_restkv: float, budgets_attention: half).

}  // namespace kvevict_test
