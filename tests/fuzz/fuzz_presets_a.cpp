// SPDX-License-Identifier: Apache-2.0
// The fuzz case (tests/fuzz/fuzz_case.hpp) for restkv, h2o, tova, streaming_llm, key_norm, in every storage type.
#include "fuzz_case.hpp"

namespace kvevict_fuzz {

void run_presets_a(int which, reader& r) {
  using namespace kvevict::presets;
  switch (which) {
    case 0: dispatch_type<restkv>(r); break;
    case 4: dispatch_type<h2o>(r); break;
    case 5: dispatch_type<tova>(r); break;
    case 6: dispatch_type<streaming_llm>(r); break;
    default: dispatch_type<key_norm>(r); break;  // 7
  }
}

}  // namespace kvevict_fuzz
