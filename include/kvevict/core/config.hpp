// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Compiler/host-device macros shared by every kvevict header.
#pragma once

#include "kvevict/version.hpp"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVEVICT_HOST_DEVICE __host__ __device__
#define KVEVICT_DEVICE __device__
#else
#define KVEVICT_HOST_DEVICE
#define KVEVICT_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#define KVEVICT_IS_DEVICE_CODE 1
#else
#define KVEVICT_IS_DEVICE_CODE 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVEVICT_PRINTF_FORMAT(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define KVEVICT_PRINTF_FORMAT(fmt_idx, arg_idx)
#endif

namespace kvevict {
namespace detail {
/// `static_assert(dependent_false<T>, ...)` in a primary template fires only when instantiated.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace detail
}  // namespace kvevict
