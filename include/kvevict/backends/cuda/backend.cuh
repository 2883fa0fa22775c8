// IWYU pragma: private, include "kvevict/cuda.cuh"
// The CUDA backend tag, its error plumbing (KVEVICT_CUDA_TRY, the device status word) and the
// block/warp primitives shared by its kernels (warp dot products, block radix select).
//
// Requires nvcc (C++17) and CUB (CUDA 12's CUB 2.x or CUDA 13's CUB 3.x, include/cccl). Only
// algorithms present in CUB 2.0 are used (BlockScan, DeviceScan::InclusiveSum), so no
// CUB_VERSION guard is needed; KVEVICT_CUB_VERSION records what was seen.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/version.cuh>

#include "kvevict/core/numeric.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"

#define KVEVICT_CUB_VERSION CUB_VERSION

namespace kvevict {
namespace cuda {

/// CUDA backend. Every kernel of a run() is enqueued on `stream` (the legacy default stream
/// when null); run() never synchronises with the host, never allocates, and can be captured
/// into a CUDA graph.
/// `stage_events`, when non-null, points to `num_stage_events` (>= 6) caller-created events
/// recorded on the stream at the stage boundaries of run() (0: start, 1: plans/validation,
/// 2: scoring, 3: GQA reduction + smoothing, 4: budgets, 5: selection + CSR). It exists for
/// benchmarking (bench/cuda); leave it null otherwise.
struct backend {
  cudaStream_t stream = nullptr;
  cudaEvent_t* stage_events = nullptr;
  int num_stage_events = 0;
};

/// What a run() found wrong in the data that lives on the device (lengths, NaN/inf, the
/// selection capacity). It is the first 32 bytes of the workspace (see
/// evictor::device_status_ptr()); run() clears it at the start and kernels set it with
/// atomicCAS, so the first error wins. Read it after the stream has finished (e.g. with
/// read_device_status()) and turn it into a kvevict::status with to_status().
/// `code` is a kvevict::errc value (0 = ok); `check` says which check fired (device_check);
/// a0..a3 are the check's arguments (documented at device_check).
struct device_status {
  std::int32_t code;
  std::int32_t check;
  std::int32_t a0, a1, a2, a3;
  std::int32_t reserved[2];
};
static_assert(sizeof(device_status) == 32, "device_status is 32 bytes");

/// Which device-side check set the status word, and the meaning of a0..a3.
enum class device_check : std::int32_t {
  none = 0,
  length_range = 1,        ///< lengths(b=a0, h=a1) = a2 is outside [0, seq = a3]
  layer_mean_lengths = 2,  ///< gqa layer_mean: sequence a0 has lengths a1 (head 0) and a2 (head a3)
  non_finite = 3,          ///< tensor a0 (0 keys, 1 values, 2 queries: (b=a1, h=a2, row a3); 3 wo_factor: (a1, a2, a3)) has a NaN/inf
  capacity = 4,            ///< selection.capacity = a0 < kept tokens = a1 (nothing written to indices)
  compact_index = 5,       ///< compaction: index a1 of row a0 outside [0, a2) or not ascending
  compact_capacity = 6,    ///< compaction: row a0 keeps a1 tokens > dst capacity a2
  lkv_lengths = 7,         ///< headwise_learned, num_tokens = 0: sequence a0 has length a2 in out row a1 != a3 in row 0
  lkv_apportion = 8,       ///< headwise_learned: sequence a0 cannot apportion total a1 over a2 heads of t = a3
  page_indptr = 9,         ///< pages row a0 holds a1 pages outside [0, max_pages_per_row = a2]; a0 = -1: indptr[0] = a1 != 0
  page_last_len = 10,      ///< pages.last_page_len[a0] = a1 outside [1, page_size = a2]
  page_lengths_table = 11, ///< lengths(b=a0, h=a1) = a2 != the page table's a3 tokens
  page_lengths_range = 12, ///< lengths(b=a0, h=a1) = a2 outside [0, pages * page_size - start_offset = a3] of its table row
  page_prefix = 13,        ///< pages.protected_prefix[a0] = a1 outside [0, a2], the tokens of KV head a3
  page_id = 14,            ///< pages.indices[a0] = a1 (row a2, page a3) outside [0, num_pages)
  page_repeat = 15,        ///< pages.indices[a0] = a1 (row a2, page a3) repeats a page of the table
  compact_prefix = 16,     ///< compact_paged: selection row a0 drops a token of sequence a1's protected prefix [0, a2)
  compact_unequal = 17,    ///< compact_paged: sequence a0 keeps a1 tokens in KV head 0 and a2 in KV head a3 (shared table)
  compact_freed = 18,      ///< compact_paged: a0 pages become free > freed_capacity = a1
  compact_indptr = 19,     ///< compact_paged: selection indptr[a0] = a1 (indptr[0] must be 0, then non-decreasing: indptr[a0 - 1] = a2)
  page_start_offset = 20,  ///< pages.start_offset[a0] = a1 outside [0, page_size = a2)
  page_start_empty = 21,   ///< pages.start_offset[a0] = a1 >= last_page_len = a2 of a row of one page
  union_indptr = 22,       ///< union_selections: selection a0's indptr decreases at row a1 (a2 then a3); a1 = -1: indptr[0] = a2 < 0
  union_index = 23,        ///< union_selections: selection a0 row a1 holds index a2 outside [0, slots = a3)
  union_order = 24,        ///< union_selections: selection a0 row a1 is not strictly ascending at position a2 (index a3)
  union_capacity = 25,     ///< union_selections: the union keeps a0 tokens > out.capacity = a1 (a0 = -1: more than int32 holds)
};

/// Build a host-side status from a device status word copied to the host.
inline status to_status(const device_status& s) {
  if (s.code == 0) return {};
  const errc e = static_cast<errc>(s.code);
  switch (static_cast<device_check>(s.check)) {
    case device_check::length_range:
      return status::error(e, "lengths(b=%d, h=%d) = %d is outside [0, seq = %d] (checked on the device)", s.a0, s.a1, s.a2, s.a3);
    case device_check::layer_mean_lengths:
      return status::error(e, "gqa = layer_mean needs equal lengths across heads; sequence %d has %d (head 0) and %d (head %d)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::non_finite: {
      static const char* names[4] = {"keys", "values", "queries", "wo_factor"};
      const char* n = (s.a0 >= 0 && s.a0 < 4) ? names[s.a0] : "input";
      if (s.a0 == 3) return status::error(e, "wo_factor(%d, %d, %d) is not finite (checked on the device)", s.a1, s.a2, s.a3);
      return status::error(e, "%s(b=%d, h=%d, row %d) holds a NaN or inf (checked on the device)", n, s.a1, s.a2, s.a3);
    }
    case device_check::capacity:
      return status::error(e, "selection.capacity = %d < kept tokens = %d (use max_selected(); nothing was written to indices)",
                           s.a0, s.a1);
    case device_check::compact_index:
      return status::error(e, "compact: selection index %d of row %d is outside [0, %d) or not ascending", s.a1, s.a0, s.a2);
    case device_check::compact_capacity:
      return status::error(e, "compact: row %d keeps %d tokens > dst capacity %d", s.a0, s.a1, s.a2);
    case device_check::lkv_lengths:
      return status::error(e,
                           "headwise_learned: head lengths differ in sequence %d (%d in out row %d vs %d in row 0; checked on the "
                           "device); set budgeter.num_tokens",
                           s.a0, s.a2, s.a1, s.a3);
    case device_check::lkv_apportion:
      return status::error(e, "headwise_learned: sequence %d cannot apportion total = %d over %d heads of t = %d (checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::page_indptr:
      if (s.a0 < 0) return status::error(e, "pages.indptr[0] = %d must be 0 (checked on the device)", s.a1);
      return status::error(e, "pages row %d holds %d pages, outside [0, max_pages_per_row = %d] (checked on the device)", s.a0, s.a1, s.a2);
    case device_check::page_last_len:
      return status::error(e, "pages.last_page_len[%d] = %d must be in [1, page_size = %d] (checked on the device)", s.a0, s.a1, s.a2);
    case device_check::page_start_offset:
      return status::error(e, "pages.start_offset[%d] = %d must be in [0, page_size = %d) (checked on the device)", s.a0, s.a1, s.a2);
    case device_check::page_start_empty:
      return status::error(e, "pages.start_offset[%d] = %d >= last_page_len = %d of a row of one page: the row holds no token (checked on the device)",
                           s.a0, s.a1, s.a2);
    case device_check::page_lengths_table:
      return status::error(e, "lengths(%d, %d) = %d != the page table's %d tokens ((pages - 1) * page_size + last_page_len - start_offset; checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::page_lengths_range:
      return status::error(e, "lengths(%d, %d) = %d is outside [0, pages * page_size - start_offset = %d] of its page table row (checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::page_prefix:
      return status::error(e, "pages.protected_prefix[%d] = %d is outside [0, %d], the tokens of sequence %d (KV head %d; checked on the device)",
                           s.a0, s.a1, s.a2, s.a0, s.a3);
    case device_check::page_id:
      return status::error(e, "pages.indices[%d] = %d (row %d, page %d) is outside [0, num_pages) (checked on the device)", s.a0, s.a1,
                           s.a2, s.a3);
    case device_check::page_repeat:
      return status::error(e,
                           "pages.indices[%d] = %d (row %d, page %d) repeats a page of the table (only pages wholly inside a "
                           "protected prefix may be shared; checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::compact_prefix:
      return status::error(e,
                           "compact_paged: selection row %d drops a token of sequence %d's protected prefix [0, %d) (shared pages are "
                           "never moved or freed: keep the prefix, e.g. num_sink >= the prefix; checked on the device)",
                           s.a0, s.a1, s.a2);
    case device_check::compact_unequal:
      return status::error(e,
                           "compact_paged: sequence %d keeps %d tokens in KV head 0 and %d in KV head %d under a shared page table "
                           "(one length per sequence): use uniform budgets, union_selections or pages.per_head (checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::compact_indptr:
      if (s.a0 == 0) return status::error(e, "compact_paged: selection indptr[0] = %d must be 0 (checked on the device)", s.a1);
      return status::error(e, "compact_paged: selection indptr[%d] = %d < indptr[%d] = %d (checked on the device)", s.a0, s.a1, s.a0 - 1, s.a2);
    case device_check::compact_freed:
      return status::error(e, "compact_paged: %d pages become free > result freed_capacity = %d (checked on the device)", s.a0, s.a1);
    case device_check::union_indptr:
      if (s.a1 < 0) return status::error(e, "union_selections: selection %d indptr[0] = %d must be >= 0 (checked on the device)", s.a0, s.a2);
      return status::error(e, "union_selections: selection %d indptr decreases at row %d (%d then %d; checked on the device)", s.a0, s.a1,
                           s.a2, s.a3);
    case device_check::union_index:
      return status::error(e, "union_selections: selection %d row %d holds index %d outside [0, slots = %d) (checked on the device)", s.a0,
                           s.a1, s.a2, s.a3);
    case device_check::union_order:
      return status::error(e, "union_selections: selection %d row %d is not strictly ascending at %d (index %d; checked on the device)",
                           s.a0, s.a1, s.a2, s.a3);
    case device_check::union_capacity:
      if (s.a0 < 0) return status::error(e, "union_selections: the union keeps more tokens than int32 indptr holds (checked on the device)");
      return status::error(e, "union_selections: the union keeps %d tokens > out.capacity = %d (checked on the device)", s.a0, s.a1);
    default: break;
  }
  return status::error(e, "device status check %d (%d, %d, %d, %d)", s.check, s.a0, s.a1, s.a2, s.a3);
}

namespace detail {
inline status cuda_status(cudaError_t e, const char* expr, const char* file, int line) {
  return status::error(errc::cuda_error, "%s (%s) at %s:%d: %s", cudaGetErrorName(e), cudaGetErrorString(e), file, line, expr);
}
}  // namespace detail

/// Copy the device status word to the host and convert it. SYNCHRONISES with `stream`
/// (cudaMemcpyAsync + cudaStreamSynchronize): call it after run(), never inside a graph capture.
inline status read_device_status(const device_status* d_status, cudaStream_t stream = nullptr) {
  device_status h{};
  cudaError_t e = cudaMemcpyAsync(&h, d_status, sizeof(h), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return detail::cuda_status(e, "read_device_status", __FILE__, __LINE__);
  return to_status(h);
}

}  // namespace cuda
}  // namespace kvevict

/// Evaluate a cudaError_t expression; on failure return a kvevict::status (errc::cuda_error)
/// carrying cudaGetErrorName / cudaGetErrorString, the expression and the location.
#define KVEVICT_CUDA_TRY(expr)                                                                       \
  do {                                                                                               \
    const cudaError_t kvevict_cuda_e_ = (expr);                                                      \
    if (kvevict_cuda_e_ != cudaSuccess)                                                              \
      return ::kvevict::cuda::detail::cuda_status(kvevict_cuda_e_, #expr, __FILE__, __LINE__);      \
  } while (0)

/// Check the launch of the kernel just enqueued (cudaPeekAtLastError, no synchronisation).
#define KVEVICT_CUDA_CHECK_LAUNCH() KVEVICT_CUDA_TRY(cudaPeekAtLastError())

namespace kvevict {
namespace cuda {
namespace detail {

/// Threads per block of every kvevict kernel; 8 warps.
inline constexpr int block_threads = 256;
inline constexpr int block_warps = block_threads / 32;
/// Largest head_dim the CUDA kernels support (8 values per lane in the warp-per-key kernels).
inline constexpr int max_head_dim = 256;
inline constexpr int lane_slots = max_head_dim / 32;

/// Set the status word once (first error wins).
__device__ inline void report(device_status* st, errc code, device_check what, std::int64_t a0, std::int64_t a1,
                              std::int64_t a2, std::int64_t a3) {
  if (atomicCAS(&st->code, 0, static_cast<std::int32_t>(code)) == 0) {
    st->check = static_cast<std::int32_t>(what);
    st->a0 = static_cast<std::int32_t>(a0);
    st->a1 = static_cast<std::int32_t>(a1);
    st->a2 = static_cast<std::int32_t>(a2);
    st->a3 = static_cast<std::int32_t>(a3);
  }
}

/// Warp sum; the result (from lane 0's reduction order) is broadcast so all lanes agree bitwise.
__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return __shfl_sync(0xffffffffu, v, 0);
}

/// Saturate to the finite float range (NaN -> 0), as cpu::detail::saturate.
__device__ inline float saturate(double x) {
  if (!(x == x)) return 0.0f;
  const double m = 3.4028234663852886e38;
  return static_cast<float>(x > m ? m : (x < -m ? -m : x));
}

/// Order-preserving key of a score: larger key = better (higher score). NaN maps to 0 (below
/// every number, -inf included) and -0 to +0, as cpu::detail::score_before.
__device__ inline std::uint32_t order_key(float f) {
  if (!(f == f)) return 0u;
  if (f == 0.0f) f = 0.0f;
  const std::uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Load row `n` of a (batch, heads, seq, dim) view for one head into the lane registers:
/// r[t] = x(base + n, lane + 32 t) for lane + 32 t < d, else 0.
template <class T>
__device__ inline void load_row(const T* head_base, std::int64_t n, std::int64_t s_seq, std::int64_t s_dim, int d, int lane,
                                float (&r)[lane_slots]) {
  const T* p = head_base + n * s_seq;
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) {
    const int c = lane + 32 * t;
    r[t] = c < d ? to_float(p[static_cast<std::int64_t>(c) * s_dim]) : 0.0f;
  }
}

/// Dot product of a lane-distributed row with a contiguous fp32 vector q[0, d), in fp64,
/// identical on every lane.
__device__ inline double warp_dot(const float (&r)[lane_slots], const float* q, int d, int lane) {
  double acc = 0.0;
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) {
    const int c = lane + 32 * t;
    if (c < d) acc += static_cast<double>(r[t]) * static_cast<double>(q[c]);
  }
  return warp_sum(acc);
}

/// y = R x for a lane-distributed x (lane + 32 t layout), R given transposed and contiguous
/// (rt[c * d + i] = R[i][c]); y in the same lane layout, fp32 accumulation (as Eigen's V R^T).
__device__ inline void warp_matvec_t(const float* rt, const float (&x)[lane_slots], int d, int lane, float (&y)[lane_slots]) {
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) y[t] = 0.0f;
#pragma unroll
  for (int tt = 0; tt < lane_slots; ++tt) {
    if (32 * tt >= d) break;
    for (int cc = 0; cc < 32; ++cc) {
      const int c = 32 * tt + cc;
      const float xc = __shfl_sync(0xffffffffu, x[tt], cc);
      if (c >= d) continue;
      const float* row = rt + static_cast<std::int64_t>(c) * d;
#pragma unroll
      for (int t = 0; t < lane_slots; ++t) {
        const int i = lane + 32 * t;
        if (i < d) y[t] = fmaf(row[i], xc, y[t]);
      }
    }
  }
}

/// Result of block_select_kth(): the K best keys are every key > kth plus the first `ties`
/// keys == kth in index order.
struct kth_result {
  std::uint32_t kth;
  long long ties;
};

/// Shared memory of the block selection primitives.
struct select_smem {
  unsigned int hist[256];
  long long sh[2];
  typename cub::BlockScan<int, block_threads>::TempStorage scan;
};

/// Radix select (MSB first, 4 passes of 8 bits, one 256-bin shared histogram per pass) of the
/// K-th largest of key(i), i in [0, n), 1 <= K <= n. Every thread of the block must call it.
/// Cost: 4 reads of the n keys. Exact (no sampling), so ties are resolved by index afterwards.
/// blockDim.x must be a multiple of 32 (full warps take part in __match_any_sync).
template <class KeyF>
__device__ kth_result block_select_kth(KeyF key, long long n, long long K, select_smem& sm) {
  std::uint32_t prefix = 0u, mask = 0u;
  long long krem = K;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sm.hist[i] = 0u;
    __syncthreads();
    // Warp-aggregated histogram: lanes with the same digit add once (scores of a row share
    // their leading bits, so plain shared atomics would serialise on one bin).
    const int lane = threadIdx.x & 31;
    for (long long base = 0; base < n; base += blockDim.x) {
      const long long i = base + threadIdx.x;
      unsigned int bin = 256u;  // 256: not counted
      if (i < n) {
        const std::uint32_t k = key(i);
        if ((k & mask) == prefix) bin = (k >> shift) & 255u;
      }
      const unsigned int peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[bin], static_cast<unsigned int>(__popc(peers)));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long cum = 0;
      int digit = 0;
      for (int dd = 255; dd >= 0; --dd) {
        const long long c = sm.hist[dd];
        if (cum + c >= krem) {
          digit = dd;
          break;
        }
        cum += c;
      }
      sm.sh[0] = krem - cum;
      sm.sh[1] = digit;
    }
    __syncthreads();
    krem = sm.sh[0];
    prefix |= static_cast<std::uint32_t>(sm.sh[1]) << shift;
    mask |= 0xffu << shift;
    __syncthreads();
  }
  return kth_result{prefix, krem};
}

/// Visit the K selected indices of block_select_kth() in increasing index order:
/// take(i, rank) with rank = 0, 1, ... (rank is the position in ascending index order).
/// Every thread of the block must call it.
template <class KeyF, class TakeF>
__device__ void block_take_ordered(KeyF key, long long n, kth_result sel, TakeF take, select_smem& sm) {
  using scan_t = cub::BlockScan<int, block_threads>;
  long long tie_base = 0, out_base = 0;
  for (long long base = 0; base < n; base += blockDim.x) {
    const long long i = base + threadIdx.x;
    const bool valid = i < n;
    const std::uint32_t k = valid ? key(i) : 0u;
    const int eq = (valid && k == sel.kth) ? 1 : 0;
    int eq_pos = 0, eq_tot = 0;
    scan_t(sm.scan).ExclusiveSum(eq, eq_pos, eq_tot);
    __syncthreads();
    const int t = (valid && (k > sel.kth || (eq && tie_base + eq_pos < sel.ties))) ? 1 : 0;
    int t_pos = 0, t_tot = 0;
    scan_t(sm.scan).ExclusiveSum(t, t_pos, t_tot);
    __syncthreads();
    if (t) take(i, out_base + t_pos);
    tie_base += eq_tot;
    out_base += t_tot;
  }
}

/// Ceil division for launch sizes.
inline unsigned int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<unsigned int>((a + b - 1) / b); }

/// Grid size of a grid-stride loop over n items (at most 65535 * 16 blocks).
inline unsigned int grid_for(std::int64_t n) {
  std::int64_t g = (n + block_threads - 1) / block_threads;
  if (g < 1) g = 1;
  if (g > 65535LL * 16) g = 65535LL * 16;
  return static_cast<unsigned int>(g);
}

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
