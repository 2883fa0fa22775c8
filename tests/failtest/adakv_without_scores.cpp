// AdaKV budgets need scores: pairing them with the score-free StreamingLLM scorer must not compile.
#include <kvevict/cpu.hpp>
#ifdef KVEVICT_SHOULD_FAIL_TO_BUILD
using policy = kvevict::eviction_policy<kvevict::scorers::none, kvevict::temporal::last, kvevict::spatial::none,
                                        kvevict::budgeters::adakv>;
#else
using policy = kvevict::eviction_policy<kvevict::scorers::attention_weight, kvevict::temporal::sum, kvevict::spatial::none,
                                        kvevict::budgeters::adakv>;
#endif
int main() {
  kvevict::evictor<policy, kvevict::cpu::backend> ev;
  (void)ev;
}
