// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU backend tag and its plumbing: threading over heads, Eigen maps, fp32 staging.
// Only files under backends/cpu include Eigen; Eigen types never appear in public signatures.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kvevict/core/numeric.hpp"
#include "kvevict/core/tensor_view.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvevict {
namespace cpu {

/// CPU backend (Eigen 3.4). Work is split over (sequence, KV head) pairs with OpenMP when the
/// translation unit is compiled with it (kvevict::cpu links OpenMP::OpenMP_CXX when found);
/// otherwise it runs on the calling thread. num_threads = 0: OpenMP's default.
/// Matrix products inside a head use Eigen (single-threaded inside the parallel region).
struct backend {
  int num_threads = 0;
};

namespace detail {

using mat_rm = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using map_rm = Eigen::Map<mat_rm, Eigen::Unaligned, Eigen::OuterStride<>>;
using cmap_rm = Eigen::Map<const mat_rm, Eigen::Unaligned, Eigen::OuterStride<>>;
using vec_map = Eigen::Map<Eigen::VectorXf>;
using cvec_map = Eigen::Map<const Eigen::VectorXf>;
using row_map = Eigen::Map<Eigen::RowVectorXf>;

/// Threads a run may use: the evictor's workspace holds per-thread scratch for at most this many.
inline constexpr int max_scratch_threads = 256;

inline int max_threads(const backend& be) {
#if defined(_OPENMP)
  const int n = be.num_threads > 0 ? be.num_threads : omp_get_max_threads();
  return n < max_scratch_threads ? n : max_scratch_threads;  // more would index past the scratch
#else
  (void)be;
  return 1;
#endif
}

/// f(i, thread_id) for i in [0, n) over exactly min(threads, n) threads (a plan's thread count:
/// thread_id < threads, the per-thread scratch the plan's workspace holds).
template <class F>
inline void parallel_for_threads(int threads, std::int64_t n, F&& f) {
#if defined(_OPENMP)
  const int nt = static_cast<int>(std::min<std::int64_t>(threads, std::max<std::int64_t>(n, 1)));
  if (nt > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (std::int64_t i = 0; i < n; ++i) f(i, omp_get_thread_num());
    return;
  }
#endif
  (void)threads;
  for (std::int64_t i = 0; i < n; ++i) f(i, 0);
}

/// f(i, thread_id) for i in [0, n), dynamically scheduled over the backend's threads.
template <class F>
inline void parallel_for(const backend& be, std::int64_t n, F&& f) {
  parallel_for_threads(max_threads(be), n, std::forward<F>(f));
}

/// A rows x cols fp32 row-major matrix read from strided storage of type T. Zero-copy when T
/// is float and the column stride is 1; otherwise widened into `scratch` (rows * cols floats).
template <class T>
inline cmap_rm stage_rows(const T* base, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                          std::int64_t col_stride, float* scratch) {
  if constexpr (std::is_same<std::remove_const_t<T>, float>::value) {
    if (col_stride == 1 && rows > 0) return cmap_rm(base, rows, cols, Eigen::OuterStride<>(row_stride));
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* src = base + r * row_stride;
    float* dst = scratch + r * cols;
    if (col_stride == 1) {
      for (std::int64_t c = 0; c < cols; ++c) dst[c] = to_float(src[c]);
    } else {
      for (std::int64_t c = 0; c < cols; ++c) dst[c] = to_float(src[c * col_stride]);
    }
  }
  return cmap_rm(scratch, rows, cols, Eigen::OuterStride<>(cols));
}

/// Largest |x| over a staged matrix (finite inputs).
inline float max_abs(const cmap_rm& m) {
  if (m.outerStride() == m.cols())  // contiguous: one flat vectorised reduction
    return m.size() > 0 ? Eigen::Map<const Eigen::ArrayXf>(m.data(), m.size()).abs().maxCoeff() : 0.0f;
  float mx = 0.0f;
  for (Eigen::Index r = 0; r < m.rows(); ++r) mx = std::max(mx, m.row(r).cwiseAbs().maxCoeff());
  return mx;
}

/// Saturate to the finite float range (NaN -> 0: callers guarantee NaN cannot arise).
inline float saturate(double x) {
  if (!(x == x)) return 0.0f;
  const double m = 3.4028234663852886e38;
  return static_cast<float>(x > m ? m : (x < -m ? -m : x));
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
