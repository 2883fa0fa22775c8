// IWYU pragma: private, include "kvevict/cuda.cuh"
// CUDA compaction: gather the kept K/V rows of a (device) selection into a dense or a ragged
// buffer. Same contract as kvevict::cpu::compact / compact_ragged, except that the selection
// lives on the device: its indices are checked in the kernel and a violation is reported
// through a device status word (optional) instead of the returned status, and in-place
// compaction is not supported (parallel row moves could overlap).
#pragma once

#include <cstdint>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

/// Block per selection row r = b * H + h; dense (ragged = 0): dst(b, h, i, :) ; ragged:
/// dst_flat[(indptr[r] + i) * D + c]. Source head h / G.
template <class T>
__global__ void compact_kernel(kv_view<const T> src, const std::int32_t* indptr, const std::int32_t* indices, int H, int G,
                               kv_view<T> dst, T* flat, std::int64_t flat_elems, device_status* st) {
  const std::int64_t r = blockIdx.x, b = r / H, h = r % H;
  const std::int64_t beg = indptr[r], cnt = indptr[r + 1] - indptr[r], D = src.extent[3], S = src.extent[2];
  if (cnt < 0) {
    if (st && threadIdx.x == 0) report(st, errc::invalid_argument, device_check::compact_index, r, cnt, 0, 0);
    return;
  }
  if (!flat && cnt > dst.extent[2]) {
    if (st && threadIdx.x == 0) report(st, errc::insufficient_capacity, device_check::compact_capacity, r, cnt, dst.extent[2], 0);
    return;
  }
  if (flat && (beg + cnt) * D > flat_elems) {
    if (st && threadIdx.x == 0) report(st, errc::insufficient_capacity, device_check::compact_capacity, r, beg + cnt, flat_elems / D, 0);
    return;
  }
  for (std::int64_t i = threadIdx.x; i < cnt * D; i += blockDim.x) {
    const std::int64_t t = i / D, c = i % D;
    const std::int32_t from = indices[beg + t];
    if (from < 0 || from >= S || (t > 0 && indices[beg + t - 1] >= from)) {
      if (st && c == 0) report(st, errc::invalid_argument, device_check::compact_index, r, from, S, 0);
      continue;
    }
    const T v = src(b, h / G, from, c);
    if (flat) flat[(beg + t) * D + c] = v;
    else dst(b, h, t, c) = v;
  }
}

}  // namespace detail

/// Gather kept rows into a dense dst (batch, out_heads, budget_max, head_dim), any layout:
/// dst(b, h, i, :) = src(b, h / G, indices[indptr[r] + i], :), r = b * out_heads + h,
/// G = out_heads / src heads. Enqueued on `stream`, no synchronisation. Host-side errors:
/// null pointers, shape mismatch, dst aliasing src (not supported on CUDA). Device-side
/// (reported to *st when st is non-null): indices out of range / not ascending, a row longer
/// than dst's seq extent (that row is then not written).
template <class T>
[[nodiscard]] status compact(kv_view<const T> src, const_selection_view sel, kv_view<T> dst, cudaStream_t stream = nullptr,
                             device_status* st = nullptr) {
  if (!src.data || !dst.data) return status::error(errc::null_pointer, "compact: src.data or dst.data is null");
  if (!sel.indptr || !sel.indices) return status::error(errc::null_pointer, "compact: selection indptr/indices is null");
  if (src.extent[0] != dst.extent[0] || src.extent[3] != dst.extent[3])
    return status::error(errc::shape_mismatch, "compact: src (batch %lld, head_dim %lld) != dst (batch %lld, head_dim %lld)",
                         static_cast<long long>(src.extent[0]), static_cast<long long>(src.extent[3]),
                         static_cast<long long>(dst.extent[0]), static_cast<long long>(dst.extent[3]));
  if (src.extent[1] < 1 || dst.extent[1] % src.extent[1] != 0)
    return status::error(errc::shape_mismatch, "compact: dst heads = %lld is not a multiple of src heads = %lld",
                         static_cast<long long>(dst.extent[1]), static_cast<long long>(src.extent[1]));
  const std::int64_t rows = dst.extent[0] * dst.extent[1];
  if (sel.rows != rows)
    return status::error(errc::shape_mismatch, "compact: selection rows = %lld != batch * heads = %lld",
                         static_cast<long long>(sel.rows), static_cast<long long>(rows));
  if (static_cast<const void*>(src.data) == static_cast<const void*>(dst.data))
    return status::error(errc::not_supported, "compact: in-place compaction is not supported by the CUDA backend");
  if (rows == 0) return {};
  detail::compact_kernel<T><<<static_cast<unsigned>(rows), detail::block_threads, 0, stream>>>(
      src, sel.indptr, sel.indices, static_cast<int>(dst.extent[1]), static_cast<int>(dst.extent[1] / src.extent[1]), dst,
      nullptr, 0, st);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

/// Gather kept rows into a ragged buffer: row r's tokens go to dst[(indptr[r] + i) * head_dim
/// + c]; dst holds dst_elems elements (>= indptr[rows] * head_dim, checked on the device).
/// sel.rows must be a multiple of batch * kv_heads (per-query-head selections expand heads).
template <class T>
[[nodiscard]] status compact_ragged(kv_view<const T> src, const_selection_view sel, T* dst, std::int64_t dst_elems,
                                    cudaStream_t stream = nullptr, device_status* st = nullptr) {
  if (!src.data || !dst) return status::error(errc::null_pointer, "compact_ragged: src.data or dst is null");
  if (!sel.indptr || !sel.indices) return status::error(errc::null_pointer, "compact_ragged: selection indptr/indices is null");
  if (sel.rows < 1 || sel.rows % (src.extent[0] * src.extent[1]) != 0)
    return status::error(errc::shape_mismatch, "compact_ragged: selection rows = %lld is not a multiple of batch * kv_heads = %lld",
                         static_cast<long long>(sel.rows), static_cast<long long>(src.extent[0] * src.extent[1]));
  const std::int64_t H = sel.rows / src.extent[0];
  detail::compact_kernel<T><<<static_cast<unsigned>(sel.rows), detail::block_threads, 0, stream>>>(
      src, sel.indptr, sel.indices, static_cast<int>(H), static_cast<int>(H / src.extent[1]), kv_view<T>{}, dst, dst_elems, st);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

}  // namespace cuda
}  // namespace kvevict
