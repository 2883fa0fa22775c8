// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Storage types: IEEE binary16 (`half_t`) and bfloat16 (`bfloat16_t`).
//
// Both are 2-byte, trivially copyable structs holding the raw bits, layout-compatible with
// CUDA's __half / __nv_bfloat16 and with ggml's fp16/bf16, so a K/V buffer can be viewed
// through them without copies. kvevict always computes in fp32: `to_float` widens exactly,
// `from_float<T>` rounds to nearest-even (NaN stays NaN, overflow gives +-inf).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/core/config.hpp"

namespace kvevict {

namespace detail {
KVEVICT_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if KVEVICT_IS_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KVEVICT_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if KVEVICT_IS_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
}  // namespace detail

/// IEEE 754 binary16 storage type (1 sign, 5 exponent, 10 mantissa bits).
struct half_t {
  std::uint16_t bits;
};
/// bfloat16 storage type (the top 16 bits of an IEEE binary32).
struct bfloat16_t {
  std::uint16_t bits;
};
static_assert(sizeof(half_t) == 2 && std::is_trivially_copyable<half_t>::value, "half_t layout");
static_assert(sizeof(bfloat16_t) == 2 && std::is_trivially_copyable<bfloat16_t>::value, "bf16 layout");

KVEVICT_HOST_DEVICE inline float to_float(float x) { return x; }
KVEVICT_HOST_DEVICE inline float to_float(bfloat16_t x) {
  return detail::bits_float(static_cast<std::uint32_t>(x.bits) << 16);
}
KVEVICT_HOST_DEVICE inline float to_float(half_t x) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(x.bits) & 0x8000u) << 16;
  std::uint32_t exp = (x.bits >> 10) & 0x1fu;
  std::uint32_t man = x.bits & 0x3ffu;
  std::uint32_t out;
  if (exp == 0) {
    if (man == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      out = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    out = sign | 0x7f800000u | (man << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return detail::bits_float(out);
}

/// Round a float to the storage type T (nearest-even). T is float, half_t or bfloat16_t.
template <class T>
KVEVICT_HOST_DEVICE inline T from_float(float f);

template <>
KVEVICT_HOST_DEVICE inline float from_float<float>(float f) {
  return f;
}
template <>
KVEVICT_HOST_DEVICE inline bfloat16_t from_float<bfloat16_t>(float f) {
  std::uint32_t u = detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_t{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16_t{static_cast<std::uint16_t>(u >> 16)};
}
template <>
KVEVICT_HOST_DEVICE inline half_t from_float<half_t>(float f) {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return half_t{static_cast<std::uint16_t>(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return half_t{static_cast<std::uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // result is subnormal or zero
    if (a < 0x33000001u) return half_t{sign};  // rounds to zero (<= 2^-25)
    const std::uint32_t e = a >> 23;
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // 14 .. 24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return half_t{static_cast<std::uint16_t>(sign | r)};
  }
  std::uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return half_t{static_cast<std::uint16_t>(sign | (r >> 13))};
}

/// Runtime tag of a storage type (for dispatch from a model config).
enum class dtype : int { f32 = 0, f16 = 1, bf16 = 2 };

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of<half_t> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of<bfloat16_t> : std::integral_constant<dtype, dtype::bf16> {};
template <class T>
struct dtype_of<const T> : dtype_of<T> {};

/// True for the storage types kvevict accepts for Q, K and V.
template <class T>
inline constexpr bool is_storage_type_v =
    std::is_same<std::remove_const_t<T>, float>::value || std::is_same<std::remove_const_t<T>, half_t>::value ||
    std::is_same<std::remove_const_t<T>, bfloat16_t>::value;

inline const char* to_string(dtype d) noexcept {
  switch (d) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "unknown";
}

/// Finite-value test that works for every storage type (and does not rely on -ffast-math).
template <class T>
KVEVICT_HOST_DEVICE inline bool is_finite_value(T x) {
  const float f = to_float(x);
  return (detail::float_bits(f) & 0x7f800000u) != 0x7f800000u;
}

}  // namespace kvevict
