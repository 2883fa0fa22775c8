// The adaptive-window smoother needs the window attention's drift: key norm cannot feed it.
#include <kvevict/cpu.hpp>
#ifdef KVEVICT_SHOULD_FAIL_TO_BUILD
using scorer = kvevict::scorers::key_norm;
#else
using scorer = kvevict::scorers::attention_weight;
#endif
using policy = kvevict::eviction_policy<scorer, kvevict::temporal::ema, kvevict::spatial::adaptive_window>;
int main() {
  kvevict::evictor<policy, kvevict::cpu::backend> ev;
  (void)ev;
}
