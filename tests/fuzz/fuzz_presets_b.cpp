// SPDX-License-Identifier: Apache-2.0
// The fuzz case (tests/fuzz/fuzz_case.hpp) for snapkv, pyramidkv, adakv, criticalkv and
// critical_adakv, in every storage type.
#include "fuzz_case.hpp"

namespace kvevict_fuzz {

void run_presets_b(int which, reader& r) {
  using namespace kvevict::presets;
  switch (which) {
    case 1: dispatch_type<snapkv>(r); break;
    case 2: dispatch_type<pyramidkv>(r); break;
    case 3: dispatch_type<adakv>(r); break;
    case 8: dispatch_type<criticalkv>(r); break;
    default: dispatch_type<critical_adakv>(r); break;  // 9
  }
}

}  // namespace kvevict_fuzz
