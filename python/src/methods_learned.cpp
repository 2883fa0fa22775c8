// kvevict Python binding, method unit 3 of 3: LKV and its ablations, parameters from an LKV
// artifact (io/lkv_artifact.hpp), which the evictor keeps alive (its params point into it).
#include <kvevict/backends/cpu/learned.hpp>
#include <kvevict/io/lkv_artifact.hpp>

#include "evictor_impl.hpp"

namespace kvevict_py {

bool make_learned_methods(const std::string& method, const param_map& overrides, const std::string& artifact,
                          kvevict::status* st, std::unique_ptr<evictor_iface>* out) {
  namespace P = kvevict::presets;
  namespace L = kvevict::lkv;
  const bool known = method == "lkv" || method == "lkv_uniform_budgets" || method == "lkv_budgets_restkv" ||
                     method == "lkv_budgets_attention";
  if (!known) return false;
  if (artifact.empty()) {
    *st = kvevict::status::error(kvevict::errc::invalid_argument,
                                 "artifact is required for method '%s' (the path of an LKV artifact, e.g. "
                                 "artifacts/lkv/stories260K.lkv)",
                                 method.c_str());
    return true;
  }
  auto art = std::make_shared<kvevict::io::lkv_artifact>();
  *st = kvevict::io::read_lkv_artifact(artifact.c_str(), art.get());
  if (!st->ok()) {
    *st = kvevict::status::error(st->code(), "artifact: %s", st->message());
    return true;
  }
  const kvevict::io::lkv_artifact& a = *art;
  if (method == "lkv") *st = make_policy<P::lkv>("lkv", overrides, out, L::full_params(a), art);
  else if (method == "lkv_uniform_budgets")
    *st = make_policy<P::lkv_uniform_budgets>("lkv_uniform_budgets", overrides, out, L::uniform_budgets_params(a), art);
  else if (method == "lkv_budgets_restkv")
    *st = make_policy<P::lkv_budgets_restkv>("lkv_budgets_restkv", overrides, out, L::budgets_restkv_params(a), art);
  else *st = make_policy<P::lkv_budgets_attention>("lkv_budgets_attention", overrides, out, L::budgets_attention_params(a), art);
  return true;
}

}  // namespace kvevict_py
