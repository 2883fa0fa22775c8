// The user-defined scorer of the CUDA backend test: examples/value_norm (score = ||v_n||^power,
// query-free), the same policy and the same two implementations the examples use:
// value_norm_cpu.hpp in cpu_reference.cpp (the only file of test_cuda that sees the CPU backend)
// and value_norm_cuda.cuh in test_cuda.cu. No Eigen here.
#pragma once

#include "../examples/value_norm/value_norm.hpp"

namespace kvevict_test {

using value_norm_scorer = ::value_norm_scorer;

/// The user scorer composed with kvevict's stages (as in examples/custom_policy_cuda.cu).
using user_scorer_policy = kvevict::eviction_policy<value_norm_scorer, kvevict::temporal::last, kvevict::spatial::max_pool,
                                                    kvevict::budgeters::adakv, kvevict::selectors::topk>;

}  // namespace kvevict_test
