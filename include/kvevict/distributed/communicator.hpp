// IWYU pragma: private, include "kvevict/distributed.hpp"
// Sharded eviction (tensor and pipeline parallelism): the communicator an engine supplies, the
// description of what one rank holds, and the per-layer exchange statistics. docs/distributed.md.
//
// kvevict owns no communication. The engine wraps the collectives it already has (MPI, NCCL,
// torch.distributed) in a `communicator`: two collectives on int64 buffers, called in the same
// order with the same sizes on every rank of the group (the rules of MPI and NCCL collectives).
// kvevict/distributed/mpi.hpp is a ready adapter for MPI; docs/distributed.md shows NCCL's.
#pragma once

#include <cstdint>

#include "kvevict/core/status.hpp"

namespace kvevict {
namespace distributed {

/// Where the buffers a communicator's collectives receive live.
enum class memory_space : int {
  host = 0,    ///< host memory (MPI without CUDA awareness, gloo)
  device = 1,  ///< CUDA device memory (NCCL); the CUDA backend's run_sharded stages its host messages
               ///< through a device buffer; the CPU backend refuses such a communicator
};

/// The collectives kvevict needs from the engine's process group: the ranks that hold the heads
/// of one layer (the tensor-parallel group). Every rank of the group calls the same collectives
/// in the same order with the same `count`: kvevict guarantees this, also when one rank's inputs
/// are bad (its error travels in the first collective; no rank is left waiting).
///
/// Buffers hold int64 values (counts, histogram bins, head plans), `count` >= 1 of them, in
/// space(); with memory_space::device a collective must have completed when it returns (e.g.
/// ncclAllReduce, then a synchronisation of its stream). A collective returns an error status if the transport failed; kvevict then returns
/// that status (prefixed with the rank) on this rank, and the engine owns recovery (as with any
/// failed collective, the group is unusable afterwards).
class communicator {
 public:
  virtual ~communicator() = default;
  /// This process's rank in the group, 0 <= rank() < size().
  virtual int rank() const = 0;
  /// Ranks in the group (>= 1).
  virtual int size() const = 0;
  /// Where the buffers passed to the collectives live.
  virtual memory_space space() const { return memory_space::host; }
  /// In place: data[i] = sum over ranks of data[i], i < count (MPI_Allreduce(MPI_IN_PLACE, ...,
  /// MPI_INT64_T, MPI_SUM), ncclAllReduce(..., ncclInt64, ncclSum)).
  virtual status all_reduce_sum(std::int64_t* data, std::int64_t count) = 0;
  /// recv[r * count + i] = send[i] of rank r (size() * count values; MPI_Allgather,
  /// ncclAllGather). send and recv do not overlap.
  virtual status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) = 0;
};

/// A group of one rank: every collective is a copy. Sharded calls with it equal the unsharded
/// ones (the tests use it as the reference's shape).
class self_communicator final : public communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  status all_reduce_sum(std::int64_t*, std::int64_t) override { return {}; }
  status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) override {
    for (std::int64_t i = 0; i < count; ++i) recv[i] = send[i];
    return {};
  }
};

/// What one rank holds of a layer: `num_heads` KV heads of the layer's `global_kv_heads`, local
/// KV head h being global KV head heads[h] (host memory; any order, each global head on exactly
/// one rank of the group). Layers are named by layer_inputs::layer_idx / num_layers, which are
/// global indices under pipeline parallelism (a rank runs only the layers it holds).
/// With gqa_reduction::per_query_head, local out row hk * G + g is global row heads[hk] * G + g.
/// The pointer must stay valid while plans made with the shard are used.
struct shard {
  std::int32_t global_kv_heads = 0;      ///< KV heads of the whole layer
  const std::int32_t* heads = nullptr;   ///< (num_heads) global KV head index of each local KV head
  std::int32_t num_heads = 0;            ///< local KV heads (= layer_inputs' kv_heads)
};

/// Communication of one sharded run (one layer): collectives called and int64 bytes each rank
/// contributed (all_gather: its send buffer; all_reduce_sum: the buffer).
struct exchange_stats {
  int rounds = 0;                ///< collectives called
  std::int64_t bytes = 0;        ///< bytes this rank sent, summed over the rounds
  int radix_rounds = 0;          ///< of them, histogram rounds of the radix select (AdaKV budgets)
};

}  // namespace distributed
}  // namespace kvevict
