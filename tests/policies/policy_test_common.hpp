// Helpers shared by the sources of the test_policies executable (tests/policies/CMakeLists.txt):
// the file-level names every policy test uses, and
//  - check_policy: run a policy on seeded random problems on the CPU backend and compare every
//    row with the fp64 whole-pipeline reference (tests/reference/harness.hpp);
//  - cfg_tokens: a reference configuration with a token budget;
//  - lib_plan: a reference head plan (kvref::head_plan) as the library's kvevict::detail::head_plan.
// Defined here once; include this header instead of copying them.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "reference/harness.hpp"

using kvevict::bfloat16_t;
using kvevict::half_t;
using kvtest::layout;
using kvtest::ref_config;
using kvtest::scorer_kind;
using kvtest::spatial_kind;
namespace kv = kvevict;

namespace kvtest {

template <class T>
const char* type_name() {
  return kv::to_string(kv::dtype_of<T>::value);
}

/// Run Policy on `seeds` random problems of shape s and compare with the reference.
/// Returns the number of rows whose selection was compared as exact sets.
template <class Policy, class T>
int check_policy(const typename Policy::params& params, const ref_config& cfg, const kvtest::shape& s,
                 kv::budget_request budget, std::uint64_t seed0, int seeds, std::vector<std::int32_t> lens = {},
                 double rtol = kvtest::score_rtol, double atol = kvtest::score_atol) {
  int sets = 0;
  for (int i = 0; i < seeds; ++i) {
    const std::uint64_t seed = seed0 + static_cast<std::uint64_t>(i);
    kvtest::problem p = kvtest::make_problem(s, seed, 1.0, 1.5, 1.0, lens);
    kvtest::quantize<T>(p);
    kvtest::stored<T> st;
    kvtest::store(p, layout::nhd, st);
    kv::evictor<Policy, kv::cpu::backend> ev(params);
    auto lib = kvtest::run_lib(ev, st.in, budget);
    auto ref = kvtest::reference_run(p, cfg);
    CAPTURE(seed);
    CAPTURE(type_name<T>());
    CAPTURE(budget.keep_tokens);
    CAPTURE(budget.keep_fraction);
    const std::string diff = kvtest::compare(lib, ref, rtol, atol, &sets);
    CHECK_MESSAGE(diff.empty(), diff);
    // non-vacuity: something was evicted somewhere
    std::int64_t kept = lib.indptr.back(), total = 0;
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < ev.out_heads(st.in); ++h) total += p.length(b, h / (ev.out_heads(st.in) / s.kv_heads));
    CHECK(kept < total);
  }
  return sets;
}

inline ref_config cfg_tokens(ref_config c, std::int64_t b) {
  c.keep_tokens = b;
  return c;
}

inline kvevict::detail::head_plan lib_plan(const kvref::head_plan& h) {
  kvevict::detail::head_plan p;
  p.length = h.L;
  p.base_budget = h.base;
  p.sinks = h.sinks;
  p.recent = h.recent;
  p.pass_through = h.pass;
  return p;
}

}  // namespace kvtest

using kvtest::cfg_tokens;
using kvtest::check_policy;
using kvtest::lib_plan;
