// Runtime-to-compile-time dispatch for engines whose storage type comes from a model config.
//
//   kvevict::status s = kvevict::dispatch_dtype(cfg.kv_dtype, [&](auto tag) {
//     using T = typename decltype(tag)::type;          // float, half_t or bfloat16_t
//     kvevict::layer_inputs<T> in = ...;
//     return ev.run(in, budget, sel, ws, ws_bytes);    // must return kvevict::status
//   });
#pragma once

#include <utility>

#include "kvevict/core/numeric.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {

/// A value carrying a type, for generic lambdas.
template <class T>
struct type_tag {
  using type = T;
};

/// Call f(type_tag<T>{}) for the storage type named by `dt` and return its status.
/// Error: errc::not_supported naming the value and the supported set.
template <class F>
status dispatch_dtype(dtype dt, F&& f) {
  switch (dt) {
    case dtype::f32: return std::forward<F>(f)(type_tag<float>{});
    case dtype::f16: return std::forward<F>(f)(type_tag<half_t>{});
    case dtype::bf16: return std::forward<F>(f)(type_tag<bfloat16_t>{});
  }
  return status::error(errc::not_supported, "dtype = %d is not supported (supported: f32, f16, bf16)", static_cast<int>(dt));
}

}  // namespace kvevict
