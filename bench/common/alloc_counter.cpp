// Heap-byte counter: malloc interposition for glibc. See alloc_counter.hpp.
#include "common/alloc_counter.hpp"

#include <atomic>
#include <cerrno>
#include <cstddef>

// Sanitizers that own malloc (ASan, TSan, MSan) turn the counter off.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define KVEVICT_BENCH_NO_HOOK 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVEVICT_BENCH_NO_HOOK 1
#endif

#if defined(__GLIBC__) && !defined(KVEVICT_BENCH_NO_HOOK)
#include <malloc.h>

namespace {
std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<std::int64_t> g_base{0};

inline void note_alloc(void* p) {
  if (!p) return;
  const std::int64_t n = static_cast<std::int64_t>(malloc_usable_size(p));
  const std::int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  std::int64_t pk = g_peak.load(std::memory_order_relaxed);
  while (now > pk && !g_peak.compare_exchange_weak(pk, now, std::memory_order_relaxed)) {
  }
}
inline void note_free(void* p) {
  if (!p) return;
  g_live.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
}
}  // namespace

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);

void* malloc(std::size_t n) {
  void* p = __libc_malloc(n);
  note_alloc(p);
  return p;
}
void* calloc(std::size_t a, std::size_t b) {
  void* p = __libc_calloc(a, b);
  note_alloc(p);
  return p;
}
void* realloc(void* old, std::size_t n) {
  const std::int64_t before = old ? static_cast<std::int64_t>(malloc_usable_size(old)) : 0;
  void* p = __libc_realloc(old, n);
  if (p) {  // success: old is gone (or became p)
    g_live.fetch_sub(before, std::memory_order_relaxed);
    note_alloc(p);
  } else if (n == 0 && old) {  // realloc(p, 0) freed p
    g_live.fetch_sub(before, std::memory_order_relaxed);
  }
  return p;
}
void free(void* p) {
  note_free(p);
  __libc_free(p);
}
void* memalign(std::size_t al, std::size_t n) {
  void* p = __libc_memalign(al, n);
  note_alloc(p);
  return p;
}
void* aligned_alloc(std::size_t al, std::size_t n) { return memalign(al, n); }
int posix_memalign(void** out, std::size_t al, std::size_t n) {
  if (al < sizeof(void*) || (al & (al - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(al, n);
  if (!p && n) return ENOMEM;
  note_alloc(p);
  *out = p;
  return 0;
}
}  // extern "C"

namespace kvevict_bench {
bool alloc_counter::available() { return true; }
void alloc_counter::reset() {
  const std::int64_t now = g_live.load();
  g_base.store(now);
  g_peak.store(now);
}
std::int64_t alloc_counter::peak_extra() {
  const std::int64_t d = g_peak.load() - g_base.load();
  return d > 0 ? d : 0;
}
std::int64_t alloc_counter::live() { return g_live.load(); }
}  // namespace kvevict_bench

#else  // no interposition

namespace kvevict_bench {
bool alloc_counter::available() { return false; }
void alloc_counter::reset() {}
std::int64_t alloc_counter::peak_extra() { return 0; }
std::int64_t alloc_counter::live() { return 0; }
}  // namespace kvevict_bench

#endif
