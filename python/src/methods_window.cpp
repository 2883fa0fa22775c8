// kvevict Python binding, method unit 1 of 3: ReST-KV and the SnapKV family (the window-attention
// scorers with pooling). The evictor instantiations are split over three units so that they
// compile in parallel (binding.hpp).
#include "evictor_impl.hpp"

namespace kvevict_py {

bool make_window_methods(const std::string& method, const param_map& overrides, const std::string&, kvevict::status* st,
                         std::unique_ptr<evictor_iface>* out) {
  namespace P = kvevict::presets;
  if (method == "restkv") *st = make_policy<P::restkv>("restkv", overrides, out);
  else if (method == "snapkv") *st = make_policy<P::snapkv>("snapkv", overrides, out);
  else if (method == "pyramidkv") *st = make_policy<P::pyramidkv>("pyramidkv", overrides, out);
  else if (method == "adakv") *st = make_policy<P::adakv>("adakv", overrides, out);
  else if (method == "adakv_published") *st = make_policy<P::adakv_published>("adakv_published", overrides, out);
  else return false;
  return true;
}

kvevict::status wo_factors(const tensor_arg& wo, std::int64_t q_heads, std::int64_t head_dim, float* out) {
  return dispatch_storage(wo.type, "wo", [&](auto tag) {
    using T = decltype(tag);
    KVEVICT_TRY(check_arg(wo, "wo", 2, dtype_of<T>(), "(hidden, q_heads * head_dim)"));
    return kvevict::cpu::compute_wo_factors(view_of<kvevict::strided_view<const T, 2>>(wo), q_heads, head_dim, out);
  });
}

}  // namespace kvevict_py
