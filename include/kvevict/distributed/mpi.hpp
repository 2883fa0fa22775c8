// kvevict::distributed::mpi_communicator: the communicator interface over an MPI communicator
// (Open MPI, MPICH). Include only where <mpi.h> is available; link MPI::MPI_CXX (CMake's
// FindMPI). Host buffers (a CUDA-aware MPI could pass device buffers; this adapter says host).
#pragma once

#include <mpi.h>

#include <cstdint>

#include "kvevict/distributed/communicator.hpp"

namespace kvevict {
namespace distributed {

/// Wraps an MPI communicator the engine owns (not duplicated, not freed). Counts above INT_MAX
/// are refused (MPI's count is an int; kvevict's exchanges are a few KiB). A failed MPI call is
/// returned as a status only when the communicator's error handler is MPI_ERRORS_RETURN
/// (MPI_Comm_set_errhandler); under MPI's default, MPI_ERRORS_ARE_FATAL, MPI aborts the job.
class mpi_communicator final : public communicator {
 public:
  explicit mpi_communicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  status all_reduce_sum(std::int64_t* data, std::int64_t count) override {
    if (count < 1 || count > 0x7fffffff) return status::error(errc::invalid_argument, "all_reduce_sum count = %lld", static_cast<long long>(count));
    return check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_INT64_T, MPI_SUM, comm_), "MPI_Allreduce");
  }
  status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) override {
    if (count < 1 || count > 0x7fffffff) return status::error(errc::invalid_argument, "all_gather count = %lld", static_cast<long long>(count));
    return check(MPI_Allgather(send, static_cast<int>(count), MPI_INT64_T, recv, static_cast<int>(count), MPI_INT64_T, comm_),
                 "MPI_Allgather");
  }

 private:
  static status check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return {};
    char msg[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, msg, &n);
    return status::error(errc::io_error, "%s failed: %s", what, msg);
  }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace distributed
}  // namespace kvevict
