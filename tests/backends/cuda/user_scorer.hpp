// A user-defined scorer for the CUDA backend test: the value-norm scorer of
// examples/custom_policy_cuda.cu (score = ||v_n||^power, query-free), shared by both translation
// units of test_cuda. Its CUDA implementation (a scorer_impl specialisation with its own kernel)
// lives in test_cuda.cu; its CPU implementation is the CPU hook score_kv_head, defined in
// cpu_reference.cpp (the only file that sees the CPU backend). No Eigen here.
#pragma once

#include <cstdint>

#include "kvevict/kvevict.hpp"

namespace kvevict {
namespace cpu {
struct head_inputs;  // kvevict/cpu.hpp
}  // namespace cpu
}  // namespace kvevict

namespace kvevict_test {

struct value_norm_scorer {
  struct params {
    float power = 1.0f;  ///< score = ||v||^power
  };
  static constexpr const char* name = "value_norm";
  static constexpr bool needs_queries = false;
  static constexpr bool needs_values = true;
  static constexpr bool window_attention = false;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static kvevict::status check(const params& p) {
    if (!(p.power > 0.0f))
      return kvevict::status::error(kvevict::errc::invalid_argument, "scorer.power = %g must be > 0", static_cast<double>(p.power));
    return {};
  }
  /// CPU hook: out[n] = ||v_n||^power for n < in.length (fp64 sum of squares in element order,
  /// as the CUDA kernel). Defined in cpu_reference.cpp.
  static void score_kv_head(const params& p, const kvevict::cpu::head_inputs& in, float* out);
};

/// The user scorer composed with kvevict's stages (as in examples/custom_policy_cuda.cu).
using user_scorer_policy = kvevict::eviction_policy<value_norm_scorer, kvevict::temporal::last, kvevict::spatial::max_pool,
                                                    kvevict::budgeters::adakv, kvevict::selectors::topk>;

}  // namespace kvevict_test
