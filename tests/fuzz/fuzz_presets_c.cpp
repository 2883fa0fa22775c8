// SPDX-License-Identifier: Apache-2.0
// The fuzz case (tests/fuzz/fuzz_case.hpp) for adakv_published and the four LKV compositions (random
// tables: fuzz_case.hpp, lkv_case), in every storage type.
#include "fuzz_case.hpp"

namespace kvevict_fuzz {

void run_presets_c(int which, reader& r) {
  using namespace kvevict::presets;
  switch (which) {
    case 10: dispatch_type<adakv_published>(r); break;
    case 11: dispatch_type<lkv>(r); break;
    case 12: dispatch_type<lkv_uniform_budgets>(r); break;
    case 13: dispatch_type<lkv_budgets_restkv>(r); break;
    default: dispatch_type<lkv_budgets_attention>(r); break;  // 14
  }
}

}  // namespace kvevict_fuzz
