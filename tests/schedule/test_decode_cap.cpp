// decode_schedule driving real CPU evictions of a per-layer budgeter (PyramidKV) over a synthetic
// 4-layer cache for 2,000 generated tokens: the model-wide average per head stays at B after every
// eviction and within B + interval between them, and each layer holds the pyramid of the tokens seen
// (hand-computed below). The same run with the layers' own lengths as the pyramid's reference (the
// rule before budgeters::pyramid::params::num_tokens) is checked to exceed B, so the test sees the
// failure it guards against (issue: PyramidKV under a decode cap kept +20% over B).
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/schedule/decode.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace {

struct cap_run {
  double max_avg_after = 0;              // largest model-wide average per head right after an eviction
  double max_avg_peak = 0;               // largest average per head at any step
  std::vector<std::int64_t> max_layer;   // per layer: the most tokens a head held after the prefill eviction
  std::vector<std::int64_t> last_after;  // per layer: a head's length after the last eviction
  int evictions = 0;
  bool ok = true;
};

// A synthetic model: `layers` layers, each an NHD fp32 cache [capacity][kv_heads][dim] whose heads
// all hold the same length (a per-layer budgeter gives a layer's heads the same budget).
cap_run run_cap(bool reference_tokens, int steps) {
  const int layers = 4, q_heads = 4, kv_heads = 2, dim = 8, window = 8, interval = 16, B = 64, prompt = 300;
  const int capacity = prompt + 4 * B + 2 * interval;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> k(layers), v(layers);
  std::vector<std::int64_t> len(layers, prompt);
  for (int l = 0; l < layers; ++l) {
    k[l].assign(static_cast<std::size_t>(capacity) * kv_heads * dim, 0.0f);
    v[l] = k[l];
    for (std::size_t i = 0; i < static_cast<std::size_t>(prompt) * kv_heads * dim; ++i) k[l][i] = normal(rng), v[l][i] = normal(rng);
  }
  std::vector<float> q(static_cast<std::size_t>(window) * q_heads * dim);
  kvevict::decode_schedule s;
  kvevict::decode_schedule_options o;
  o.interval = interval;
  o.budget = kvevict::budget_request::tokens(B);
  REQUIRE(s.init(o).ok());
  cap_run r;
  r.max_layer.assign(layers, 0);
  r.last_after.assign(layers, 0);
  auto evict = [&](const kvevict::decode_action& a) {
    for (int l = 0; l < layers; ++l) {
      auto p = kvevict::presets::pyramidkv::defaults();
      kvevict::budget_request budget;
      REQUIRE(s.apply(a, p, window, &budget).ok());
      CHECK(p.budgeter.num_tokens == a.tokens_seen);
      if (!reference_tokens) p.budgeter.num_tokens = 0;  // each layer's own length (the old rule)
      for (float& x : q) x = normal(rng);
      const std::int64_t L = len[l];
      kvevict::layer_inputs<float> in;
      in.keys = kvevict::make_kv_view<const float>(k[l].data(), 1, kv_heads, L, dim, kvevict::kv_layout::nhd);
      in.values = kvevict::make_kv_view<const float>(v[l].data(), 1, kv_heads, L, dim, kvevict::kv_layout::nhd);
      in.queries = kvevict::make_query_view<const float>(q.data(), 1, q_heads, window, dim, kvevict::kv_layout::nhd);
      in.layer_idx = l;
      in.num_layers = layers;
      const kvevict::evictor<kvevict::presets::pyramidkv, kvevict::cpu::backend> ev(p);
      std::vector<std::int32_t> indptr(kv_heads + 1), kept(static_cast<std::size_t>(ev.max_selected(in, budget)));
      std::vector<unsigned char> ws(ev.workspace_size(in));
      kvevict::selection_view sel{indptr.data(), kept.data(), nullptr, static_cast<std::int64_t>(kept.size())};
      const kvevict::status st = ev.run(in, budget, sel, ws.data(), ws.size());
      REQUIRE_MESSAGE(st.ok(), st.message());
      const std::int32_t n = indptr[1];
      for (int h = 1; h < kv_heads; ++h) REQUIRE(indptr[h + 1] - indptr[h] == n);  // one length per layer
      auto kv = kvevict::make_kv_view(k[l].data(), 1, kv_heads, L, dim, kvevict::kv_layout::nhd);
      auto vv = kvevict::make_kv_view(v[l].data(), 1, kv_heads, L, dim, kvevict::kv_layout::nhd);
      const kvevict::const_selection_view cs(sel, kv_heads);
      REQUIRE(kvevict::cpu::compact<float>(kv, cs, kv).ok());
      REQUIRE(kvevict::cpu::compact<float>(vv, cs, vv).ok());
      len[l] = n;
      r.last_after[l] = n;
    }
    REQUIRE(s.evicted(a).ok());
    ++r.evictions;
    double sum = 0;
    for (int l = 0; l < layers; ++l) sum += double(len[l]), r.max_layer[l] = std::max(r.max_layer[l], len[l]);
    r.max_avg_after = std::max(r.max_avg_after, sum / layers);
  };
  kvevict::decode_action a;
  REQUIRE(s.after_prefill(prompt, &a).ok());
  REQUIRE(a.evict);
  evict(a);
  for (int step = 0; step < steps; ++step) {
    double sum = 0;
    for (int l = 0; l < layers; ++l) {  // append one token to every head of every layer
      REQUIRE(len[l] < capacity);
      float* kr = k[l].data() + static_cast<std::size_t>(len[l]) * kv_heads * dim;
      float* vr = v[l].data() + static_cast<std::size_t>(len[l]) * kv_heads * dim;
      for (int i = 0; i < kv_heads * dim; ++i) kr[i] = normal(rng), vr[i] = normal(rng);
      ++len[l];
      sum += double(len[l]);
      r.max_layer[l] = std::max(r.max_layer[l], len[l]);
    }
    r.max_avg_peak = std::max(r.max_avg_peak, sum / layers);
    REQUIRE(s.after_decode(1, &a).ok());
    if (a.evict) evict(a);
  }
  return r;
}

}  // namespace

TEST_CASE("decode_schedule + PyramidKV: 2,000 decode steps keep the model-wide average within B + interval") {
  // B = 64, window 8 protected (num_recent = -1), beta 20: P = 56, min = 56 // 20 = 2, max = 2P - min = 110,
  // the layers' candidates 110 - 36 l = 110, 74, 38, 2 (sum 4 P), plus the 8 protected tokens.
  const std::vector<std::int64_t> pyramid = {118, 82, 46, 10};
  const cap_run r = run_cap(true, 2000);
  CHECK(r.evictions == 1 + 2000 / 16);
  CHECK(r.last_after == pyramid);
  CHECK(r.max_avg_after <= 64.0);
  CHECK(r.max_avg_after == 64.0);  // every layer is at least its pyramid budget at every eviction
  CHECK(r.max_avg_peak <= 64.0 + 16.0);
  for (int l = 0; l < 4; ++l) CHECK(r.max_layer[static_cast<std::size_t>(l)] <= pyramid[static_cast<std::size_t>(l)] + 16);
}

TEST_CASE("decode_schedule + PyramidKV: with each layer's own length as the reference the cap is exceeded (the old rule)") {
  const cap_run r = run_cap(false, 400);
  // short layers pass through whole while the long ones keep their share: 77 per head (+20%), as measured
  // on stories260K at B = 256
  CHECK(r.max_avg_after > 64.0 * 1.15);
}
