// IWYU pragma: private, include "kvevict/cpu.hpp"
// Per-query-head factor of the output projection, computed once per model load.
#pragma once

#include <Eigen/QR>
#include <cstdint>

#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/core/numeric.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {
namespace cpu {

/// R factors of W_O for the output-reconstruction score (ReST-KV, ICLR 2026), so that
/// ||x W_O^h||_2 = ||R_h x||_2 for every x in R^d without the C-wide projection.
///
/// @param wo   the layer's output projection as the model stores it: (hidden C, q_heads * d),
///             [out][in] (PyTorch nn.Linear / llama2.c / GGUF order, y = W x), any strides,
///             storage float/half_t/bfloat16_t. Columns h*d .. h*d+d-1 belong to query head h.
/// @param q_heads, head_dim  H_q and d.
/// @param out  fp32 (q_heads, d, d), row-major, upper-triangular R_h (from a Householder QR
///             of W_O^h^T, so rank-deficient W_O works; fp64 arithmetic).
/// Errors: null pointers, wo.extent[1] != q_heads * head_dim, non-finite weights.
/// Cost: O(H_q C d^2) once per layer; memory O(C d).
template <class T>
[[nodiscard]] status compute_wo_factors(strided_view<const T, 2> wo, std::int64_t q_heads, std::int64_t head_dim,
                                        float* out) {
  if (!wo.data || !out) return status::error(errc::null_pointer, "compute_wo_factors: wo.data or out is null");
  if (q_heads < 1 || head_dim < 1)
    return status::error(errc::invalid_argument, "compute_wo_factors: q_heads = %lld and head_dim = %lld must be >= 1",
                         static_cast<long long>(q_heads), static_cast<long long>(head_dim));
  if (wo.extent[1] != q_heads * head_dim || wo.extent[0] < 1)
    return status::error(errc::shape_mismatch, "compute_wo_factors: wo shape (%lld, %lld) != (hidden, q_heads * head_dim = %lld)",
                         static_cast<long long>(wo.extent[0]), static_cast<long long>(wo.extent[1]),
                         static_cast<long long>(q_heads * head_dim));
  const std::int64_t C = wo.extent[0], d = head_dim;
  const detail::thread_scope serial(1);  // Eigen's QR on the calling thread, whatever the caller's OpenMP
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t i = 0; i < q_heads * d; ++i)
      if (!is_finite_value(wo(c, i)))
        return status::error(errc::non_finite_input, "compute_wo_factors: wo(%lld, %lld) is not finite",
                             static_cast<long long>(c), static_cast<long long>(i));
  Eigen::MatrixXd wt(C, d);
  for (std::int64_t h = 0; h < q_heads; ++h) {
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t i = 0; i < d; ++i) wt(c, i) = static_cast<double>(to_float(wo(c, h * d + i)));
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(wt);
    const Eigen::MatrixXd& m = qr.matrixQR();
    float* r = out + h * d * d;
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t j = 0; j < d; ++j) r[i * d + j] = (i <= j && i < C) ? static_cast<float>(m(i, j)) : 0.0f;
  }
  return {};
}

/// View of the factors written by compute_wo_factors (for layer_inputs::wo_factor).
inline strided_view<const float, 3> wo_factor_view(const float* r, std::int64_t q_heads, std::int64_t head_dim) {
  strided_view<const float, 3> v;
  v.data = r;
  v.extent[0] = q_heads;
  v.extent[1] = head_dim;
  v.extent[2] = head_dim;
  v.stride[0] = head_dim * head_dim;
  v.stride[1] = head_dim;
  v.stride[2] = 1;
  return v;
}

}  // namespace cpu
}  // namespace kvevict
