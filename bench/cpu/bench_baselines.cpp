// Limits and baselines measured in the same run as the stage benchmarks:
//
// 1. Machine limits.
//    stream_copy / stream_triad: b = a, a = b + s c over 32 Mi floats per array (128 MiB each,
//      far above any LLC), split over the OpenMP threads. bytes = 2 * 4 n (copy), 3 * 4 n
//      (triad; write-allocate traffic not counted, as STREAM does).
//    gemm_square: Eigen fp32 2048^3 product (Eigen's own OpenMP threading); flops 2 n^3.
//    gemm_heads: the LOR scorer's dominant product at its shape, 32 heads of
//      (4096 x 128) * (128 x 128)^T, one head per OpenMP task; flops 2 * 32 * 4096 * 128^2.
//    gemm_qk: the window-attention product, 32 heads of (32 x 128) * (128 x 4096).
//    scripts/run_bench.sh takes bandwidth = max(copy, triad) and GEMM rate = max of the three.
//
// 2. ReST-KV scoring, straightforward vs kvevict (fp32, all 32 query heads, "after" mode, EMA
//    alpha 0.3, W_O of the 4096 x 4096 layer):
//    restkv_reference: what the authors' PyTorch code does, with Eigen for the products: per
//      query head h, the dense window attention A (w x L, fp32, causal inside the window),
//      a_bar = EMA over its rows, the values projected to the hidden size VW = V_h W_O^h
//      (L x 4096), z = sum_{n < L-w} a_bar[n] VW[n], s[n] = a/(1-a) ||z - VW[n]||.
//      Heads run one per OpenMP task (two at a time on 2 cores). flops = per head 2 w L d +
//      2 w L + 2 L d C + 2 L C + 3 L C. Its extra memory is counted by the malloc counter
//      (peak heap above the inputs): one A and one VW per thread at a time. The PyTorch
//      reference holds VW for ALL heads at once ([H, L, C]) and repeats K, V to 32 heads, so
//      it needs at least 32 / threads times more: the measured ratio is a lower bound.
//    restkv_kvevict: kvevict's LOR scorer (the scorer stage of the restkv preset, W_O factor
//      R_h, 128 x 128) on the same data. extra_bytes = its scratch + output rows + heap peak.
//    Both report max_rel_diff = max over heads of max_n |s_ref - s_kvevict| / max_n |s_ref|.
//
// 3. decode_attention: one decoding step (one query per q head, GQA: 4 queries share a KV
//    head) over a cache of n tokens: softmax(q K^T / sqrt(d)) V with Eigen, 8 KV heads over the
//    OpenMP threads (decode_attention) or on one thread (decode_attention_1thread: no
//    parallel-region cost, which dominates the small compacted caches on a loaded machine), fp32. n = 32768 (full cache) and the compacted caches of B = 2048, 1024,
//    512 tokens (built with cpu::compact from the 32k cache). bytes = 2 * 8 n d * 4 (K and V
//    once); flops = 4 * 32 n d.
//
// 4. prefill_attention: one layer's causal prefill attention cost, measured on `threads`
//    query heads at once (one head per thread, each a full blocked causal attention over L
//    keys, query blocks of 128 rows: S = Q_b K[0:e]^T, masked softmax, O_b = P V[0:e], Eigen
//    fp32), then scaled to the 32 query heads of the layer by the counter layer_scale =
//    32 / threads (heads are independent, so a layer is layer_scale such rounds). flops per
//    head = 2 * 2 d * L (L + 1) / 2 (causal half of QK^T and PV).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/alloc_counter.hpp"
#include "common/bench_data.hpp"
#include "common/cpu_stage.hpp"
#include "kvevict/cpu.hpp"

namespace kb = kvevict_bench;
namespace kc = kvevict::cpu;

namespace {

using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using cmap = Eigen::Map<const mat>;

int nthreads() { return kc::detail::max_threads(kc::backend{}); }

// --- 1. limits -------------------------------------------------------------------------------
constexpr std::int64_t kStreamN = std::int64_t{32} << 20;

void BM_stream_copy(benchmark::State& st) {
  std::vector<float> a(static_cast<std::size_t>(kStreamN), 1.0f), b(static_cast<std::size_t>(kStreamN), 0.0f);
  const std::int64_t chunks = 64, per = kStreamN / chunks;
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, chunks, [&](std::int64_t c, int) {
      std::copy(a.data() + c * per, a.data() + (c + 1) * per, b.data() + c * per);
    });
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, 0.0, 2.0 * 4.0 * kStreamN, 0.0);
}

void BM_stream_triad(benchmark::State& st) {
  std::vector<float> a(static_cast<std::size_t>(kStreamN), 0.0f), b(static_cast<std::size_t>(kStreamN), 1.0f),
      c(static_cast<std::size_t>(kStreamN), 2.0f);
  const std::int64_t chunks = 64, per = kStreamN / chunks;
  const float s = 0.5f;
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, chunks, [&](std::int64_t k, int) {
      float* __restrict pa = a.data() + k * per;
      const float* __restrict pb = b.data() + k * per;
      const float* __restrict pc = c.data() + k * per;
      for (std::int64_t i = 0; i < per; ++i) pa[i] = pb[i] + s * pc[i];
    });
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, 0.0, 3.0 * 4.0 * kStreamN, 2.0 * kStreamN);
}

void BM_gemm_square(benchmark::State& st) {
  const Eigen::Index n = 2048;
  mat a(n, n), b(n, n), c(n, n);
  kb::fill_uniform(a.data(), static_cast<std::size_t>(n * n), 5);
  kb::fill_uniform(b.data(), static_cast<std::size_t>(n * n), 6);
  for (auto _ : st) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  kb::set_cost(st, 0.0, 3.0 * 4.0 * n * n, 2.0 * n * n * n);
}

void BM_gemm_heads(benchmark::State& st) {
  const std::int64_t rows = 4096, d = kb::kHeadDim, H = kb::kQHeads;
  std::vector<float> v(static_cast<std::size_t>(kb::kKvHeads * rows * d)), r(static_cast<std::size_t>(H * d * d)),
      y(static_cast<std::size_t>(nthreads() * rows * d));
  kb::fill_uniform(v.data(), v.size(), 7);
  kb::fill_uniform(r.data(), r.size(), 8);
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, H, [&](std::int64_t h, int tid) {
      cmap V(v.data() + (h / kb::kGroup) * rows * d, rows, d);
      cmap R(r.data() + h * d * d, d, d);
      Eigen::Map<mat> Y(y.data() + tid * rows * d, rows, d);
      Y.noalias() = V * R.transpose();
    });
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, 0.0, 4.0 * (static_cast<double>(v.size()) + static_cast<double>(r.size())), 2.0 * H * rows * d * d);
}

void BM_gemm_qk(benchmark::State& st) {
  const std::int64_t L = 4096, d = kb::kHeadDim, H = kb::kQHeads, w = kb::kWindow;
  std::vector<float> k(static_cast<std::size_t>(kb::kKvHeads * L * d)), q(static_cast<std::size_t>(H * w * d)),
      s(static_cast<std::size_t>(nthreads() * w * L));
  kb::fill_uniform(k.data(), k.size(), 9);
  kb::fill_uniform(q.data(), q.size(), 10);
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, H, [&](std::int64_t h, int tid) {
      cmap K(k.data() + (h / kb::kGroup) * L * d, L, d);
      cmap Q(q.data() + h * w * d, w, d);
      Eigen::Map<mat> S(s.data() + tid * w * L, w, L);
      S.noalias() = Q * K.transpose();
    });
    benchmark::DoNotOptimize(s.data());
    benchmark::ClobberMemory();
  }
  kb::set_cost(st, 0.0, 4.0 * (static_cast<double>(k.size()) + static_cast<double>(q.size())), 2.0 * H * w * L * d);
}

// --- 2. ReST-KV scoring: straightforward reference vs kvevict -------------------------------
/// The straightforward scorer (see the file comment). rows: 32 x L scores.
void reference_lor(const kb::layer_data<float>& data, std::vector<float>& rows) {
  const std::int64_t L = data.L, w = data.W, d = kb::kHeadDim, C = kb::kHidden, G = kb::kGroup;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const auto tp = kvevict::presets::restkv::defaults().temporal;  // EMA alpha 0.3
  std::vector<float> c(static_cast<std::size_t>(w));
  for (std::int64_t j = 0; j < w; ++j)
    c[static_cast<std::size_t>(j)] = static_cast<float>(
        kvevict::temporal::ema::weight(tp, static_cast<int>(j), static_cast<int>(w)));
  const cmap WO(kb::wo_matrix().data(), C, kb::kQHeads * d);  // (C, Hq d), [out][in]
  kc::backend be{};
  kc::detail::parallel_for(be, kb::kQHeads, [&](std::int64_t h, int) {
    const std::int64_t hk = h / G;
    cmap Q(data.q.data() + h * w * d, w, d);
    cmap K(data.k.data() + hk * L * d, L, d);
    cmap V(data.v.data() + hk * L * d, L, d);
    // Dense window attention, fp32, causal inside the window.
    mat A = (Q * K.transpose()) * scale;
    for (std::int64_t j = 0; j < w; ++j) {
      const std::int64_t vis = L - w + j + 1;
      auto row = A.row(j);
      const float mx = row.head(vis).maxCoeff();
      row.head(vis) = (row.head(vis).array() - mx).exp().matrix();
      row.head(vis) /= row.head(vis).sum();
      row.tail(L - vis).setZero();
    }
    Eigen::Map<const Eigen::VectorXf> cw(c.data(), w);
    Eigen::VectorXf abar = A.transpose() * cw;  // EMA over the rows
    // Values projected to the hidden size: VW = V W_O^h (L x C).
    mat VW = V * WO.middleCols(h * d, d).transpose();
    Eigen::RowVectorXf z = abar.head(L - w).transpose() * VW.topRows(L - w);
    float* out = rows.data() + h * L;
    for (std::int64_t n = 0; n < L; ++n) {
      const float a = abar[n];
      out[n] = a <= 0.0f ? 0.0f : a / (1.0f - a) * (z - VW.row(n)).norm();
    }
  });
}

double max_rel_diff(const std::vector<float>& ref, const float* got, std::int64_t rows, std::int64_t L) {
  double worst = 0.0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double mx = 0.0, diff = 0.0;
    for (std::int64_t n = 0; n < L; ++n) {
      mx = std::max(mx, std::fabs(static_cast<double>(ref[static_cast<std::size_t>(r * L + n)])));
      diff = std::max(diff, std::fabs(static_cast<double>(ref[static_cast<std::size_t>(r * L + n)]) - got[r * L + n]));
    }
    worst = std::max(worst, mx > 0 ? diff / mx : diff);
  }
  return worst;
}

double reference_flops(std::int64_t L) {
  const double l = static_cast<double>(L), w = kb::kWindow, d = kb::kHeadDim, C = kb::kHidden;
  return kb::kQHeads * (2 * w * l * d + 2 * w * l + 2 * l * d * C + 2 * l * C + 3 * l * C);
}
double lor_bytes_f32(std::int64_t L) {
  const double d = kb::kHeadDim;
  return (2.0 * kb::D(kb::kKvHeads * L) * d + kb::D(kb::kQHeads * kb::kWindow) * d) * 4.0 + kb::D(kb::kQHeads * L) * 4.0;
}

void BM_restkv_reference(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<float>(L);
  (void)kb::wo_matrix();
  std::vector<float> rows(static_cast<std::size_t>(kb::kQHeads * L));
  kb::alloc_counter::reset();
  for (auto _ : st) {
    reference_lor(data, rows);
    benchmark::DoNotOptimize(rows.data());
    benchmark::ClobberMemory();
  }
  const std::int64_t heap = kb::alloc_counter::peak_extra();
  // Check against kvevict (untimed).
  const auto in = data.inputs();
  kb::scorer_stage<kvevict::presets::restkv, float> stage(in, 0);
  stage.run(in, kvevict::presets::restkv::defaults());
  kb::set_cost(st, static_cast<double>(L), lor_bytes_f32(L) + 4.0 * kb::kHidden * kb::kQHeads * kb::kHeadDim, reference_flops(L));
  st.counters["extra_bytes"] = static_cast<double>(heap) + static_cast<double>(rows.size() * sizeof(float));
  st.counters["max_rel_diff"] = max_rel_diff(rows, stage.rows.data(), kb::kQHeads, L);
}

void BM_restkv_kvevict(benchmark::State& st) {
  const std::int64_t L = st.range(0);
  const auto& data = kb::get_layer<float>(L);
  const auto in = data.inputs();
  const auto p = kvevict::presets::restkv::defaults();
  kb::alloc_counter::reset();
  kb::scorer_stage<kvevict::presets::restkv, float> stage(in, 0);
  for (auto _ : st) {
    stage.run(in, p);
    benchmark::DoNotOptimize(stage.rows.data());
    benchmark::ClobberMemory();
  }
  const std::int64_t heap = kb::alloc_counter::peak_extra();  // includes the stage's own buffers
  kb::set_cost(st, static_cast<double>(L), lor_bytes_f32(L) + 4.0 * kb::kQHeads * kb::kHeadDim * kb::kHeadDim, kb::lor_flops(L));
  st.counters["extra_bytes"] = static_cast<double>(std::max<std::int64_t>(heap, static_cast<std::int64_t>(stage.held_bytes())));
  st.counters["held_bytes"] = static_cast<double>(stage.held_bytes());
}

int iters_reference(std::int64_t L) { return L >= 8192 ? 1 : 0; }
int iters_kvevict(std::int64_t L) { return L >= 32768 ? 3 : 0; }

// --- 3. decode attention over the full vs the compacted cache --------------------------------
struct decode_cache {
  std::int64_t n = 0;
  std::vector<float> k, v;  // (8, n, d)
};

const decode_cache& get_decode_cache(std::int64_t n) {
  static std::vector<std::unique_ptr<decode_cache>> caches;
  for (auto& c : caches)
    if (c->n == n) return *c;
  const std::int64_t L = 32768, d = kb::kHeadDim, H = kb::kKvHeads;
  const auto& full = kb::get_layer<float>(L);
  auto c = std::make_unique<decode_cache>();
  c->n = n;
  c->k.resize(static_cast<std::size_t>(H * n * d));
  c->v.resize(c->k.size());
  // Selection: every (L / n)-th slot, ascending (the content does not change the cost).
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(H + 1)), idx(static_cast<std::size_t>(H * n));
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t i = 0; i < n; ++i) idx[static_cast<std::size_t>(h * n + i)] = static_cast<std::int32_t>(i * (L / n));
    indptr[static_cast<std::size_t>(h + 1)] = static_cast<std::int32_t>((h + 1) * n);
  }
  const kvevict::const_selection_view sel(indptr.data(), idx.data(), H);
  const auto in = full.inputs();
  kvevict::status s1 = kc::compact(in.keys, sel, kvevict::make_kv_view(c->k.data(), 1, H, n, d, kvevict::kv_layout::hnd));
  kvevict::status s2 = kc::compact(in.values, sel, kvevict::make_kv_view(c->v.data(), 1, H, n, d, kvevict::kv_layout::hnd));
  if (!s1.ok() || !s2.ok()) c->k.clear();
  caches.push_back(std::move(c));
  return *caches.back();
}

template <bool Threaded>
void BM_decode_attention(benchmark::State& st) {
  const std::int64_t n = st.range(0), d = kb::kHeadDim, G = kb::kGroup;
  const float* kp;
  const float* vp;
  if (n == 32768) {
    const auto& full = kb::get_layer<float>(32768);
    kp = full.k.data();
    vp = full.v.data();
  } else {
    const auto& c = get_decode_cache(n);
    if (c.k.empty()) {
      st.SkipWithError("compaction failed");
      return;
    }
    kp = c.k.data();
    vp = c.v.data();
  }
  std::vector<float> q(static_cast<std::size_t>(kb::kQHeads * d)), o(q.size());
  kb::fill_uniform(q.data(), q.size(), 11);
  const int nt = nthreads();
  std::vector<float> sbuf(static_cast<std::size_t>(nt * G * n));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  kc::backend be{};
  be.num_threads = Threaded ? 0 : 1;
  // One thread: Eigen must not open its own OpenMP region for the products either.
  const int eigen_threads = Eigen::nbThreads();
  if (!Threaded) Eigen::setNbThreads(1);
  for (auto _ : st) {
    kc::detail::parallel_for(be, kb::kKvHeads, [&](std::int64_t h, int tid) {
      cmap K(kp + h * n * d, n, d), V(vp + h * n * d, n, d), Q(q.data() + h * G * d, G, d);
      Eigen::Map<mat> S(sbuf.data() + tid * G * n, G, n);
      S.noalias() = (Q * K.transpose()) * scale;
      for (std::int64_t g = 0; g < G; ++g) {
        auto row = S.row(g);
        const float mx = row.maxCoeff();
        row = (row.array() - mx).exp().matrix();
        row /= row.sum();
      }
      Eigen::Map<mat> O(o.data() + h * G * d, G, d);
      O.noalias() = S * V;
    });
    benchmark::DoNotOptimize(o.data());
    benchmark::ClobberMemory();
  }
  Eigen::setNbThreads(eigen_threads);
  kb::set_cost(st, static_cast<double>(n), 2.0 * kb::D(kb::kKvHeads * n * d) * 4.0, 4.0 * kb::D(kb::kQHeads * n * d));
}

// --- 4. prefill attention --------------------------------------------------------------------
void BM_prefill_attention(benchmark::State& st) {
  const std::int64_t L = st.range(0), d = kb::kHeadDim, blk = 128;
  const auto& data = kb::get_layer<float>(L);
  const int nt = nthreads();
  std::vector<float> q(static_cast<std::size_t>(nt * L * d));
  kb::fill_uniform(q.data(), q.size(), 12);
  std::vector<float> out(q.size()), sbuf(static_cast<std::size_t>(nt * blk * L));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  kc::backend be{};
  for (auto _ : st) {
    kc::detail::parallel_for(be, nt, [&](std::int64_t t, int tid) {
      const std::int64_t hk = t % kb::kKvHeads;
      cmap K(data.k.data() + hk * L * d, L, d), V(data.v.data() + hk * L * d, L, d);
      for (std::int64_t i0 = 0; i0 < L; i0 += blk) {
        const std::int64_t rb = std::min(blk, L - i0), e = i0 + rb;  // rows [i0, e) see keys [0, row]
        cmap Qb(q.data() + (t * L + i0) * d, rb, d);
        Eigen::Map<mat, Eigen::Unaligned, Eigen::OuterStride<>> S(sbuf.data() + tid * blk * L, rb, e, Eigen::OuterStride<>(e));
        S.noalias() = (Qb * K.topRows(e).transpose()) * scale;
        for (std::int64_t r = 0; r < rb; ++r) {
          const std::int64_t vis = i0 + r + 1;
          auto row = S.row(r);
          const float mx = row.head(vis).maxCoeff();
          row.head(vis) = (row.head(vis).array() - mx).exp().matrix();
          row.head(vis) /= row.head(vis).sum();
          row.tail(e - vis).setZero();
        }
        Eigen::Map<mat> Ob(out.data() + (t * L + i0) * d, rb, d);
        Ob.noalias() = S * V.topRows(e);
      }
    });
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double l = static_cast<double>(L);
  kb::set_cost(st, l * nt, 2.0 * kb::kKvHeads * l * d * 4.0, nt * 2.0 * 2.0 * d * l * (l + 1) / 2.0);
  st.counters["layer_scale"] = static_cast<double>(kb::kQHeads) / nt;
  st.counters["heads_timed"] = nt;
}

int iters_prefill(std::int64_t L) { return L >= 16384 ? 1 : 0; }

struct registrar {
  registrar() {
    for (auto* b : {benchmark::RegisterBenchmark("limit_stream_copy", BM_stream_copy),
                    benchmark::RegisterBenchmark("limit_stream_triad", BM_stream_triad),
                    benchmark::RegisterBenchmark("limit_gemm_square", BM_gemm_square),
                    benchmark::RegisterBenchmark("limit_gemm_heads", BM_gemm_heads),
                    benchmark::RegisterBenchmark("limit_gemm_qk", BM_gemm_qk)})
      b->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
    kb::register_seq("restkv_scoring_kvevict/f32", BM_restkv_kvevict, kb::kSeqLensWith8k, iters_kvevict);
    kb::register_seq("restkv_scoring_reference/f32", BM_restkv_reference, kb::kSeqLensWith8k, iters_reference);
    for (const std::int64_t n : {std::int64_t{32768}, std::int64_t{2048}, std::int64_t{1024}, std::int64_t{512}}) {
      benchmark::RegisterBenchmark("decode_attention/f32", BM_decode_attention<true>)
          ->Arg(n)
          ->ArgName("cache")
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark("decode_attention_1thread/f32", BM_decode_attention<false>)
          ->Arg(n)
          ->ArgName("cache")
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
    }
    kb::register_seq("prefill_attention/f32", BM_prefill_attention, kb::kSeqLens, iters_prefill);
  }
} the_registrar;

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("kvevict_threads", std::to_string(nthreads()));
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::AddCustomContext("alloc_counter", kb::alloc_counter::available() ? "glibc malloc interposition" : "unavailable");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
