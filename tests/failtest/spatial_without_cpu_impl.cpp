// A user spatial smoother without a CPU implementation (no cpu::spatial_impl specialisation, no
// legacy smooth() hook) must fail at the call site with a message naming the stage and backend.
#include <kvevict/cpu.hpp>
struct my_smoother {
  struct params {};
  static constexpr const char* name = "mine";
  static constexpr bool needs_attention_drift = false;
  static kvevict::status check(const params&) { return {}; }
};
#ifndef KVEVICT_SHOULD_FAIL_TO_BUILD
template <>
struct kvevict::cpu::spatial_impl<my_smoother> {
  static void smooth(const my_smoother::params&, float*, std::int64_t, double, float*, double*, std::int64_t*) {}
};
#endif
int main() {
  std::vector<float> k(16);
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), 1, 1, 8, 2, kvevict::kv_layout::hnd);
  std::int32_t indptr[2], idx[8];
  kvevict::evictor<kvevict::eviction_policy<kvevict::scorers::key_norm, kvevict::temporal::last, my_smoother>, kvevict::cpu::backend> ev;
  kvevict::status st = ev.run(in, kvevict::budget_request::tokens(4), kvevict::selection_view{indptr, idx, nullptr, 8});
  return st.ok() ? 0 : 1;
}
