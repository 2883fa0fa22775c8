// IWYU pragma: private, include "kvevict/cuda.cuh"
// CUDA compaction of a paged KV cache in place (docs/integration.md, docs/cuda.md "Paged
// caches"): the device counterpart of kvevict::cpu::compact_paged, same modes (a, b, c), the same
// checks (reported through a device status word; when several fail, whichever the device reaches
// first), the same result but the freed page ids in ascending order, with the table, the selection
// and the result in device memory.
//
// Everything is enqueued on one stream without host synchronisation: the checks run first (the
// page table's three passes, the selection, the freed pages against freed_capacity) and report
// to a device status word in the workspace (compact_paged_status()); the move and the result
// kernels read that word and do nothing when a check failed, so that on error the cache and the
// result are untouched, as on the CPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_scan.cuh>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/paged.cuh"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/paged.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/workspace.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

/// Elements each thread holds per step of compact_paged_head().
inline constexpr int compact_per_thread = 4;

/// Move the kept tokens of one (sequence b, KV head h) down within the head's own pages, in place:
/// token idx[i] goes to logical slot i, for i < cnt (idx strictly ascending, so idx[i] >= i).
/// Block code, written against a context `cx` with sync() (block barrier) so that the host test
/// runs the very same code with host threads: thread tid of nthreads. Each step reads
/// nthreads * compact_per_thread elements into registers, synchronises, then writes them: a step
/// writes slots <= its last token i and later steps read slots idx[k] >= k > i, so no element is
/// overwritten before it is read, whatever the order of the pages. A token already at its slot
/// (a protected prefix) is neither read nor written. The table must be valid and idx checked.
#pragma nv_exec_check_disable
template <class T, class Ctx>
KVEVICT_HOST_DEVICE inline void compact_paged_head(Ctx& cx, int tid, int nthreads, const kv_view<T>& pool, const page_table_view& t,
                                                   std::int64_t b, std::int64_t h, const std::int32_t* idx, std::int64_t cnt) {
  const std::int64_t D = pool.extent[3], total = cnt * D, step = static_cast<std::int64_t>(nthreads) * compact_per_thread;
  const std::int64_t ps = pool.extent[2];
  T* base = pool.data + h * pool.stride[1];
  const std::int64_t row = t.row(b, h, pool.extent[1]), first = t.start(row);  // slot n: table position first + n
  const std::int32_t* pages = t.indices + t.indptr[row];
  auto at = [&](std::int64_t n, std::int64_t c) -> T* {
    const std::int64_t m = first + n;
    return base + static_cast<std::int64_t>(pages[m / ps]) * pool.stride[0] + (m % ps) * pool.stride[2] + c * pool.stride[3];
  };
  for (std::int64_t e0 = 0; e0 < total; e0 += step) {  // uniform over the block
    T v[compact_per_thread];
    T* dst[compact_per_thread];
#pragma unroll
    for (int k = 0; k < compact_per_thread; ++k) {
      const std::int64_t e = e0 + tid + static_cast<std::int64_t>(k) * nthreads;
      dst[k] = nullptr;
      if (e < total) {
        const std::int64_t i = e / D, c = e % D, from = idx[i];
        if (from != i) {
          v[k] = *at(from, c);
          dst[k] = at(i, c);
        }
      }
    }
    cx.sync();
#pragma unroll
    for (int k = 0; k < compact_per_thread; ++k)
      if (dst[k]) *dst[k] = v[k];
    cx.sync();
  }
}

/// compact_paged_head()'s device context: the block barrier.
struct compact_block_ctx {
  __device__ void sync() { __syncthreads(); }
};

/// What the compaction kernels share (device pointers, host shapes).
struct compact_paged_args {
  paged_table_args a;          ///< the table and its lengths view
  const_selection_view sel;    ///< device selection
  std::int64_t B = 0;          ///< batch
  int per_sequence_set = 0;    ///< mode c: sel.rows == batch (one set per sequence, every head)
  const std::int32_t* len = nullptr;  ///< [B * H] validated lengths (paged_lengths_kernel)

  KVEVICT_HOST_DEVICE std::int64_t sel_row(std::int64_t b, std::int64_t h) const { return per_sequence_set ? b : b * a.H + h; }
  KVEVICT_HOST_DEVICE std::int64_t kept(std::int64_t b, std::int64_t h) const {
    const std::int64_t r = sel_row(b, h);
    return static_cast<std::int64_t>(sel.indptr[r + 1]) - sel.indptr[r];
  }
  /// Pages table row r keeps (its first ones): ceil((start_offset + kept) / page_size) of its (first) head.
  KVEVICT_HOST_DEVICE std::int64_t row_kept_pages(std::int64_t r) const {
    const std::int64_t b = a.t.per_head ? r / a.H : r, h = a.t.per_head ? r % a.H : 0;
    return a.t.pages_for(r, kept(b, h), a.ps);
  }
};

/// The selection's indptr, thread per entry: indptr[0] = 0, then non-decreasing (before any index
/// is read, so that a bad indptr is reported, never followed).
template <int Unused = 0>
__global__ void compact_paged_indptr_kernel(const std::int32_t* indptr, std::int64_t rows, device_status* st) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i <= rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (i == 0 && indptr[0] != 0) report(st, errc::invalid_argument, device_check::compact_indptr, 0, indptr[0], 0, 0);
    if (i > 0 && indptr[i] < indptr[i - 1]) report(st, errc::invalid_argument, device_check::compact_indptr, i, indptr[i], indptr[i - 1], 0);
  }
}

/// The selection against the validated lengths, block per (b, h): indptr, every index in [0, L)
/// and strictly ascending, the protected prefix kept, equal counts under a per-sequence table.
template <int Unused = 0>
__global__ void compact_paged_check_kernel(compact_paged_args ca, device_status* st) {
  const std::int64_t H = ca.a.H, n = ca.B * H;
  if (st->code != 0) return;  // a table or indptr error: nothing more is read
  for (std::int64_t bh = blockIdx.x; bh < n; bh += gridDim.x) {
    const std::int64_t b = bh / H, h = bh % H, r = ca.sel_row(b, h), L = ca.len[bh];
    const std::int32_t beg = ca.sel.indptr[r], end = ca.sel.indptr[r + 1];
    for (std::int64_t i = beg + static_cast<std::int64_t>(threadIdx.x); i < end; i += blockDim.x) {
      const std::int32_t s = ca.sel.indices[i];
      if (s < 0 || s >= L || (i > beg && s <= ca.sel.indices[i - 1])) report(st, errc::invalid_argument, device_check::compact_index, r, s, L, 0);
    }
    if (threadIdx.x == 0) {
      const std::int64_t pre = ca.a.t.prefix(b);
      if (pre > 0 && (end - beg < pre || ca.sel.indices[beg + pre - 1] != pre - 1))
        report(st, errc::invalid_argument, device_check::compact_prefix, r, b, pre, 0);
      if (!ca.a.t.per_head && h > 0 && ca.kept(b, h) != ca.kept(b, 0))
        report(st, errc::invalid_argument, device_check::compact_unequal, b, ca.kept(b, 0), ca.kept(b, h), h);
    }
  }
}

/// state[page] |= 1 when a row keeps a token in it, |= 2 when a row held tokens in it and lets it
/// go: the freed pages are those with state == 2 (every row that used it let it go). Block per table row.
template <int Unused = 0>
__global__ void compact_paged_state_kernel(compact_paged_args ca, const device_status* st, unsigned int* state) {
  if (st->code != 0) return;
  const std::int64_t R = ca.a.rows();
  for (std::int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const std::int64_t used = ca.a.used(r), np = ca.row_kept_pages(r), beg = ca.a.t.indptr[r];
    for (std::int64_t i = threadIdx.x; i < used; i += blockDim.x) atomicOr(state + ca.a.t.indices[beg + i], i < np ? 1u : 2u);
  }
}

/// flag[p] = 1 for a freed page.
template <int Unused = 0>
__global__ void compact_paged_flags_kernel(const unsigned int* state, std::int64_t P, std::int32_t* flag) {
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < P;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    flag[p] = state[p] == 2u ? 1 : 0;
}

/// The freed count (the inclusive scan's last element) against freed_capacity.
template <int Unused = 0>
__global__ void compact_paged_capacity_kernel(const std::int32_t* pos, std::int64_t P, std::int64_t capacity, device_status* st) {
  if (threadIdx.x == 0 && st->code == 0 && pos[P - 1] > capacity)
    report(st, errc::insufficient_capacity, device_check::compact_freed, pos[P - 1], capacity, 0, 0);
}

/// The moves, block per (b, h) and per tensor (blockIdx.y: 0 keys, 1 values); nothing when a
/// check failed.
template <class T>
__global__ void compact_paged_move_kernel(kv_view<T> keys, kv_view<T> values, compact_paged_args ca, const device_status* st) {
  if (st->code != 0) return;  // uniform: set by earlier kernels only
  compact_block_ctx cx;
  const kv_view<T>& pool = blockIdx.y == 0 ? keys : values;
  const std::int64_t H = ca.a.H, n = ca.B * H;
  for (std::int64_t bh = blockIdx.x; bh < n; bh += gridDim.x) {
    const std::int64_t b = bh / H, h = bh % H, r = ca.sel_row(b, h);
    const std::int32_t beg = ca.sel.indptr[r];
    compact_paged_head<T>(cx, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), pool, ca.a.t, b, h, ca.sel.indices + beg,
                          ca.sel.indptr[r + 1] - beg);
  }
}

/// The result (only when every check passed): pages_kept and last_page_len per table row, the
/// lengths per (b, h), the freed page ids in ascending order and their count.
template <int Unused = 0>
__global__ void compact_paged_result_kernel(compact_paged_args ca, const std::int32_t* flag, const std::int32_t* pos, std::int64_t P,
                                            paged_compaction_result out, const device_status* st) {
  if (st->code != 0) return;
  const std::int64_t R = ca.a.rows(), H = ca.a.H, ps = ca.a.ps;
  const std::int64_t n = R > ca.B * H ? R : ca.B * H, m = n > P ? n : P;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < m;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (i < R) {
      const std::int64_t b = ca.a.t.per_head ? i / H : i, h = ca.a.t.per_head ? i % H : 0;
      const std::int64_t kept = ca.kept(b, h);
      out.pages_kept[i] = static_cast<std::int32_t>(ca.a.t.pages_for(i, kept, ps));
      out.last_page_len[i] = static_cast<std::int32_t>(ca.a.t.last_len_for(i, kept, ps));
    }
    if (out.lengths && i < ca.B * H) out.lengths[i] = static_cast<std::int32_t>(ca.kept(i / H, i % H));
    if (i < P && flag[i]) out.freed_pages[pos[i] - 1] = static_cast<std::int32_t>(i);
    if (i == 0) *out.num_freed = pos[P - 1];
  }
}

/// The workspace layout of compact_paged (carved from the aligned workspace).
struct compact_paged_buffers {
  device_status* status = nullptr;
  unsigned long long* cnt = nullptr;  ///< [slots] table-check counters
  std::int32_t* len = nullptr;        ///< [B * H]
  unsigned int* state = nullptr;      ///< [P]
  std::int32_t* flag = nullptr;       ///< [P]
  std::int32_t* pos = nullptr;        ///< [P] inclusive scan of flag
  void* scan_tmp = nullptr;
  std::size_t scan_bytes = 0;
};

inline compact_paged_buffers carve_compact_paged(kvevict::detail::workspace_carver& c, const paged_table_args& a, std::int64_t B) {
  auto cnt = [](std::int64_t v) { return static_cast<std::size_t>(v > 0 ? v : 1); };
  compact_paged_buffers bf;
  bf.status = c.carve<device_status>(1);
  bf.cnt = c.carve<unsigned long long>(cnt(a.slots()));
  bf.len = c.carve<std::int32_t>(cnt(B * a.H));
  bf.state = c.carve<unsigned int>(cnt(a.P));
  bf.flag = c.carve<std::int32_t>(cnt(a.P));
  bf.pos = c.carve<std::int32_t>(cnt(a.P));
  std::size_t sb = 0;
  (void)cub::DeviceScan::InclusiveSum(nullptr, sb, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
                                      static_cast<int>(a.P > 0 ? a.P : 1));
  bf.scan_bytes = sb > 0 ? sb : 1;
  bf.scan_tmp = c.carve<unsigned char>(bf.scan_bytes);
  return bf;
}

}  // namespace detail

/// Bytes of device workspace cuda::compact_paged() needs (shapes only; any alignment): the
/// status word, the table check's counters (8 bytes per page, per (page, KV head) for per-head
/// tables over pages of every head), 4 bytes per (sequence, KV head) and 12 per page, and CUB's
/// scan scratch.
template <class T>
std::size_t compact_paged_workspace_size(const paged_cache<T>& cache) {
  kvevict::detail::workspace_carver c;
  (void)detail::carve_compact_paged(c, detail::paged_args_of(kvevict::detail::paged_cache_inputs(cache)), cache.pages.batch);
  return c.bytes() + kvevict::detail::workspace_carver::alignment;
}

/// The device status word inside a workspace passed to compact_paged() (same pointer): read it
/// with read_device_status() after the stream has reached the compaction.
inline device_status* compact_paged_status(void* workspace) {
  return reinterpret_cast<device_status*>(kvevict::detail::workspace_carver::align_up(workspace));
}

/// Compact a paged cache in place on the device, as kvevict::cpu::compact_paged (same modes a, b,
/// c, same result) with DEVICE memory for the pools, the table, the lengths, the selection and the
/// result. Enqueued on `stream`, no allocation, no synchronisation.
/// Host-side errors (returned; nothing enqueued): null pointers, strides, the pool's and table's
/// shapes, lengths shape, sel.rows neither batch * kv_heads nor batch, one-head pages under a
/// per-sequence table, a workspace smaller than compact_paged_workspace_size().
/// Device-side errors (compact_paged_status(workspace), read with read_device_status()): the page
/// table's (as the evictor's: ids, repeats, last_page_len, lengths), the selection's (indices
/// outside a head's length or not ascending, a dropped protected-prefix token, unequal counts
/// under a per-sequence table), more freed pages than out.freed_capacity. On a device-side error
/// the cache and the result are untouched. The freed page ids come in ascending order.
template <class T>
[[nodiscard]] status compact_paged(const paged_cache<T>& cache, const_selection_view sel, paged_compaction_result out, void* workspace,
                                   std::size_t workspace_bytes, cudaStream_t stream = nullptr) {
  KVEVICT_TRY(kvevict::detail::validate_paged_cache_shapes(cache));
  const layer_inputs<T> in = kvevict::detail::paged_cache_inputs(cache);
  const std::int64_t B = in.batch(), H = in.kv_heads();
  if (!sel.indptr || !sel.indices) return status::error(errc::null_pointer, "compact_paged: selection indptr/indices is null");
  if (sel.rows != B * H && sel.rows != B)
    return status::error(errc::shape_mismatch, "compact_paged: selection rows = %lld is neither batch * kv_heads = %lld nor batch = %lld",
                         static_cast<long long>(sel.rows), static_cast<long long>(B * H), static_cast<long long>(B));
  if (!cache.pages.per_head && H > 1 && in.keys.stride[1] == 0)
    return status::error(errc::invalid_argument,
                         "compact_paged: keys.stride[1] = 0 (pages of one head) under a per-sequence table: every KV head would "
                         "move the same rows; use pages.per_head tables for one-head pages");
  if (!out.pages_kept || !out.last_page_len || !out.freed_pages || !out.num_freed)
    return status::error(errc::null_pointer, "compact_paged: result pages_kept, last_page_len, freed_pages or num_freed is null");
  if (out.freed_capacity < 0 || out.freed_capacity > 0x7fffffff)
    return status::error(errc::invalid_argument, "compact_paged: result freed_capacity = %lld must be in [0, 2^31)",
                         static_cast<long long>(out.freed_capacity));
  const std::size_t need = compact_paged_workspace_size(cache);
  if (!workspace || workspace_bytes < need)
    return status::error(errc::insufficient_workspace, "compact_paged: workspace_bytes = %zu < %zu needed (compact_paged_workspace_size)",
                         workspace ? workspace_bytes : std::size_t{0}, need);
  using namespace detail;
  kvevict::detail::workspace_carver c(kvevict::detail::workspace_carver::align_up(workspace));
  detail::compact_paged_args ca;
  ca.a = paged_args_of(in);
  const compact_paged_buffers bf = carve_compact_paged(c, ca.a, B);
  ca.sel = sel;
  ca.B = B;
  ca.per_sequence_set = (sel.rows == B && H > 1) ? 1 : 0;
  ca.len = bf.len;
  const std::int64_t P = ca.a.P, R = ca.a.rows(), n = B * H;
  auto grid_rows = [](std::int64_t x) { return static_cast<unsigned>(x < 65535LL * 16 ? (x > 0 ? x : 1) : 65535LL * 16); };
  KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.status, 0, sizeof(device_status), stream));
  KVEVICT_TRY(enqueue_page_table_check(ca.a, B, bf.cnt, bf.len, bf.status, stream));
  compact_paged_indptr_kernel<<<grid_for(sel.rows + 1), block_threads, 0, stream>>>(sel.indptr, sel.rows, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  compact_paged_check_kernel<<<grid_rows(n), block_threads, 0, stream>>>(ca, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.state, 0, static_cast<std::size_t>(P) * sizeof(unsigned int), stream));
  compact_paged_state_kernel<<<grid_rows(R), block_threads, 0, stream>>>(ca, bf.status, bf.state);
  KVEVICT_CUDA_CHECK_LAUNCH();
  compact_paged_flags_kernel<<<grid_for(P), block_threads, 0, stream>>>(bf.state, P, bf.flag);
  KVEVICT_CUDA_CHECK_LAUNCH();
  std::size_t sb = bf.scan_bytes;
  KVEVICT_CUDA_TRY(cub::DeviceScan::InclusiveSum(bf.scan_tmp, sb, bf.flag, bf.pos, static_cast<int>(P), stream));
  compact_paged_capacity_kernel<<<1, 32, 0, stream>>>(bf.pos, P, out.freed_capacity, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  compact_paged_move_kernel<T><<<dim3(grid_rows(n), in.values.data ? 2u : 1u), block_threads, 0, stream>>>(cache.keys, cache.values, ca,
                                                                                                          bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  const std::int64_t m = std::max(std::max(R, n), P);
  compact_paged_result_kernel<<<grid_for(m), block_threads, 0, stream>>>(ca, bf.flag, bf.pos, P, out, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

}  // namespace cuda
}  // namespace kvevict
