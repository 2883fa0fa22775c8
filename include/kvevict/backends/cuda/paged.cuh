// IWYU pragma: private, include "kvevict/cuda.cuh"
// Paged KV caches on the CUDA backend (docs/integration.md, docs/cuda.md "Paged caches"): the row
// accessor every kernel reads K/V through (kv_rows: a contiguous (sequence, head) or the pages of a
// page table, same code), the device-side validation of a page table (device memory: the host
// never reads it) and the NaN/inf scan of a paged cache's valid tokens.
//
// The page table lives in DEVICE memory (indptr, indices, last_page_len, protected_prefix), as
// FlashInfer's and vLLM's. Its checks are the CPU's (kvevict::detail::check_page_table), run by
// four kernels before any other kernel reads through the table: the per-row checks read no page id,
// and the passes that do (ids, repeats) run only when every row's indptr has passed, so that a bad
// indptr is reported, never followed. A violation lands in the device status word
// (device_check::page_*) and zeroes every length, so that no later kernel reads a page. When
// several checks fail, the one reported is whichever the device reaches first (the CPU reports the
// first in row order).
#pragma once

#include <cstdint>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/core/paged.hpp"
#include "kvevict/core/tensor_view.hpp"

namespace kvevict {
namespace cuda {

/// The tokens of one (sequence, KV head): row(n) points at element (n, 0) of token n, whose
/// elements are s_dim apart. Contiguous caches: base = data + b s0 + h s1, row(n) = base + n s_tok.
/// Paged caches: base = pool + h s1 (s1 = 0 for one-head pages), token n lies at table position
/// m = first + n (first: the row's start_offset), in page pages[m / page_size] at offset
/// m % page_size: row(n) = base + pages[m / ps] s_page + (m % ps) s_tok.
/// The branch is uniform over a warp (one head per warp), so the contiguous path costs a
/// predictable branch and nothing else. Host and device (the host tests run kernel code with it).
template <class T>
struct kv_rows {
  const T* base = nullptr;
  std::int64_t s_tok = 0, s_dim = 0, s_page = 0;
  const std::int32_t* pages = nullptr;  ///< paged: this row's page ids (device memory), else null
  std::int64_t page_size = 1;
  std::int64_t first = 0;  ///< paged: table position of token 0 (page_table_view::start_offset)

  KVEVICT_HOST_DEVICE const T* row(std::int64_t n) const {
    if (pages == nullptr) return base + n * s_tok;
    const std::int64_t m = n + first;
    return base + static_cast<std::int64_t>(pages[m / page_size]) * s_page + (m % page_size) * s_tok;
  }
  KVEVICT_HOST_DEVICE const T& at(std::int64_t n, std::int64_t c) const { return row(n)[c * s_dim]; }
};

/// The rows of (sequence b, KV head h) of a K or V view: contiguous (batch, kv_heads, seq, dim)
/// when pt is empty, else a page pool (num_pages, kv_heads, page_size, dim) read through pt
/// (row pt.row(b, h, kv_heads)). The table must have been validated (the evictor does it before
/// any scorer runs). A user's scorer_impl reads K/V through it to support paged caches
/// (examples/value_norm/value_norm_cuda.cuh) and then declares `static constexpr bool reads_pages = true`.
template <class T>
KVEVICT_HOST_DEVICE inline kv_rows<T> head_rows(const kv_view<T>& v, const page_table_view& pt, std::int64_t b, std::int64_t h) {
  kv_rows<T> r;
  r.s_tok = v.stride[2];
  r.s_dim = v.stride[3];
  if (pt.indptr == nullptr) {
    r.base = v.data + b * v.stride[0] + h * v.stride[1];
    return r;
  }
  r.base = v.data + h * v.stride[1];
  r.s_page = v.stride[0];
  r.page_size = v.extent[2];
  const std::int64_t row = pt.row(b, h, v.extent[1]);
  r.pages = pt.indices + pt.indptr[row];
  r.first = pt.start(row);
  return r;
}

namespace detail {

/// Load token n of a kv_rows into the lane registers: r[t] = x(n, lane + 32 t) for lane + 32 t < d, else 0.
template <class T>
__device__ inline void load_row(const kv_rows<T>& rows, std::int64_t n, int d, int lane, float (&r)[lane_slots]) {
  const T* p = rows.row(n);
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) {
    const int c = lane + 32 * t;
    r[t] = c < d ? to_float(p[static_cast<std::int64_t>(c) * rows.s_dim]) : 0.0f;
  }
}

/// What the page-table checks read: the table (device), the optional lengths (device,
/// (batch, kv_heads)), the pool's num_pages P, kv_heads H, page_size ps, and whether duplicate
/// slots are (page, head) pairs (per-head tables over pages that span every head).
struct paged_table_args {
  page_table_view t;
  lengths_view lens;
  std::int64_t P = 0, H = 0, ps = 1;
  bool head_slots = false;

  /// Rows of the table.
  KVEVICT_HOST_DEVICE std::int64_t rows() const { return t.rows(H); }
  /// Duplicate-check slots (counters): P, or P * H with head_slots.
  KVEVICT_HOST_DEVICE std::int64_t slots() const { return head_slots ? P * H : P; }
  /// The length of (b, h): lengths when given, else the table's (needs last_page_len).
  KVEVICT_HOST_DEVICE std::int64_t length(std::int64_t b, std::int64_t h) const {
    if (lens.data) return lens(b, h);
    return t.table_length(t.row(b, h, H), ps);
  }
  /// Pages of row r that hold tokens (the longest head's for a per-sequence table), clamped to
  /// the row's pages so that a bad length never reads past the row.
  KVEVICT_HOST_DEVICE std::int64_t used(std::int64_t r) const {
    std::int64_t u = 0;
    if (t.per_head) {
      u = t.pages_for(r, length(r / H, r % H), ps);
    } else {
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t x = t.pages_for(r, length(r, h), ps);
        u = x > u ? x : u;
      }
    }
    const std::int64_t n = t.pages(r);
    u = u < n ? u : n;
    return u > 0 ? u : 0;
  }
};

/// The per-row checks of page table row r (indptr, last_page_len, lengths against the table, the
/// protected prefix), as kvevict::detail::check_page_table. On the first violation calls
/// rep(check, a0, a1, a2, a3) and returns false. Host and device (the host test calls it).
template <class Report>
KVEVICT_HOST_DEVICE inline bool check_page_row(const paged_table_args& a, std::int64_t r, Report&& rep) {
  const page_table_view& t = a.t;
  if (r == 0 && t.indptr[0] != 0) {
    rep(device_check::page_indptr, -1, t.indptr[0], 0, 0);
    return false;
  }
  const std::int64_t n = t.pages(r);
  if (n < 0 || n > t.max_pages_per_row) {
    rep(device_check::page_indptr, r, n, t.max_pages_per_row, 0);
    return false;
  }
  if (t.last_page_len && n > 0 && (t.last_page_len[r] < 1 || t.last_page_len[r] > a.ps)) {
    rep(device_check::page_last_len, r, t.last_page_len[r], a.ps, 0);
    return false;
  }
  if (t.start_offset && (t.start_offset[r] < 0 || t.start_offset[r] >= a.ps)) {
    rep(device_check::page_start_offset, r, t.start_offset[r], a.ps, 0);
    return false;
  }
  if (t.start_offset && t.last_page_len && n == 1 && t.last_page_len[r] <= t.start_offset[r]) {
    rep(device_check::page_start_empty, r, t.start_offset[r], t.last_page_len[r], 0);
    return false;
  }
  const std::int64_t b = t.per_head ? r / a.H : r;
  const std::int64_t h0 = t.per_head ? r % a.H : 0, h1 = t.per_head ? h0 + 1 : a.H;
  for (std::int64_t h = h0; h < h1; ++h) {
    if (a.lens.data) {
      const std::int64_t L = a.lens(b, h);
      if (t.last_page_len && L != t.table_length(r, a.ps)) {
        rep(device_check::page_lengths_table, b, h, L, t.table_length(r, a.ps));
        return false;
      }
      if (L < 0 || L > t.row_capacity(r, a.ps)) {
        rep(device_check::page_lengths_range, b, h, L, t.row_capacity(r, a.ps));
        return false;
      }
    }
    const std::int64_t pre = t.prefix(b), L = a.length(b, h);
    if (pre < 0 || pre > L) {
      rep(device_check::page_prefix, b, pre, L, h);
      return false;
    }
  }
  return true;
}

/// Pass 1 of the table check, thread per table row: check_page_row (indptr, last_page_len, lengths,
/// prefix); nothing is read from indices. After it passes for every row, indptr starts at 0 and never
/// decreases, so the later passes read indices only below indptr[rows].
template <int Unused = 0>
__global__ void paged_check_rows_kernel(paged_table_args a, device_status* st) {
  const std::int64_t R = a.rows();
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < R;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    (void)check_page_row(a, r, [&](device_check c, std::int64_t a0, std::int64_t a1, std::int64_t a2, std::int64_t a3) {
      report(st, errc::invalid_argument, c, a0, a1, a2, a3);
    });
}

/// Pass 2, block per table row (grid-stride), only when pass 1 found nothing: every page that holds
/// tokens has its id in [0, P) and adds one count to its slot's counter (the low 32 bits count uses
/// as a shared-prefix page, the high 32 bits other uses). cnt: [a.slots()], zeroed.
template <int Unused = 0>
__global__ void paged_count_pages_kernel(paged_table_args a, unsigned long long* cnt, device_status* st) {
  if (st->code != 0) return;  // uniform: set by pass 1 only
  const std::int64_t R = a.rows();
  for (std::int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const std::int64_t used = a.used(r), beg = a.t.indptr[r];
    const std::int64_t h = a.t.per_head ? r % a.H : 0, shared = a.t.shared_pages(r, a.t.per_head ? r / a.H : r, a.ps);
    for (std::int64_t i = threadIdx.x; i < used; i += blockDim.x) {
      const std::int32_t pg = a.t.indices[beg + i];
      if (pg < 0 || pg >= a.P) {
        report(st, errc::invalid_argument, device_check::page_id, beg + i, pg, r, i);
        continue;
      }
      atomicAdd(cnt + (a.head_slots ? static_cast<std::int64_t>(pg) * a.H + h : pg), i < shared ? 1ull : (1ull << 32));
    }
  }
}

/// Pass 3, only when passes 1 and 2 found nothing: a page used twice (not as a shared-prefix page of
/// every row that uses it) is reported with its position in indices, its row and its index in the row.
template <int Unused = 0>
__global__ void paged_check_repeats_kernel(paged_table_args a, const unsigned long long* cnt, device_status* st) {
  if (st->code != 0) return;
  const std::int64_t R = a.rows();
  for (std::int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const std::int64_t used = a.used(r), beg = a.t.indptr[r];
    const std::int64_t h = a.t.per_head ? r % a.H : 0;
    for (std::int64_t i = threadIdx.x; i < used; i += blockDim.x) {
      const std::int32_t pg = a.t.indices[beg + i];
      if (pg < 0 || pg >= a.P) continue;
      const unsigned long long w = cnt[a.head_slots ? static_cast<std::int64_t>(pg) * a.H + h : pg];
      const unsigned long long other = w >> 32, prefix = w & 0xffffffffull;
      if (other > 1 || (other >= 1 && prefix >= 1)) report(st, errc::invalid_argument, device_check::page_repeat, beg + i, pg, r, i);
    }
  }
}

/// Pass 4, thread per (b, h): len[b * H + h] = the validated length, or 0 for every head once any
/// check has failed (the status word is set), so that no later kernel reads through a bad table.
template <int Unused = 0>
__global__ void paged_lengths_kernel(paged_table_args a, std::int64_t B, const device_status* st, std::int32_t* len) {
  const std::int64_t n = B * a.H;
  const bool bad = st->code != 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    len[i] = bad ? 0 : static_cast<std::int32_t>(a.length(i / a.H, i % a.H));
}

/// The four table-check passes on `stream`: cnt ([a.slots()] counters, device) and len
/// ([B * H] int32, device) are scratch and output. Lengths come out as a per-head lengths view.
inline status enqueue_page_table_check(const paged_table_args& a, std::int64_t B, unsigned long long* cnt, std::int32_t* len,
                                       device_status* st, cudaStream_t stream) {
  const std::int64_t R = a.rows();
  const unsigned grid = static_cast<unsigned>(R < 65535LL * 16 ? (R > 0 ? R : 1) : 65535LL * 16);
  KVEVICT_CUDA_TRY(cudaMemsetAsync(cnt, 0, static_cast<std::size_t>(a.slots() > 0 ? a.slots() : 1) * sizeof(unsigned long long), stream));
  paged_check_rows_kernel<<<grid_for(R), block_threads, 0, stream>>>(a, st);
  KVEVICT_CUDA_CHECK_LAUNCH();
  paged_count_pages_kernel<<<grid, block_threads, 0, stream>>>(a, cnt, st);
  KVEVICT_CUDA_CHECK_LAUNCH();
  paged_check_repeats_kernel<<<grid, block_threads, 0, stream>>>(a, cnt, st);
  KVEVICT_CUDA_CHECK_LAUNCH();
  paged_lengths_kernel<<<grid_for(B * a.H), block_threads, 0, stream>>>(a, B, st, len);
  KVEVICT_CUDA_CHECK_LAUNCH();
  return {};
}

/// Device-side NaN/inf scan of the valid tokens of a paged K or V pool (tensor 0 keys, 1 values),
/// read through the (validated) table: grid-stride over B * H * S * D with S the capacity; a
/// violation names the logical (b, h, slot), as the contiguous scan.
template <class T>
__global__ void paged_finite_scan_kernel(kv_view<const T> v, page_table_view pt, int tensor, const std::int32_t* len_kv, std::int64_t B,
                                         std::int64_t S, device_status* st) {
  const std::int64_t H = v.extent[1], D = v.extent[3], total = B * H * S * D;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % D, s = (i / D) % S, h = (i / (D * S)) % H, b = i / (D * S * H);
    if (s >= len_kv[b * H + h]) continue;
    if (!is_finite_value(head_rows(v, pt, b, h).at(s, c))) report(st, errc::non_finite_input, device_check::non_finite, tensor, b, h, s);
  }
}

/// The check arguments of a paged layer_inputs (host shapes, device pointers).
template <class T>
inline paged_table_args paged_args_of(const layer_inputs<T>& in) {
  paged_table_args a;
  a.t = in.pages;
  a.lens = in.lengths;
  a.P = in.keys.extent[0];
  a.H = in.keys.extent[1];
  a.ps = in.keys.extent[2];
  a.head_slots = in.pages.per_head && in.keys.stride[1] != 0;
  return a;
}

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
