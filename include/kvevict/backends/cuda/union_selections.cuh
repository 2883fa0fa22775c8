// IWYU pragma: private, include "kvevict/cuda.cuh"
// The union of selections on the device (docs/integration.md, mode c): the device counterpart of
// kvevict::cpu::union_selections, for engines whose cache can hold one token set per sequence for
// every KV head and layer (cells shared by every layer and head, as llama.cpp's), with the
// selections and the result in device memory.
//
// A bitmap per output row: every kept slot sets its bit, each row's bits are counted, a scan gives
// the output indptr, and each row writes its set bits in ascending order. Everything is enqueued
// on one stream without host synchronisation; the checks (indptr non-decreasing, indices in
// [0, slots) and strictly ascending, the union within out.capacity) report to a device status word
// in the workspace (union_selections_status()), and the output is written only when every check
// passed, as on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/workspace.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

/// Number of set bits of a 32-bit word (host and device).
KVEVICT_HOST_DEVICE inline int popcount32(std::uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __popc(w);
#else
  int n = 0;
  for (; w; w &= w - 1) ++n;
  return n;
#endif
}

/// Index of the lowest set bit of a non-zero word (host and device).
KVEVICT_HOST_DEVICE inline int lowest_bit32(std::uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(w)) - 1;
#else
  int b = 0;
  while (!(w & 1u)) w >>= 1, ++b;
  return b;
#endif
}

/// Write the slots of word j of a row's bitmap (bit b of word j = slot 32 j + b) to dst in
/// ascending order; returns how many. Host and device (the host test runs it).
KVEVICT_HOST_DEVICE inline int union_emit_word(std::uint32_t w, std::int64_t j, std::int32_t* dst) {
  int n = 0;
  for (; w; w &= w - 1) dst[n++] = static_cast<std::int32_t>(j * 32 + lowest_bit32(w));
  return n;
}

/// Mark the indices i0, i0 + step, ... of row r of selection k (device views) into `row_bits` (the
/// bitmap of the output row r / group): checks that each index is in [0, slots) and above the
/// previous one of its row, and calls set(word pointer, mask) for it (atomicOr on the device).
/// On a violation calls rep(check, a0, a1, a2, a3) and skips the index. Host and device.
#pragma nv_exec_check_disable
template <class Set, class Report>
KVEVICT_HOST_DEVICE inline void union_mark_row(const const_selection_view& s, int k, std::int64_t r, std::int64_t slots, std::uint32_t* row_bits,
                                               std::int64_t i0, std::int64_t step, Set&& set, Report&& rep) {
  const std::int64_t beg = s.indptr[r], end = s.indptr[r + 1];
  for (std::int64_t i = beg + i0; i < end; i += step) {
    const std::int32_t x = s.indices[i];
    if (x < 0 || x >= slots) {
      rep(device_check::union_index, k, r, x, slots);
      continue;
    }
    if (i > beg && x <= s.indices[i - 1]) {
      rep(device_check::union_order, k, r, i, x);
      continue;
    }
    set(row_bits + x / 32, 1u << (x % 32));
  }
}

/// indptr of selection k: indptr[0] >= 0, non-decreasing (thread per row).
template <int Unused = 0>
__global__ void union_indptr_kernel(const_selection_view s, int k, device_status* st) {
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < s.rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
  {
    if (r == 0 && s.indptr[0] < 0) report(st, errc::invalid_argument, device_check::union_indptr, k, -1, s.indptr[0], 0);
    if (s.indptr[r + 1] < s.indptr[r]) report(st, errc::invalid_argument, device_check::union_indptr, k, r, s.indptr[r], s.indptr[r + 1]);
  }
}

/// Selection k into the bitmaps, block per input row (grid-stride); nothing once an indptr failed.
template <int Unused = 0>
__global__ void union_mark_kernel(const_selection_view s, int k, std::int64_t group, std::int64_t slots, std::int64_t words,
                                  std::uint32_t* bits, device_status* st) {
  if (st->code != 0 && st->check == static_cast<std::int32_t>(device_check::union_indptr)) return;  // never follow a bad indptr
  for (std::int64_t r = blockIdx.x; r < s.rows; r += gridDim.x)
    union_mark_row(
        s, k, r, slots, bits + (r / group) * words, threadIdx.x, blockDim.x, [](std::uint32_t* w, std::uint32_t m) { atomicOr(w, m); },
        [&](device_check c, std::int64_t a0, std::int64_t a1, std::int64_t a2, std::int64_t a3) {
          report(st, errc::invalid_argument, c, a0, a1, a2, a3);
        });
}

/// Set bits per output row, block per row: count[q].
template <int Unused = 0>
__global__ void union_count_kernel(const std::uint32_t* bits, std::int64_t rows, std::int64_t words, long long* count) {
  using reduce = cub::BlockReduce<long long, block_threads>;
  __shared__ typename reduce::TempStorage tmp;
  for (std::int64_t q = blockIdx.x; q < rows; q += gridDim.x) {
    long long n = 0;
    for (std::int64_t j = threadIdx.x; j < words; j += blockDim.x) n += popcount32(bits[q * words + j]);
    const long long total = reduce(tmp).Sum(n);
    if (threadIdx.x == 0) count[q] = total;
    __syncthreads();  // tmp is reused by the next row
  }
}

/// The union's size against out.capacity and int32 indptr (pos: exclusive scan of the counts, rows + 1).
template <int Unused = 0>
__global__ void union_capacity_kernel(const long long* pos, std::int64_t rows, std::int64_t capacity, device_status* st) {
  if (threadIdx.x != 0 || st->code != 0) return;
  const long long total = pos[rows];
  if (total > 0x7fffffffLL) report(st, errc::invalid_argument, device_check::union_capacity, -1, 0, 0, 0);
  else if (total > capacity) report(st, errc::insufficient_capacity, device_check::union_capacity, total, capacity, 0, 0);
}

/// The output, block per output row, only when every check passed: indptr, then the set bits in
/// ascending order, a block-wide scan of the words' counts per chunk of block_threads words.
template <int Unused = 0>
__global__ void union_write_kernel(const std::uint32_t* bits, std::int64_t rows, std::int64_t words, const long long* pos,
                                   selection_view out, const device_status* st) {
  if (st->code != 0) return;  // uniform: set by earlier kernels only
  using scan = cub::BlockScan<int, block_threads>;
  __shared__ typename scan::TempStorage tmp;
  for (std::int64_t q = blockIdx.x; q < rows; q += gridDim.x) {
    if (threadIdx.x == 0) {
      out.indptr[q] = static_cast<std::int32_t>(pos[q]);
      if (q == rows - 1) out.indptr[rows] = static_cast<std::int32_t>(pos[rows]);
    }
    long long base = pos[q];
    for (std::int64_t j0 = 0; j0 < words; j0 += block_threads) {  // uniform over the block
      const std::int64_t j = j0 + threadIdx.x;
      const std::uint32_t w = j < words ? bits[q * words + j] : 0u;
      int off = 0, chunk = 0;
      scan(tmp).ExclusiveSum(popcount32(w), off, chunk);
      (void)union_emit_word(w, j, out.indices + base + off);
      base += chunk;
      __syncthreads();  // tmp is reused by the next chunk
    }
  }
}

/// The workspace layout of union_selections (carved from the aligned workspace).
struct union_buffers {
  device_status* status = nullptr;
  std::uint32_t* bits = nullptr;  ///< [rows * words]
  long long* count = nullptr;     ///< [rows + 1]
  long long* pos = nullptr;       ///< [rows + 1] exclusive scan of count
  void* scan_tmp = nullptr;
  std::size_t scan_bytes = 0;
};

inline union_buffers carve_union(kvevict::detail::workspace_carver& c, std::int64_t rows, std::int64_t words) {
  auto cnt = [](std::int64_t v) { return static_cast<std::size_t>(v > 0 ? v : 1); };
  union_buffers bf;
  bf.status = c.carve<device_status>(1);
  bf.bits = c.carve<std::uint32_t>(cnt(rows * words));
  bf.count = c.carve<long long>(cnt(rows + 1));
  bf.pos = c.carve<long long>(cnt(rows + 1));
  std::size_t sb = 0;
  (void)cub::DeviceScan::ExclusiveSum(nullptr, sb, static_cast<const long long*>(nullptr), static_cast<long long*>(nullptr),
                                      static_cast<int>(rows + 1));
  bf.scan_bytes = sb > 0 ? sb : 1;
  bf.scan_tmp = c.carve<unsigned char>(bf.scan_bytes);
  return bf;
}

}  // namespace detail

/// Bytes of device workspace cuda::union_selections() needs for selections of `rows` rows merged
/// `group` rows at a time, with indices below `slots` (any alignment): a bitmap of slots bits per
/// output row, 16 bytes per output row and CUB's scan scratch. 0 for a shape union_selections
/// refuses (group < 1, rows not a positive multiple of group, slots outside [1, 2^31)).
inline std::size_t union_selections_workspace_size(std::int64_t rows, std::int64_t group, std::int64_t slots) {
  if (group < 1 || rows < 1 || rows % group != 0 || rows / group >= 0x7fffffff || slots < 1 || slots > 0x7fffffff) return 0;
  kvevict::detail::workspace_carver c;
  (void)detail::carve_union(c, rows / group, (slots + 31) / 32);
  return c.bytes() + kvevict::detail::workspace_carver::alignment;
}

/// The device status word inside a workspace passed to union_selections() (same pointer): read it
/// with read_device_status() after the stream has reached the union.
inline device_status* union_selections_status(void* workspace) {
  return reinterpret_cast<device_status*>(kvevict::detail::workspace_carver::align_up(workspace));
}

/// The union of n selections, row group by row group, on the device: output row q keeps every
/// slot that any of the selections keeps in its rows q * group .. q * group + group - 1, in
/// ascending order; the same result as kvevict::cpu::union_selections (group = kv_heads: one token
/// set per sequence from per-head selections; every layer's selection: one set for the whole model,
/// mode c of compact_paged).
///   sels   host array of n selection views whose indptr and indices are DEVICE memory, all with
///          the same rows (a positive multiple of group); evictor::run() output, for example
///   slots  a bound on every index (the cache rows' capacity, layer_inputs::capacity()), in
///          [1, 2^31): the bitmap has slots bits per output row
///   out    DEVICE indptr (rows / group + 1) and indices (out.capacity; the sum of the inputs'
///          sizes always suffices); positions are not written; no memory shared with the inputs
/// Enqueued on `stream`, no allocation, no synchronisation.
/// Host-side errors (returned; nothing enqueued): null pointers, n < 1, group < 1, rows that
/// differ or are not a multiple of group, slots out of range, out.capacity < 0, a workspace
/// smaller than union_selections_workspace_size().
/// Device-side errors (union_selections_status(workspace), read with read_device_status()): an
/// indptr that decreases, an index outside [0, slots) or not above the previous one of its row, a
/// union larger than out.capacity (or than int32 indptr holds). On a device-side error nothing is
/// written to out.
/// (A template only so that translation units that never call it do not compile its kernels.)
template <int Unused = 0>
[[nodiscard]] status union_selections(const const_selection_view* sels, int n, std::int64_t group, std::int64_t slots,
                                             selection_view out, void* workspace, std::size_t workspace_bytes, cudaStream_t stream = nullptr) {
  if (!sels || n < 1) return status::error(errc::invalid_argument, "union_selections: n = %d selections (need >= 1, non-null)", n);
  if (group < 1) return status::error(errc::invalid_argument, "union_selections: group = %lld must be >= 1", static_cast<long long>(group));
  if (slots < 1 || slots > 0x7fffffff)
    return status::error(errc::invalid_argument, "union_selections: slots = %lld must be in [1, 2^31)", static_cast<long long>(slots));
  if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "union_selections: out indptr/indices is null");
  if (out.capacity < 0)
    return status::error(errc::invalid_argument, "union_selections: out.capacity = %lld must be >= 0", static_cast<long long>(out.capacity));
  const std::int64_t rows = sels[0].rows;
  if (rows < 1 || rows % group != 0)
    return status::error(errc::shape_mismatch, "union_selections: rows = %lld is not a positive multiple of group = %lld",
                         static_cast<long long>(rows), static_cast<long long>(group));
  if (rows / group >= 0x7fffffff)
    return status::error(errc::invalid_argument, "union_selections: rows / group = %lld output rows must be < 2^31 - 1",
                         static_cast<long long>(rows / group));
  for (int k = 0; k < n; ++k) {
    if (!sels[k].indptr || !sels[k].indices)
      return status::error(errc::null_pointer, "union_selections: selection %d indptr/indices is null", k);
    if (sels[k].rows != rows)
      return status::error(errc::shape_mismatch, "union_selections: selection %d has %lld rows != %lld", k,
                           static_cast<long long>(sels[k].rows), static_cast<long long>(rows));
  }
  const std::size_t need = union_selections_workspace_size(rows, group, slots);
  if (!workspace || workspace_bytes < need)
    return status::error(errc::insufficient_workspace, "union_selections: workspace_bytes = %zu < %zu needed (union_selections_workspace_size)",
                         workspace ? workspace_bytes : std::size_t{0}, need);
  using namespace detail;
  const std::int64_t Q = rows / group, W = (slots + 31) / 32;
  kvevict::detail::workspace_carver c(kvevict::detail::workspace_carver::align_up(workspace));
  const union_buffers bf = carve_union(c, Q, W);
  auto grid_rows = [](std::int64_t x) { return static_cast<unsigned>(x < 65535LL * 16 ? (x > 0 ? x : 1) : 65535LL * 16); };
  KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.status, 0, sizeof(device_status), stream));
  KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.bits, 0, static_cast<std::size_t>(Q * W) * sizeof(std::uint32_t), stream));
  KVEVICT_CUDA_TRY(cudaMemsetAsync(bf.count, 0, static_cast<std::size_t>(Q + 1) * sizeof(long long), stream));
  for (int k = 0; k < n; ++k) {  // every indptr before any index is read through one
    union_indptr_kernel<<<grid_for(rows), block_threads, 0, stream>>>(sels[k], k, bf.status);
    KVEVICT_CUDA_CHECK_LAUNCH();
  }
  for (int k = 0; k < n; ++k) {
    union_mark_kernel<<<grid_rows(rows), block_threads, 0, stream>>>(sels[k], k, group, slots, W, bf.bits, bf.status);
    KVEVICT_CUDA_CHECK_LAUNCH();
  }
  union_count_kernel<<<grid_rows(Q), block_threads, 0, stream>>>(bf.bits, Q, W, bf.count);
  KVEVICT_CUDA_CHECK_LAUNCH();
  std::size_t sb = bf.scan_bytes;
  KVEVICT_CUDA_TRY(cub::DeviceScan::ExclusiveSum(bf.scan_tmp, sb, bf.count, bf.pos, static_cast<int>(Q + 1), stream));
  union_capacity_kernel<<<1, 32, 0, stream>>>(bf.pos, Q, out.capacity, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  union_write_kernel<<<grid_rows(Q), block_threads, 0, stream>>>(bf.bits, Q, W, bf.pos, out, bf.status);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

}  // namespace cuda
}  // namespace kvevict
