// A kvevict CPU call keeps to the threads its plan names, whatever the caller's OpenMP and Eigen
// settings (cpu::detail::thread_scope; issue: after torch.set_num_threads(2) a 1-thread call ran
// 3.8-10.3x slower because Eigen parallelised its products). Counted, not timed: a process that
// has never opened a parallel region has one OS thread, and libgomp / libomp start their workers at
// the first active region, so a 1-thread call that leaves the process with one thread opened none.
// Its own executable: the count needs a process no other test has parallelised in.
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/presets.hpp>

#include <dirent.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/random.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kv = kvevict;

namespace {

int os_threads() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

struct layer {
  // SnapKV's window attention at a size where Eigen's GEMM would parallelise (G W rows x d x L =
  // 128 x 64 x 4096, far above Eigen's 50,000-flop threshold per thread); H KV heads
  static constexpr std::int64_t B = 1, G = 4, S = 4096, d = 64, W = 32;
  std::int64_t H = 2;
  std::vector<float> k, v, q;
  kv::layer_inputs<float> in;
  explicit layer(std::int64_t heads = 2) : H(heads) {
    kvtest::rng r(5);
    for (std::int64_t i = 0; i < B * H * S * d; ++i) k.push_back(static_cast<float>(r.normal()));
    v = k;
    for (std::int64_t i = 0; i < B * H * G * W * d; ++i) q.push_back(static_cast<float>(r.normal()));
    in.keys = kv::make_kv_view<const float>(k.data(), B, H, S, d, kv::kv_layout::hnd);
    in.values = kv::make_kv_view<const float>(v.data(), B, H, S, d, kv::kv_layout::hnd);
    in.queries = kv::make_query_view<const float>(q.data(), B, H * G, W, d, kv::kv_layout::hnd);
  }
};

std::vector<std::int32_t> select(const layer& L, int threads) {
  const kv::evictor<kv::presets::snapkv, kv::cpu::backend> ev(kv::presets::snapkv::defaults(), kv::cpu::backend{threads});
  const auto req = kv::budget_request::fraction(0.25);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(L.B * L.H + 1)), idx(static_cast<std::size_t>(ev.max_selected(L.in, req)));
  kv::selection_view sel{indptr.data(), idx.data(), nullptr, static_cast<std::int64_t>(idx.size())};
  const kv::status st = ev.run(L.in, req, sel);
  REQUIRE_MESSAGE(st.ok(), st.message());
  idx.insert(idx.begin(), indptr.begin(), indptr.end());
  return idx;
}

}  // namespace

TEST_CASE("a 1-thread call opens no parallel region with the caller's OpenMP and Eigen at 8 threads; settings restored") {
#if !defined(_OPENMP)
  MESSAGE("built without OpenMP: every kvevict call runs on the calling thread; nothing to check");
#else
  const layer L;
  REQUIRE(os_threads() == 1);  // nothing has started a thread pool yet
  omp_set_num_threads(8);      // what torch.set_num_threads(8) leaves in the calling thread
  Eigen::setNbThreads(8);
  const int levels = omp_get_max_active_levels();
  const std::vector<std::int32_t> sel1 = select(L, 1);
  CHECK_MESSAGE(os_threads() == 1, "a 1-thread kvevict call started OpenMP workers (nested parallelism in Eigen)");
  // the caller's settings as they were
  CHECK(omp_get_max_threads() == 8);
  CHECK(Eigen::nbThreads() == 8);
  CHECK(omp_get_max_active_levels() == levels);
  // the same call and a cpu::compute_wo_factors (Eigen's QR) at caller settings 1 and 2: same selection, still no pool
  std::vector<float> wo(static_cast<std::size_t>(96 * 8 * 64)), f(static_cast<std::size_t>(8 * 64 * 64));
  kvtest::rng r(3);
  for (auto& x : wo) x = static_cast<float>(r.normal());
  REQUIRE(kv::cpu::compute_wo_factors<float>({wo.data(), {96, 8 * 64}, {8 * 64, 1}}, 8, 64, f.data()).ok());
  for (int caller : {1, 2}) {
    omp_set_num_threads(caller);
    Eigen::setNbThreads(caller);
    CHECK(select(L, 1) == sel1);
  }
  CHECK(os_threads() == 1);
  // a 2-thread plan over one KV head (MQA, or a sharded rank with one head): one task, run on the
  // calling thread, where Eigen must not open a region either
  omp_set_num_threads(8);
  Eigen::setNbThreads(8);
  const layer one(1);
  CHECK(!select(one, 2).empty());
  CHECK_MESSAGE(os_threads() == 1, "a 2-thread call with one task let Eigen start OpenMP workers");
  // a 2-thread call opens its own region of 2 (one worker), and Eigen does not nest inside it
  omp_set_num_threads(8);
  Eigen::setNbThreads(8);
  CHECK(select(L, 2) == sel1);
  CHECK(os_threads() == 2);
  CHECK(omp_get_max_threads() == 8);
  CHECK(omp_get_max_active_levels() == levels);
#endif
}

TEST_CASE("called from inside the caller's parallel region, a 2-thread call does not nest a team") {
#if defined(_OPENMP)
  const layer L;
  const std::vector<std::int32_t> ref = select(L, 1);
  const int levels = omp_get_max_active_levels();
  std::vector<std::vector<std::int32_t>> got(2);
  int nested_levels = -1;
#pragma omp parallel num_threads(2)
  {
    got[static_cast<std::size_t>(omp_get_thread_num())] = select(L, 2);
    if (omp_get_thread_num() == 0) nested_levels = omp_get_max_active_levels();
  }
  CHECK(got[0] == ref);
  CHECK(got[1] == ref);
  CHECK(nested_levels == levels);  // restored inside the caller's region too
  CHECK(os_threads() <= 2);        // the caller's team of 2; kvevict's calls did not nest a team of 2 each
#endif
}
