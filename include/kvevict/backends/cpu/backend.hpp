// IWYU pragma: private, include "kvevict/cpu.hpp"
// The CPU backend tag and its plumbing: threading over heads, Eigen maps, fp32 staging.
// Only files under backends/cpu include Eigen; Eigen types never appear in public signatures.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvevict/core/inputs.hpp"
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
  /// Bytes of per-thread scratch one block of window-attention logits may take (the scorers that
  /// compute window attention hold the logits of a block of window rows of the whole GQA group
  /// over all L keys: max(G, 2) x rows x L floats). Below 32 rows' worth the block has fewer rows
  /// (at least one): less memory, more passes over K at long contexts, the same selections. Any
  /// value is valid (0: one row per block). The rest of the scoring scratch grows with L by a few
  /// rows (docs/performance.md "Workspace"). Default 16 MiB: 32 rows per block up to L = 32k at
  /// GQA group 4, 8 rows at 128k.
  std::size_t score_block_bytes = std::size_t{16} << 20;
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

/// Keeps a kvevict CPU call on the threads it was given, whatever the caller's OpenMP settings
/// (issue: a caller at omp_set_num_threads(8), as `torch.set_num_threads(8)` leaves it, made Eigen
/// parallelise the products of a 1-thread kvevict call: 2.0 s of CPU in 1.4 s of wall time
/// instead of 0.06 s). While alive, on the calling thread:
///  - max-active-levels allows no OpenMP region deeper than kvevict's own: none with `threads`
///    <= 1 (Eigen's GEMM and QR run on the calling thread), one level more with more threads
///    (kvevict's own parallel_for_threads; Eigen inside it sees a team and stays serial). Never
///    above the caller's own limit: called from inside the caller's parallel region, or with
///    nesting turned off, kvevict's region is not made to nest (its work runs on the calling
///    thread, with the same results);
///  - the thread count (nthreads-var) is 1, so that Eigen's nbThreads() is 1 unless the caller set
///    it with Eigen::setNbThreads, and Eigen blocks its products as for one thread: the same bits
///    whatever the caller's omp_set_num_threads (with Eigen::setNbThreads(n > 1), products deeper
///    than about 320, such as ReST-KV's over the sequence, are blocked for n threads and may
///    differ in the last bits; kvevict does not change that process-wide setting).
/// Both are restored on exit (RAII: every return path). Both ICVs have data-environment scope in
/// OpenMP 5.0, one per thread in libgomp (GCC >= 11) and libomp: checked with libgomp 12 and
/// libomp 14, a thread at 0 levels beside one opening a region of 4; an older runtime that keeps
/// max-active-levels process-wide would let concurrent calls race on it. No-op without OpenMP.
class thread_scope {
 public:
  explicit thread_scope(int threads) {
#if defined(_OPENMP)
    saved_levels_ = omp_get_max_active_levels();
    saved_threads_ = omp_get_max_threads();
    const int want = omp_get_active_level() + (threads > 1 ? 1 : 0);
    omp_set_max_active_levels(want < saved_levels_ ? want : saved_levels_);
    omp_set_num_threads(1);
#else
    (void)threads;
#endif
  }
  ~thread_scope() {
#if defined(_OPENMP)
    omp_set_num_threads(saved_threads_);
    omp_set_max_active_levels(saved_levels_);
#endif
  }
  thread_scope(const thread_scope&) = delete;
  thread_scope& operator=(const thread_scope&) = delete;

 private:
  int saved_levels_ = 0;
  int saved_threads_ = 1;
};

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
  // One task (or one thread): on the calling thread, where a many-thread plan's scope still
  // allows a region; close it so that Eigen cannot open one here.
  const thread_scope serial(1);
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

/// Rows of a (rows x cols) matrix stored with any strides as T, read as fp32 a tile at a time:
/// the scorers stream K and V through tiles instead of holding an fp32 copy of every token.
/// Values are divided by 2^scale_exp when it is non-zero (an exact power-of-two rescale into a
/// safe range, see scale_pow2), the same values a whole staged copy would hold.
///
/// Rows are either strided from `base` (a contiguous cache: row r at base + r * row_stride), or
/// paged (pages != null): row r is table position m = page_offset + r (page_table_view::
/// start_offset, plus from_row's shift), in page pages[m / page_size] at offset m % page_size,
/// at base + pages[m / page_size] * page_stride + (m % page_size) * row_stride. The contiguous
/// cache is the paged one with a single page, and reads exactly as before.
template <class T>
struct row_source {
  const T* base = nullptr;
  std::int64_t row_stride = 0, col_stride = 1, cols = 0;
  int scale_exp = 0;
  const std::int32_t* pages = nullptr;  ///< page ids in logical order (paged caches), or null
  std::int64_t page_size = 0;           ///< rows per page (paged)
  std::int64_t page_stride = 0;         ///< elements between pages (paged)
  std::int64_t page_offset = 0;         ///< paged: row r is the table's row page_offset + r

  /// First element of row r.
  const T* row_ptr(std::int64_t r) const {
    if (!pages) return base + r * row_stride;
    r += page_offset;
    return base + static_cast<std::int64_t>(pages[r / page_size]) * page_stride + (r % page_size) * row_stride;
  }
  /// The same rows from row t0 on (row r of the result is row t0 + r of this one).
  row_source from_row(std::int64_t t0) const {
    row_source s = *this;
    if (pages) {
      s.page_offset += t0;
    } else {
      s.base += t0 * row_stride;
    }
    return s;
  }
  /// Rows [r0, r0 + n) as an n x cols fp32 row-major matrix: zero-copy when T is float, the
  /// column stride is 1, no rescale applies and the rows lie in one page; otherwise widened
  /// into buf (n * cols floats).
  cmap_rm rows(std::int64_t r0, std::int64_t n, float* buf) const;
  /// Rows [r0, r0 + n) widened into buf (n * cols floats, row-major), always a copy.
  void copy_rows(std::int64_t r0, std::int64_t n, float* buf) const;
  /// Element (r, c) as fp32 (rescaled as rows() does).
  float at(std::int64_t r, std::int64_t c) const;
};

/// x is finite, tested on its exponent bits (as the K scan's row_finite): std::isfinite may be
/// folded to true under -ffinite-math-only / -ffast-math in a user's translation unit.
inline bool finite_bits(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/// True when the n elements at p (unit stride) are all finite. One branch-free pass: each
/// element's exponent field is tested for all ones (inf or NaN) on its bits and the flags are
/// ORed, a loop the compiler vectorises (an early-exit loop over is_finite_value is not, and
/// converts every 16-bit element to float). The scans below take a row through this and walk it
/// element by element only when it fails, to name the first bad element.
template <class T>
inline bool row_finite(const T* p, std::int64_t n) {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same<U, float>::value) {
    std::uint32_t bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint32_t u;
      std::memcpy(&u, p + i, sizeof u);
      bad |= static_cast<std::uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
  } else if constexpr (std::is_same<U, bfloat16_t>::value || std::is_same<U, half_t>::value) {
    constexpr unsigned e = std::is_same<U, bfloat16_t>::value ? 0x7f80u : 0x7c00u;  // exponent field
    unsigned bad = 0;
    for (std::int64_t i = 0; i < n; ++i) bad |= static_cast<unsigned>((p[i].bits & e) == e);
    return bad == 0;
  } else {
    for (std::int64_t i = 0; i < n; ++i)
      if (!is_finite_value(p[i])) return false;
    return true;
  }
}

/// Order key of a float (a score or a weight): a > b <=> score_key(a) > score_key(b) for
/// numbers, one key for -0 and +0 (they compare equal), and 0, below every number (-inf's key is
/// 0x007fffff), for every NaN: the order of cpu::detail::score_before. On the bits, so a user's
/// -ffast-math cannot fold it.
inline std::uint32_t score_key(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0u;  // NaN
  if (mag == 0u) u = 0u;             // -0 -> +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// The K-th largest t of n order keys key(i) (1 <= K <= n) and the count of keys above it.
struct kth_key {
  std::uint32_t t;
  std::int64_t above;
};

/// kth_key of the keys key(i), i < n, by radix select: a histogram of their top 11 bits finds
/// the bucket of the K-th largest, and only that bucket's keys (compacted into scratch, room for
/// n) go on. Scores that share their top bits (key norms: one sign, one exponent) fill a few
/// buckets, so while the bucket holds more than radix_select_small keys the next 11 bits (then
/// the last 10) split it the same way, in scratch. An nth_element over the last bucket gives
/// the key. Two passes over the keys, and passes over ever smaller buckets, instead of an
/// nth_element over all of them (the top-k selection, select.hpp topk_slots, and the adaptive
/// window's top-K mean index, window_attention.hpp topk_mean_index).
inline constexpr std::int64_t radix_select_small = 512;

template <class KeyOf>
inline kth_key kth_largest_key(std::int64_t n, std::int64_t K, KeyOf key, std::uint32_t* scratch) {
  constexpr int bits = 11;
  std::uint32_t hist[1u << bits];
  // Highest bucket bk such that the buckets above it hold fewer than K - above keys (the counts
  // sum to the keys' number >= K - above, so the walk stops at bucket 0 at the latest); it holds
  // hist[bk] >= K - above >= 1 keys.
  std::int64_t above = 0;
  auto find_bucket = [&](std::uint32_t top) {
    std::uint32_t bk = top;
    while (above + static_cast<std::int64_t>(hist[bk]) < K) above += hist[bk--];
    return bk;
  };
  std::fill(hist, hist + (1u << bits), 0u);
  for (std::int64_t i = 0; i < n; ++i) ++hist[key(i) >> (32 - bits)];
  std::uint32_t bk = find_bucket((1u << bits) - 1);
  std::int64_t nb = 0;
  for (std::int64_t i = 0; i < n; ++i) {  // the bucket's keys, compacted without branches
    const std::uint32_t k = key(i);
    scratch[nb] = k;
    nb += (k >> (32 - bits)) == bk;
  }
  // The bucket's keys share their top 11 bits; split by bits [10, 21), then [0, 10).
  for (int level = 1; level < 3 && nb > radix_select_small; ++level) {
    const int shift = level == 1 ? 10 : 0;
    const std::uint32_t mask = level == 1 ? (1u << bits) - 1 : (1u << 10) - 1;
    std::fill(hist, hist + mask + 1, 0u);
    for (std::int64_t j = 0; j < nb; ++j) ++hist[(scratch[j] >> shift) & mask];
    bk = find_bucket(mask);
    std::int64_t m = 0;
    for (std::int64_t j = 0; j < nb; ++j) {  // in place: m <= j
      const std::uint32_t k = scratch[j];
      scratch[m] = k;
      m += ((k >> shift) & mask) == bk;
    }
    nb = m;
  }
  const std::int64_t r = K - above;  // rank (1-based) of t among the bucket's keys, 1 <= r <= nb
  std::nth_element(scratch, scratch + (r - 1), scratch + nb, [](std::uint32_t a, std::uint32_t b) { return a > b; });
  const std::uint32_t t = scratch[r - 1];
  for (std::int64_t j = 0; j < nb; ++j) above += scratch[j] > t;
  return {t, above};
}

/// Saturate to the finite float range (NaN -> 0: callers guarantee NaN cannot arise).
inline float saturate(double x) {
  if (!(x == x)) return 0.0f;
  const double m = 3.4028234663852886e38;
  return static_cast<float>(x > m ? m : (x < -m ? -m : x));
}

template <class T>
cmap_rm row_source<T>::rows(std::int64_t r0, std::int64_t n, float* buf) const {
  if (pages) {
    if constexpr (std::is_same<std::remove_const_t<T>, float>::value) {
      const std::int64_t a = r0 + page_offset;
      if (scale_exp == 0 && col_stride == 1 && n > 0 && a / page_size == (a + n - 1) / page_size)  // one page
        return cmap_rm(row_ptr(r0), n, cols, Eigen::OuterStride<>(row_stride));
    }
    copy_rows(r0, n, buf);
    return cmap_rm(buf, n, cols, Eigen::OuterStride<>(cols));
  }
  if constexpr (std::is_same<std::remove_const_t<T>, float>::value) {
    if (scale_exp == 0 && col_stride == 1 && n > 0) return cmap_rm(base + r0 * row_stride, n, cols, Eigen::OuterStride<>(row_stride));
  }
  cmap_rm m = stage_rows(base + r0 * row_stride, n, cols, row_stride, col_stride, buf);
  if (scale_exp != 0) {
    if (m.data() != buf) map_rm(buf, n, cols, Eigen::OuterStride<>(cols)) = m;
    const double f = std::ldexp(1.0, -scale_exp);
    for (std::int64_t i = 0; i < n * cols; ++i) buf[i] = static_cast<float>(static_cast<double>(buf[i]) * f);
    return cmap_rm(buf, n, cols, Eigen::OuterStride<>(cols));
  }
  return m;
}

template <class T>
void row_source<T>::copy_rows(std::int64_t r0, std::int64_t n, float* buf) const {
  // Page by page: each page's run of rows is one strided block (stage_rows widens it). The next
  // page's rows are prefetched while this one is widened: pages lie anywhere in the pool, so the
  // hardware prefetcher, which follows streams, cannot guess them.
  for (std::int64_t i = 0; i < n;) {
    const std::int64_t r = r0 + i;
    const std::int64_t run = pages ? std::min(n - i, page_size - (r + page_offset) % page_size) : n - i;
#if defined(__GNUC__) || defined(__clang__)
    if (pages && col_stride == 1) {
      const std::int64_t nr = std::min(page_size, n - i - run);  // rows of the next page in this call
      for (std::int64_t q = 0; q < nr; ++q) {
        const char* p = reinterpret_cast<const char*>(row_ptr(r + run + q));
        for (std::int64_t off = 0; off < cols * static_cast<std::int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
      }
    }
#endif
    float* dst = buf + i * cols;
    const cmap_rm m = stage_rows(row_ptr(r), run, cols, row_stride, col_stride, dst);
    if (m.data() != dst) map_rm(dst, run, cols, Eigen::OuterStride<>(cols)) = m;
    i += run;
  }
  if (scale_exp != 0) {
    const double f = std::ldexp(1.0, -scale_exp);
    for (std::int64_t i = 0; i < n * cols; ++i) buf[i] = static_cast<float>(static_cast<double>(buf[i]) * f);
  }
}

template <class T>
float row_source<T>::at(std::int64_t r, std::int64_t c) const {
  const float x = to_float(row_ptr(r)[c * col_stride]);
  return scale_exp == 0 ? x : static_cast<float>(static_cast<double>(x) * std::ldexp(1.0, -scale_exp));
}

/// Largest |x| over the first `rows` rows of a row_source's storage (its scale ignored): rows read
/// in place when T is float with column stride 1, else widened a chunk at a time; a vectorised
/// maximum either way (the same value a staged copy's max_abs gives).
template <class T>
inline float max_abs_rows(const row_source<T>& src, std::int64_t rows) {
  constexpr std::int64_t chunk = 256;
  float buf[chunk];
  float mx = 0.0f;
  if constexpr (std::is_same<std::remove_const_t<T>, float>::value) {
    if (!src.pages && src.col_stride == 1 && src.row_stride == src.cols)  // contiguous rows: one flat reduction
      return rows > 0 && src.cols > 0 ? Eigen::Map<const Eigen::ArrayXf>(src.base, rows * src.cols).abs().maxCoeff() : 0.0f;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* p = src.row_ptr(r);
    if constexpr (std::is_same<std::remove_const_t<T>, float>::value) {
      if (src.col_stride == 1) {
        if (src.cols > 0) mx = std::max(mx, Eigen::Map<const Eigen::ArrayXf>(p, src.cols).abs().maxCoeff());
        continue;
      }
    }
    for (std::int64_t c0 = 0; c0 < src.cols; c0 += chunk) {
      const std::int64_t n = std::min(chunk, src.cols - c0);
      for (std::int64_t c = 0; c < n; ++c) buf[c] = to_float(p[(c0 + c) * src.col_stride]);
      mx = std::max(mx, Eigen::Map<const Eigen::ArrayXf>(buf, n).abs().maxCoeff());
    }
  }
  return mx;
}

/// The rows of KV head h of sequence b of a layer's K or V (`v` is in.keys or in.values): strided
/// from a contiguous cache, or through the page table of a paged one (layer_inputs::pages).
template <class T>
inline row_source<T> head_rows(const layer_inputs<T>& in, const kv_view<const T>& v, std::int64_t b, std::int64_t h) {
  row_source<T> s;
  s.row_stride = v.stride[2];
  s.col_stride = v.stride[3];
  s.cols = v.extent[3];
  if (!v.data) return s;
  if (in.paged()) {
    const std::int64_t r = in.pages.row(b, h, in.kv_heads());
    s.base = v.data + h * v.stride[1];
    s.pages = in.pages.indices + in.pages.indptr[r];
    s.page_size = v.extent[2];
    s.page_stride = v.stride[0];
    s.page_offset = in.pages.start(r);  // slot 0 is the row's token at table position start_offset
  } else {
    s.base = v.data + b * v.stride[0] + h * v.stride[1];
  }
  return s;
}

}  // namespace detail
}  // namespace cpu
}  // namespace kvevict
