// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU backend's GEMM-bound products, C = alpha * A * B^T over fp32 row-major blocks: Eigen's
// GEMM by default, BLIS's when the build defines KVEVICT_WITH_BLIS (CMake: -DKVEVICT_BLAS=BLIS;
// docs/performance.md, "Against plain PyTorch on a real BLAS"). Every translation unit of a
// program must agree on KVEVICT_WITH_BLIS (the inline functions that call gemm_nt are the same
// names either way).
//
// Why BLIS and not a CBLAS: a kvevict call runs on exactly the threads its plan says (issue 37;
// cpu::detail::thread_scope), and its products run inside its own parallel region, one per
// (sequence, KV head) task. BLIS's typed API takes the thread count per call (rntm_t): every
// product here runs on the calling thread, whatever BLIS_NUM_THREADS or the caller's BLIS
// settings are, and no global state is touched. A CBLAS call cannot say that (OpenBLAS's pthread
// build uses its own pool whatever the caller's threads; torch's own OpenBLAS, loaded first in a
// Python process, would even replace the one kvevict was linked with, under the same soname).
// BLIS also takes general row and column strides, so the blocks (outer strides, transposes) are
// passed as they are, never copied.
//
// Results: the same products summed in another order, so scores differ from the Eigen build in
// the last bits and selections may differ at near-ties of the scores.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvevict/backends/cpu/backend.hpp"

#if defined(KVEVICT_WITH_BLIS)
#include <blis.h>
#endif

namespace kvevict {
namespace cpu {
namespace detail {

/// True when the products below run on BLIS (KVEVICT_WITH_BLIS).
inline constexpr bool gemm_uses_blis =
#if defined(KVEVICT_WITH_BLIS)
    true;
#else
    false;
#endif

/// c = alpha * a * b^T. a: m x k, b: n x k, c: m x n, all fp32 Eigen blocks or maps of any
/// strides (row- or column-major, e.g. cmap_rm, a mat_rm's middleRows); c must not alias a or b.
/// Shapes are the caller's invariant (checked by the plan before any product runs). One thread:
/// the caller's, inside or outside kvevict's parallel region.
template <class C, class A, class B>
inline void gemm_nt(float alpha, const A& a, const B& b, C&& c) {
#if defined(KVEVICT_WITH_BLIS)
  eigen_assert(a.cols() == b.cols() && c.rows() == a.rows() && c.cols() == b.rows());
  const dim_t m = static_cast<dim_t>(a.rows()), n = static_cast<dim_t>(b.rows()), k = static_cast<dim_t>(a.cols());
  if (m == 0 || n == 0) return;
  // Row/column strides of an Eigen block: row-major -> (outer, inner), column-major -> (inner, outer).
  auto rs = [](const auto& x) -> inc_t { return static_cast<inc_t>(std::decay_t<decltype(x)>::IsRowMajor ? x.outerStride() : x.innerStride()); };
  auto cs = [](const auto& x) -> inc_t { return static_cast<inc_t>(std::decay_t<decltype(x)>::IsRowMajor ? x.innerStride() : x.outerStride()); };
  if (k == 0) {
    c.setZero();
    return;
  }
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads_only(1, &rntm);  // the calling thread only
  float al = alpha, be = 0.0f;
  bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_TRANSPOSE, m, n, k, &al, const_cast<float*>(a.data()), rs(a), cs(a),
               const_cast<float*>(b.data()), rs(b), cs(b), &be, c.data(), rs(c), cs(c), nullptr, &rntm);
#else
  if (alpha == 1.0f)
    c.noalias() = a * b.transpose();
  else
    c.noalias() = alpha * (a * b.transpose());
#endif
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
