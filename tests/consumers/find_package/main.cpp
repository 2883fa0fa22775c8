// Consumer check: the installed package compiles and runs an eviction (SnapKV, CPU backend).
// Built twice by each consumer: header-only (kvevict::cpu) and in the compiled mode
// (kvevict::compiled, which defines KVEVICT_COMPILED: the evictor's instantiation is the library's).
#include <kvevict/cpu.hpp>

#include <cstdio>
#include <vector>

int main() {
  const int seq = 64, dim = 8, window = 4;
  std::vector<float> k(seq * dim), q(window * dim);
  for (int i = 0; i < seq * dim; ++i) k[i] = static_cast<float>((i * 37) % 11) - 5.0f;
  for (int i = 0; i < window * dim; ++i) q[i] = static_cast<float>((i * 13) % 7) - 3.0f;
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), 1, 1, seq, dim, kvevict::kv_layout::hnd);
  in.queries = kvevict::make_query_view<const float>(q.data(), 1, 1, window, dim, kvevict::kv_layout::hnd);
  kvevict::evictor<kvevict::presets::snapkv, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(16);
  std::vector<std::int32_t> indptr(2), idx(static_cast<std::size_t>(ev.max_selected(in, budget)));
  kvevict::selection_view sel{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())};
  const kvevict::status st = ev.run(in, budget, sel);
  if (!st.ok() || indptr[1] != 16) {
    std::fprintf(stderr, "consumer: %s (kept %d)\n", st.message(), indptr[1]);
    return 1;
  }
#ifdef KVEVICT_COMPILED
  const char* mode = "compiled mode";
#else
  const char* mode = "header-only";
#endif
  std::printf("consumer (%s): kept %d of %d tokens\n", mode, indptr[1], seq);
  return 0;
}
