// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over kvevict's public CPU API: evictor<Preset, cpu::backend> for every preset
// (the published methods, AdaKV as published and the four LKV compositions with random tables) and
// storage type, with random shapes, strides (padding, NHD/HND, broadcast), lengths,
// positions, budgets, parameters and values (NaN, +-inf, denormals, FLT_MAX, fp16 max, huge and
// tiny norms), and workspaces full of garbage.
//
// Asserts (abort on violation, so libFuzzer records a crash):
//  * no crash, no sanitizer report, no out-of-bounds access on exactly sized buffers;
//  * either a clear error - can_implement() and run() agree, the message starts with the error
//    category, max_selected() == -1, no output written - or a valid result: kept count exactly
//    max_selected() (at most it for adakv_published's per-head rounding), indices strictly ascending, unique, inside [0, L) of the head (pads never
//    kept), protected sink and recent tokens present, pass-through heads whole, candidates
//    ranked by the returned final scores, maybe_scores finite everywhere (robust::contract);
//  * errc::non_finite_input is reported iff check_finite is on and the VALID region of a tensor
//    the scorer reads holds NaN/inf (pads are never scanned);
//  * a second run with other garbage in the workspace and another thread count gives the same
//    bytes; compact_ragged() of the selection gathers exactly the selected rows.
//
// Input format: docs/failure-kinds.md ("Fuzzing"); tests/fuzz/make_seeds.py writes the seed corpus.
#include <cstddef>
#include <cstdint>

#include "fuzz_case.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvevict_fuzz::reader r{data, size};
  const int which = r.u8() % 15;
  switch (which) {
    case 0: case 4: case 5: case 6: case 7: kvevict_fuzz::run_presets_a(which, r); break;
    case 1: case 2: case 3: case 8: case 9: kvevict_fuzz::run_presets_b(which, r); break;
    default: kvevict_fuzz::run_presets_c(which, r); break;
  }
  return 0;
}
