// Test helper shared by the LKV tests: a private, platform-independent generator (splitmix64),
// so a seed gives the same weights and inputs on every compiler and standard library.
#pragma once

#include <cstdint>

namespace lkv_test {

/// splitmix64 started at seed * golden + salt. uniform() in [0, 1) with 53 random bits;
/// sym(a) in [-a, a) as float.
struct prng {
  std::uint64_t s;
  explicit prng(std::uint64_t seed, std::uint64_t salt = 7) : s(seed * 0x9E3779B97F4A7C15ull + salt) {}
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  float sym(double a) { return static_cast<float>((2.0 * uniform() - 1.0) * a); }
};

}  // namespace lkv_test
