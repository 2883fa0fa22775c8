// IWYU pragma: private, include "kvevict/cuda.cuh"
// budgeters::headwise_learned on CUDA (LKV-H, docs/lkv.md; whole-layer): in the plan kernel, each
// sequence's block runs the steps of headwise_learned::layer_slice, the host-device code of the
// CPU hook (lkv_sequence_budgets, backends/cuda/select.cuh: thread 0 slice_begin and the
// water-filling shares, the whole block the apportionment, bit for bit, thread 0 the layer's
// slice) on the ratios lkv_device_tables computed on the host, so budgets are bit-identical to
// the CPU's. The tables are device memory (host_budgets = false): plan() cannot compute the
// budgets on the host and gives an upper bound of max_selected.
#pragma once

#include <cstdint>
#include <vector>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/distributed/communicator.hpp"
#include "kvevict/distributed/exchange.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace cuda {

template <>
struct budgeter_impl<budgeters::headwise_learned> : budgeter_impl_base {
  using Budgeter = budgeters::headwise_learned;
  static constexpr bool host_budgets = false;  ///< the tables live on the device

  /// n = num_layers * kv_heads entries per sequence.
  struct scratch {
    double* share = nullptr;
    std::int64_t* capv = nullptr;
    unsigned char* clipped = nullptr;
    std::int64_t* all = nullptr;
    std::int64_t n = 0;
  };

  static scratch carve(workspace_carver& c, const layer_shape& sh, const Budgeter::params& p) {
    scratch s;
    const std::int64_t nh = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    s.n = nh > 0 ? nh : 1;
    const std::int64_t m = static_cast<std::int64_t>(sh.B) * s.n;
    s.share = c.carve<double>(carve_count(m));
    s.capv = c.carve<std::int64_t>(carve_count(m));
    s.all = c.carve<std::int64_t>(carve_count(m));
    s.clipped = c.carve<unsigned char>(carve_count(m));
    return s;
  }

  /// The tables live on the device and match the layer; the budget arithmetic stays in range.
  template <class T>
  static status check(const Budgeter::params& p, const layer_inputs<T>& in) {
    return check_tables(p, in, false);
  }

  /// check() for plan_options::sharded: the table is the whole model's (kv_heads = the shard's
  /// global count, which run_sharded checks), so it must hold at least this rank's heads.
  template <class T>
  static status check_sharded(const Budgeter::params& p, const layer_inputs<T>& in) {
    return check_tables(p, in, true);
  }

  template <class T>
  static status check_tables(const Budgeter::params& p, const layer_inputs<T>& in, bool sharded) {
    if (!p.on_device)
      return status::error(errc::invalid_argument,
                           "budgeter.on_device = false: the CUDA backend needs the LKV tables in device memory (cuda::lkv_device_tables)");
    if (!sharded && (in.num_layers != p.num_layers || in.kv_heads() != p.kv_heads))
      return status::error(errc::shape_mismatch,
                           "budgeter table (num_layers = %d, kv_heads = %d) != layer inputs (num_layers = %d, kv_heads = %lld)",
                           p.num_layers, p.kv_heads, in.num_layers, static_cast<long long>(in.kv_heads()));
    if (sharded && (in.num_layers != p.num_layers || in.kv_heads() > p.kv_heads))
      return status::error(errc::shape_mismatch,
                           "budgeter table (num_layers = %d, kv_heads = %d) does not cover the layer inputs (num_layers = %d, local "
                           "kv_heads = %lld): a sharded LKV-H keeps the whole model's table",
                           p.num_layers, p.kv_heads, in.num_layers, static_cast<long long>(in.kv_heads()));
    const std::int64_t t = p.num_tokens > in.capacity() ? p.num_tokens : in.capacity();
    if (static_cast<std::int64_t>(p.num_layers) * p.kv_heads > (std::int64_t{1} << 40) / (t > 0 ? t : 1))
      return status::error(errc::not_supported, "num_layers * kv_heads * t is too large for the budget arithmetic");
    return {};
  }

  /// run_sharded's host side (docs/distributed.md). The whole-model allocation runs on the host,
  /// over the gathered plans of every rank's rows, with the CPU's own code (layer_slice) on the
  /// device ratios copied back once per call: budgets are bit-identical to one device's.
  struct sharded_tables {
    std::vector<double> ratios;  ///< (num_layers * kv_heads) r = softmax(logits / temperature)
  };
  /// Copy the ratios to the host (synchronises `stream`) and fold them into the fingerprint the
  /// ranks compare (ranks that uploaded different artifacts are refused). Errors: a table that is
  /// not the whole layer's (kv_heads != shard.global_kv_heads), a failed copy.
  static status sharded_begin(const Budgeter::params& p, const distributed::shard& sh, cudaStream_t stream, sharded_tables* t,
                              std::uint64_t* fingerprint) {
    if (p.kv_heads != sh.global_kv_heads)
      return status::error(errc::shape_mismatch,
                           "budgeter table kv_heads = %d != shard.global_kv_heads = %d (LKV-H's table is the whole model's)", p.kv_heads,
                           sh.global_kv_heads);
    const std::int64_t n = static_cast<std::int64_t>(p.num_layers) * p.kv_heads;
    t->ratios.assign(static_cast<std::size_t>(n), 0.0);
    KVEVICT_CUDA_TRY(cudaMemcpyAsync(t->ratios.data(), p.ratios, static_cast<std::size_t>(n) * sizeof(double), cudaMemcpyDeviceToHost,
                                     stream));
    KVEVICT_CUDA_TRY(cudaStreamSynchronize(stream));
    *fingerprint = distributed::detail::fnv1a(*fingerprint, t->ratios.data(), static_cast<std::size_t>(n) * sizeof(double));
    return {};
  }
  /// One sequence's budgets over its `rows` global rows (global head plans), as
  /// headwise_learned::layer_budgets computes them on the CPU.
  static status sharded_layer_budgets(const Budgeter::params& p, const sharded_tables& t, const budget_request& req,
                                      const kvevict::detail::head_plan* plans, std::int64_t rows, int layer, std::int64_t* budgets) {
    if (rows < 1 || rows % p.kv_heads != 0)
      return status::error(errc::invalid_argument, "rows = %lld is not a positive multiple of kv_heads = %d", static_cast<long long>(rows),
                           p.kv_heads);
    const std::size_t n = t.ratios.size();
    std::vector<double> share(n);
    std::vector<std::int64_t> capv(n), all(n);
    std::vector<unsigned char> clipped(n);
    kvevict::detail::lkv_fill_scratch s;
    s.share = share.data();
    s.capv = capv.data();
    s.clipped = clipped.data();
    std::int64_t bad[3] = {0, 0, 0};
    const int rc = Budgeter::layer_slice(p, t.ratios.data(), req, plans, rows, layer, budgets, all.data(), s, bad);
    if (rc == Budgeter::slice_unequal_lengths)
      return status::error(errc::invalid_argument, "headwise_learned: head lengths differ (%lld vs %lld) in layer %d; set budgeter.num_tokens",
                           static_cast<long long>(bad[1]), static_cast<long long>(bad[2]), layer);
    if (rc == Budgeter::slice_cannot_apportion)
      return status::error(errc::invalid_argument, "headwise_learned: cannot apportion total = %lld over %lld heads of t = %lld",
                           static_cast<long long>(bad[0]), static_cast<long long>(bad[1]), static_cast<long long>(bad[2]));
    return {};
  }

  /// Sequence b's budgets and "needs scoring" flags (every thread of its plan-kernel block calls
  /// it after writing the sequence's plans; it synchronises the block before reading them);
  /// a failure lands in the device status word (device_check::lkv_lengths / lkv_apportion) and
  /// leaves the budgets at the lengths.
  __device__ static void sequence_budgets(int b, const detail::plan_shape& sh, const budget_request& req, const Budgeter::params& bp,
                                          bool has_scores, const kvevict::detail::head_plan* plans, std::int64_t* budgets,
                                          std::uint8_t* need, device_status* st, const scratch& lb) {
    __shared__ Budgeter::slice_state lst;
    __shared__ int lrc;
    __shared__ long long lbad[3];
    __shared__ detail::block_team::storage team_sm;
    const std::int64_t r0 = static_cast<std::int64_t>(b) * sh.H, o = static_cast<std::int64_t>(b) * lb.n;
    kvevict::detail::lkv_fill_scratch s;
    s.share = lb.share + o;
    s.capv = lb.capv + o;
    s.clipped = lb.clipped + o;
    __syncthreads();  // the plans of the sequence are written
    detail::block_team team{team_sm};
    detail::lkv_sequence_budgets<Budgeter>(team, lst, lrc, lbad, bp, req, plans + r0, sh.H, sh.layer, has_scores, s, lb.all + o,
                                           budgets + r0, need + r0);
    if (threadIdx.x == 0 && lrc == Budgeter::slice_unequal_lengths)
      detail::report(st, errc::invalid_argument, device_check::lkv_lengths, b, lbad[0], lbad[1], lbad[2]);
    else if (threadIdx.x == 0 && lrc != Budgeter::slice_ok)
      detail::report(st, errc::invalid_argument, device_check::lkv_apportion, b, lbad[0], lbad[1], lbad[2]);
  }
};

}  // namespace cuda
}  // namespace kvevict
