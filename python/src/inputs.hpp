// kvevict Python binding: select_args -> kvevict::layer_inputs<T> and the plan-cache key, shared
// by the CPU (evictor_impl.hpp) and CUDA (methods_cuda.cu) evictors. Backend-neutral: it
// includes only kvevict/kvevict.hpp (no Eigen, no CUDA), so nvcc and g++ both compile it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <kvevict/kvevict.hpp>

#include "binding.hpp"

namespace kvevict_py {

using kvevict::errc;
using kvevict::status;

template <class T>
constexpr dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, kvevict::half_t>) return dtype::f16;
  else return dtype::bf16;
}

/// f(T{}) for the storage type T of `t` (float, half_t, bfloat16_t); other dtypes are an error
/// naming `name`.
template <class F>
status dispatch_storage(dtype t, const char* name, F&& f) {
  switch (t) {
    case dtype::f32: return f(float{});
    case dtype::f16: return f(kvevict::half_t{});
    case dtype::bf16: return f(kvevict::bfloat16_t{});
    default:
      return status::error(errc::invalid_argument, "%s.dtype = %s; kvevict takes float32, float16 or bfloat16", name, to_string(t));
  }
}

/// `name` must have rank `rank` and type `want`.
inline status check_arg(const tensor_arg& t, const char* name, int rank, dtype want, const char* want_desc) {
  if (t.ndim != rank)
    return status::error(errc::invalid_argument, "%s has %d dimensions; kvevict needs %d (%s)", name, t.ndim, rank, want_desc);
  if (t.type != want)
    return status::error(errc::invalid_argument, "%s.dtype = %s; kvevict needs %s here (%s)", name, to_string(t.type),
                         to_string(want), want_desc);
  for (int k = 0; k < rank; ++k)
    if (t.strides[k] < 0)
      return status::error(errc::invalid_argument, "%s.stride[%d] = %lld is negative; kvevict needs non-negative strides", name, k,
                           static_cast<long long>(t.strides[k]));
  return {};
}

template <class V>
V view_of(const tensor_arg& t) {
  V v;
  v.data = static_cast<decltype(v.data)>(t.data);
  for (int k = 0; k < V::rank; ++k) {
    v.extent[k] = t.shape[k];
    v.stride[k] = t.strides[k];
  }
  return v;
}

/// Views of every given argument with their rank and dtype checked (the keys' storage type T
/// for queries, values and wo); errors name the argument.
template <class T>
status build_inputs(const select_args& a, kvevict::layer_inputs<T>* in) {
  constexpr dtype t = dtype_of<T>();
  const char* kv = "(batch, kv_heads, seq, head_dim), the cache's storage type";
  KVEVICT_TRY(check_arg(a.keys, "keys", 4, t, kv));
  in->keys = view_of<kvevict::kv_view<const T>>(a.keys);
  if (a.values.given()) {
    KVEVICT_TRY(check_arg(a.values, "values", 4, t, "(batch, kv_heads, seq, head_dim), the keys' dtype"));
    in->values = view_of<kvevict::kv_view<const T>>(a.values);
  }
  if (a.queries.given()) {
    KVEVICT_TRY(check_arg(a.queries, "queries", 4, t, "(batch, q_heads, window, head_dim), the keys' dtype"));
    in->queries = view_of<kvevict::query_view<const T>>(a.queries);
  }
  if (a.lengths.given()) {
    KVEVICT_TRY(check_arg(a.lengths, "lengths", 2, dtype::i32, "(batch, kv_heads) int32"));
    in->lengths = view_of<kvevict::lengths_view>(a.lengths);
  }
  if (a.positions.given()) {
    KVEVICT_TRY(check_arg(a.positions, "positions", 3, dtype::i32, "(batch, kv_heads, seq) int32"));
    in->positions = view_of<kvevict::positions_view>(a.positions);
  }
  if (a.wo.given()) {
    KVEVICT_TRY(check_arg(a.wo, "wo", 2, t, "(hidden, q_heads * head_dim), the keys' dtype"));
    in->wo = view_of<kvevict::strided_view<const T, 2>>(a.wo);
  }
  if (a.wo_factor.given()) {
    KVEVICT_TRY(check_arg(a.wo_factor, "wo_factor", 3, dtype::f32, "(q_heads, head_dim, head_dim) float32"));
    in->wo_factor = view_of<kvevict::strided_view<const float, 3>>(a.wo_factor);
  }
  in->layer_idx = a.layer_idx;
  in->num_layers = a.num_layers;
  // Every view's extents against the keys' (lengths and positions included) before anything reads
  // them: the plan-cache key reads the lengths' values.
  return kvevict::detail::validate_layer_shapes(*in, kvevict::detail::input_requirements{});
}

/// Everything a plan depends on, flattened (pointers excluded: the same shapes with other data
/// reuse the plan; the lengths' values included: they fix the kept count).
template <class T>
std::vector<std::int64_t> cache_key(const select_args& a, const kvevict::layer_inputs<T>& in, bool host_lengths = true) {
  std::vector<std::int64_t> k;
  k.reserve(64);
  k.push_back(static_cast<std::int64_t>(dtype_of<T>()));
  for (const tensor_arg* t : {&a.queries, &a.keys, &a.values, &a.lengths, &a.positions, &a.wo, &a.wo_factor}) {
    k.push_back(t->given() ? t->ndim : -1);
    for (int d = 0; d < t->ndim; ++d) {
      k.push_back(t->shape[d]);
      k.push_back(t->strides[d]);
    }
  }
  std::int64_t fbits;
  std::memcpy(&fbits, &a.keep_fraction, sizeof(fbits));
  k.insert(k.end(), {a.keep_tokens, fbits, a.layer_idx, a.num_layers, a.num_threads});
  if (in.lengths.data && host_lengths)  // CUDA: device memory; the caller appends its host copy
    for (std::int64_t b = 0; b < in.batch(); ++b)
      for (std::int64_t h = 0; h < in.kv_heads(); ++h) k.push_back(in.length(b, h));
  return k;
}

}  // namespace kvevict_py
