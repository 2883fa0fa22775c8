// Real-model layers for the CUDA backend test; see model_reference.hpp.
#include "backends/cuda/model_reference.hpp"

#include <algorithm>
#include <fstream>
#include <iterator>

#include "evict.hpp"
#include "forward.hpp"
#include "model_path.hpp"
#include "tokenizer.hpp"

namespace kvevict_test {

bool capture_model_layers(int prompt_tokens, int window, std::size_t offset, std::vector<model_layer>* out,
                          std::string* why) {
  using namespace kvevict_engine;
  const std::string dir = resolve_model_dir();
  if (!model_dir_exists(dir)) {
    *why = "model folder '" + dir + "' not found (set KVEVICT_MODEL_DIR)";
    return false;
  }
  model m;
  tokenizer tok;
  wo_factors wo;
  if (auto r = load_model(model_file(dir), m); !r) return *why = "error: " + r.error, false;
  if (auto r = tok.load(tokenizer_file(dir), m.cfg.vocab_size); !r) return *why = "error: " + r.error, false;
  if (auto r = wo.compute(m); !r) return *why = "error: " + r.error, false;
  std::ifstream f(dir + "/../../data/text/sherlock.txt", std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  if (text.size() < offset + 8 * static_cast<std::size_t>(prompt_tokens))
    return *why = "error: sherlock.txt missing or too short beside '" + dir + "'", false;
  std::vector<int> tokens = tok.encode(text.substr(offset, 8 * static_cast<std::size_t>(prompt_tokens)));
  if (static_cast<int>(tokens.size()) < prompt_tokens) return *why = "error: excerpt too short", false;
  tokens.resize(static_cast<std::size_t>(prompt_tokens));

  const config& c = m.cfg;
  kv_cache cache(c, prompt_tokens);
  query_window qw(c, window);
  forward_options opt;
  opt.on_query = qw.hook();
  std::vector<float> logits;
  if (auto r = prefill(m, cache, tokens, logits, opt); !r) return *why = "error: " + r.error, false;

  const int Hkv = c.n_kv_heads, Hq = c.n_heads, d = c.head_dim(), L = prompt_tokens;
  out->clear();
  for (int l = 0; l < c.n_layers; ++l) {
    model_layer ml;
    ml.layer = l;
    ml.num_layers = c.n_layers;
    ml.kv_heads = Hkv;
    ml.q_heads = Hq;
    ml.head_dim = d;
    ml.length = L;
    ml.window = qw.count(l);
    ml.k.resize(static_cast<std::size_t>(Hkv) * L * d);
    ml.v.resize(ml.k.size());
    ml.pos.resize(static_cast<std::size_t>(Hkv) * L);
    for (int h = 0; h < Hkv; ++h) {
      if (cache.lengths(l)[h] != L) return *why = "error: cache length differs from the prompt", false;
      const std::size_t src = static_cast<std::size_t>(h) * cache.capacity() * d, dst = static_cast<std::size_t>(h) * L * d;
      std::copy_n(cache.keys(l) + src, static_cast<std::size_t>(L) * d, ml.k.data() + dst);
      std::copy_n(cache.values(l) + src, static_cast<std::size_t>(L) * d, ml.v.data() + dst);
      std::copy_n(cache.positions(l) + static_cast<std::size_t>(h) * cache.position_head_stride(), L,
                  ml.pos.data() + static_cast<std::size_t>(h) * L);
    }
    ml.q = qw.queries(l);
    const auto wv = wo.view(l);
    ml.wo.resize(static_cast<std::size_t>(Hq) * d * d);
    for (int h = 0; h < Hq; ++h)
      for (int r = 0; r < d; ++r)
        for (int cc = 0; cc < d; ++cc) ml.wo[(static_cast<std::size_t>(h) * d + r) * d + cc] = wv(h, r, cc);
    out->push_back(std::move(ml));
  }
  return true;
}

}  // namespace kvevict_test
