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
// Products of at most few_rows_max rows (TOVA's newest window row of each query head of a GQA
// group) skip BLIS: a direct kernel reads each key once (gemm_nt_few_rows), where a GEMM packs
// the keys into panels first.
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

/// Rows of `a` up to which the BLAS build computes c = alpha a b^T without packing b
/// (gemm_nt_few_rows): TOVA's product (the newest window row of each of a GQA group's G query
/// heads, G = 4: 4 x d times d x 1024 keys) is bound by reading K once, which a GEMM's packing of K
/// into panels doubles.
inline constexpr std::int64_t few_rows_max = 8;

/// c[i][j] = alpha * sum_t a[i][t] b[j][t] for M rows of a (row-major, leading dimensions lda,
/// ldb, ldc; unit inner strides): each row of b (a key) is read once, from memory, for all M
/// rows; the sum over t runs in 16 interleaved partial sums (t mod 16, which the compiler
/// vectorises: one zmm, two ymm or four xmm FMA per 16 elements), added in order, then the tail.
/// A NaN or inf in b[j] makes every c[i][j] NaN or inf (attention_block's key check relies on it:
/// no product is skipped).
template <int M>
inline void gemm_nt_rows(float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, std::int64_t n,
                         std::int64_t k, float* c, std::int64_t ldc) {
  constexpr std::int64_t lanes = 16;
  for (std::int64_t j = 0; j < n; ++j) {
    const float* bj = b + j * ldb;
    float acc[M][lanes] = {};
    std::int64_t t = 0;
    for (; t + lanes <= k; t += lanes)
      for (int i = 0; i < M; ++i)
        for (std::int64_t l = 0; l < lanes; ++l) acc[i][l] += a[i * lda + t + l] * bj[t + l];
    for (int i = 0; i < M; ++i) {
      float s = 0.0f;
      for (std::int64_t l = 0; l < lanes; ++l) s += acc[i][l];
      for (std::int64_t u = t; u < k; ++u) s += a[i * lda + u] * bj[u];
      c[i * ldc + j] = alpha * s;
    }
  }
}

/// gemm_nt_rows over m <= few_rows_max rows in groups of 4, 2 and 1 (b is read once per group;
/// a tile of b stays in cache between groups).
inline void gemm_nt_few_rows(float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, std::int64_t m,
                             std::int64_t n, std::int64_t k, float* c, std::int64_t ldc) {
  std::int64_t i = 0;
  for (; i + 4 <= m; i += 4) gemm_nt_rows<4>(alpha, a + i * lda, lda, b, ldb, n, k, c + i * ldc, ldc);
  if (i + 2 <= m) {
    gemm_nt_rows<2>(alpha, a + i * lda, lda, b, ldb, n, k, c + i * ldc, ldc);
    i += 2;
  }
  if (i < m) gemm_nt_rows<1>(alpha, a + i * lda, lda, b, ldb, n, k, c + i * ldc, ldc);
}

/// c = alpha * a * b^T. a: m x k, b: n x k, c: m x n, all fp32 Eigen blocks or maps of any
/// strides (row- or column-major, e.g. cmap_rm, a mat_rm's middleRows); c must not alias a or b.
/// Shapes are the caller's invariant (checked by the plan before any product runs). One thread:
/// the caller's, inside or outside kvevict's parallel region. The BLAS build computes products
/// of at most few_rows_max row-major rows with gemm_nt_few_rows, the others with BLIS.
template <class C, class A, class B>
inline void gemm_nt(float alpha, const A& a, const B& b, C&& c) {
#if defined(KVEVICT_WITH_BLIS)
  eigen_assert(a.cols() == b.cols() && c.rows() == a.rows() && c.cols() == b.rows());
  const dim_t m = static_cast<dim_t>(a.rows()), n = static_cast<dim_t>(b.rows()), k = static_cast<dim_t>(a.cols());
  if (m == 0 || n == 0) return;
  using AT = std::decay_t<A>;
  using BT = std::decay_t<B>;
  using CT = std::decay_t<C>;
  if constexpr (AT::IsRowMajor && BT::IsRowMajor && CT::IsRowMajor) {
    if (m <= few_rows_max && a.innerStride() == 1 && b.innerStride() == 1 && c.innerStride() == 1) {
      gemm_nt_few_rows(alpha, a.data(), a.outerStride(), b.data(), b.outerStride(), m, n, k, c.data(), c.outerStride());
      return;
    }
  }
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
