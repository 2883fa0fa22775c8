// SPDX-License-Identifier: Apache-2.0
// What every libFuzzer target of tests/fuzz shares: the input reader, the verbose switch and the
// invariant check that aborts (so libFuzzer records the input as a crash). No kvevict header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvevict_fuzz {

/// Consumes the fuzz input front to back; zeros once exhausted (so short inputs are valid).
struct reader {
  const std::uint8_t* p;
  std::size_t n, i = 0;
  bool done() const { return i >= n; }
  std::uint8_t u8() { return i < n ? p[i++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= static_cast<std::uint32_t>(u8()) << (8 * k);
    return v;
  }
  std::int32_t i32() { return static_cast<std::int32_t>(u32()); }
  float f32() {
    const std::uint32_t u = u32();
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  std::int64_t range(std::int64_t lo, std::int64_t hi) { return lo + static_cast<std::int64_t>(u8()) % (hi - lo + 1); }
};

/// KVEVICT_FUZZ_VERBOSE=1: print what each input did (error message or result), e.g. to check
/// that a corpus reaches valid results: build-fuzz/<target> -runs=0 <corpus>.
inline bool verbose() {
  static const bool v = std::getenv("KVEVICT_FUZZ_VERBOSE") != nullptr;
  return v;
}

[[noreturn]] inline void die(const char* what, const char* detail) {
  std::fprintf(stderr, "kvevict fuzz invariant violated: %s %s\n", what, detail ? detail : "");
  std::abort();
}

}  // namespace kvevict_fuzz

#define FUZZ_ASSERT(cond, detail)                       \
  do {                                                  \
    if (!(cond)) ::kvevict_fuzz::die(#cond, detail);    \
  } while (0)
