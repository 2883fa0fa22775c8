// The CPU workspace of every preset at long contexts (issue "Scratch memory that does not grow with
// the context"): at Llama-3.1-8B's attention geometry (32 query heads, 8 KV heads, head_dim 128,
// window 32, fp16) and L = 128k, at most 32 MiB on one thread, growing by at most 64 bytes per
// token per thread (the slope between 64k and 128k, on 1 and 8 threads). workspace_size() reads
// no data: the views carry shapes over a dummy buffer.
// Also: the scoring block bytes (cpu::backend::score_block_bytes) bound the block of window rows
// and do not change the selections, checked on random inputs against the default and a
// block of one row.
#include <doctest/doctest.h>

#include <kvevict/cpu.hpp>
#include <kvevict/presets.hpp>

#include "reference/harness.hpp"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace kv = kvevict;

namespace {

constexpr std::int64_t kQHeads = 32, kKvHeads = 8, kDim = 128, kWindow = 32, kHidden = 4096;

/// The inputs' shapes at seq_len L (HND, fp16); data pointers point at one dummy element.
kv::layer_inputs<kv::half_t> shapes_at(std::int64_t L) {
  static const kv::half_t dummy[1] = {};
  kv::layer_inputs<kv::half_t> in;
  in.keys = kv::make_kv_view(dummy, 1, kKvHeads, L, kDim, kv::kv_layout::hnd);
  in.values = in.keys;
  in.queries = kv::make_query_view(dummy, 1, kQHeads, kWindow, kDim, kv::kv_layout::hnd);
  in.wo.data = dummy;
  in.wo.extent[0] = kHidden;
  in.wo.extent[1] = kQHeads * kDim;
  in.wo.stride[0] = kQHeads * kDim;
  in.wo.stride[1] = 1;
  static const float fdummy[1] = {};
  in.wo_factor.data = fdummy;
  in.wo_factor.extent[0] = kQHeads;
  in.wo_factor.extent[1] = kDim;
  in.wo_factor.extent[2] = kDim;
  in.wo_factor.stride[0] = kDim * kDim;
  in.wo_factor.stride[1] = kDim;
  in.wo_factor.stride[2] = 1;
  return in;
}

template <class Policy>
std::size_t ws_bytes(std::int64_t L, int threads) {
  kv::evictor<Policy, kv::cpu::backend> ev;
  return ev.workspace_size(shapes_at(L), kv::plan_options{threads});
}

template <class Policy>
void check_bounded(const char* name) {
  constexpr std::int64_t k128 = 131072, k64 = 65536;
  for (int nt : {1, 8}) {
    const std::size_t w128 = ws_bytes<Policy>(k128, nt), w64 = ws_bytes<Policy>(k64, nt);
    const double slope = static_cast<double>(w128 - w64) / static_cast<double>(k128 - k64);
    INFO(std::string(name) << ", " << nt << " thread(s): workspace at 128k = " << w128 << " bytes, " << slope << " bytes per token");
    if (nt == 1) CHECK(w128 <= std::size_t{32} << 20);
    CHECK(w128 >= w64);
    CHECK(slope <= 64.0 * nt);
  }
}

}  // namespace

TEST_CASE("workspace: every preset at 128k tokens stays within 32 MiB on one thread and 64 B per token per thread") {
  check_bounded<kv::presets::restkv>("restkv");
  check_bounded<kv::presets::snapkv>("snapkv");
  check_bounded<kv::presets::pyramidkv>("pyramidkv");
  check_bounded<kv::presets::adakv>("adakv");
  check_bounded<kv::presets::criticalkv>("criticalkv");
  check_bounded<kv::presets::critical_adakv>("critical_adakv");
  check_bounded<kv::presets::h2o>("h2o");
  check_bounded<kv::presets::tova>("tova");
  check_bounded<kv::presets::streaming_llm>("streaming_llm");
  check_bounded<kv::presets::key_norm>("key_norm");
  check_bounded<kv::presets::lkv>("lkv");
  check_bounded<kv::presets::lkv_uniform_budgets>("lkv_uniform_budgets");
  check_bounded<kv::presets::lkv_budgets_restkv>("lkv_budgets_restkv");
  check_bounded<kv::presets::lkv_budgets_attention>("lkv_budgets_attention");
}

namespace {

struct block_case {
  std::int64_t group = 4, window = 24;
  kv::gqa_reduction gqa = kv::gqa_reduction::mean;
  bool before = false;  // ReST-KV's "before" aggregation
};

/// Selections of Policy with the default scoring block and with blocks of `bytes` (down to one
/// window row per block, several passes over K): identical; scores within float rounding (the
/// temporal aggregate's partial sums group by block).
template <class Policy, class T>
void check_block_independent(const char* name, std::size_t bytes, kvtest::layout l, block_case bc = {}) {
  kvtest::shape sh;
  sh.batch = 2, sh.kv_heads = 2, sh.group = bc.group, sh.cap = 1500, sh.d = 32, sh.window = bc.window, sh.hidden = 64;
  std::vector<std::int32_t> lens = {1500, 1211, 997, 1500};
  if (bc.gqa == kv::gqa_reduction::layer_mean) lens = {1500, 1500, 1211, 1211};  // equal across a sequence's heads
  kvtest::problem p = kvtest::make_problem(sh, 77, 1.0, 1.5, 1.0, lens);
  kvtest::quantize<T>(p);
  kvtest::quantize_wo<T>(p);
  kvtest::stored<T> st;
  kvtest::store(p, l, st);
  auto params = Policy::defaults();
  params.gqa = bc.gqa;
  if constexpr (std::is_same<typename Policy::scorer, kv::scorers::output_reconstruction>::value)
    if (bc.before) params.scorer.aggregation = kv::scorers::output_reconstruction::mode::before;
  kv::evictor<Policy, kv::cpu::backend> ev_default(params), ev_small(params, kv::cpu::backend{0, bytes});
  for (double f : {0.1, 0.4}) {
    const auto a = kvtest::run_lib(ev_default, st.in, kv::budget_request::fraction(f));
    const auto b = kvtest::run_lib(ev_small, st.in, kv::budget_request::fraction(f));
    INFO(name << " block bytes " << bytes << " keep " << f << " group " << bc.group << " window " << bc.window << " gqa "
              << static_cast<int>(bc.gqa) << " before " << bc.before);
    REQUIRE(a.st.ok());
    REQUIRE(b.st.ok());
    CHECK(a.indptr == b.indptr);
    CHECK(a.indices == b.indices);
    double worst = 0.0;
    for (std::size_t i = 0; i < a.scores.size(); ++i) {
      const double x = a.scores[i], y = b.scores[i];
      worst = std::max(worst, std::fabs(x - y) / std::max(std::fabs(x), 1e-30));
    }
    CHECK(worst < 1e-5);
  }
}

template <class T>
void check_all_block_independent(std::size_t bytes, kvtest::layout l, block_case bc = {}) {
  check_block_independent<kv::presets::restkv, T>("restkv", bytes, l, bc);
  check_block_independent<kv::presets::snapkv, T>("snapkv", bytes, l, bc);
  check_block_independent<kv::presets::adakv, T>("adakv", bytes, l, bc);
  check_block_independent<kv::presets::critical_adakv, T>("critical_adakv", bytes, l, bc);
  check_block_independent<kv::presets::h2o, T>("h2o", bytes, l, bc);
  check_block_independent<kv::presets::tova, T>("tova", bytes, l, bc);
}

}  // namespace

TEST_CASE("workspace: the scoring block size bounds memory and leaves the selections unchanged") {
  // 1 byte: one window row per block; 60000 bytes: a few rows at L = 1500 (G = 4)
  check_all_block_independent<float>(1, kvtest::layout::hnd);
  check_all_block_independent<kv::bfloat16_t>(60000, kvtest::layout::nhd);
  check_all_block_independent<kv::half_t>(1, kvtest::layout::interleaved);
  // no GQA group and a window longer than one block of 32 rows; per query head; layer mean
  check_all_block_independent<float>(30000, kvtest::layout::hnd, {1, 40, kv::gqa_reduction::mean, false});
  check_all_block_independent<float>(1, kvtest::layout::nhd, {2, 33, kv::gqa_reduction::per_query_head, false});
  check_all_block_independent<kv::bfloat16_t>(50000, kvtest::layout::hnd, {4, 24, kv::gqa_reduction::layer_mean, false});
  check_all_block_independent<float>(40000, kvtest::layout::hnd, {4, 24, kv::gqa_reduction::max, false});
  // ReST-KV's "before" aggregation (its own whole-value scratch, blocks of rows as the others)
  check_block_independent<kv::presets::restkv, float>("restkv before", 1, kvtest::layout::hnd, {4, 24, kv::gqa_reduction::mean, true});
  // the workspace shrinks with the block: at 128k, 1 MiB blocks vs the default 16 MiB
  const auto in = shapes_at(131072);
  kv::evictor<kv::presets::restkv, kv::cpu::backend> big, small(kv::presets::restkv::defaults(), kv::cpu::backend{0, std::size_t{1} << 20});
  CHECK(big.workspace_size(in, kv::plan_options{1}) - small.workspace_size(in, kv::plan_options{1}) >= std::size_t{14} << 20);
}
