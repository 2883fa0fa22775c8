// kvevict/distributed.hpp: sharded eviction over the engine's own collectives (tensor and
// pipeline parallelism; docs/distributed.md). The communicator interface, the shard
// description and the exchange statistics; evictor<Policy, cpu::backend>::run_sharded and
// evictor<Policy, cuda::backend>::run_sharded use them.
// The MPI adapter is kvevict/distributed/mpi.hpp (include it only where <mpi.h> is available).
#pragma once

#include "kvevict/distributed/communicator.hpp"
#include "kvevict/distributed/exchange.hpp"
#include "kvevict/distributed/fingerprint.hpp"
#include "kvevict/distributed/lkv.hpp"
