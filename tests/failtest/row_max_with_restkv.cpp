// A row-maximum temporal smoother (temporal::maximum, DefensiveKV's aggregation) cannot run with a scorer that weights
// the window rows linearly inside (ReST-KV's output_reconstruction): the window loop's static_assert fires when run()
// is instantiated.
#include <kvevict/cpu.hpp>
#ifdef KVEVICT_SHOULD_FAIL_TO_BUILD
using scorer = kvevict::scorers::output_reconstruction;
#else
using scorer = kvevict::scorers::attention_weight;
#endif
using policy = kvevict::eviction_policy<scorer, kvevict::temporal::maximum, kvevict::spatial::none>;
int main() {
  kvevict::evictor<policy, kvevict::cpu::backend> ev;
  kvevict::layer_inputs<float> in;
  kvevict::selection_view sel;
  (void)ev.run(in, kvevict::budget_request::tokens(8), sel);
}
