// A user scorer without a CPU implementation (no cpu::scorer_impl specialisation, no legacy
// score_kv_head hook) must fail at the call site with a message naming the stage and backend.
#include <kvevict/cpu.hpp>
struct my_scorer {
  struct params {};
  static constexpr const char* name = "mine";
  static constexpr bool needs_queries = false, needs_values = false, window_attention = false, has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static kvevict::status check(const params&) { return {}; }
#ifndef KVEVICT_SHOULD_FAIL_TO_BUILD
  static void score_kv_head(const params&, const kvevict::cpu::head_inputs& in, float* out) {
    for (std::int64_t n = 0; n < in.length; ++n) out[n] = static_cast<float>(n);
  }
#endif
};
int main() {
  std::vector<float> k(16);
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), 1, 1, 8, 2, kvevict::kv_layout::hnd);
  std::int32_t indptr[2], idx[8];
  kvevict::evictor<kvevict::eviction_policy<my_scorer>, kvevict::cpu::backend> ev;
  kvevict::status st = ev.run(in, kvevict::budget_request::tokens(4), kvevict::selection_view{indptr, idx, nullptr, 8});
  return st.ok() ? 0 : 1;
}
