// kvevict Python binding, method unit 2 of 3: CriticalKV, DefensiveKV, H2O, TOVA, StreamingLLM and key norm.
#include "evictor_impl.hpp"

namespace kvevict_py {

bool make_other_methods(const std::string& method, const param_map& overrides, const std::string&, kvevict::status* st,
                        std::unique_ptr<evictor_iface>* out) {
  namespace P = kvevict::presets;
  if (method == "criticalkv") *st = make_policy<P::criticalkv>("criticalkv", overrides, out);
  else if (method == "critical_adakv") *st = make_policy<P::critical_adakv>("critical_adakv", overrides, out);
  else if (method == "defensivekv") *st = make_policy<P::defensivekv>("defensivekv", overrides, out);
  else if (method == "h2o") *st = make_policy<P::h2o>("h2o", overrides, out);
  else if (method == "tova") *st = make_policy<P::tova>("tova", overrides, out);
  else if (method == "streaming_llm") *st = make_policy<P::streaming_llm>("streaming_llm", overrides, out);
  else if (method == "key_norm") *st = make_policy<P::key_norm>("key_norm", overrides, out);
  else return false;
  return true;
}

}  // namespace kvevict_py
