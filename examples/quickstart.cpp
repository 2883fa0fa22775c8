// kvevict quick start: evict one layer's KV cache with ReST-KV on the CPU, read the selection, compact.
// Built and run by ctest (kvevict_quickstart); README.md shows this file verbatim (ctest readme_quickstart).
#include <kvevict/cpu.hpp>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  // One layer of an engine's cache: batch 1, 8 query heads over 2 KV heads (GQA 4), 300 cached
  // tokens, head_dim 64, stored NHD ([batch][seq][kv_heads][dim]) in fp32. The window holds the
  // last 32 prompt queries (RoPE applied), also NHD: [batch][window][q_heads][dim].
  const int batch = 1, q_heads = 8, kv_heads = 2, seq = 300, dim = 64, window = 32, hidden = 512;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  std::vector<float> k(batch * seq * kv_heads * dim), v(k.size()), q(batch * window * q_heads * dim);
  std::vector<float> wo(hidden * q_heads * dim);  // o_proj weight, [out = hidden][in = q_heads * dim]
  for (auto* buf : {&k, &v, &q, &wo})
    for (float& x : *buf) x = normal(rng);

  // Once per model and layer: the d x d factors of W_O (ReST-KV never projects values to the hidden size).
  std::vector<float> r(q_heads * dim * dim);
  kvevict::strided_view<const float, 2> wo_view{wo.data(), {hidden, q_heads * dim}, {q_heads * dim, 1}};
  kvevict::status st = kvevict::cpu::compute_wo_factors(wo_view, q_heads, dim, r.data());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  kvevict::layer_inputs<float> in;
  in.keys = kvevict::make_kv_view<const float>(k.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  in.values = kvevict::make_kv_view<const float>(v.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  in.queries = kvevict::make_query_view<const float>(q.data(), batch, q_heads, window, dim, kvevict::kv_layout::nhd);
  in.wo_factor = kvevict::cpu::wo_factor_view(r.data(), q_heads, dim);

  // ReST-KV with its published configuration; keep 96 tokens per KV head (the window included).
  kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev;
  const int keep = 96;
  const auto budget = kvevict::budget_request::tokens(keep);
  st = ev.can_implement(in, budget);  // validate before sizing buffers
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;  // e.g. "invalid_argument: window = 40 > seq_len = 30 ..."

  // The selection is CSR: row i = b * kv_heads + h keeps slots kept[indptr[i] .. indptr[i + 1]),
  // ascending; pos holds their logical positions (here equal to the slots).
  std::vector<std::int32_t> indptr(batch * kv_heads + 1), kept(ev.max_selected(in, budget)), pos(kept.size());
  std::vector<unsigned char> workspace(ev.workspace_size(in));
  kvevict::selection_view sel{indptr.data(), kept.data(), pos.data(), static_cast<std::int64_t>(kept.size())};
  st = ev.run(in, budget, sel, workspace.data(), workspace.size());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  for (int i = 0; i < batch * kv_heads; ++i) {
    const std::int32_t* slots = kept.data() + indptr[i];
    const int count = indptr[i + 1] - indptr[i];
    if (count != keep || slots[count - 1] != seq - 1)  // uniform budget; the window's last token is always kept
      return std::fprintf(stderr, "unexpected selection in row %d\n", i), 1;
    std::printf("KV head %d keeps %d of %d tokens: slots %d %d %d ... %d\n", i % kv_heads, count, seq, slots[0], slots[1],
                slots[2], slots[count - 1]);
  }

  // Compact K and V in place: slot j of row i now holds the old slot kept[indptr[i] + j]; the
  // head's new length is its kept count.
  auto kv = kvevict::make_kv_view(k.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  auto vv = kvevict::make_kv_view(v.data(), batch, kv_heads, seq, dim, kvevict::kv_layout::nhd);
  const kvevict::const_selection_view cs(sel, batch * kv_heads);
  st = kvevict::cpu::compact<float>(kv, cs, kv);
  if (st.ok()) st = kvevict::cpu::compact<float>(vv, cs, vv);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  return 0;
}
