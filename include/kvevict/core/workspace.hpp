// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Two-phase workspace (CUB style): run once with a null base to count bytes, then carve the
// caller's buffer. Every carve is aligned to `alignment` bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvevict/core/config.hpp"

namespace kvevict {
namespace detail {

class workspace_carver {
 public:
  static constexpr std::size_t alignment = 256;

  /// p rounded up to `alignment` (what run() does with a caller's workspace pointer).
  static void* align_up(void* p) {
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<void*>((a + alignment - 1) / alignment * alignment);
  }

  /// base == nullptr: counting mode (carve() returns nullptr, bytes() accumulates).
  explicit workspace_carver(void* base = nullptr) : base_(static_cast<unsigned char*>(base)) {}

  template <class T>
  T* carve(std::size_t count) {
    offset_ = (offset_ + alignment - 1) / alignment * alignment;
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return p;
  }
  /// The current offset, to carve a second set of buffers over the same bytes (rewind) when the
  /// two sets are never used at the same time; then resume at the end of the larger (resume).
  std::size_t mark() const { return offset_; }
  void rewind(std::size_t m) { offset_ = m; }
  void resume(std::size_t end) { offset_ = end > offset_ ? end : offset_; }
  /// Bytes used so far, rounded up to the alignment.
  std::size_t bytes() const { return (offset_ + alignment - 1) / alignment * alignment; }

 private:
  unsigned char* base_;
  std::size_t offset_ = 0;
};

}  // namespace detail
}  // namespace kvevict
