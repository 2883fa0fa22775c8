// Real-model layers for the CUDA backend test (issue: "run the real-model demo's eviction path with
// the CUDA backend and compare selections with the CPU backend"). The example engine
// (examples/engine, CPU, fp32) prefills stories260K on a Sherlock excerpt; per layer this returns
// what the engine's eviction path hands the evictor: the cache's K and V, the last W queries
// (RoPE applied) and the W_O factors. Compiled by the host compiler (model_reference.cpp) so that
// test_cuda.cu needs neither Eigen nor the engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvevict_test {

/// One layer of the prefilled cache, fp32, contiguous.
struct model_layer {
  int layer = 0, num_layers = 0;
  int kv_heads = 0, q_heads = 0, head_dim = 0;
  int length = 0;  ///< L: tokens in the cache (every head)
  int window = 0;  ///< W: queries held (min(window asked, L))
  std::vector<float> k, v;        ///< (kv_heads, L, head_dim): HND, as the engine's cache
  std::vector<float> q;           ///< (q_heads, W, head_dim): the last W tokens' queries
  std::vector<float> wo;          ///< (q_heads, head_dim, head_dim): the W_O factors R_h
  std::vector<std::int32_t> pos;  ///< (kv_heads, L): logical positions (0..L-1 after a prefill)
};

/// Prefills `prompt_tokens` tokens of sherlock.txt (from character `offset`) and returns every
/// layer. False with *why set when the model folder is missing ("skip") or fails to load
/// (an error: *why starts with "error:").
bool capture_model_layers(int prompt_tokens, int window, std::size_t offset, std::vector<model_layer>* out,
                          std::string* why);

}  // namespace kvevict_test
