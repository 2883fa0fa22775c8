// A row-maximum temporal smoother combines window-attention rows: a query-free scorer (key norm) has none.
#include <kvevict/cpu.hpp>
#ifdef KVEVICT_SHOULD_FAIL_TO_BUILD
using scorer = kvevict::scorers::key_norm;
#else
using scorer = kvevict::scorers::attention_weight;
#endif
using policy = kvevict::eviction_policy<scorer, kvevict::temporal::defensive, kvevict::spatial::none>;
int main() {
  kvevict::evictor<policy, kvevict::cpu::backend> ev;
  (void)ev;
}
