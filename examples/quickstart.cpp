// kvevict quick start: evict one layer's KV cache with ReST-KV on the CPU and compact it.
// Built by CMake as kvevict_quickstart; the same code is shown in README.md.
#include <kvevict/cpu.hpp>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  // One layer of an engine's cache: batch 1, 8 query heads over 2 KV heads (GQA 4), 300
  // cached tokens, head_dim 64, stored NHD ([seq][heads][dim]) in fp32. The window holds the
  // last 32 prompt queries (RoPE applied), also NHD.
  const int batch = 1, q_heads = 8, kv_heads = 2, seq = 300, dim = 64, window = 32, hidden = 512;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  std::vector<float> k(batch * seq * kv_heads * dim), v(k.size()), q(batch * window * q_heads * dim);
  std::vector<float> wo(hidden * q_heads * dim);  // o_proj weight, [out = hidden][in = q_heads * dim]
  for (auto* buf : {&k, &v, &q, &wo})
    for (float& x : *buf) x = normal(rng);

  // Per-model, once: the d x d factors of W_O (ReST-KV never projects values to the hidden size).
  std::vector<float> r(q_heads * dim * dim);
  kvevict::strided_view<const float, 2> wo_view{wo.data(), {hidden, q_heads * dim}, {q_heads * dim, 1}};
  kvevict::status st = kvevict::cpu::compute_wo_factors(wo_view, q_heads, dim, r.data());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  in.values = kvevict::make_kv_view<const float>(v.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  in.queries = kvevict::make_query_view<const float>(q.data(), batch, q_heads, window, dim, kvevict::kv_layout::nhd);
  in.wo_factor = kvevict::cpu::wo_factor_view(r.data(), q_heads, dim);

  // ReST-KV with its published configuration; keep 96 tokens per KV head (window included).
  kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev;
  const auto budget = kvevict::budget_request::tokens(96);
  st = ev.can_implement(in, budget);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  std::vector<std::int32_t> indptr(batch * kv_heads + 1), kept(ev.max_selected(in, budget)), pos(kept.size());
  std::vector<unsigned char> workspace(ev.workspace_size(in));
  kvevict::selection_view sel{indptr.data(), kept.data(), pos.data(), static_cast<std::int64_t>(kept.size())};
  st = ev.run(in, budget, sel, workspace.data(), workspace.size());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  // Compact K and V in place: row i of each head now holds token kept[indptr[h] + i].
  auto kv = kvevict::make_kv_view(k.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  auto vv = kvevict::make_kv_view(v.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  const kvevict::const_selection_view cs(sel, batch * kv_heads);
  st = kvevict::cpu::compact<float>(kv, cs, kv);
  if (st.ok()) st = kvevict::cpu::compact<float>(vv, cs, vv);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  for (int h = 0; h < kv_heads; ++h)
    std::printf("KV head %d keeps %d of %d tokens; first kept positions: %d %d %d ...\n", h,
                indptr[h + 1] - indptr[h], seq, pos[indptr[h]], pos[indptr[h] + 1], pos[indptr[h] + 2]);
  return 0;
}
