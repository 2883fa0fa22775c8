// CPU reference runs for test_cuda (see cpu_reference.hpp).
#include "cpu_reference.hpp"

#include <cmath>

#include "kvevict/backends/cpu/learned.hpp"
#include "kvevict/cpu.hpp"
#include "kvevict/distributed.hpp"
#include "../examples/value_norm/value_norm_cpu.hpp"

namespace kvevict_test {

template <class P, class T>
cpu_result cpu_run(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget) {
  cpu_result r;
  kvevict::evictor<P, kvevict::cpu::backend> ev(p);
  const std::int64_t rows = in.batch() * ev.out_heads(in);
  const std::int64_t cap = ev.max_selected(in, budget);
  if (cap < 0) {
    r.st = ev.can_implement(in, budget);
    return r;
  }
  r.indptr.assign(static_cast<std::size_t>(rows + 1), 0);
  r.indices.assign(static_cast<std::size_t>(cap > 0 ? cap : 1), -1);
  r.positions.assign(static_cast<std::size_t>(cap > 0 ? cap : 1), -1);
  r.scores.assign(static_cast<std::size_t>(rows * in.capacity() + 1), 0.0f);
  kvevict::selection_view sel;
  sel.indptr = r.indptr.data();
  sel.indices = r.indices.data();
  sel.positions = r.positions.data();
  sel.capacity = cap;
  r.st = ev.run(in, budget, sel, r.scores.data());
  return r;
}

template <class P, class T>
cpu_result cpu_run_sharded(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget,
                           kvevict::distributed::communicator* comm, const kvevict::distributed::shard& sh) {
  cpu_result r;
  kvevict::evictor<P, kvevict::cpu::backend> ev(p);
  kvevict::plan_options opt;
  opt.sharded = true;
  kvevict::eviction_plan pl;
  r.st = ev.plan(in, budget, &pl, opt);  // on error the run below still takes part in the exchange
  const std::int64_t rows = in.batch() * ev.out_heads(in), cap = pl.valid ? pl.max_selected : 1;
  r.indptr.assign(static_cast<std::size_t>(rows + 1), 0);
  r.indices.assign(static_cast<std::size_t>(cap > 0 ? cap : 1), -1);
  r.scores.assign(static_cast<std::size_t>(rows * in.capacity() + 1), 0.0f);
  std::vector<unsigned char> ws(pl.valid ? pl.workspace_bytes : 1);
  kvevict::selection_view sel;
  sel.indptr = r.indptr.data();
  sel.indices = r.indices.data();
  sel.capacity = cap;
  r.st = ev.run_sharded(pl, in, comm, sh, sel, ws.data(), ws.size(), r.scores.data());
  return r;
}
template cpu_result cpu_run_sharded<kvevict::presets::adakv, float>(const kvevict::layer_inputs<float>&, const kvevict::presets::adakv::params&,
                                                                    kvevict::budget_request, kvevict::distributed::communicator*,
                                                                    const kvevict::distributed::shard&);
template cpu_result cpu_run_sharded<kvevict::presets::pyramidkv, float>(const kvevict::layer_inputs<float>&,
                                                                        const kvevict::presets::pyramidkv::params&, kvevict::budget_request,
                                                                        kvevict::distributed::communicator*, const kvevict::distributed::shard&);

template <class P, class T>
std::int64_t cpu_max_selected(const kvevict::layer_inputs<T>& in, const typename P::params& p, kvevict::budget_request budget) {
  return kvevict::evictor<P, kvevict::cpu::backend>(p).max_selected(in, budget);
}

#define KVEVICT_TEST_INST(P)                                                                                             \
  template cpu_result cpu_run<P, float>(const kvevict::layer_inputs<float>&, const P::params&, kvevict::budget_request); \
  template cpu_result cpu_run<P, kvevict::half_t>(const kvevict::layer_inputs<kvevict::half_t>&, const P::params&,        \
                                                  kvevict::budget_request);                                               \
  template cpu_result cpu_run<P, kvevict::bfloat16_t>(const kvevict::layer_inputs<kvevict::bfloat16_t>&, const P::params&, \
                                                      kvevict::budget_request);

KVEVICT_TEST_INST(kvevict::presets::restkv)
KVEVICT_TEST_INST(kvevict::presets::snapkv)
KVEVICT_TEST_INST(kvevict::presets::pyramidkv)
KVEVICT_TEST_INST(kvevict::presets::adakv)
KVEVICT_TEST_INST(kvevict::presets::h2o)
KVEVICT_TEST_INST(kvevict::presets::tova)
KVEVICT_TEST_INST(kvevict::presets::streaming_llm)
KVEVICT_TEST_INST(kvevict::presets::key_norm)
KVEVICT_TEST_INST(maxpool_policy)
KVEVICT_TEST_INST(kvevict::lkv::full)
template cpu_result cpu_run<user_scorer_policy, float>(const kvevict::layer_inputs<float>&, const user_scorer_policy::params&,
                                                       kvevict::budget_request);
template cpu_result cpu_run<user_scorer_policy, kvevict::bfloat16_t>(const kvevict::layer_inputs<kvevict::bfloat16_t>&,
                                                                     const user_scorer_policy::params&, kvevict::budget_request);
#define KVEVICT_TEST_MAX_SELECTED(P) \
  template std::int64_t cpu_max_selected<P, float>(const kvevict::layer_inputs<float>&, const P::params&, kvevict::budget_request);
KVEVICT_TEST_MAX_SELECTED(kvevict::presets::snapkv)
KVEVICT_TEST_MAX_SELECTED(kvevict::presets::pyramidkv)
KVEVICT_TEST_MAX_SELECTED(kvevict::presets::adakv)
KVEVICT_TEST_MAX_SELECTED(kvevict::lkv::uniform_budgets)
template cpu_result cpu_run<kvevict::lkv::uniform_budgets, kvevict::bfloat16_t>(const kvevict::layer_inputs<kvevict::bfloat16_t>&,
                                                                                const kvevict::lkv::uniform_budgets::params&,
                                                                                kvevict::budget_request);
template cpu_result cpu_run<kvevict::lkv::budgets_restkv, float>(const kvevict::layer_inputs<float>&,
                                                                 const kvevict::lkv::budgets_restkv::params&, kvevict::budget_request);
template cpu_result cpu_run<kvevict::lkv::budgets_attention, kvevict::half_t>(const kvevict::layer_inputs<kvevict::half_t>&,
                                                                             const kvevict::lkv::budgets_attention::params&,
                                                                             kvevict::budget_request);

template <class T>
kvevict::status cpu_compact_paged(const kvevict::paged_cache<T>& cache, kvevict::const_selection_view sel,
                                  kvevict::paged_compaction_result out) {
  std::vector<unsigned char> ws(kvevict::cpu::compact_paged_workspace_size(cache) + 1);
  return kvevict::cpu::compact_paged(cache, sel, out, ws.data(), ws.size());
}
template kvevict::status cpu_compact_paged<float>(const kvevict::paged_cache<float>&, kvevict::const_selection_view,
                                                  kvevict::paged_compaction_result);
template kvevict::status cpu_compact_paged<kvevict::bfloat16_t>(const kvevict::paged_cache<kvevict::bfloat16_t>&,
                                                                kvevict::const_selection_view, kvevict::paged_compaction_result);

kvevict::status cpu_union_selections(const kvevict::const_selection_view* sels, int n, std::int64_t group, kvevict::selection_view out) {
  return kvevict::cpu::union_selections(sels, n, group, out);
}

}  // namespace kvevict_test
