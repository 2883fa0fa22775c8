// The GEMM-bound part of kvevict's scorers against the BLAS libraries of the machine, at the
// scorers' exact shapes, in the same run (issue 37).
//
// Shapes (one layer: q_heads 32, kv_heads 8, G = 4, head_dim d = 128, window w = 32):
//   qk   the window-attention logits of a GQA group: (G w = 128) x d times d x L, per KV head,
//        as attention_block computes them (tiles of attention_key_tile = 1024 keys written into
//        the L-strided logits block); flops 2 * 32 * w * L * d for the layer.
//   vr   ReST-KV's value projections of a group: L x d times d x (G d = 512), per KV head, as the
//        "after" phase computes them (tiles of lor_token_tile tokens); flops 2 * 32 * L * d^2.
// Each benchmark runs the 8 KV heads over kvevict's parallel_for (the plan's threads), one
// single-threaded product per head, as the scorers do:
//   gemm_{qk,vr}/kvevict   cpu::detail::gemm_nt, the call the scorers make (Eigen's GEMM, or
//                          BLIS's when built with KVEVICT_BLAS=BLIS);
//   gemm_{qk,vr}/<lib>     cblas_sgemm of a library loaded with dlopen(RTLD_LOCAL | RTLD_DEEPBIND)
//                          from its own path (so several BLAS can be measured in one process,
//                          each set to one thread by its own openblas_set_num_threads /
//                          bli_thread_set_num_threads): Debian's OpenBLAS variants (serial,
//                          openmp, pthread) and BLIS, whichever are installed. A missing library
//                          is skipped with a message.
// Counters: GFLOP/s (and tokens/s). scripts/run_bench.sh reports kvevict's fraction of the fastest.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "common/bench_data.hpp"
#include "kvevict/cpu.hpp"

namespace kb = kvevict_bench;
namespace kc = kvevict::cpu;

namespace {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enum values (cblas.h)

struct blas_lib {
  std::string name, path;
  sgemm_fn sgemm = nullptr;
  bool tried = false;
};

/// cblas_sgemm of the library at `path`, private to this process's lookup scope; nullptr when
/// absent. The library is set to one thread (its own setter, when it has one).
sgemm_fn load(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (!h) return nullptr;
  if (auto set = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"))) set(1);
  if (auto set = reinterpret_cast<void (*)(long)>(dlsym(h, "bli_thread_set_num_threads"))) set(1);
  return reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
}

/// The libraries compared (Debian's paths; KVEVICT_BENCH_BLAS_DIR replaces the directory). Loaded
/// on first use by their own benchmarks, so a run filtered to other benchmarks loads none (an
/// OpenBLAS pthread build starts its thread pool when loaded).
std::vector<blas_lib>& libs() {
  static std::vector<blas_lib> v = [] {
    const char* env = std::getenv("KVEVICT_BENCH_BLAS_DIR");
    const std::string dir = env ? std::string(env) + "/" : "/usr/lib/x86_64-linux-gnu/";
    return std::vector<blas_lib>{{"openblas_serial", dir + "openblas-serial/libopenblas.so.0"},
                                 {"openblas_openmp", dir + "openblas-openmp/libopenblas.so.0"},
                                 {"openblas_pthread", dir + "openblas-pthread/libopenblas.so.0"},
                                 {"blis", dir + "libblis.so.4"}};
  }();
  return v;
}

/// lib's cblas_sgemm, loaded once; null (and a skip message) when the library is not installed.
sgemm_fn sgemm_of(blas_lib& lib, benchmark::State& st) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (!lib.sgemm && !lib.tried) {
    lib.tried = true;
    lib.sgemm = load(lib.path);
  }
  if (!lib.sgemm) st.SkipWithError((lib.path + " not installed (or has no cblas_sgemm)").c_str());
  return lib.sgemm;
}

struct qk_data {
  std::int64_t L, d = kb::kHeadDim, rows = kb::kGroup * kb::kWindow;
  std::vector<float> k, q, out;
  explicit qk_data(std::int64_t L_) : L(L_) {
    k.resize(static_cast<std::size_t>(kb::kKvHeads * L * d));
    q.resize(static_cast<std::size_t>(kb::kKvHeads * rows * d));
    out.resize(static_cast<std::size_t>(kb::kKvHeads * rows * L));
    kb::fill_uniform(k.data(), k.size(), 21);
    kb::fill_uniform(q.data(), q.size(), 22);
  }
};

/// The qk product of every KV head, tile by tile as attention_block; `lib` null: gemm_nt.
void run_qk(benchmark::State& st, sgemm_fn lib) {
  const std::int64_t L = st.range(0);
  qk_data x(L);
  const std::int64_t d = x.d, rows = x.rows, tile = kc::detail::attention_key_tile;
  const float scale = 0.0884f;
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, kb::kKvHeads, [&](std::int64_t h, int) {
      const float* K = x.k.data() + h * L * d;
      const float* Q = x.q.data() + h * rows * d;
      float* C = x.out.data() + h * rows * L;
      for (std::int64_t n0 = 0; n0 < L; n0 += tile) {
        const std::int64_t nt = std::min(tile, L - n0);
        if (lib) {
          lib(kRowMajor, kNoTrans, kTrans, static_cast<int>(rows), static_cast<int>(nt), static_cast<int>(d), scale, Q,
              static_cast<int>(d), K + n0 * d, static_cast<int>(d), 0.0f, C + n0, static_cast<int>(L));
        } else {
          kc::detail::gemm_nt(scale, kc::detail::cmap_rm(Q, rows, d, Eigen::OuterStride<>(d)),
                              kc::detail::cmap_rm(K + n0 * d, nt, d, Eigen::OuterStride<>(d)),
                              kc::detail::map_rm(C + n0, rows, nt, Eigen::OuterStride<>(L)));
        }
      }
    });
    benchmark::DoNotOptimize(x.out.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), 4.0 * kb::D(kb::kKvHeads * (L * d + rows * d + rows * L)),
               2.0 * kb::D(kb::kKvHeads * rows * L * d));
}

/// The vr product (Y = V [R_1..R_G]^T) of every KV head in tiles of lor_token_tile tokens.
void run_vr(benchmark::State& st, sgemm_fn lib) {
  const std::int64_t L = st.range(0), d = kb::kHeadDim, gd = kb::kGroup * kb::kHeadDim;
  const std::int64_t tile = kc::detail::lor_token_tile;
  std::vector<float> v(static_cast<std::size_t>(kb::kKvHeads * L * d)), r(static_cast<std::size_t>(kb::kKvHeads * gd * d)),
      y(static_cast<std::size_t>(kb::kKvHeads * tile * gd));
  kb::fill_uniform(v.data(), v.size(), 23);
  kb::fill_uniform(r.data(), r.size(), 24);
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, kb::kKvHeads, [&](std::int64_t h, int) {
      const float* R = r.data() + h * gd * d;
      float* Y = y.data() + h * tile * gd;
      for (std::int64_t n0 = 0; n0 < L; n0 += tile) {
        const std::int64_t nb = std::min(tile, L - n0);
        const float* V = v.data() + (h * L + n0) * d;
        if (lib) {
          lib(kRowMajor, kNoTrans, kTrans, static_cast<int>(nb), static_cast<int>(gd), static_cast<int>(d), 1.0f, V,
              static_cast<int>(d), R, static_cast<int>(d), 0.0f, Y, static_cast<int>(gd));
        } else {
          kc::detail::gemm_nt(1.0f, kc::detail::cmap_rm(V, nb, d, Eigen::OuterStride<>(d)),
                              kc::detail::cmap_rm(R, gd, d, Eigen::OuterStride<>(d)),
                              kc::detail::map_rm(Y, nb, gd, Eigen::OuterStride<>(gd)));
        }
        benchmark::DoNotOptimize(Y);
      }
    });
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, static_cast<double>(L), 4.0 * kb::D(kb::kKvHeads * (L * d + gd * d + L * gd)),
               2.0 * kb::D(kb::kKvHeads * L * gd * d));
}

void BM_qk_kvevict(benchmark::State& st) { run_qk(st, nullptr); }
void BM_vr_kvevict(benchmark::State& st) { run_vr(st, nullptr); }

struct registrar {
  registrar() {
    const std::vector<std::int64_t> seqs = {4096, 16384, 32768};
    const char* mine = kc::detail::gemm_uses_blis ? "gemm_qk/kvevict_blis" : "gemm_qk/kvevict_eigen";
    const char* mine_vr = kc::detail::gemm_uses_blis ? "gemm_vr/kvevict_blis" : "gemm_vr/kvevict_eigen";
    kb::register_seq(mine, BM_qk_kvevict, seqs);
    kb::register_seq(mine_vr, BM_vr_kvevict, seqs);
    for (blas_lib& lib : libs()) {
      blas_lib* p = &lib;
      for (std::int64_t L : seqs) {  // as kb::register_seq names and times them
        benchmark::RegisterBenchmark(("gemm_qk/" + lib.name).c_str(), [p](benchmark::State& st) {
          if (const sgemm_fn f = sgemm_of(*p, st)) run_qk(st, f);
        })->Arg(L)->ArgName("L")->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("gemm_vr/" + lib.name).c_str(), [p](benchmark::State& st) {
          if (const sgemm_fn f = sgemm_of(*p, st)) run_vr(st, f);
        })->Arg(L)->ArgName("L")->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
      }
    }
  }
} the_registrar;

}  // namespace
