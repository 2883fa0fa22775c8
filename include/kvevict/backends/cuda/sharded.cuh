// IWYU pragma: private, include "kvevict/cuda.cuh"
// The CUDA side of sharded eviction (evictor<Policy, cuda::backend>::run_sharded,
// docs/distributed.md): the exchange of kvevict/distributed/exchange.hpp runs on the host, as on
// the CPU backend; a communicator whose collectives take device buffers (NCCL-shaped,
// memory_space::device) is driven through staged_communicator, which copies each message through
// one device buffer reserved before the first round.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/core/status.hpp"
#include "kvevict/distributed/communicator.hpp"
#include "kvevict/distributed/exchange.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

/// The largest message (int64 values, send and receive together) of one layer's exchange
/// (exchange.hpp): round 1 (8 + 8 * ranks), round 2 (batch * global_kv_heads * (1 + 5 gout)),
/// the radix rounds (batch * 256), round 7 (batch * global rows * 2), the last (1 + ranks).
/// Only round 1 is sized when the shard is not usable (global_kv_heads < 1): the exchange then
/// ends after it. -1 when the count passes 2^40 values (refused).
inline std::int64_t exchange_max_values(std::int64_t batch, std::int64_t global_kv_heads, std::int64_t gout, std::int64_t ranks) {
  constexpr std::int64_t limit = std::int64_t{1} << 40;
  if (batch < 0 || gout < 1 || ranks < 1 || ranks > limit / 16) return -1;
  std::int64_t m = 8 + 8 * ranks;
  if (global_kv_heads >= 1) {
    if (batch > 0 && global_kv_heads > limit / batch) return -1;
    const std::int64_t bh = batch * global_kv_heads;
    if (bh > 0 && 1 + distributed::detail::plan_fields * gout > limit / bh) return -1;
    m = std::max({m, bh * (1 + distributed::detail::plan_fields * gout), batch * 256, bh * gout * 2});
  }
  return m;
}

/// A communicator with memory_space::device seen as a host one: each collective copies its host
/// buffer into a device buffer on `stream`, synchronises, calls the engine's collective on the
/// device buffer (which must have completed when it returns, e.g. ncclAllReduce followed by a
/// synchronisation of the engine's stream), then copies the result back and synchronises.
/// reserve() allocates the buffer (cudaMallocAsync, stream-ordered) before any round, so an
/// allocation never fails half-way through the exchange; the destructor frees it.
class staged_communicator final : public distributed::communicator {
 public:
  staged_communicator(distributed::communicator* inner, cudaStream_t stream) : inner_(inner), stream_(stream) {}
  ~staged_communicator() override {
    if (buf_) (void)cudaFreeAsync(buf_, stream_);
  }
  staged_communicator(const staged_communicator&) = delete;
  staged_communicator& operator=(const staged_communicator&) = delete;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  distributed::memory_space space() const override { return distributed::memory_space::host; }

  /// A device buffer of `values` int64 (no-op when it is large enough). On error the buffer held
  /// before is kept.
  status reserve(std::int64_t values) {
    if (values <= cap_) return {};
    void* p = nullptr;
    KVEVICT_CUDA_TRY(cudaMallocAsync(&p, static_cast<std::size_t>(values) * sizeof(std::int64_t), stream_));
    if (buf_) (void)cudaFreeAsync(buf_, stream_);
    buf_ = static_cast<std::int64_t*>(p);
    cap_ = values;
    return {};
  }

  // A failed copy in still enters the engine's collective (the other ranks are in it), and
  // returns the copy's error after it. A message larger than the reservation cannot happen
  // (run_sharded reserves the largest one before round 1); it is refused without entering.
  status all_reduce_sum(std::int64_t* data, std::int64_t count) override {
    if (count > cap_)
      return status::error(errc::insufficient_workspace, "staged_communicator: message of %lld values > reserved %lld",
                           static_cast<long long>(count), static_cast<long long>(cap_));
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(std::int64_t);
    const status in = copy(buf_, data, bytes, cudaMemcpyHostToDevice);
    KVEVICT_TRY(inner_->all_reduce_sum(buf_, count));
    KVEVICT_TRY(in);
    return copy(data, buf_, bytes, cudaMemcpyDeviceToHost);
  }

  status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) override {
    const std::int64_t total = count * (1 + static_cast<std::int64_t>(size()));
    if (total > cap_)
      return status::error(errc::insufficient_workspace, "staged_communicator: message of %lld values > reserved %lld",
                           static_cast<long long>(total), static_cast<long long>(cap_));
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(std::int64_t);
    const status in = copy(buf_, send, bytes, cudaMemcpyHostToDevice);
    KVEVICT_TRY(inner_->all_gather(buf_, count, buf_ + count));
    KVEVICT_TRY(in);
    return copy(recv, buf_ + count, bytes * static_cast<std::size_t>(size()), cudaMemcpyDeviceToHost);
  }

 private:
  status copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    KVEVICT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
    KVEVICT_CUDA_TRY(cudaStreamSynchronize(stream_));
    return {};
  }

  distributed::communicator* inner_;
  cudaStream_t stream_;
  std::int64_t* buf_ = nullptr;
  std::int64_t cap_ = 0;
};

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
