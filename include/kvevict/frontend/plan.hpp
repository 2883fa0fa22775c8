// IWYU pragma: private, include "kvevict/kvevict.hpp"
// The explicit plan of one eviction call (CUTLASS's initialize, FlashInfer's plan/run):
//
//   kvevict::eviction_plan pl;
//   status s = ev.plan(inputs, budget, &pl);          // validates shapes, parameters, budget, lengths
//   std::vector<unsigned char> ws(pl.workspace_bytes);
//   std::vector<std::int32_t> kept(pl.max_selected);   // exact or a bound (see max_selected_exact)
//   s = ev.run(pl, inputs, selection, ws.data(), ws.size());  // repeats none of the plan's checks
//
// The plan is computed once from the shapes, the budget and plan_options (the thread count
// included) and fixes the workspace size; a run with the same plan may take other data (other
// pointers, other lengths) of the same shapes and strides. Backend-neutral: both evictors
// produce and take this type.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/numeric.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {

/// What the caller fixes at plan time besides shapes and budget.
struct plan_options {
  /// CPU: threads run() uses; 0 = the backend's num_threads, or OpenMP's omp_get_max_threads() at
  /// plan time when that is 0 too (at most 256). The workspace holds per-thread scratch for
  /// exactly this many threads, so a later change of OpenMP's setting cannot outgrow it.
  /// CUDA: ignored.
  int num_threads = 0;
  /// CUDA: an optional HOST copy of layer_inputs::lengths, batch x kv_heads int32 row-major
  /// (lengths.data itself is device memory there). With it, plan() checks the lengths and gives
  /// the exact max_selected; without it max_selected is an upper bound when lengths are set
  /// (docs/cuda.md). CPU: ignored (lengths are host memory and read directly).
  const std::int32_t* host_lengths = nullptr;
  /// true: a plan for run_sharded() (kvevict/distributed.hpp, docs/distributed.md): the layer's
  /// KV heads are split over the ranks of a group, and head-wise budgeters (AdaKV, LKV-H) allocate
  /// over all of them. max_selected is then an upper bound (budget moves between ranks) except
  /// for per-head budgeters; the whole-layer allocation is checked at run time.
  /// CPU and CUDA backends (the CUDA run_sharded synchronises its stream; docs/distributed.md).
  bool sharded = false;
};

/// Shapes, strides and presence of every view of a layer_inputs, the layer index and the storage
/// type: what a plan was made for. run(plan, ...) compares it with its inputs (O(1)) and
/// rejects inputs of other shapes with errc::invalid_argument.
struct layer_signature {
  static constexpr int slots = 2 * (4 + 4 + 4 + 2 + 3 + 3 + 2) + 8;
  std::int64_t v[slots] = {};

  template <class T>
  static layer_signature of(const layer_inputs<T>& in) {
    static_assert(std::decay_t<decltype(in.queries)>::rank + std::decay_t<decltype(in.keys)>::rank +
                          std::decay_t<decltype(in.values)>::rank + std::decay_t<decltype(in.lengths)>::rank +
                          std::decay_t<decltype(in.positions)>::rank + std::decay_t<decltype(in.wo_factor)>::rank +
                          std::decay_t<decltype(in.wo)>::rank ==
                      (slots - 8) / 2,
                  "kvevict: layer_signature::slots must count every view of layer_inputs");
    layer_signature s;
    int i = 0;
    auto put = [&](const auto& view) {
      using V = std::decay_t<decltype(view)>;
      for (int k = 0; k < V::rank; ++k) {
        s.v[i++] = view.data ? view.extent[k] : -1;
        s.v[i++] = view.data ? view.stride[k] : -1;
      }
    };
    put(in.queries);
    put(in.keys);
    put(in.values);
    put(in.lengths);
    put(in.positions);
    put(in.wo_factor);
    put(in.wo);
    s.v[i++] = in.layer_idx;
    s.v[i++] = in.num_layers;
    s.v[i++] = std::is_same<T, float>::value ? 0 : (std::is_same<T, half_t>::value ? 1 : 2);  // storage type
    s.v[i++] = 0;
    s.v[i++] = in.paged() ? 1 : 0;  // the page table's shape (its data is checked by run())
    s.v[i++] = in.paged() ? in.pages.batch : -1;
    s.v[i++] = in.paged() ? in.pages.max_pages_per_row : -1;
    s.v[i++] = in.paged() ? (in.pages.per_head ? 1 : 0) + (in.pages.last_page_len ? 2 : 0) + (in.pages.indices ? 4 : 0) +
                                (in.pages.protected_prefix ? 8 : 0) + (in.pages.start_offset ? 16 : 0)
                          : -1;
    return s;
  }
  bool operator==(const layer_signature& o) const {
    for (int i = 0; i < slots; ++i)
      if (v[i] != o.v[i]) return false;
    return true;
  }
  bool operator!=(const layer_signature& o) const { return !(*this == o); }
};

namespace detail {
/// FNV-1a of an object's bytes (plain-data parameters; O(sizeof(T))).
template <class T>
inline std::uint64_t bytes_fingerprint(const T& x) {
  static_assert(std::is_trivially_copyable<T>::value, "kvevict: a policy's params must be plain data");
  unsigned char b[sizeof(T)];
  std::memcpy(b, &x, sizeof(T));
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

/// A process-wide unique number for an evictor's parameter state (see eviction_plan::generation).
inline std::uint64_t next_plan_generation() {
  static std::atomic<std::uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace detail

/// The result of evictor::plan(). Plain data, copyable. It belongs to the evictor object that made
/// it and stays valid until that evictor's params() are taken through the non-const accessor or
/// it is assigned another evictor (run() then rejects it with errc::invalid_argument: plan again).
/// A copy of the evictor is a new owner: plan with the copy.
struct eviction_plan {
  bool valid = false;               ///< set by a successful plan()
  std::size_t workspace_bytes = 0;  ///< bytes run() needs (any alignment: run() aligns itself)
  /// Kept tokens: the size selection.indices must have. Exact when max_selected_exact (on the CPU
  /// except for AdaKV with the reference's per-head rounding, budgeters::adakv exact_total = false,
  /// presets::adakv_published; on CUDA also unless lengths are device-only or LKV-H's tables are
  /// device-only), else an upper bound; the exact count of row r is always indptr[r + 1] - indptr[r].
  std::int64_t max_selected = 0;
  bool max_selected_exact = true;
  std::int64_t rows = 0;       ///< selection rows = batch * out_heads
  std::int64_t out_heads = 0;  ///< kv_heads, or q_heads for gqa_reduction::per_query_head
  int num_threads = 1;         ///< CPU threads of run() (plan_options::num_threads resolved)
  budget_request budget{};     ///< the budget the plan was made for
  layer_signature signature{}; ///< the shapes it was made for
  const void* owner = nullptr;    ///< the evictor object that made it (a plan is not portable)
  std::uint64_t generation = 0;  ///< that evictor's parameter generation at plan time
  /// A hash of the bytes of the evictor's params at plan time: run() rejects the plan when the
  /// parameters changed since, also through a reference taken before plan().
  std::uint64_t params_fingerprint = 0;
  /// Made with plan_options::sharded: only run_sharded() takes it (and takes only such plans).
  bool sharded = false;
};

}  // namespace kvevict
