// An in-process group of ranks for sharded-eviction tests without MPI: each rank is a thread,
// each collective a rendezvous of all threads (kvevict::distributed::communicator over host
// buffers). Used where a process cannot start MPI ranks (the CUDA tests: one process, one
// device, one stream per rank). Host code only.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kvevict/distributed/communicator.hpp"

namespace kvevict_test {

/// The shared state of `size` thread ranks: one slot per rank, a reusable barrier.
class thread_group {
 public:
  explicit thread_group(int size) : size_(size), slots_(static_cast<std::size_t>(size)) {}
  int size() const { return size_; }

  /// Every rank contributes `count` values; `combine(all)` sees the ranks' slots in rank order
  /// once every rank has arrived. Two barriers: the slots are read before any rank writes again.
  void exchange(int rank, const std::int64_t* data, std::int64_t count,
                const std::function<void(const std::vector<std::vector<std::int64_t>>&)>& combine) {
    slots_[static_cast<std::size_t>(rank)].assign(data, data + count);
    barrier();
    combine(slots_);
    barrier();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lk(m_);
    const long gen = gen_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return gen_ != gen; });
  }

  int size_;
  std::vector<std::vector<std::int64_t>> slots_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  long gen_ = 0;
};

/// Rank `rank` of a thread_group, host buffers. Counts the collectives it served.
class thread_communicator : public kvevict::distributed::communicator {
 public:
  thread_communicator(thread_group* g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }
  kvevict::status all_reduce_sum(std::int64_t* data, std::int64_t count) override {
    ++calls;
    g_->exchange(rank_, data, count, [&](const std::vector<std::vector<std::int64_t>>& all) {
      for (std::int64_t i = 0; i < count; ++i) {
        std::int64_t s = 0;
        for (const auto& v : all) s += v[static_cast<std::size_t>(i)];
        data[i] = s;
      }
    });
    return {};
  }
  kvevict::status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) override {
    ++calls;
    g_->exchange(rank_, send, count, [&](const std::vector<std::vector<std::int64_t>>& all) {
      for (std::size_t r = 0; r < all.size(); ++r)
        for (std::int64_t i = 0; i < count; ++i) recv[static_cast<std::int64_t>(r) * count + i] = all[r][static_cast<std::size_t>(i)];
    });
    return {};
  }
  int calls = 0;

 private:
  thread_group* g_;
  int rank_;
};

/// Run f(rank) on `ranks` threads and join them.
template <class F>
void run_ranks(int ranks, F f) {
  std::vector<std::thread> ts;
  for (int r = 0; r < ranks; ++r) ts.emplace_back([&f, r] { f(r); });
  for (auto& t : ts) t.join();
}

}  // namespace kvevict_test
