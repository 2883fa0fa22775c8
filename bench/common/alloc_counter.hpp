// Heap-byte counter for kvevict's benchmarks: measures the EXTRA memory a piece of code
// allocates (peak live heap bytes above the level at reset()).
//
// How it counts: the benchmark executable interposes malloc, calloc, realloc, free,
// posix_memalign, aligned_alloc and memalign (glibc only; it forwards to __libc_malloc & co.)
// and keeps the live heap size in bytes, as malloc_usable_size() reports each block (so a
// block counts what glibc really reserved for it, a few bytes above the request). Every
// allocation path of the process goes through these: operator new (libstdc++ calls malloc),
// Eigen's aligned_malloc, std::vector, OpenMP's runtime. mmap'ed memory that bypasses malloc
// is not seen (no code measured here does that).
//
// Use:
//   kvevict_bench::alloc_counter::reset();        // live level now = baseline
//   ... code under measurement ...
//   std::int64_t extra = kvevict_bench::alloc_counter::peak_extra();  // max(live) - baseline
//
// Not available (available() == false, every query returns 0) off glibc and under
// Address/Thread/MemorySanitizer, which own malloc themselves.
#pragma once

#include <cstdint>

namespace kvevict_bench {

struct alloc_counter {
  /// True when the malloc interposition is compiled in (glibc, no ASan).
  static bool available();
  /// Make the current live heap size the baseline and the peak.
  static void reset();
  /// Largest live heap size seen since reset(), minus the baseline, in bytes (>= 0).
  static std::int64_t peak_extra();
  /// Live heap bytes now (absolute).
  static std::int64_t live();
};

}  // namespace kvevict_bench
