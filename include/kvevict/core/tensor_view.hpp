// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Non-owning strided views of the tensors an eviction step reads and writes.
//
// All strides are in ELEMENTS (not bytes), as int64_t, and may be any non-negative value
// (0 broadcasts). A view never owns memory and is trivially copyable, so it can be passed to
// CUDA kernels by value. Logical axis order is fixed per view type; the memory layout is
// whatever the strides say. docs/layouts.md has pictures.
//
//   kv_view<T>     (batch, kv_heads, seq, head_dim)   one layer's keys or values
//   query_view<T>  (batch, q_heads, window, head_dim) the observation-window queries
//   lengths_view   (batch, kv_heads)                  int32 valid tokens per (sequence, KV head)
//   positions_view (batch, kv_heads, seq)             int32 logical position of each slot
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvevict/core/config.hpp"

namespace kvevict {

/// A rank-`Rank` strided view: element (i0, .., iR-1) is data[sum_k i_k * stride[k]].
template <class T, int Rank>
struct strided_view {
  static_assert(Rank >= 1 && Rank <= 4, "strided_view: Rank must be 1..4");
  using value_type = T;
  static constexpr int rank = Rank;

  T* data = nullptr;
  std::int64_t extent[Rank] = {};
  std::int64_t stride[Rank] = {};

  KVEVICT_HOST_DEVICE bool empty() const { return data == nullptr; }

  template <class... I>
  KVEVICT_HOST_DEVICE std::int64_t offset(I... idx) const {
    static_assert(sizeof...(I) == Rank, "strided_view: wrong number of indices");
    const std::int64_t ids[Rank] = {static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (int k = 0; k < Rank; ++k) off += ids[k] * stride[k];
    return off;
  }
  template <class... I>
  KVEVICT_HOST_DEVICE T& operator()(I... idx) const {
    return data[offset(idx...)];
  }
  /// Number of logical elements (product of extents).
  KVEVICT_HOST_DEVICE std::int64_t size() const {
    std::int64_t n = 1;
    for (int k = 0; k < Rank; ++k) n *= extent[k];
    return n;
  }
  /// Implicit view-to-const conversion (only for views of non-const T).
  template <class U = T, class = std::enable_if_t<!std::is_const<U>::value>>
  KVEVICT_HOST_DEVICE operator strided_view<const U, Rank>() const {
    strided_view<const U, Rank> v;
    v.data = data;
    for (int k = 0; k < Rank; ++k) {
      v.extent[k] = extent[k];
      v.stride[k] = stride[k];
    }
    return v;
  }
};

/// One layer's keys or values: (batch, kv_heads, seq, head_dim). Keys are stored as the
/// engine stores them, i.e. already RoPE-rotated at their own logical positions.
template <class T>
using kv_view = strided_view<T, 4>;
/// Observation-window queries: (batch, q_heads, window, head_dim), RoPE applied. Row j of
/// sequence b is the query of the token at slot len(b, h) - window + j (the last `window`
/// tokens of the sequence).
template <class T>
using query_view = strided_view<T, 4>;
/// Valid tokens per (sequence, KV head), int32. Empty (data == nullptr) means every head of
/// every sequence holds `seq` tokens (the kv_view extent). stride[1] == 0 gives per-sequence
/// lengths (see per_sequence_lengths()).
using lengths_view = strided_view<const std::int32_t, 2>;
/// Logical position of each slot, int32, (batch, kv_heads, seq). Empty means position == slot.
using positions_view = strided_view<const std::int32_t, 3>;

/// Memory layout of a layer's K/V cache.
///  - nhd: [batch][seq][heads][head_dim]  (vLLM/FlashInfer "NHD", llama.cpp's default)
///  - hnd: [batch][heads][seq][head_dim]  (FlashInfer "HND", HF transformers)
enum class kv_layout : int { nhd = 0, hnd = 1 };

inline const char* to_string(kv_layout l) noexcept { return l == kv_layout::nhd ? "nhd" : "hnd"; }

/// View of a densely packed K or V buffer of one layer.
/// @param data      first element; the buffer holds batch * kv_heads * capacity * head_dim elements
/// @param capacity  slots per head (the seq extent); valid lengths come from a lengths_view
template <class T>
KVEVICT_HOST_DEVICE inline kv_view<T> make_kv_view(T* data, std::int64_t batch, std::int64_t kv_heads,
                                                   std::int64_t capacity, std::int64_t head_dim, kv_layout layout) {
  kv_view<T> v;
  v.data = data;
  v.extent[0] = batch;
  v.extent[1] = kv_heads;
  v.extent[2] = capacity;
  v.extent[3] = head_dim;
  v.stride[3] = 1;
  if (layout == kv_layout::hnd) {
    v.stride[2] = head_dim;
    v.stride[1] = capacity * head_dim;
    v.stride[0] = kv_heads * capacity * head_dim;
  } else {
    v.stride[1] = head_dim;
    v.stride[2] = kv_heads * head_dim;
    v.stride[0] = capacity * kv_heads * head_dim;
  }
  return v;
}

/// View of densely packed window queries, (batch, q_heads, window, head_dim) in the given layout
/// (nhd: [batch][window][q_heads][head_dim], hnd: [batch][q_heads][window][head_dim]).
template <class T>
KVEVICT_HOST_DEVICE inline query_view<T> make_query_view(T* data, std::int64_t batch, std::int64_t q_heads,
                                                         std::int64_t window, std::int64_t head_dim,
                                                         kv_layout layout) {
  return make_kv_view(data, batch, q_heads, window, head_dim, layout);
}

/// Per-sequence lengths `seq_lens[batch]` broadcast over the KV heads.
KVEVICT_HOST_DEVICE inline lengths_view per_sequence_lengths(const std::int32_t* seq_lens, std::int64_t batch,
                                                             std::int64_t kv_heads) {
  lengths_view v;
  v.data = seq_lens;
  v.extent[0] = batch;
  v.extent[1] = kv_heads;
  v.stride[0] = 1;
  v.stride[1] = 0;
  return v;
}

/// Per-(sequence, KV head) lengths stored row-major as lens[batch][kv_heads].
KVEVICT_HOST_DEVICE inline lengths_view per_head_lengths(const std::int32_t* lens, std::int64_t batch,
                                                         std::int64_t kv_heads) {
  lengths_view v;
  v.data = lens;
  v.extent[0] = batch;
  v.extent[1] = kv_heads;
  v.stride[0] = kv_heads;
  v.stride[1] = 1;
  return v;
}

/// Logical positions stored as pos[batch][kv_heads][capacity] (per-head positions), or, with
/// `shared_across_heads`, as pos[batch][capacity] broadcast over the heads.
KVEVICT_HOST_DEVICE inline positions_view make_positions_view(const std::int32_t* pos, std::int64_t batch,
                                                              std::int64_t kv_heads, std::int64_t capacity,
                                                              bool shared_across_heads = false) {
  positions_view v;
  v.data = pos;
  v.extent[0] = batch;
  v.extent[1] = kv_heads;
  v.extent[2] = capacity;
  v.stride[2] = 1;
  v.stride[1] = shared_across_heads ? 0 : capacity;
  v.stride[0] = shared_across_heads ? capacity : kv_heads * capacity;
  return v;
}

/// Valid length of (b, h): the lengths view if given, else the capacity.
template <class LV>
KVEVICT_HOST_DEVICE inline std::int64_t length_at(const LV& lens, std::int64_t capacity, std::int64_t b,
                                                  std::int64_t h) {
  return lens.data ? static_cast<std::int64_t>(lens(b, h)) : capacity;
}

}  // namespace kvevict
