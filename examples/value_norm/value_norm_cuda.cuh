// The CUDA implementation of value_norm_scorer (value_norm.hpp): a kernel of its own and a
// kvevict::cuda::scorer_impl specialisation (docs/cuda.md, "Adding a stage"). Include from a .cu
// translation unit compiled by nvcc.
#pragma once

#include <kvevict/cuda.cuh>

#include <cstdint>

#include "value_norm.hpp"

// Its kernel: one thread per (KV head, token). Row layout of the scorer's output (see
//    kvevict::cuda::score_job): rows[(kvi * G + g) * S + n] for the G query heads g of KV head
//    kvi = b * kv_heads + h and the valid tokens n < len[kvi]; a query-free scorer writes the same
//    score G times. Heads with needkv[kvi] = 0 keep everything and need no scores.
//    It reads V through kvevict::cuda::head_rows, so the same kernel serves contiguous and paged
//    caches (layer_inputs::pages: rows are then pages of a pool, addressed by a device page table).
template <class T>
__global__ void value_norm_kernel(kvevict::kv_view<const T> values, kvevict::page_table_view pages, const std::int32_t* len, const std::uint8_t* needkv, int kv_heads,
                                  int G, std::int64_t S, float power, float* rows) {
  const int kvi = blockIdx.y;
  if (!needkv[kvi]) return;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= len[kvi]) return;
  const int b = kvi / kv_heads, h = kvi % kv_heads;
  const kvevict::cuda::kv_rows<const T> v = kvevict::cuda::head_rows(values, pages, b, h);
  double s = 0.0;
  for (std::int64_t c = 0; c < values.extent[3]; ++c) {
    const double x = kvevict::to_float(v.at(n, c));
    s += x * x;
  }
  const float u = static_cast<float>(pow(sqrt(s), static_cast<double>(power)));
  for (int g = 0; g < G; ++g) rows[(static_cast<std::int64_t>(kvi) * G + g) * S + n] = u;
}

// The CUDA implementation trait: score() enqueues the kernel on the job's stream (no
//    allocation, no synchronisation). scorer_impl_base: no scratch, no plan-time checks.
namespace kvevict {
namespace cuda {
template <>
struct scorer_impl<value_norm_scorer> : scorer_impl_base {
  static constexpr bool reads_pages = true;  // value_norm_kernel reads V through cuda::head_rows
  template <class Policy, class T>
  static status score(const score_job<Policy, T>& job, const scratch&) {
    const layer_shape& sh = job.sh;
    if (sh.S == 0) return {};
    const dim3 grid(static_cast<unsigned>((sh.S + 255) / 256), static_cast<unsigned>(sh.nkv));
    value_norm_kernel<T><<<grid, 256, 0, job.stream>>>(job.in->values, job.in->pages, job.pb.len_kv, job.pb.needkv, sh.Hkv, sh.Gq, sh.S,
                                                        job.p->scorer.power, job.rows);
    KVEVICT_CUDA_CHECK_LAUNCH();
    return {};
  }
};
}  // namespace cuda
}  // namespace kvevict
