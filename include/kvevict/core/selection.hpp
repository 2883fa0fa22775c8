// IWYU pragma: private, include "kvevict/kvevict.hpp"
// What the caller asks for (a budget) and what kvevict returns (a ragged CSR selection).
#pragma once

#include <cstdint>

#include "kvevict/core/config.hpp"

namespace kvevict {

/// How many tokens each head keeps. A budget counts every kept token of a head, protected
/// (sink and recent/window) tokens included, as in the ReST-KV and SnapKV papers ("B").
///
/// Exactly one of the two forms:
///  - keep_tokens  B >= 1 tokens per head (the papers' per-head budget);
///  - keep_fraction f in (0, 1]: head (b, h) with L tokens keeps B = floor(f * L) tokens,
///    raised to the number of protected tokens and to 1 when the floor is smaller (documented
///    in docs/semantics.md; the exact kept count is always indptr[r+1] - indptr[r]).
/// Head-wise budgeters (PyramidKV, AdaKV, learned) redistribute the same per-layer total.
struct budget_request {
  std::int32_t keep_tokens = 0;
  double keep_fraction = 0.0;

  static budget_request tokens(std::int32_t b) {
    budget_request r;
    r.keep_tokens = b;
    return r;
  }
  static budget_request fraction(double f) {
    budget_request r;
    r.keep_fraction = f;
    return r;
  }
};

/// Output of a selection: for each row r = b * out_heads + h (out_heads = kv_heads, or q_heads
/// in the per-query-head GQA mode) the kept slots are indices[indptr[r] .. indptr[r+1]),
/// strictly ascending (original order). `positions`, when non-null, receives the logical
/// position of every kept slot, aligned with `indices`. All buffers are caller-allocated:
///   indptr    int32[rows + 1]   (indptr[0] = 0)
///   indices   int32[capacity]
///   positions int32[capacity]   (optional)
/// `capacity` must be at least the total kept count; max_selected() gives a safe bound.
struct selection_view {
  std::int32_t* indptr = nullptr;
  std::int32_t* indices = nullptr;
  std::int32_t* positions = nullptr;
  std::int64_t capacity = 0;
};

/// Read-only form of a selection (for compaction).
struct const_selection_view {
  const std::int32_t* indptr = nullptr;
  const std::int32_t* indices = nullptr;
  std::int64_t rows = 0;

  const_selection_view() = default;
  const_selection_view(const std::int32_t* ip, const std::int32_t* idx, std::int64_t r)
      : indptr(ip), indices(idx), rows(r) {}
  const_selection_view(const selection_view& s, std::int64_t r) : indptr(s.indptr), indices(s.indices), rows(r) {}
};

}  // namespace kvevict
