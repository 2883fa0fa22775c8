// A user-defined scorer, written the way kvevict's built-in policies are: the policy itself is
// backend-neutral (parameters, capability flags, the parameter check), and each backend runs it
// through an implementation trait that lives in a file of its own:
//   value_norm.hpp         this file: the policy (includes no backend)
//   value_norm_cpu.hpp     kvevict::cpu::scorer_impl<value_norm_scorer>   (examples/custom_policy.cpp)
//   value_norm_cuda.cuh    kvevict::cuda::scorer_impl<value_norm_scorer>  (examples/custom_policy_cuda.cu)
// The tests of both backends compare the two implementations (tests/backends/cuda).
//
// value_norm_scorer keeps tokens whose VALUE vectors are large, a query-free heuristic in the
// spirit of VATP / "value norms matter": score[n] = ||v_n||_2 ^ power, the sum of squares in fp64
// in element order on both backends.
#pragma once

#include <kvevict/kvevict.hpp>

struct value_norm_scorer {
  struct params {
    float power = 1.0f;  ///< score = ||v||^power, > 0
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
};
