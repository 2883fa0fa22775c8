// CUDA backend tests: every built-in stage compared with the CPU backend (kvevict::cpu, an
// independent implementation) on seeded inputs, the LKV policies (learned scorer and budgets,
// synthetic tables and the trained stories260K artifact), plus graph capture, the device status
// word and compaction. Without a CUDA device only the host-side tests ("host: ...": bounds,
// parameter checks, messages) run and the binary prints a skip message for the rest.
//
// Comparison rules (docs/cuda.md): budgets (CSR row lengths) exactly equal; final scores
// within |g - c| <= 2e-3 |c| + 1e-5 max|row| (a handful of outliers allowed, reported); the
// selection of a row exactly equal wherever the k-th and (k+1)-th best CPU candidate scores
// are separated by more than the score tolerance (else the row is counted as a near-tie).
// KVEVICT_CUDA_TEST_GRID=small|tiny limits the grid (used under compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "backends/cuda/cpu_reference.hpp"
#include "backends/cuda/model_reference.hpp"
#include "reference/paged.hpp"
#include "reference/thread_communicator.hpp"
#include "kvevict/backends/cuda/learned.cuh"
#include "kvevict/cuda.cuh"

namespace kv = kvevict;
using kvevict_test::cpu_result;

// The user scorer of user_scorer.hpp on CUDA: examples/value_norm/value_norm_cuda.cuh (a kernel of
// its own and a cuda::scorer_impl specialisation), as examples/custom_policy_cuda.cu uses it.
#include "../examples/value_norm/value_norm_cuda.cuh"

namespace {

bool g_small = false;  // KVEVICT_CUDA_TEST_GRID=small: seq {3, 129}, HND only
bool g_tiny = false;   // KVEVICT_CUDA_TEST_GRID=tiny: seq {129}, HND, bf16 only (racecheck)

#define CUDA_OK(expr)                                                                      \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    REQUIRE_MESSAGE(e_ == cudaSuccess, #expr, ": ", cudaGetErrorString(e_));              \
  } while (0)

template <class T>
struct dbuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t count) : n(count ? count : 1) { CUDA_OK(cudaMalloc(&p, n * sizeof(T))); }
  dbuf(const std::vector<T>& h) : dbuf(h.size()) {
    if (!h.empty()) CUDA_OK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~dbuf() { cudaFree(p); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  std::vector<T> get(std::size_t count) const {
    std::vector<T> h(count);
    if (count) CUDA_OK(cudaMemcpy(h.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

/// What a case is, without its storage type (so the result comparison is not a template).
struct case_meta {
  int B = 1, Hkv = 2, G = 1, S = 1, W = 1, d = 8;
  kv::kv_layout layout = kv::kv_layout::hnd;
  kv::dtype dt = kv::dtype::f32;
  std::vector<float> wo;
  std::vector<std::int32_t> lens, pos;
  unsigned seed = 0;
  std::int32_t layer_idx = 0, num_layers = 1;
  bool per_head = false;    ///< lens holds B * Hkv per-head lengths (else B per-sequence ones)
  bool no_queries = false;  ///< pass no queries (query-agnostic scorers)

  int Hq() const { return Hkv * G; }
  int window() const { return no_queries ? 0 : W; }
  int len_of(std::int64_t b, std::int64_t hk) const { return per_head ? lens[b * Hkv + hk] : lens[b]; }
};

/// Host inputs of one case (storage type T) and their views.
template <class T>
struct host_case : case_meta {
  std::vector<T> k, v, q;
  host_case() { dt = kv::dtype_of<T>::value; }
  kv::layer_inputs<T> views(const T* kp, const T* vp, const T* qp, const float* wop, const std::int32_t* lp,
                            const std::int32_t* pp) const {
    kv::layer_inputs<T> in;
    in.keys = kv::make_kv_view(kp, B, Hkv, S, d, layout);
    in.values = kv::make_kv_view(vp, B, Hkv, S, d, layout);
    if (!no_queries) in.queries = kv::make_query_view(qp, B, Hq(), W, d, layout);
    in.lengths = per_head ? kv::per_head_lengths(lp, B, Hkv) : kv::per_sequence_lengths(lp, B, Hkv);
    in.positions = kv::make_positions_view(pp, B, Hkv, S);
    in.wo_factor.data = wop;
    in.wo_factor.extent[0] = Hq();
    in.wo_factor.extent[1] = d;
    in.wo_factor.extent[2] = d;
    in.wo_factor.stride[0] = static_cast<std::int64_t>(d) * d;
    in.wo_factor.stride[1] = d;
    in.wo_factor.stride[2] = 1;
    in.layer_idx = layer_idx;
    in.num_layers = num_layers;
    return in;
  }
};

/// Seeded inputs: uniform K, V, Q in [-1, 1] (Q scaled so attention is peaked but not
/// degenerate); with `dominant`, one key per head is aligned with every window query so that
/// it takes almost all the attention (the exact dominant-token paths).
template <class T>
host_case<T> make_case(unsigned seed, int B, int Hkv, int G, int S, int W, int d, kv::kv_layout layout, bool dominant) {
  host_case<T> c;
  c.seed = seed;
  c.B = B;
  c.Hkv = Hkv;
  c.G = G;
  c.S = S;
  c.W = W;
  c.d = d;
  c.layout = layout;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const std::size_t nkv = static_cast<std::size_t>(B) * Hkv * S * d, nq = static_cast<std::size_t>(B) * c.Hq() * W * d;
  std::vector<float> kf(nkv), vf(nkv), qf(nq);
  for (auto& x : kf) x = u(rng);
  for (auto& x : vf) x = u(rng);
  for (auto& x : qf) x = 2.0f * u(rng);
  if (dominant && S > 1) {
    // keys and queries are in the case's layout: align key slot 1 of every head with a fixed
    // direction and push every query along it.
    const auto kview = kv::make_kv_view(kf.data(), B, Hkv, S, d, layout);
    const auto qview = kv::make_query_view(qf.data(), B, c.Hq(), W, d, layout);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h)
        for (int x = 0; x < d; ++x) kview(b, h, 1, x) = (x % 2 ? 1.0f : -1.0f);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < c.Hq(); ++h)
        for (int j = 0; j < W; ++j)
          for (int x = 0; x < d; ++x) qview(b, h, j, x) = 0.1f * qview(b, h, j, x) + 6.0f * (x % 2 ? 1.0f : -1.0f);
  }
  c.k.resize(nkv);
  c.v.resize(nkv);
  c.q.resize(nq);
  for (std::size_t i = 0; i < nkv; ++i) {
    c.k[i] = kv::from_float<T>(kf[i]);
    c.v[i] = kv::from_float<T>(vf[i]);
  }
  for (std::size_t i = 0; i < nq; ++i) c.q[i] = kv::from_float<T>(qf[i]);
  c.wo.resize(static_cast<std::size_t>(c.Hq()) * d * d);
  for (auto& x : c.wo) x = u(rng) / std::sqrt(static_cast<float>(d));
  c.lens.resize(B);
  for (int b = 0; b < B; ++b) c.lens[b] = b == B - 1 ? S : std::max(W, static_cast<int>(S - (rng() % (S / 2 + 1))));
  c.pos.resize(static_cast<std::size_t>(B) * Hkv * S);
  for (std::size_t i = 0; i < c.pos.size(); ++i) c.pos[i] = static_cast<std::int32_t>(i % S) + 1000 * static_cast<int>(i / (static_cast<std::size_t>(Hkv) * S));
  return c;
}

/// The case's lengths as plan_options::host_lengths wants them: batch x kv_heads, row-major.
std::vector<std::int32_t> host_lengths_of(const case_meta& c) {
  std::vector<std::int32_t> h(static_cast<std::size_t>(c.B) * c.Hkv);
  for (int b = 0; b < c.B; ++b)
    for (int hk = 0; hk < c.Hkv; ++hk) h[static_cast<std::size_t>(b) * c.Hkv + hk] = c.len_of(b, hk);
  return h;
}

struct gpu_result {
  kv::status st, dev;
  std::vector<std::int32_t> indptr, indices, positions;
  std::vector<float> scores;
  std::int64_t capacity = 0;
  bool exact = false;  ///< capacity is the plan's exact kept count
};

/// plan() (with plan_options::host_lengths = hl when non-null) and run(plan) of device inputs
/// `in`; capacity = the plan's max_selected.
template <class P, class T>
gpu_result gpu_run_inputs(const kv::layer_inputs<T>& in, const std::int32_t* hl, const typename P::params& p, kv::budget_request budget,
                          cudaStream_t stream = nullptr) {
  gpu_result r;
  kv::cuda::backend be;
  be.stream = stream;
  kv::evictor<P, kv::cuda::backend> ev(p, be);
  kv::plan_options opt;
  opt.host_lengths = hl;
  kv::eviction_plan pl;
  r.st = ev.plan(in, budget, &pl, opt);
  if (!r.st.ok()) return r;
  CHECK(pl.workspace_bytes == ev.workspace_size(in));
  const std::int64_t rows = pl.rows, S = in.capacity();
  r.capacity = pl.max_selected;
  r.exact = pl.max_selected_exact;
  dbuf<std::int32_t> indptr(rows + 1), indices(r.capacity), positions(r.capacity);
  dbuf<float> scores(rows * S);
  dbuf<unsigned char> ws(pl.workspace_bytes);
  kv::selection_view sel;
  sel.indptr = indptr.p;
  sel.indices = indices.p;
  sel.positions = positions.p;
  sel.capacity = r.capacity;
  r.st = ev.run(pl, in, sel, ws.p, ws.n, scores.p);
  if (!r.st.ok()) return r;
  r.dev = kv::cuda::read_device_status(ev.device_status_ptr(ws.p), stream);
  CUDA_OK(cudaDeviceSynchronize());
  r.indptr = indptr.get(rows + 1);
  const std::size_t total = static_cast<std::size_t>(std::max(0, r.indptr.back()));
  r.indices = indices.get(std::min<std::size_t>(total, r.capacity));
  r.positions = positions.get(std::min<std::size_t>(total, r.capacity));
  r.scores = scores.get(rows * S);
  return r;
}

/// gpu_run_inputs on device copies of the case (with the host copy of the lengths unless
/// host_lengths = false: then the device checks them).
template <class P, class T>
gpu_result gpu_run(const host_case<T>& c, const typename P::params& p, kv::budget_request budget, cudaStream_t stream = nullptr,
                   bool host_lengths = true) {
  dbuf<T> k(c.k), v(c.v), q(c.q);
  dbuf<float> wo(c.wo);
  dbuf<std::int32_t> lens(c.lens), pos(c.pos);
  const auto in = c.views(k.p, v.p, q.p, wo.p, lens.p, pos.p);
  const std::vector<std::int32_t> hl = host_lengths_of(c);
  return gpu_run_inputs<P>(in, host_lengths ? hl.data() : nullptr, p, budget, stream);
}

struct compare_stats {
  long rows = 0, rows_exact = 0, rows_near_tie = 0, score_bad = 0, scores_compared = 0, kept = 0, total = 0;
};

/// What the result comparison needs to know of the policy.
struct policy_meta {
  kv::selectors::topk::params selector;
  kv::gqa_reduction gqa = kv::gqa_reduction::mean;
  bool adakv = false;       ///< score-dependent (AdaKV) budgets: near-ties of the layer threshold allowed
  bool has_scores = true;   ///< the scorer produces scores
};

/// Compare a GPU run with the CPU run of one case (rules in the file comment). Not a template:
/// one copy for every policy and storage type.
void compare_results(const char* name, const case_meta& c, const policy_meta& pm, kv::budget_request budget, const cpu_result& cr,
                     const gpu_result& gr, compare_stats& cs) {
  CAPTURE(name);
  CAPTURE(c.seed);
  CAPTURE(c.S);
  CAPTURE(c.W);
  CAPTURE(c.d);
  CAPTURE(c.G);
  CAPTURE(kv::to_string(c.layout));
  CAPTURE(kv::to_string(c.dt));
  CAPTURE(budget.keep_tokens);
  CAPTURE(budget.keep_fraction);
  CAPTURE(kv::to_string(pm.gqa));
  CAPTURE(c.layer_idx);
  CAPTURE(c.per_head);
  CAPTURE(c.no_queries);
  REQUIRE_MESSAGE(cr.st.ok(), cr.st.message());
  REQUIRE_MESSAGE(gr.st.ok(), gr.st.message());
  REQUIRE_MESSAGE(gr.dev.ok(), gr.dev.message());
  const std::int64_t rows = static_cast<std::int64_t>(cr.indptr.size()) - 1, S = c.S;
  REQUIRE(gr.indptr.size() == cr.indptr.size());
  CHECK(gr.capacity >= cr.indptr.back());
  if (gr.exact) CHECK(gr.capacity == cr.indptr.back());  // host lengths and host budgets: the CPU's exact count
  const bool adakv = pm.adakv;
  const std::int64_t H = rows / c.B;
  // budgets
  bool budgets_equal = true;
  for (std::int64_t r = 0; r < rows; ++r)
    if (gr.indptr[r + 1] - gr.indptr[r] != cr.indptr[r + 1] - cr.indptr[r]) budgets_equal = false;
  if (!adakv) CHECK(budgets_equal);
  if (adakv) {
    // AdaKV budgets must be equal wherever the layer's T-th and (T+1)-th candidate scores
    // (CPU) are separated by more than the tolerance.
    for (int b = 0; b < c.B; ++b) {
      std::vector<float> all;
      std::int64_t total_t = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        const auto pl = kv::detail::plan_head(budget, pm.selector, c.len_of(b, h / (H / c.Hkv)), c.window());
        if (pl.pass_through) continue;
        total_t += pl.base_budget - pl.protected_count();
        for (std::int64_t n = pl.sinks; n < pl.evictable_end(); ++n) all.push_back(cr.scores[(b * H + h) * S + n]);
      }
      bool separated = true;
      if (total_t > 0 && total_t < static_cast<std::int64_t>(all.size())) {
        std::sort(all.begin(), all.end(), [](float x, float y) { return x > y; });
        const float hi = all[total_t - 1], lo = all[total_t];
        const float tol = 2e-3f * std::max(std::fabs(hi), std::fabs(lo)) + 1e-6f;
        separated = (hi - lo) > 2.0f * tol;
      }
      if (separated)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t r = b * H + h;
          CHECK_MESSAGE(gr.indptr[r + 1] - gr.indptr[r] == cr.indptr[r + 1] - cr.indptr[r], "adakv budget of row ", r);
        }
    }
  }
  // scores
  for (std::int64_t r = 0; r < rows; ++r) {
    float mx = 0.0f;
    for (std::int64_t n = 0; n < S; ++n) mx = std::max(mx, std::fabs(cr.scores[r * S + n]));
    for (std::int64_t n = 0; n < S; ++n) {
      const float a = cr.scores[r * S + n], g = gr.scores[r * S + n];
      ++cs.scores_compared;
      if (!(std::fabs(a - g) <= 2e-3f * std::fabs(a) + 1e-5f * mx)) {
        if (cs.score_bad < 5) MESSAGE("score mismatch row ", r, " slot ", n, ": cpu ", a, " gpu ", g);
        ++cs.score_bad;
      }
    }
  }
  // selections
  for (std::int64_t r = 0; r < rows; ++r) {
    ++cs.rows;
    const std::int64_t b = r / H, L = c.len_of(b, (r % H) / (H / c.Hkv));
    const std::int32_t cb = cr.indptr[r], ce = cr.indptr[r + 1], gb = gr.indptr[r], ge = gr.indptr[r + 1];
    cs.kept += ce - cb;
    cs.total += L;
    if (ce - cb != ge - gb) {
      ++cs.rows_near_tie;  // AdaKV near-tie of the layer threshold (checked below)
      continue;
    }
    std::vector<std::int32_t> ci(cr.indices.begin() + cb, cr.indices.begin() + ce);
    std::vector<std::int32_t> gi(gr.indices.begin() + gb, gr.indices.begin() + ge);
    const auto pl = kv::detail::plan_head(budget, pm.selector, L, c.window());
    const std::int64_t cnt = ce - cb;
    bool must_equal = true;
    if (!pl.pass_through && cnt < L && pm.has_scores) {
      const std::int64_t c0 = pl.sinks, c1 = L - pl.recent, kk = cnt - pl.protected_count();
      if (kk > 0 && kk < c1 - c0) {
        std::vector<float> s(cr.scores.begin() + r * S + c0, cr.scores.begin() + r * S + c1);
        std::sort(s.begin(), s.end(), [](float x, float y) { return x > y; });
        const float hi = s[kk - 1], lo = s[kk];
        float mx = 0.0f;
        for (float x : s) mx = std::max(mx, std::fabs(x));
        const float tol = 2e-3f * std::max(std::fabs(hi), std::fabs(lo)) + 1e-5f * mx;
        must_equal = (hi - lo) > 2.0f * tol;
      }
    }
    for (std::size_t i = 1; i < gi.size(); ++i) REQUIRE(gi[i] > gi[i - 1]);
    if (must_equal) {
      ++cs.rows_exact;
      CHECK_MESSAGE(ci == gi, "row ", r);
      if (ci == gi)
        for (std::int64_t i = 0; i < cnt; ++i) CHECK(gr.positions[gb + i] == cr.positions[cb + i]);
    } else {
      ++cs.rows_near_tie;
    }
  }
  if (adakv && !budgets_equal) MESSAGE("adakv budgets differ (near-tie of the layer threshold) in ", name);
}

/// Run one case on the CPU (params p) and the GPU (p_gpu, default p: LKV passes the same
/// tables in device memory) and compare.
template <class P, class T>
void compare(const char* name, const host_case<T>& c, const typename P::params& p, kv::budget_request budget, compare_stats& cs,
             const typename P::params* p_gpu = nullptr) {
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const cpu_result cr = kvevict_test::cpu_run<P, T>(hin, p, budget);
  const gpu_result gr = cr.st.ok() ? gpu_run<P, T>(c, p_gpu ? *p_gpu : p, budget) : gpu_result{};
  policy_meta pm;
  pm.selector = p.selector;
  pm.gqa = p.gqa;
  pm.adakv = std::is_same<typename P::budgeter, kv::budgeters::adakv>::value;
  pm.has_scores = P::scorer::has_scores;
  compare_results(name, c, pm, budget, cr, gr, cs);
}

template <class T>
void run_grid(compare_stats& cs) {
  if (g_tiny && !std::is_same<T, kv::bfloat16_t>::value) return;
  std::vector<int> seqs = g_tiny ? std::vector<int>{129}
                          : g_small ? std::vector<int>{3, 129}
                                    : std::vector<int>{1, 3, 27, 129, 4097, 32768};
  const int dims[3] = {64, 128, 8};
  const int groups[4] = {1, 2, 4, 8};
  unsigned seed = 1000u * static_cast<unsigned>(kv::dtype_of<T>::value);
  int idx = 0;
  for (int layout = (g_small || g_tiny) ? 1 : 0; layout < 2; ++layout)
    for (int S : seqs) {
      ++idx;
      const int d = g_small ? (idx % 2 ? 8 : 64) : dims[idx % 3];
      const int G = groups[idx % 4];
      const int B = S > 4097 ? 1 : 2;
      const int W = std::min(S, idx % 2 ? 32 : 8);
      const auto lay = layout ? kv::kv_layout::hnd : kv::kv_layout::nhd;
      const auto c = make_case<T>(++seed, B, 2, G, S, W, d, lay, idx % 3 == 0);
      const auto cd = make_case<T>(++seed, B, 2, G, S, W, d, lay, true);
      const kv::budget_request tok = kv::budget_request::tokens(W + std::max(1, S / 5));
      const kv::budget_request frac = kv::budget_request::fraction(0.3);
      {
        using P = kv::presets::restkv;
        auto p = P::defaults();
        p.gqa = idx % 2 ? kv::gqa_reduction::mean : kv::gqa_reduction::per_query_head;
        compare<P>("restkv", c, p, tok, cs);
        compare<P>("restkv dominant", cd, p, frac, cs);
        p.scorer.aggregation = kv::scorers::output_reconstruction::mode::before;
        p.scorer.tau = idx % 3 == 1 ? 0.5f : 1.0f;
        compare<P>("restkv before", c, p, tok, cs);
        compare<P>("restkv before dominant", cd, p, tok, cs);
        p = P::defaults();
        p.scorer.use_wo = false;
        p.scorer.include_window_in_output = true;
        p.gqa = kv::gqa_reduction::max;
        compare<P>("restkv value space", c, p, frac, cs);
      }
      {
        using P = kv::presets::snapkv;
        auto p = P::defaults();
        const kv::gqa_reduction modes[3] = {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head};
        p.gqa = modes[idx % 3];
        p.selector.num_sink = 2;
        compare<P>("snapkv", c, p, kv::budget_request::tokens(W + 2 + std::max(1, S / 5)), cs);
      }
      {
        using P = kv::presets::pyramidkv;
        auto cl = c;  // layer 3 of 8: the pyramid schedule, exact_total and PyramidKV's integer steps
        cl.layer_idx = 3;
        cl.num_layers = 8;
        auto p = P::defaults();
        p.budgeter.exact_total = idx % 2 == 0;
        compare<P>("pyramidkv", cl, p, tok, cs);
      }
      {
        using P = kv::presets::adakv;
        compare<P>("adakv", c, P::defaults(), tok, cs);
        // nothing protected, about 1 token per head: the floor that keeps every head non-empty
        auto p0 = P::defaults();
        p0.selector.num_recent = 0;
        compare<P>("adakv floor", c, p0, kv::budget_request::tokens(1), cs);
      }
      {
        using P = kv::presets::pyramidkv;  // nothing protected: min raised to 1 in the last layer
        auto cl = c;
        cl.layer_idx = 7;
        cl.num_layers = 8;
        auto p = P::defaults();
        p.selector.num_recent = 0;
        compare<P>("pyramidkv floor", cl, p, kv::budget_request::tokens(2), cs);
      }
      if (S <= 4097) {
        using P = kv::presets::h2o;
        auto p = P::defaults();
        p.scorer.normalize_by_visible = idx % 2 == 0;
        const auto ch = make_case<T>(++seed, B, 2, G, S, S, d, lay, false);  // W = L: the whole prompt
        compare<P>("h2o", ch, p, kv::budget_request::tokens(std::max(1, S / 4)), cs);
      }
      {
        using P = kv::presets::tova;
        compare<P>("tova", c, P::defaults(), kv::budget_request::tokens(std::max(1, S / 3)), cs);
      }
      {
        using P = kv::presets::streaming_llm;
        compare<P>("streaming_llm", c, P::defaults(), kv::budget_request::tokens(std::max(4, S / 3)), cs);
      }
      {
        using P = kv::presets::key_norm;
        compare<P>("key_norm", c, P::defaults(), frac, cs);
      }
      {
        using P = kvevict_test::maxpool_policy;
        auto p = P::defaults();
        p.spatial.kernel = 7;
        compare<P>("max_pool", c, p, tok, cs);
      }
    }
}

/// Synthetic LKV tables in the artifact's layout (seeded): logits in [-2, 2], W1 ~ U(-1, 1) /
/// sqrt(2d), b1 ~ U(-0.2, 0.2), w2 ~ U(-1, 1) / sqrt(hidden), b2 ~ U(-0.1, 0.1), so utilities
/// are O(1) and well spread.
kv::io::lkv_artifact make_tables(unsigned seed, int layers, int kv_heads, int d, int hidden, kv::lkv_activation act,
                                 float temperature) {
  kv::io::lkv_artifact a;
  a.version = kv::io::lkv_format_version;
  a.num_layers = layers;
  a.kv_heads = kv_heads;
  a.head_dim = d;
  a.mlp_hidden = hidden;
  a.activation = act;
  a.temperature = temperature;
  a.keep_ratio_min = 0.08f;
  a.keep_ratio_max = 0.25f;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  a.logits.resize(static_cast<std::size_t>(a.heads()));
  for (auto& x : a.logits) x = 2.0f * u(rng);
  const std::int64_t blk = a.block(), w1 = static_cast<std::int64_t>(hidden) * 2 * d;
  a.mlp.resize(static_cast<std::size_t>(a.heads() * blk));
  for (std::int64_t hd = 0; hd < a.heads(); ++hd) {
    float* m = a.mlp.data() + hd * blk;
    for (std::int64_t i = 0; i < w1; ++i) m[i] = u(rng) / std::sqrt(2.0f * static_cast<float>(d));
    for (int j = 0; j < hidden; ++j) m[w1 + j] = 0.2f * u(rng);
    for (int j = 0; j < hidden; ++j) m[w1 + hidden + j] = u(rng) / std::sqrt(static_cast<float>(hidden));
    m[w1 + 2 * hidden] = 0.1f * u(rng);
  }
  return a;
}

/// Params of an LKV composition: host tables (a, for the CPU) or device tables (t, for CUDA).
template <class P>
typename P::params lkv_params(const kv::io::lkv_artifact* a, const kv::cuda::lkv_device_tables* t) {
  typename P::params p = P::defaults();
  if constexpr (std::is_same<typename P::scorer, kv::scorers::learned_mlp>::value)
    p.scorer = a ? kv::io::scorer_params(*a) : t->scorer_params();
  if constexpr (std::is_same<typename P::budgeter, kv::budgeters::headwise_learned>::value)
    p.budgeter = a ? kv::io::budgeter_params(*a) : t->budgeter_params();
  return p;
}

/// Compare one LKV composition on CPU (host tables) and CUDA (device tables), applying `edit`
/// to both params.
template <class P, class T, class Edit>
void compare_lkv(const char* name, const host_case<T>& c, const kv::io::lkv_artifact& a, const kv::cuda::lkv_device_tables& t,
                 kv::budget_request budget, compare_stats& cs, Edit edit) {
  auto pc = lkv_params<P>(&a, nullptr);
  auto pg = lkv_params<P>(nullptr, &t);
  edit(pc);
  edit(pg);
  compare<P>(name, c, pc, budget, cs, &pg);
}

/// LKV grid: seq 1 .. 32768 x head_dim 8/128/64/256 x hidden 32/8/48 (one or two 32-unit
/// passes) x silu/relu x GQA 1/2/4/8 x NHD/HND x the storage type; lkv::full with queries
/// (mean / max / per-query-head GQA), without queries, and in decoding mode B (per-head
/// lengths, num_tokens = seq, min_budget); the other compositions with one storage type each.
template <class T>
void run_lkv_grid(compare_stats& cs) {
  if (g_tiny && !std::is_same<T, kv::bfloat16_t>::value) return;
  std::vector<int> seqs = g_tiny ? std::vector<int>{129}
                          : g_small ? std::vector<int>{3, 129}
                                    : std::vector<int>{1, 3, 27, 129, 4097, 32768};
  const int dims[4] = {8, 128, 64, 256};
  const int hiddens[3] = {32, 8, 48};
  const int groups[4] = {1, 2, 4, 8};
  const kv::gqa_reduction modes[3] = {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head};
  unsigned seed = 50000u + 1000u * static_cast<unsigned>(kv::dtype_of<T>::value);
  int idx = 0;
  for (int layout = (g_small || g_tiny) ? 1 : 0; layout < 2; ++layout)
    for (int S : seqs) {
      ++idx;
      const int d = g_small ? (idx % 2 ? 8 : 128) : dims[idx % 4];
      const int G = groups[(idx / 2) % 4];
      const int B = S > 4097 ? 1 : 2;
      const int W = std::min(S, 8);
      const int hidden = hiddens[idx % 3];
      const auto act = idx % 2 ? kv::lkv_activation::relu : kv::lkv_activation::silu;
      const auto lay = layout ? kv::kv_layout::hnd : kv::kv_layout::nhd;
      const auto art = make_tables(++seed, 3, 2, d, hidden, act, idx % 3 == 0 ? 0.7f : 1.0f);
      kv::cuda::lkv_device_tables tables;
      const kv::status up = tables.upload(art);
      REQUIRE_MESSAGE(up.ok(), up.message());
      auto c = make_case<T>(++seed, B, 2, G, S, W, d, lay, false);
      c.layer_idx = idx % 3;
      c.num_layers = 3;
      CAPTURE(hidden);
      CAPTURE(static_cast<int>(act));
      const kv::budget_request frac = kv::budget_request::fraction(idx % 2 ? 0.1 : 0.3);
      const kv::budget_request tok = kv::budget_request::tokens(std::max(1, S / 5));
      const kv::gqa_reduction mode = modes[idx % 3];
      compare_lkv<kv::lkv::full>("lkv full", c, art, tables, frac, cs, [&](auto& p) { p.gqa = mode; });
      auto cn = c;
      cn.no_queries = true;
      compare_lkv<kv::lkv::full>("lkv full, no queries", cn, art, tables, tok, cs, [](auto&) {});
      auto cb = cn;  // decoding mode B: heads of a sequence hold different lengths, t = S tokens seen
      cb.per_head = true;
      cb.lens.assign(static_cast<std::size_t>(B) * 2, S);
      std::mt19937 lr(seed);
      for (std::size_t i = 1; i < cb.lens.size(); ++i) cb.lens[i] = 1 + static_cast<int>(lr() % static_cast<unsigned>(S));
      compare_lkv<kv::lkv::full>("lkv full, mode B", cb, art, tables, frac, cs, [&](auto& p) {
        p.budgeter.num_tokens = S;
        p.budgeter.min_budget = idx % 2 ? 2 : 0;
        p.scorer.layer = (idx + 1) % 3;
      });
      if constexpr (std::is_same<T, kv::bfloat16_t>::value)
        compare_lkv<kv::lkv::uniform_budgets>("lkv uniform budgets", c, art, tables, frac, cs, [&](auto& p) { p.gqa = mode; });
      if constexpr (std::is_same<T, float>::value)
        compare_lkv<kv::lkv::budgets_restkv>("lkv budgets + restkv", c, art, tables,
                                             kv::budget_request::tokens(W + std::max(1, S / 5)), cs, [](auto&) {});
      if constexpr (std::is_same<T, kv::half_t>::value)
        compare_lkv<kv::lkv::budgets_attention>("lkv budgets + attention", c, art, tables, frac, cs, [](auto&) {});
    }
}

/// The trained artifact on random K/V of its model's shapes, every layer, R = 0.1 and 0.2
/// (small grid: seq 129 only; tiny grid: bf16, seq 129, R = 0.1).
template <class T>
void run_lkv_artifact(const kv::io::lkv_artifact& art, const kv::cuda::lkv_device_tables& tables, compare_stats& cs) {
  if (g_tiny && !std::is_same<T, kv::bfloat16_t>::value) return;
  const int G = art.model.header[4] > 0 ? art.model.header[3] / art.model.header[4] : 1;  // n_heads / n_kv_heads
  unsigned seed = 90000u + 100u * static_cast<unsigned>(kv::dtype_of<T>::value);
  const std::vector<int> seqs = (g_small || g_tiny) ? std::vector<int>{129} : std::vector<int>{448, 129};
  const std::vector<double> ratios = g_tiny ? std::vector<double>{0.1} : std::vector<double>{0.1, 0.2};
  for (int S : seqs) {
    for (int l = 0; l < art.num_layers; ++l) {
      auto c = make_case<T>(++seed, 2, art.kv_heads, G, S, std::min(S, 32), art.head_dim, l % 2 ? kv::kv_layout::nhd : kv::kv_layout::hnd,
                            false);
      c.layer_idx = l;
      c.num_layers = art.num_layers;
      for (double R : ratios)
        compare_lkv<kv::lkv::full>("lkv full, stories260K artifact", c, art, tables, kv::budget_request::fraction(R), cs,
                                   [](auto&) {});
    }
  }
}

/// The user scorer (user_scorer.hpp) on both backends: seq 1 .. 4097 x head_dim 8/64/128 x GQA
/// 1/2/4 x NHD/HND x mean / max / per-query-head GQA, power 1 and 0.5, tokens and fraction budgets,
/// per-sequence and ragged per-head lengths (the storage type T: float and bf16).
template <class T>
void run_user_grid(compare_stats& cs) {
  using P = kvevict_test::user_scorer_policy;
  std::vector<int> seqs = g_tiny ? std::vector<int>{129} : g_small ? std::vector<int>{3, 129} : std::vector<int>{1, 3, 27, 129, 4097};
  const int dims[3] = {8, 64, 128};
  const kv::gqa_reduction modes[3] = {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head};
  unsigned seed = 70000u + 1000u * static_cast<unsigned>(kv::dtype_of<T>::value);
  int idx = 0;
  for (int layout = (g_small || g_tiny) ? 1 : 0; layout < 2; ++layout)
    for (int S : seqs) {
      ++idx;
      const int d = dims[idx % 3], G = 1 << (idx % 3), W = std::min(S, 8);
      auto c = make_case<T>(++seed, 2, 2, G, S, W, d, layout ? kv::kv_layout::hnd : kv::kv_layout::nhd, false);
      auto p = P::defaults();
      p.gqa = modes[idx % 3];
      p.scorer.power = idx % 2 ? 1.0f : 0.5f;
      p.selector.num_sink = 2;
      p.spatial.kernel = 3;
      compare<P>("user value_norm", c, p, kv::budget_request::fraction(0.3), cs);
      auto cr = c;  // ragged per-head lengths
      cr.per_head = true;
      cr.lens.assign(static_cast<std::size_t>(2) * 2, S);
      std::mt19937 lr(seed);
      for (std::size_t i = 1; i < cr.lens.size(); ++i) cr.lens[i] = std::max(W, 1 + static_cast<int>(lr() % static_cast<unsigned>(S)));
      compare<P>("user value_norm, ragged", cr, p, kv::budget_request::tokens(std::max(1, S / 4)), cs);
    }
}

}  // namespace

TEST_CASE("cuda vs cpu: a user-defined scorer (cuda::scorer_impl) equals its CPU hook") {
  compare_stats cs;
  run_user_grid<float>(cs);
  run_user_grid<kv::bfloat16_t>(cs);
  MESSAGE("user scorer: rows ", cs.rows, ", compared exactly ", cs.rows_exact, ", near-ties skipped ", cs.rows_near_tie, ", scores ",
          cs.scores_compared, " (", cs.score_bad, " outside tolerance), kept ", cs.kept, " of ", cs.total, " tokens");
  CHECK(cs.rows_exact > cs.rows / 2);
  CHECK(cs.kept < cs.total);
  CHECK(cs.score_bad <= cs.scores_compared / 1000 + 5);
}

TEST_CASE("cuda vs cpu: LKV policies (learned scorer and budgets) over the grid") {
  compare_stats cs;
  run_lkv_grid<float>(cs);
  run_lkv_grid<kv::half_t>(cs);
  run_lkv_grid<kv::bfloat16_t>(cs);
  MESSAGE("LKV: rows ", cs.rows, ", compared exactly ", cs.rows_exact, ", near-ties skipped ", cs.rows_near_tie, ", scores ",
          cs.scores_compared, " (", cs.score_bad, " outside tolerance), kept ", cs.kept, " of ", cs.total, " tokens");
  CHECK(cs.rows_exact > cs.rows / 2);
  CHECK(cs.kept < cs.total);
  CHECK(cs.score_bad <= cs.scores_compared / 1000 + 5);
}

TEST_CASE("cuda vs cpu: LKV with the trained stories260K artifact") {
  kv::io::lkv_artifact art;
  const kv::status rd = kv::io::read_lkv_artifact((std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv").c_str(), &art);
  REQUIRE_MESSAGE(rd.ok(), rd.message());
  kv::cuda::lkv_device_tables tables;
  const kv::status up = tables.upload(art);
  REQUIRE_MESSAGE(up.ok(), up.message());
  compare_stats cs;
  run_lkv_artifact<float>(art, tables, cs);
  run_lkv_artifact<kv::bfloat16_t>(art, tables, cs);
  MESSAGE("stories260K: rows ", cs.rows, ", compared exactly ", cs.rows_exact, ", near-ties skipped ", cs.rows_near_tie,
          ", scores outside tolerance ", cs.score_bad, " of ", cs.scores_compared, ", kept ", cs.kept, " of ", cs.total);
  CHECK(cs.rows_exact > cs.rows / 2);
  CHECK(cs.kept < cs.total);
  CHECK(cs.score_bad <= cs.scores_compared / 1000 + 5);
}

TEST_CASE("cuda: LKV run() captured into a CUDA graph equals a direct run") {
  using P = kv::lkv::full;
  const auto art = make_tables(31, 2, 2, 64, 32, kv::lkv_activation::silu, 1.0f);
  kv::cuda::lkv_device_tables tables;
  REQUIRE(tables.upload(art).ok());
  auto c = make_case<kv::bfloat16_t>(78, 2, 2, 2, 300, 8, 64, kv::kv_layout::hnd, false);
  c.layer_idx = 1;
  c.num_layers = 2;
  const auto p = lkv_params<P>(nullptr, &tables);
  const auto budget = kv::budget_request::fraction(0.2);
  const auto direct = gpu_run<P>(c, p, budget);
  REQUIRE_MESSAGE(direct.st.ok(), direct.st.message());
  REQUIRE_MESSAGE(direct.dev.ok(), direct.dev.message());

  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  dbuf<kv::bfloat16_t> k(c.k), v(c.v), q(c.q);
  dbuf<float> wo(c.wo);
  dbuf<std::int32_t> lens(c.lens), pos(c.pos);
  const auto in = c.views(k.p, v.p, q.p, wo.p, lens.p, pos.p);
  kv::cuda::backend be;
  be.stream = s;
  kv::evictor<P, kv::cuda::backend> ev(p, be);
  const std::int64_t rows = in.batch() * ev.out_heads(in), cap = ev.max_selected(in, budget);
  dbuf<std::int32_t> indptr(rows + 1), indices(cap);
  dbuf<unsigned char> ws(ev.workspace_size(in));
  kv::selection_view sel;
  sel.indptr = indptr.p;
  sel.indices = indices.p;
  sel.capacity = cap;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const kv::status rs = ev.run(in, budget, sel, ws.p, ws.n);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  REQUIRE_MESSAGE(rs.ok(), rs.message());
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const kv::status dev = kv::cuda::read_device_status(ev.device_status_ptr(ws.p), s);
  CHECK_MESSAGE(dev.ok(), dev.message());
  CHECK(indptr.get(rows + 1) == direct.indptr);
  CHECK(indices.get(direct.indices.size()) == direct.indices);
  CHECK(direct.indptr.back() < 2 * 2 * 300);  // something evicted
  CHECK(direct.indptr.back() > 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_CASE("cuda: LKV unequal head lengths without budgeter.num_tokens land in the device status word") {
  using P = kv::lkv::full;
  const auto art = make_tables(32, 1, 2, 8, 8, kv::lkv_activation::silu, 1.0f);
  kv::cuda::lkv_device_tables tables;
  REQUIRE(tables.upload(art).ok());
  auto c = make_case<float>(79, 2, 2, 1, 64, 8, 8, kv::kv_layout::nhd, false);
  c.no_queries = true;
  c.per_head = true;
  c.lens = {64, 64, 50, 41};  // sequence 1 differs
  const auto budget = kv::budget_request::fraction(0.2);
  const auto r = gpu_run<P>(c, lkv_params<P>(nullptr, &tables), budget);
  REQUIRE_MESSAGE(r.st.ok(), r.st.message());
  CHECK(r.dev.code() == kv::errc::invalid_argument);
  CHECK_MESSAGE(std::string(r.dev.message()).find("head lengths differ in sequence 1") != std::string::npos, r.dev.message());
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  CHECK(kvevict_test::cpu_run<P, float>(hin, lkv_params<P>(&art, nullptr), budget).st.code() == kv::errc::invalid_argument);
  // with num_tokens the same lengths are valid
  auto pg = lkv_params<P>(nullptr, &tables);
  pg.budgeter.num_tokens = 64;
  const auto ok = gpu_run<P>(c, pg, budget);
  REQUIRE_MESSAGE(ok.st.ok(), ok.st.message());
  CHECK_MESSAGE(ok.dev.ok(), ok.dev.message());
}

TEST_CASE("host: LKV max_selected on CUDA bounds the CPU's exact kept count") {
  // LKV-H's tables are device memory, so the host cannot compute its budgets: the plan's
  // max_selected is the bound batch * out_heads * seq (exact = false) with or without host
  // lengths, and it must bound the CPU's exact count. With uniform budgets (lkv::uniform_budgets,
  // the same learned scorer) and host lengths the plan is exact: the CPU's max_selected.
  using P = kv::lkv::full;
  using PU = kv::lkv::uniform_budgets;
  int compared = 0, exact_uniform = 0;
  long long slack_sum = 0;
  for (unsigned seed = 1; seed <= 300; ++seed) {
    CAPTURE(seed);
    const int layers = 1 + static_cast<int>(seed % 4);
    const auto art = make_tables(seed, layers, 2, 8, 8, kv::lkv_activation::silu, seed % 3 ? 1.0f : 0.3f);
    const int S = 1 + static_cast<int>((seed * 37u) % 300u), G = 1 + static_cast<int>(seed % 2);
    auto c = make_case<float>(seed, 2, 2, G, S, std::min(S, 8), 8, kv::kv_layout::hnd, false);
    c.layer_idx = static_cast<std::int32_t>(seed % static_cast<unsigned>(layers));
    c.num_layers = layers;
    auto pc = lkv_params<P>(&art, nullptr);
    if (seed % 4 == 1) {  // mode B: per-head lengths
      c.per_head = true;
      c.lens = {S, 1 + static_cast<int>(seed % static_cast<unsigned>(S)), std::max(1, S / 2), S};
      pc.budgeter.num_tokens = S + static_cast<int>(seed % 5);
    }
    if (seed % 5 == 2) c.no_queries = true;
    pc.selector.num_sink = static_cast<std::int32_t>(seed % 3);
    pc.selector.num_recent = seed % 7 == 3 ? 4 : 0;
    pc.budgeter.min_budget = seed % 6 == 5 ? 3 : 0;
    if (!c.no_queries && seed % 3 == 0) pc.gqa = kv::gqa_reduction::per_query_head;
    const kv::budget_request budget =
        seed % 2 ? kv::budget_request::fraction(0.05 + 0.9 * ((seed * 13u) % 100u) / 100.0)
                 : kv::budget_request::tokens(6 + static_cast<int>((seed * 7u) % static_cast<unsigned>(S + 5)));
    const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
    const auto cr = kvevict_test::cpu_run<P, float>(hin, pc, budget);
    REQUIRE_MESSAGE(cr.st.ok(), cr.st.message());
    auto pg = pc;  // the same params as device tables: never dereferenced on the host
    pg.scorer.on_device = true;
    pg.budgeter.on_device = true;
    pg.budgeter.ratios = reinterpret_cast<const double*>(pc.budgeter.logits);
    pg.budgeter.ratios_temperature = pg.budgeter.temperature;
    kv::evictor<P, kv::cuda::backend> ev(pg);
    const kv::status ci = ev.can_implement(hin, budget);
    REQUIRE_MESSAGE(ci.ok(), ci.message());
    const std::int64_t bound = ev.max_selected(hin, budget);  // hin.lengths taken as device memory
    const std::int64_t rows = hin.batch() * ev.out_heads(hin);
    CHECK(bound == rows * S);
    CHECK(bound >= cr.indptr.back());
    const auto hl = host_lengths_of(c);
    kv::plan_options opt;
    opt.host_lengths = hl.data();
    kv::eviction_plan pl;
    REQUIRE(ev.plan(hin, budget, &pl, opt).ok());
    CHECK_FALSE(pl.max_selected_exact);  // the LKV-H tables are device-only
    CHECK(pl.max_selected == bound);
    slack_sum += bound - cr.indptr.back();
    ++compared;
    // the learned scorer with uniform budgets: exact with host lengths
    auto pu = PU::defaults();
    pu.scorer = pg.scorer;
    pu.selector = pc.selector;
    pu.gqa = pc.gqa;
    auto pu_cpu = pu;
    pu_cpu.scorer = pc.scorer;
    kv::evictor<PU, kv::cuda::backend> evu(pu);
    kv::eviction_plan plu;
    REQUIRE(evu.plan(hin, budget, &plu, opt).ok());
    CHECK(plu.max_selected_exact);
    CHECK(plu.max_selected == kvevict_test::cpu_max_selected<PU, float>(hin, pu_cpu, budget));
    CHECK(plu.max_selected <= evu.max_selected(hin, budget));  // the bound without host lengths
    exact_uniform += plu.max_selected_exact;
  }
  CHECK(compared == 300);
  CHECK(exact_uniform == 300);
  MESSAGE("LKV max_selected: ", compared, " cases, mean slack ", static_cast<double>(slack_sum) / compared, " tokens");
}

TEST_CASE("host: LKV tables must live where the backend reads them") {
  using P = kv::lkv::full;
  const auto art = make_tables(3, 3, 2, 8, 8, kv::lkv_activation::relu, 1.0f);
  auto c = make_case<float>(3, 1, 2, 1, 40, 8, 8, kv::kv_layout::hnd, false);
  c.num_layers = 3;
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const auto budget = kv::budget_request::fraction(0.25);
  auto ph = lkv_params<P>(&art, nullptr);
  auto pd = ph;
  pd.scorer.on_device = true;
  pd.budgeter.on_device = true;
  pd.budgeter.ratios = reinterpret_cast<const double*>(ph.budgeter.logits);
  pd.budgeter.ratios_temperature = pd.budgeter.temperature;
  {  // host tables on CUDA
    const kv::status s = kv::evictor<P, kv::cuda::backend>(ph).can_implement(hin, budget);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(std::string(s.message()).find("on_device") != std::string::npos);
  }
  {  // device tables on the CPU
    const auto r = kvevict_test::cpu_run<P, float>(hin, pd, budget);
    CHECK(r.st.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.st.message()).find("on_device") != std::string::npos);
  }
  CHECK(kv::evictor<P, kv::cuda::backend>(pd).can_implement(hin, budget).ok());
  auto bad = pd;
  bad.budgeter.ratios = nullptr;
  CHECK(kv::evictor<P, kv::cuda::backend>(bad).can_implement(hin, budget).code() == kv::errc::null_pointer);
  bad = pd;
  bad.budgeter.num_layers = 2;
  CHECK(kv::evictor<P, kv::cuda::backend>(bad).can_implement(hin, budget).code() == kv::errc::shape_mismatch);
  bad = pd;
  bad.scorer.head_dim = 16;
  CHECK(kv::evictor<P, kv::cuda::backend>(bad).can_implement(hin, budget).code() == kv::errc::shape_mismatch);
  bad = pd;
  bad.scorer.layer = 3;
  CHECK(kv::evictor<P, kv::cuda::backend>(bad).can_implement(hin, budget).code() == kv::errc::invalid_argument);
  // LKV-H: the host cannot compute the budgets from device tables, so max_selected is the bound
  // seq per row, without and with host lengths (exact only when the budgets are host-computable)
  CHECK(kv::evictor<P, kv::cuda::backend>(pd).max_selected(hin, budget) == 1 * 2 * 40);
  const auto hl = host_lengths_of(c);
  kv::plan_options opt;
  opt.host_lengths = hl.data();
  kv::eviction_plan pl;
  REQUIRE(kv::evictor<P, kv::cuda::backend>(pd).plan(hin, budget, &pl, opt).ok());
  CHECK(pl.max_selected == 1 * 2 * 40);
  CHECK_FALSE(pl.max_selected_exact);
}

/// plan() on CUDA with host lengths against the CPU evictor's exact max_selected and its kept
/// count (cpu_run), for one policy: per_head / ragged lengths, no lengths view, and the bound
/// without host lengths. Returns the number of cases where the bound was loose (the exact count is
/// then strictly smaller).
template <class P>
int check_exact_max_selected(unsigned seed, const host_case<float>& c, const typename P::params& p, kv::budget_request budget) {
  CAPTURE(seed);
  CAPTURE(c.S);
  CAPTURE(c.per_head);
  CAPTURE(budget.keep_tokens);
  CAPTURE(budget.keep_fraction);
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const std::int64_t cpu = kvevict_test::cpu_max_selected<P, float>(hin, p, budget);
  REQUIRE(cpu >= 0);
  const auto cr = kvevict_test::cpu_run<P, float>(hin, p, budget);
  REQUIRE_MESSAGE(cr.st.ok(), cr.st.message());
  CHECK(cr.indptr.back() == cpu);
  kv::evictor<P, kv::cuda::backend> ev(p);
  const auto hl = host_lengths_of(c);
  kv::plan_options opt;
  opt.host_lengths = hl.data();
  kv::eviction_plan pl;
  const kv::status ps = ev.plan(hin, budget, &pl, opt);  // hin's pointers are never dereferenced by the CUDA evictor
  REQUIRE_MESSAGE(ps.ok(), ps.message());
  CHECK(pl.max_selected_exact);
  CHECK(pl.max_selected == cpu);
  CHECK(pl.rows == hin.batch() * ev.out_heads(hin));
  CHECK(pl.workspace_bytes == ev.workspace_size(hin));
  // without host lengths: the bound from the shapes (the old CUDA max_selected)
  kv::eviction_plan pb;
  REQUIRE(ev.plan(hin, budget, &pb).ok());
  CHECK_FALSE(pb.max_selected_exact);
  CHECK(pb.max_selected == ev.max_selected(hin, budget));
  CHECK(pb.max_selected >= cpu);
  CHECK(pb.workspace_bytes == pl.workspace_bytes);
  // without a lengths view every head holds seq tokens: exact again, with or without host lengths
  auto nin = hin;
  nin.lengths = kv::lengths_view{};
  kv::eviction_plan pn;
  REQUIRE(ev.plan(nin, budget, &pn).ok());
  CHECK(pn.max_selected_exact);
  CHECK(pn.max_selected == kvevict_test::cpu_max_selected<P, float>(nin, p, budget));
  CHECK(pn.max_selected == ev.max_selected(nin, budget));
  return pb.max_selected > cpu ? 1 : 0;
}

TEST_CASE("host: plan() with host lengths gives the CPU's exact max_selected (uniform, pyramid, adakv; ragged lengths)") {
  std::mt19937 rng(17);
  int cases = 0, loose = 0;
  const kv::gqa_reduction modes[3] = {kv::gqa_reduction::mean, kv::gqa_reduction::max, kv::gqa_reduction::per_query_head};
  for (unsigned seed = 1; seed <= 60; ++seed) {
    const int S = 1 + static_cast<int>(rng() % 300), W = std::min(S, 1 + static_cast<int>(rng() % 16));
    const int G = 1 + static_cast<int>(rng() % 3), B = 1 + static_cast<int>(rng() % 3), Hkv = 1 + static_cast<int>(rng() % 3);
    auto c = make_case<float>(seed, B, Hkv, G, S, W, 8, seed % 2 ? kv::kv_layout::hnd : kv::kv_layout::nhd, false);
    if (seed % 3 != 0) {  // ragged per-head lengths (some below the window, some 0)
      c.per_head = true;
      c.lens.resize(static_cast<std::size_t>(B) * Hkv);
      for (auto& L : c.lens) L = static_cast<int>(rng() % static_cast<unsigned>(S + 1));
      c.lens.back() = S;
    }
    const kv::gqa_reduction mode = modes[seed % 3];
    const std::int32_t sink = static_cast<std::int32_t>(rng() % 4), recent = seed % 4 == 0 ? -1 : static_cast<std::int32_t>(rng() % 6);
    const int protect = sink + (recent >= 0 ? recent : W);  // a token budget must hold them
    const kv::budget_request budget =
        seed % 2 ? kv::budget_request::fraction(0.02 + 0.9 * (rng() % 100) / 100.0)
                 : kv::budget_request::tokens(protect + 1 + static_cast<int>(rng() % static_cast<unsigned>(S + 8)));
    {
      using P = kv::presets::snapkv;  // uniform budgets
      auto p = P::defaults();
      p.gqa = mode;
      p.selector.num_sink = sink;
      p.selector.num_recent = recent;
      loose += check_exact_max_selected<P>(seed, c, p, budget);
    }
    {
      using P = kv::presets::pyramidkv;
      auto cl = c;
      cl.num_layers = 1 + static_cast<int>(rng() % 8);
      cl.layer_idx = static_cast<std::int32_t>(rng() % static_cast<unsigned>(cl.num_layers));
      auto p = P::defaults();
      p.gqa = mode;
      p.selector.num_sink = sink;
      p.selector.num_recent = recent;
      p.budgeter.exact_total = seed % 2 == 0;
      loose += check_exact_max_selected<P>(seed, cl, p, budget);
    }
    {
      using P = kv::presets::adakv;
      auto p = P::defaults();
      p.gqa = mode;
      p.selector.num_sink = sink;
      p.selector.num_recent = recent;
      loose += check_exact_max_selected<P>(seed, c, p, budget);
    }
    cases += 3;
  }
  CHECK(cases == 180);
  CHECK(loose > cases / 4);  // non-vacuous: the bound without host lengths is often not the exact count
  MESSAGE("exact max_selected: ", cases, " plans equal to the CPU's, ", loose, " where the shape bound is loose");
}

TEST_CASE("host: run(plan) accepts only a current plan of this evictor for inputs of its shapes") {
  using P = kv::presets::snapkv;
  const auto c = make_case<float>(41, 2, 2, 2, 64, 8, 8, kv::kv_layout::nhd, false);
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const auto budget = kv::budget_request::tokens(20);
  kv::evictor<P, kv::cuda::backend> ev;
  kv::eviction_plan pl;
  REQUIRE(ev.plan(hin, budget, &pl).ok());
  // Null outputs: a run that gets past the plan check stops at the pointers, before any launch.
  const kv::selection_view none{};
  auto msg = [](const kv::status& s) { return std::string(s.message() ? s.message() : ""); };
  {  // the plan itself is accepted
    const kv::status s = ev.run(pl, hin, none, nullptr, 0);
    CHECK(s.code() == kv::errc::null_pointer);
  }
  {  // a plan that was never made
    const kv::status s = ev.run(kv::eviction_plan{}, hin, none, nullptr, 0);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(msg(s).find("not valid") != std::string::npos);
  }
  {  // another evictor's plan (a copy is another owner too)
    kv::evictor<P, kv::cuda::backend> other;
    const kv::status s = other.run(pl, hin, none, nullptr, 0);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(msg(s).find("another evictor") != std::string::npos);
    const auto copy = ev;
    CHECK(copy.run(pl, hin, none, nullptr, 0).code() == kv::errc::invalid_argument);
  }
  {  // inputs of other shapes: another seq extent, another layout (strides), another layer, no queries
    const auto c2 = make_case<float>(42, 2, 2, 2, 65, 8, 8, kv::kv_layout::nhd, false);
    const auto in2 = c2.views(c2.k.data(), c2.v.data(), c2.q.data(), c2.wo.data(), c2.lens.data(), c2.pos.data());
    const kv::status s = ev.run(pl, in2, none, nullptr, 0);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(msg(s).find("do not match the plan") != std::string::npos);
    const auto c3 = make_case<float>(41, 2, 2, 2, 64, 8, 8, kv::kv_layout::hnd, false);
    const auto in3 = c3.views(c3.k.data(), c3.v.data(), c3.q.data(), c3.wo.data(), c3.lens.data(), c3.pos.data());
    CHECK(ev.run(pl, in3, none, nullptr, 0).code() == kv::errc::invalid_argument);
    auto in4 = hin;
    in4.layer_idx = 1;
    in4.num_layers = 2;
    CHECK(ev.run(pl, in4, none, nullptr, 0).code() == kv::errc::invalid_argument);
    auto in5 = hin;
    in5.queries = kv::query_view<const float>{};
    CHECK(ev.run(pl, in5, none, nullptr, 0).code() == kv::errc::invalid_argument);
    // other data of the same shapes is fine (the plan fixes shapes, not pointers)
    auto in6 = hin;
    in6.keys.data = c3.k.data();
    CHECK(ev.run(pl, in6, none, nullptr, 0).code() == kv::errc::null_pointer);
  }
  {  // const access keeps the plan; the mutable params() makes it stale
    CHECK(static_cast<const kv::evictor<P, kv::cuda::backend>&>(ev).params().selector.num_sink >= 0);
    CHECK(ev.run(pl, hin, none, nullptr, 0).code() == kv::errc::null_pointer);
    ev.params().spatial.kernel = 7;
    const kv::status s = ev.run(pl, hin, none, nullptr, 0);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(msg(s).find("stale") != std::string::npos);
    kv::eviction_plan fresh;
    REQUIRE(ev.plan(hin, budget, &fresh).ok());
    CHECK(ev.run(fresh, hin, none, nullptr, 0).code() == kv::errc::null_pointer);
    auto ev2 = ev;  // assigning another evictor's state makes the plans stale too
    ev2 = kv::evictor<P, kv::cuda::backend>();
    kv::eviction_plan p2;
    REQUIRE(ev2.plan(hin, budget, &p2).ok());
    ev2 = ev;
    CHECK(ev2.run(p2, hin, none, nullptr, 0).code() == kv::errc::invalid_argument);
    pl = fresh;
  }
  {  // the outputs and the workspace size are checked against the plan
    std::int32_t dummy[4] = {};
    kv::selection_view sel;
    sel.indptr = dummy;
    sel.indices = dummy;
    sel.capacity = 1;
    unsigned char byte = 0;
    const kv::status s = ev.run(pl, hin, sel, &byte, pl.workspace_bytes - 1);
    CHECK(s.code() == kv::errc::insufficient_workspace);
    CHECK(ev.run(pl, hin, sel, nullptr, pl.workspace_bytes).code() == kv::errc::insufficient_workspace);
  }
  {  // plan-time errors: the lengths with a host copy, the backend's limits, a null plan
    auto bad = c;
    bad.lens[0] = 65;
    const auto bin = bad.views(bad.k.data(), bad.v.data(), bad.q.data(), bad.wo.data(), bad.lens.data(), bad.pos.data());
    const auto hl = host_lengths_of(bad);
    kv::plan_options opt;
    opt.host_lengths = hl.data();
    kv::eviction_plan bp;
    const kv::status s = ev.plan(bin, budget, &bp, opt);
    CHECK(s.code() == kv::errc::invalid_argument);
    CHECK(msg(s).find("lengths(b=0, h=0) = 65 is outside [0, seq = 64]") != std::string::npos);
    CHECK_FALSE(bp.valid);
    CHECK(ev.plan(bin, budget, &bp).ok());  // device-only lengths: checked by the kernels instead
    CHECK(ev.plan(hin, budget, nullptr).code() == kv::errc::null_pointer);
    const auto wide = make_case<float>(43, 1, 1, 1, 16, 4, 264, kv::kv_layout::hnd, false);
    const auto win = wide.views(wide.k.data(), wide.v.data(), wide.q.data(), wide.wo.data(), wide.lens.data(), wide.pos.data());
    CHECK(ev.can_implement(win, kv::budget_request::tokens(8)).code() == kv::errc::not_supported);
  }
}

/// team_apportion's team as host threads (a generation barrier): the block decomposition of
/// the CUDA plan kernel's apportionment, run on the host.
struct host_team_shared {
  int nt = 1;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  long long gen = 0;
  std::vector<long long> iv;
  std::vector<double> fv;
  void barrier() {
    std::unique_lock<std::mutex> lk(m);
    const long long g = gen;
    if (++arrived == nt) {
      arrived = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return gen != g; });
    }
  }
};
struct host_team {
  host_team_shared* sh;
  int r;
  int rank() const { return r; }
  int size() const { return sh->nt; }
  void sync() { sh->barrier(); }
  long long sum(long long v) {
    sh->barrier();
    sh->iv[r] = v;
    sh->barrier();
    long long t = 0;
    for (long long x : sh->iv) t += x;
    return t;
  }
  long long best(double f, long long i) {
    sh->barrier();
    sh->fv[r] = f;
    sh->iv[r] = i;
    sh->barrier();
    double bf = sh->fv[0];
    long long bi = sh->iv[0];
    for (int k = 1; k < sh->nt; ++k) {
      const double fo = sh->fv[k];
      const long long io = sh->iv[k];
      if (io >= 0 && (bi < 0 || fo > bf || (fo == bf && io < bi))) {
        bf = fo;
        bi = io;
      }
    }
    return bi;
  }
};

TEST_CASE("host: team_apportion (the CUDA plan kernel's apportionment) equals detail::apportion") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int too_many = 0, capped = 0, cases = 0;
  for (int cs = 0; cs < 120; ++cs) {
    CAPTURE(cs);
    const std::int64_t n = 1 + rng() % 200;
    std::vector<double> share(static_cast<std::size_t>(n));
    std::vector<std::int64_t> cap(static_cast<std::size_t>(n));
    const int kind = cs % 4;
    if (kind == 0) {  // water-filled LKV shares from random ratios
      std::vector<double> r(static_cast<std::size_t>(n));
      double z = 0.0;
      for (auto& x : r) z += (x = std::exp(4.0 * u(rng)));
      for (auto& x : r) x /= z;
      const std::int64_t t = 1 + rng() % 500, fl = rng() % (t + 1) / 4;
      const std::int64_t total = n * fl + static_cast<std::int64_t>(u(rng) * static_cast<double>(n * (t - fl)));
      std::vector<unsigned char> clipped(static_cast<std::size_t>(n));
      kv::detail::lkv_fill_scratch sc;
      sc.share = share.data();
      sc.capv = cap.data();
      sc.clipped = clipped.data();
      REQUIRE(kv::detail::lkv_water_fill_shares(r.data(), n, total, t, fl, sc));
    } else {
      for (std::int64_t i = 0; i < n; ++i) {
        const double x = u(rng);
        double s = 40.0 * u(rng);
        if (x < 0.15) s = std::floor(s);                  // exact integers (ties of fraction 0)
        else if (x < 0.25) s = 0.0;
        else if (x < 0.30) s = -3.0 * u(rng);
        else if (x < 0.33) s = std::nan("");
        else if (x < 0.36) s = 0.5 + std::floor(s);       // equal fractions
        share[static_cast<std::size_t>(i)] = s;
        cap[static_cast<std::size_t>(i)] = kind == 3 ? static_cast<std::int64_t>(rng() % 30) : 1000;
      }
    }
    const bool use_cap = kind != 2;
    std::int64_t sum_floor = 0, sum_cap = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double sv = share[static_cast<std::size_t>(i)];
      std::int64_t f = (sv > 0.0 && sv < 9e18) ? static_cast<std::int64_t>(std::floor(sv)) : 0;
      if (use_cap) f = std::min(f, cap[static_cast<std::size_t>(i)]);
      sum_floor += f;
      sum_cap += cap[static_cast<std::size_t>(i)];
    }
    std::int64_t total = kind == 0 ? -1 : std::max<std::int64_t>(0, sum_floor - 3 + static_cast<std::int64_t>(rng() % (n + 6)));
    if (kind == 0) {  // the units above the floor of that water fill: sum(share) rounded
      double ssum = 0.0;
      for (double x : share) ssum += x;
      total = static_cast<std::int64_t>(std::llround(ssum));
    }
    if (use_cap) total = std::min(total, sum_cap);
    too_many += total < sum_floor;
    capped += kind == 3;
    std::vector<std::int64_t> want(static_cast<std::size_t>(n));
    kv::detail::apportion(share.data(), use_cap ? cap.data() : nullptr, n, total, want.data());
    for (int nt : {1, 3, 8}) {
      CAPTURE(nt);
      host_team_shared sh;
      sh.nt = nt;
      sh.iv.assign(static_cast<std::size_t>(nt), 0);
      sh.fv.assign(static_cast<std::size_t>(nt), 0.0);
      std::vector<std::int64_t> got(static_cast<std::size_t>(n), -7);
      std::vector<std::thread> th;
      for (int r = 0; r < nt; ++r)
        th.emplace_back([&, r] {
          host_team tm{&sh, r};
          kv::cuda::detail::team_apportion(tm, share.data(), use_cap ? cap.data() : nullptr, n, total, got.data());
        });
      for (auto& x : th) x.join();
      CHECK(got == want);
    }
    ++cases;
  }
  CHECK(too_many > 0);  // the rank-0 pass was exercised
  CHECK(capped > 0);
  MESSAGE("team_apportion: ", cases, " cases x team sizes 1/3/8, ", too_many, " with the rounding-excess pass");
}

TEST_CASE("host: lkv_sequence_budgets (the CUDA plan kernel's LKV-H code) equals the CPU hook") {
  using Bu = kv::budgeters::headwise_learned;
  std::mt19937 rng(5);
  int ok_cases = 0, err_cases = 0, evicting = 0;
  for (int cs = 0; cs < 80; ++cs) {
    CAPTURE(cs);
    const int kvh = 1 + static_cast<int>(rng() % 4), layers = 1 + static_cast<int>(rng() % 8);
    const auto art = make_tables(700u + static_cast<unsigned>(cs), layers, kvh, 1, 1, kv::lkv_activation::silu,
                                 cs % 3 ? 1.0f : 0.5f);
    auto p = kv::io::budgeter_params(art);
    p.min_budget = cs % 5 == 0 ? static_cast<std::int32_t>(rng() % 8) : 0;
    const bool mode_b = cs % 4 == 1;
    const std::int64_t L = 1 + rng() % 2000;
    if (mode_b) p.num_tokens = L + static_cast<std::int64_t>(rng() % 50);
    const std::int64_t n = art.heads();
    std::vector<double> r(static_cast<std::size_t>(n));
    REQUIRE(kv::detail::lkv_ratios(art.logits.data(), n, static_cast<double>(p.temperature), r.data()));
    const kv::budget_request req = cs % 2 ? kv::budget_request::fraction(0.02 + 0.96 * (rng() % 100) / 100.0)
                                          : kv::budget_request::tokens(8 + static_cast<int>(rng() % 400));
    kv::selectors::topk::params sp;
    sp.num_sink = static_cast<std::int32_t>(rng() % 3);
    sp.num_recent = cs % 3 == 0 ? 0 : static_cast<std::int32_t>(rng() % 6);
    const int G = 1 + static_cast<int>(rng() % 3), rows = kvh * G, layer = static_cast<int>(rng() % static_cast<unsigned>(layers));
    std::vector<kv::detail::head_plan> plans(static_cast<std::size_t>(rows));
    for (int h = 0; h < rows; ++h) {
      std::int64_t Lh = L;
      if ((mode_b || cs % 7 == 3) && h / G == kvh - 1 && kvh > 1) Lh = std::max<std::int64_t>(1, L / 2);  // unequal lengths
      plans[static_cast<std::size_t>(h)] = kv::detail::plan_head(req, sp, Lh, 32);
    }
    std::vector<std::int64_t> want(static_cast<std::size_t>(rows), -1);
    const kv::detail::host_layer_scratch<Bu> hls(p);
    const kv::status cst = Bu::layer_budgets(p, req, plans.data(), rows, kvh, layer, layers, want.data(), hls.s);
    auto pd = p;
    pd.on_device = true;
    pd.ratios = r.data();
    pd.ratios_temperature = pd.temperature;
    std::vector<double> share(static_cast<std::size_t>(n));
    std::vector<std::int64_t> capv(static_cast<std::size_t>(n)), all(static_cast<std::size_t>(n)), got(static_cast<std::size_t>(rows), -1);
    std::vector<unsigned char> clipped(static_cast<std::size_t>(n));
    std::vector<std::uint8_t> need(static_cast<std::size_t>(rows), 7);
    kv::detail::lkv_fill_scratch sc;
    sc.share = share.data();
    sc.capv = capv.data();
    sc.clipped = clipped.data();
    Bu::slice_state lst{};
    int lrc = -1;
    long long lbad[3] = {0, 0, 0};
    host_team_shared sh;
    sh.nt = 8;
    sh.iv.assign(8, 0);
    sh.fv.assign(8, 0.0);
    std::vector<std::thread> th;
    for (int t = 0; t < 8; ++t)
      th.emplace_back([&, t] {
        host_team tm{&sh, t};
        kv::cuda::detail::lkv_sequence_budgets<Bu>(tm, lst, lrc, lbad, pd, req, plans.data(), rows, layer, true, sc, all.data(),
                                                   got.data(), need.data());
      });
    for (auto& x : th) x.join();
    if (cst.ok()) {
      ++ok_cases;
      CHECK(lrc == Bu::slice_ok);
      CHECK(got == want);
      bool ev = false;
      for (int h = 0; h < rows; ++h) {
        const bool nd = want[static_cast<std::size_t>(h)] < plans[static_cast<std::size_t>(h)].length;
        CHECK(need[static_cast<std::size_t>(h)] == (nd ? 1 : 0));
        ev = ev || nd;
      }
      evicting += ev;
    } else {
      ++err_cases;
      CHECK_MESSAGE(lrc == Bu::slice_unequal_lengths, cst.message());
    }
  }
  CHECK(ok_cases > 40);
  CHECK(err_cases > 0);
  CHECK(evicting > 20);
  MESSAGE("lkv_sequence_budgets: ", ok_cases, " cases equal to the CPU hook (", evicting, " evicting), ", err_cases,
          " unequal-length errors");
}

/// lkv_mlp_tile's context as the 256 host threads of one block.
struct host_block_shared {
  host_team_shared bar;
  std::vector<double> xchg;
};
struct host_block_ctx {
  host_block_shared* sh;
  int tid;
  void sync() { sh->bar.barrier(); }
  double shfl_xor(double v, int o) {
    sh->xchg[static_cast<std::size_t>(tid)] = v;
    sh->bar.barrier();
    const double r = sh->xchg[static_cast<std::size_t>(tid ^ o)];
    sh->bar.barrier();
    return r;
  }
};

/// Run lkv_mlp_tile (the code of the CUDA LKV-T kernel) block by block with host threads and
/// compare every written score with learned_mlp::utility on the fp32-widened rows.
template <class T>
/// page_size > 0: the block code reads K/V through a paged copy (shuffled pages, per-head tables
/// over one-head pages when per_head) instead of the contiguous view.
void check_lkv_tile(unsigned seed, int d, int hidden, int S, int G, kv::lkv_activation act, kv::kv_layout lay, long& compared,
                    int page_size = 0, bool per_head = false) {
  CAPTURE(seed);
  CAPTURE(page_size);
  CAPTURE(d);
  CAPTURE(hidden);
  CAPTURE(S);
  CAPTURE(kv::to_string(kv::dtype_of<T>::value));
  const int B = 2, Hkv = 2, layer = 1;
  const auto art = make_tables(seed, 2, Hkv, d, hidden, act, 1.0f);
  const auto c = make_case<T>(seed, B, Hkv, G, S, std::min(S, 8), d, lay, false);
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  kvtest::paged_copy<T> pc;
  kv::kv_view<const T> keys = hin.keys, values = hin.values;
  kv::page_table_view pages;
  if (page_size > 0) {
    kvtest::make_paged(hin, page_size, lay == kv::kv_layout::hnd ? kvtest::pool_layout::hnd : kvtest::pool_layout::nhd, per_head,
                       per_head, seed, pc);
    keys = pc.in.keys;
    values = pc.in.values;
    pages = pc.in.pages;
  }
  std::vector<std::int32_t> len(static_cast<std::size_t>(B) * Hkv);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) len[static_cast<std::size_t>(b * Hkv + h)] = c.len_of(b, h);
  std::vector<std::uint8_t> needkv(len.size(), 1);
  needkv[1] = 0;  // a KV head that needs no scores is left alone
  kv::cuda::detail::lkv_mlp_args m;
  m.block = art.block();
  m.w = art.mlp.data() + static_cast<std::int64_t>(layer) * Hkv * m.block;
  m.hidden = hidden;
  m.relu = act == kv::lkv_activation::relu ? 1 : 0;
  const float sentinel = -12345.0f;
  std::vector<float> out(static_cast<std::size_t>(B) * Hkv * G * S, sentinel);
  const int nbx = (S + kv::cuda::detail::lkv_tile_tokens - 1) / kv::cuda::detail::lkv_tile_tokens;
  for (int kvi = 0; kvi < B * Hkv; ++kvi)
    for (int bx = 0; bx < nbx; ++bx) {
      host_block_shared sh;
      sh.bar.nt = kv::cuda::detail::block_threads;
      sh.xchg.assign(static_cast<std::size_t>(kv::cuda::detail::block_threads), 0.0);
      auto sm = std::make_unique<kv::cuda::detail::lkv_mlp_smem>();
      std::vector<std::thread> th;
      for (int t = 0; t < kv::cuda::detail::block_threads; ++t)
        th.emplace_back([&, t] {
          host_block_ctx cx{&sh, t};
          kv::cuda::detail::lkv_mlp_tile<T>(cx, t, bx, kvi, *sm, keys, values, pages, len.data(), needkv.data(), Hkv, G, S, m,
                                            out.data());
        });
      for (auto& x : th) x.join();
    }
  const auto sp = kv::io::scorer_params(art);
  std::vector<float> kf(static_cast<std::size_t>(d)), vf(static_cast<std::size_t>(d));
  long bad = 0, nonzero = 0;
  for (int kvi = 0; kvi < B * Hkv; ++kvi) {
    const int b = kvi / Hkv, h = kvi % Hkv, L = len[static_cast<std::size_t>(kvi)];
    for (int n = 0; n < S; ++n) {
      float want = sentinel;
      if (needkv[static_cast<std::size_t>(kvi)] && n < L) {
        for (int x = 0; x < d; ++x) {
          kf[static_cast<std::size_t>(x)] = kv::to_float(hin.keys(b, h, n, x));
          vf[static_cast<std::size_t>(x)] = kv::to_float(hin.values(b, h, n, x));
        }
        want = kv::scorers::learned_mlp::utility(sp, layer, h, kf.data(), vf.data());
        nonzero += want != 0.0f;
      }
      for (int g = 0; g < G; ++g) {
        const float got = out[(static_cast<std::size_t>(kvi) * G + g) * S + n];
        ++compared;
        if (!(std::fabs(got - want) <= 1e-6f * std::fabs(want) + 1e-6f)) {
          if (bad < 5) MESSAGE("kvi ", kvi, " g ", g, " n ", n, ": got ", got, " want ", want);
          ++bad;
        }
      }
    }
  }
  CHECK(bad == 0);
  CHECK(nonzero > 0);
}

TEST_CASE("host: lkv_mlp_tile (the CUDA LKV-T kernel's block code) equals learned_mlp::utility") {
  long compared = 0;
  check_lkv_tile<kv::bfloat16_t>(201, 8, 32, 129, 2, kv::lkv_activation::silu, kv::kv_layout::hnd, compared);
  check_lkv_tile<kv::half_t>(202, 24, 40, 70, 1, kv::lkv_activation::relu, kv::kv_layout::nhd, compared);
  check_lkv_tile<float>(203, 128, 8, 200, 1, kv::lkv_activation::silu, kv::kv_layout::nhd, compared);
  // the same block code through paged copies (NaN in every unused pool slot: a wrong page shows)
  check_lkv_tile<kv::bfloat16_t>(204, 8, 32, 129, 2, kv::lkv_activation::silu, kv::kv_layout::hnd, compared, 16, false);
  check_lkv_tile<kv::half_t>(205, 24, 40, 70, 1, kv::lkv_activation::relu, kv::kv_layout::nhd, compared, 1, true);
  check_lkv_tile<float>(206, 64, 8, 200, 1, kv::lkv_activation::silu, kv::kv_layout::nhd, compared, 64, true);
  MESSAGE("lkv_mlp_tile: ", compared, " scores compared");
}

TEST_CASE("host: LKV device-check messages") {
  kv::cuda::device_status s{};
  s.code = static_cast<std::int32_t>(kv::errc::invalid_argument);
  s.check = static_cast<std::int32_t>(kv::cuda::device_check::lkv_lengths);
  s.a0 = 1;
  s.a1 = 3;
  s.a2 = 50;
  s.a3 = 64;
  const kv::status st = kv::cuda::to_status(s);
  CHECK(st.code() == kv::errc::invalid_argument);
  CHECK(std::string(st.message()).find("head lengths differ in sequence 1 (50 in out row 3 vs 64 in row 0") != std::string::npos);
  s.check = static_cast<std::int32_t>(kv::cuda::device_check::lkv_apportion);
  CHECK(std::string(kv::cuda::to_status(s).message()).find("sequence 1 cannot apportion total = 3 over 50 heads of t = 64") !=
        std::string::npos);
}

namespace {
/// docs/cuda.md "Workspace": bytes per token of capacity S of the CUDA workspace, batch B, nq = B x
/// q_heads score rows, rows = B x out_heads selection rows: grows 4 nq; the reduced scores 4 rows
/// (when out rows differ from query heads); avg_pool / adaptive_window 12 rows, max_pool 4 rows;
/// the reconstruction scorer's a_bar 4 nq and its z partials (8 nq d per 4096 tokens, up to 64 of
/// them: S <= 256k); the drift rows min(nq W S, 2^24) floats (no per-token term once
/// S >= 2^24 / (nq W)).
struct cuda_ws_terms {
  bool scores = true, reduced = true, lor = false;
  int box = 0;  // 12: avg_pool / adaptive_window, 4: max_pool, 0: none
};
template <class P, class T>
void check_cuda_workspace(const char* name, const kv::layer_inputs<T>& a, const kv::layer_inputs<T>& b, cuda_ws_terms t) {
  kv::evictor<P, kv::cuda::backend> ev;
  const std::int64_t nq = a.batch() * a.q_heads(), rows = a.batch() * a.kv_heads();
  const double lor = t.lor ? 4.0 * nq + 8.0 * nq * a.head_dim() / 4096.0 : 0.0;
  const double per_token = t.scores ? 4.0 * nq + (t.reduced ? 4.0 * rows : 0.0) + t.box * rows + lor : 0.0;
  const std::size_t wa = ev.workspace_size(a), wb = ev.workspace_size(b);
  const double slope = (static_cast<double>(wb) - static_cast<double>(wa)) / static_cast<double>(b.capacity() - a.capacity());
  INFO(std::string(name) << ": CUDA workspace at " << b.capacity() << " tokens = " << wb << " bytes, " << slope << " bytes per token (formula "
            << per_token << ")");
  CHECK(std::fabs(slope - per_token) < 0.1);
  MESSAGE(std::string(name) << ": CUDA workspace at " << b.capacity() << " tokens = " << wb << " bytes");
}
}  // namespace

TEST_CASE("host: CUDA workspace_size at 128k tokens for every preset follows docs/cuda.md's formula") {
  // Llama-3.1-8B attention geometry, fp16, shapes only (workspace_size reads no data)
  static const kv::half_t dummy[1] = {};
  auto at = [](std::int64_t L) {
    kv::layer_inputs<kv::half_t> in;
    in.keys = kv::make_kv_view(dummy, 1, 8, L, 128, kv::kv_layout::hnd);
    in.values = in.keys;
    in.queries = kv::make_query_view(dummy, 1, 32, 32, 128, kv::kv_layout::hnd);
    static const float r[1] = {};
    in.wo_factor = kv::strided_view<const float, 3>{r, {32, 128, 128}, {128 * 128, 128, 1}};
    return in;
  };
  const auto a = at(65536), b = at(131072);
  check_cuda_workspace<kv::presets::restkv>("restkv", a, b, {true, true, true, 12});
  check_cuda_workspace<kv::presets::snapkv>("snapkv", a, b, {true, true, false, 12});
  check_cuda_workspace<kv::presets::pyramidkv>("pyramidkv", a, b, {true, true, false, 12});
  check_cuda_workspace<kv::presets::adakv>("adakv", a, b, {true, true, false, 12});
  check_cuda_workspace<kv::presets::h2o>("h2o", a, b, {true, true, false, 0});
  check_cuda_workspace<kv::presets::tova>("tova", a, b, {true, true, false, 0});
  check_cuda_workspace<kv::presets::streaming_llm>("streaming_llm", a, b, {false, false, false, 0});
  check_cuda_workspace<kv::presets::key_norm>("key_norm", a, b, {true, true, false, 0});
  check_cuda_workspace<kv::lkv::full>("lkv", a, b, {true, true, false, 0});
  check_cuda_workspace<kv::lkv::uniform_budgets>("lkv_uniform_budgets", a, b, {true, true, false, 0});
  check_cuda_workspace<kv::lkv::budgets_restkv>("lkv_budgets_restkv", a, b, {true, true, true, 12});
  check_cuda_workspace<kv::lkv::budgets_attention>("lkv_budgets_attention", a, b, {true, true, false, 12});
}

TEST_CASE("cuda vs cpu: the engine's eviction path on real stories260K layers") {
#if defined(KVEVICT_TEST_HAVE_MODEL)
  // K, V, the last 32 queries and the W_O factors of every layer after the example engine
  // prefilled a Sherlock excerpt (what eviction_session hands the evictor), evicted by the
  // presets on both backends at keep 10/20/50%, and by full LKV with the trained artifact.
  const int prompt = (g_small || g_tiny) ? 129 : 448;
  std::vector<kvevict_test::model_layer> layers;
  std::string why;
  if (!kvevict_test::capture_model_layers(prompt, 32, 20000, &layers, &why)) {
    REQUIRE_MESSAGE(why.rfind("error:", 0) != 0, why);
    MESSAGE("skipping: ", why);
    return;
  }
  kv::io::lkv_artifact art;
  const kv::status rd = kv::io::read_lkv_artifact((std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv").c_str(), &art);
  REQUIRE_MESSAGE(rd.ok(), rd.message());
  kv::cuda::lkv_device_tables tables;
  const kv::status up = tables.upload(art);
  REQUIRE_MESSAGE(up.ok(), up.message());
  compare_stats cs;
  for (const auto& ml : layers) {
    host_case<float> c;
    c.B = 1;
    c.Hkv = ml.kv_heads;
    c.G = ml.q_heads / ml.kv_heads;
    c.S = ml.length;
    c.W = ml.window;
    c.d = ml.head_dim;
    c.layout = kv::kv_layout::hnd;
    c.k = ml.k;
    c.v = ml.v;
    c.q = ml.q;
    c.wo = ml.wo;
    c.lens = {ml.length};
    c.pos = ml.pos;
    c.seed = static_cast<unsigned>(ml.layer);
    c.layer_idx = ml.layer;
    c.num_layers = ml.num_layers;
    for (double R : {0.1, 0.2, 0.5}) {
      const auto frac = kv::budget_request::fraction(R);
      compare<kv::presets::restkv>("stories260K restkv", c, kv::presets::restkv::defaults(), frac, cs);
      compare<kv::presets::snapkv>("stories260K snapkv", c, kv::presets::snapkv::defaults(), frac, cs);
      compare<kv::presets::adakv>("stories260K adakv", c, kv::presets::adakv::defaults(), frac, cs);
      compare<kv::presets::pyramidkv>("stories260K pyramidkv", c, kv::presets::pyramidkv::defaults(), frac, cs);
      compare<kv::presets::tova>("stories260K tova", c, kv::presets::tova::defaults(), frac, cs);
      compare<kv::presets::key_norm>("stories260K key_norm", c, kv::presets::key_norm::defaults(), frac, cs);
      if (R < 0.5) compare_lkv<kv::lkv::full>("stories260K lkv full", c, art, tables, frac, cs, [](auto&) {});
    }
  }
  MESSAGE("stories260K engine path: rows ", cs.rows, ", compared exactly ", cs.rows_exact, ", near-ties skipped ",
          cs.rows_near_tie, ", scores outside tolerance ", cs.score_bad, " of ", cs.scores_compared, ", kept ", cs.kept, " of ",
          cs.total);
  CHECK(cs.rows_exact > cs.rows / 2);
  CHECK(cs.kept < cs.total);
  CHECK(cs.score_bad <= cs.scores_compared / 1000 + 5);
#else
  MESSAGE("skipping: built without the example engine (KVEVICT_BUILD_EXAMPLES=OFF)");
#endif
}

TEST_CASE("cuda vs cpu: every stage over the seq/head_dim/GQA/layout/dtype grid") {
  compare_stats cs;
  run_grid<float>(cs);
  run_grid<kv::half_t>(cs);
  run_grid<kv::bfloat16_t>(cs);
  MESSAGE("rows ", cs.rows, ", compared exactly ", cs.rows_exact, ", near-ties skipped ", cs.rows_near_tie, ", scores ",
          cs.scores_compared, " (", cs.score_bad, " outside tolerance), kept ", cs.kept, " of ", cs.total, " tokens");
  CHECK(cs.rows_exact > cs.rows / 2);       // non-vacuous: most rows compared exactly
  CHECK(cs.kept < cs.total);                // something was evicted
  CHECK(cs.score_bad <= cs.scores_compared / 1000 + 5);
}

TEST_CASE("cuda: run() captured into a CUDA graph equals a direct run") {
  using P = kv::presets::restkv;
  const auto c = make_case<kv::bfloat16_t>(77, 2, 2, 4, 300, 32, 64, kv::kv_layout::hnd, false);
  const auto budget = kv::budget_request::tokens(80);
  const auto direct = gpu_run<P>(c, P::defaults(), budget);
  REQUIRE(direct.st.ok());
  REQUIRE(direct.dev.ok());

  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  dbuf<kv::bfloat16_t> k(c.k), v(c.v), q(c.q);
  dbuf<float> wo(c.wo);
  dbuf<std::int32_t> lens(c.lens), pos(c.pos);
  const auto in = c.views(k.p, v.p, q.p, wo.p, lens.p, pos.p);
  kv::cuda::backend be;
  be.stream = s;
  kv::evictor<P, kv::cuda::backend> ev(P::defaults(), be);
  const std::int64_t rows = in.batch() * ev.out_heads(in), cap = ev.max_selected(in, budget);
  dbuf<std::int32_t> indptr(rows + 1), indices(cap);
  dbuf<unsigned char> ws(ev.workspace_size(in));
  kv::selection_view sel;
  sel.indptr = indptr.p;
  sel.indices = indices.p;
  sel.capacity = cap;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const kv::status rs = ev.run(in, budget, sel, ws.p, ws.n);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  REQUIRE_MESSAGE(rs.ok(), rs.message());
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const kv::status dev = kv::cuda::read_device_status(ev.device_status_ptr(ws.p), s);
  CHECK_MESSAGE(dev.ok(), dev.message());
  CHECK(indptr.get(rows + 1) == direct.indptr);
  CHECK(indices.get(direct.indices.size()) == direct.indices);
  CHECK(direct.indptr.back() < 2 * 2 * 300);  // something evicted
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_CASE("cuda: data errors land in the device status word") {
  using P = kv::presets::snapkv;
  auto c = make_case<float>(5, 2, 2, 2, 64, 8, 8, kv::kv_layout::nhd, false);
  const auto budget = kv::budget_request::tokens(20);
  SUBCASE("length outside [0, seq]") {
    c.lens[0] = 65;
    const auto r = gpu_run<P>(c, P::defaults(), budget, nullptr, /*host_lengths=*/false);
    REQUIRE(r.st.ok());
    CHECK(r.dev.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.dev.message()).find("lengths(b=0") != std::string::npos);
  }
  SUBCASE("NaN in the keys") {
    c.k[100] = std::nanf("");
    const auto r = gpu_run<P>(c, P::defaults(), budget);
    REQUIRE(r.st.ok());
    CHECK(r.dev.code() == kv::errc::non_finite_input);
  }
  SUBCASE("host-side errors are returned at once") {
    auto p = P::defaults();
    p.spatial.kernel = 4;
    const auto r = gpu_run<P>(c, p, budget);
    CHECK(r.st.code() == kv::errc::invalid_argument);
  }
}

TEST_CASE("cuda: selection capacity smaller than the kept count is reported, indices untouched") {
  using P = kv::presets::snapkv;
  const auto c = make_case<float>(6, 1, 2, 1, 64, 8, 8, kv::kv_layout::hnd, false);
  dbuf<float> k(c.k), v(c.v), q(c.q), wo(c.wo);
  dbuf<std::int32_t> lens(c.lens), pos(c.pos);
  const auto in = c.views(k.p, v.p, q.p, wo.p, lens.p, pos.p);
  kv::evictor<P, kv::cuda::backend> ev;
  const auto budget = kv::budget_request::tokens(20);
  dbuf<std::int32_t> indptr(3), indices(10);
  std::vector<std::int32_t> sentinel(10, -7);
  CUDA_OK(cudaMemcpy(indices.p, sentinel.data(), 40, cudaMemcpyHostToDevice));
  dbuf<unsigned char> ws(ev.workspace_size(in));
  kv::selection_view sel;
  sel.indptr = indptr.p;
  sel.indices = indices.p;
  sel.capacity = 10;
  REQUIRE(ev.run(in, budget, sel, ws.p, ws.n).ok());
  const auto dev = kv::cuda::read_device_status(ev.device_status_ptr(ws.p));
  CHECK(dev.code() == kv::errc::insufficient_capacity);
  CHECK(indices.get(10) == sentinel);
}

TEST_CASE("cuda: dense and ragged compaction equal a host gather") {
  const auto c = make_case<kv::half_t>(9, 2, 2, 1, 50, 8, 64, kv::kv_layout::nhd, false);
  // a hand-made selection: row r keeps every (r + 2)-th slot
  const int rows = 4, S = 50, D = 64;
  std::vector<std::int32_t> indptr(rows + 1, 0), indices;
  for (int r = 0; r < rows; ++r) {
    for (int s = 0; s < S; s += r + 2) indices.push_back(s);
    indptr[r + 1] = static_cast<std::int32_t>(indices.size());
  }
  dbuf<kv::half_t> k(c.k);
  dbuf<std::int32_t> dip(indptr), dix(indices);
  const int cap = 25;
  dbuf<kv::half_t> dense(static_cast<std::size_t>(2) * 2 * cap * D), ragged(indices.size() * D);
  const auto src = kv::make_kv_view(static_cast<const kv::half_t*>(k.p), 2, 2, S, D, kv::kv_layout::nhd);
  const auto dst = kv::make_kv_view(dense.p, 2, 2, cap, D, kv::kv_layout::hnd);
  dbuf<kv::cuda::device_status> st(1);
  CUDA_OK(cudaMemset(st.p, 0, sizeof(kv::cuda::device_status)));
  REQUIRE(kv::cuda::compact(src, kv::const_selection_view(dip.p, dix.p, rows), dst, nullptr, st.p).ok());
  REQUIRE(kv::cuda::compact_ragged(src, kv::const_selection_view(dip.p, dix.p, rows), ragged.p,
                                   static_cast<std::int64_t>(indices.size()) * D, nullptr, st.p).ok());
  CHECK(kv::cuda::read_device_status(st.p).ok());
  const auto hd = dense.get(dense.n), hr = ragged.get(ragged.n);
  const auto hsrc = kv::make_kv_view(c.k.data(), 2, 2, S, D, kv::kv_layout::nhd);
  const auto hdst = kv::make_kv_view(hd.data(), 2, 2, cap, D, kv::kv_layout::hnd);
  long bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int i = indptr[r]; i < indptr[r + 1]; ++i)
      for (int x = 0; x < D; ++x) {
        const auto want = hsrc(r / 2, r % 2, indices[i], x).bits;
        bad += hdst(r / 2, r % 2, i - indptr[r], x).bits != want;
        bad += hr[static_cast<std::size_t>(i) * D + x].bits != want;
      }
  CHECK(bad == 0);
  CHECK(indices.size() < static_cast<std::size_t>(rows) * S);  // non-vacuous
  // in place is refused on CUDA
  auto same = kv::make_kv_view(k.p, 2, 2, S, D, kv::kv_layout::nhd);
  CHECK(kv::cuda::compact(src, kv::const_selection_view(dip.p, dix.p, rows), same).code() == kv::errc::not_supported);
}

// ---------------------------------------------------------------------------------------------
// Paged caches (backends/cuda/paged.cuh, compact_paged.cuh). The host tests run the code the
// kernels run (kv_rows, check_page_row, compact_paged_head) on the host; the device tests compare
// the paged views with the contiguous view of the same data on the device (same kernels, same
// split: selections and scores bit-identical) and the device compaction with a naive gather.

namespace {

/// A small case in every pool layout, page size and table kind: calls f(paged_copy, hin, label).
template <class T, class F>
void for_paged_copies(const host_case<T>& c, F&& f) {
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const kvtest::pool_layout lays[3] = {kvtest::pool_layout::nhd, kvtest::pool_layout::hnd, kvtest::pool_layout::token_innermost};
  const int sizes[3] = {1, 16, 64};
  std::uint64_t seed = c.seed;
  for (const auto lay : lays)
    for (const int ps : sizes)
      for (int kind = 0; kind < 3; ++kind) {  // 0 per-sequence table, 1 per-head over all-head pages, 2 per-head one-head pages
        kvtest::paged_copy<T> pc;
        ++seed;
        // rows that begin inside their first page (pages.start_offset): free offsets, or offsets that
        // add no page (so that compare_paged keeps the contiguous capacity)
        const bool start = ps > 1 && seed % 3 == 1;
        kvtest::make_paged(hin, ps, lay, kind > 0, kind == 2, seed, pc, /*with_last_page_len=*/seed % 2 == 0, 3, /*reversed=*/seed % 5 == 0,
                           start ? (seed % 2 == 0 ? 2 : 1) : 0);
        const std::string label = std::string(kvtest::to_string(lay)) + " ps " + std::to_string(ps) +
                                  (kind == 0 ? " per-seq" : kind == 1 ? " per-head" : " per-head one-head pages") + (start ? " start_offset" : "");
        f(pc, hin, label);
      }
}

}  // namespace

TEST_CASE("host: cuda::head_rows reads a paged pool token for token as the contiguous view") {
  long compared = 0, bad = 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto c = make_case<T>(401, 2, 3, 1, 70, 8, 12, kv::kv_layout::nhd, false);
    c.lens = {70, 33};
    for_paged_copies(c, [&](const kvtest::paged_copy<T>& pc, const kv::layer_inputs<T>& hin, const std::string& label) {
      for (int b = 0; b < c.B; ++b)
        for (int h = 0; h < c.Hkv; ++h) {
          const auto kr = kv::cuda::head_rows(pc.in.keys, pc.in.pages, b, h), vr = kv::cuda::head_rows(pc.in.values, pc.in.pages, b, h);
          const auto kc = kv::cuda::head_rows(hin.keys, kv::page_table_view{}, b, h);
          for (int n = 0; n < c.len_of(b, h); ++n)
            for (int x = 0; x < c.d; ++x) {
              ++compared;
              const bool ok = std::memcmp(&kr.at(n, x), &hin.keys(b, h, n, x), sizeof(T)) == 0 &&
                              std::memcmp(&vr.at(n, x), &hin.values(b, h, n, x), sizeof(T)) == 0 &&
                              std::memcmp(&kc.at(n, x), &hin.keys(b, h, n, x), sizeof(T)) == 0;
              if (!ok && bad++ < 5) MESSAGE(label, ": b ", b, " h ", h, " n ", n, " c ", x);
            }
        }
    });
  };
  run(float{});
  run(kv::half_t{});
  run(kv::bfloat16_t{});
  MESSAGE("head_rows: ", compared, " elements read through 27 paged copies per dtype");
  CHECK(bad == 0);
  CHECK(compared > 100000);
}

TEST_CASE("host: the device page-table checks (check_page_row) accept valid tables and name what is wrong") {
  auto c = make_case<float>(402, 2, 2, 1, 40, 4, 8, kv::kv_layout::hnd, false);
  c.lens = {40, 23};
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  auto first_error = [&](const kvtest::paged_copy<float>& pc) {
    kv::cuda::detail::paged_table_args a;
    a.t = pc.in.pages;
    a.lens = pc.in.lengths;
    a.P = pc.in.keys.extent[0];
    a.H = pc.in.keys.extent[1];
    a.ps = pc.in.keys.extent[2];
    a.head_slots = pc.in.pages.per_head && pc.in.keys.stride[1] != 0;
    kv::cuda::device_status st{};
    for (std::int64_t r = 0; r < a.rows() && st.code == 0; ++r)
      kv::cuda::detail::check_page_row(a, r, [&](kv::cuda::device_check k, std::int64_t a0, std::int64_t a1, std::int64_t a2, std::int64_t a3) {
        st.code = static_cast<std::int32_t>(kv::errc::invalid_argument);
        st.check = static_cast<std::int32_t>(k);
        st.a0 = static_cast<std::int32_t>(a0), st.a1 = static_cast<std::int32_t>(a1), st.a2 = static_cast<std::int32_t>(a2),
        st.a3 = static_cast<std::int32_t>(a3);
      });
    return kv::cuda::to_status(st);
  };
  auto has = [](const kv::status& s, const char* text) {
    INFO(s.message());
    return s.code() == kv::errc::invalid_argument && std::string(s.message()).find(text) != std::string::npos;
  };
  for (int per_head = 0; per_head < 2; ++per_head) {
    CAPTURE(per_head);
    kvtest::paged_copy<float> pc;
    kvtest::make_paged(hin, 16, kvtest::pool_layout::nhd, per_head == 1, per_head == 1, 7, pc, true);
    CHECK(first_error(pc).ok());
    {
      auto bad = pc;
      bad.in.pages.indptr = bad.indptr.data(), bad.in.pages.indices = bad.indices.data();
      bad.in.pages.last_page_len = bad.last_page_len.empty() ? nullptr : bad.last_page_len.data();
      bad.in.lengths = bad.last_page_len.empty() ? kv::per_head_lengths(bad.lens.data(), 2, 2) : kv::lengths_view{};
      if (!bad.last_page_len.empty()) {
        bad.last_page_len[1] = 17;
        CHECK(has(first_error(bad), "pages.last_page_len[1] = 17 must be in [1, page_size = 16]"));
        bad.last_page_len[1] = 0;
        CHECK(has(first_error(bad), "pages.last_page_len[1] = 0"));
      }
    }
    {
      auto bad = pc;
      bad.in.pages.indptr = bad.indptr.data(), bad.in.pages.indices = bad.indices.data();
      bad.in.pages.last_page_len = bad.last_page_len.empty() ? nullptr : bad.last_page_len.data();
      bad.in.lengths = bad.last_page_len.empty() ? kv::per_head_lengths(bad.lens.data(), 2, 2) : kv::lengths_view{};
      bad.in.pages.max_pages_per_row = 1;
      CHECK(has(first_error(bad), "pages row 0 holds 3 pages, outside [0, max_pages_per_row = 1]"));
      bad.in.pages.max_pages_per_row = pc.in.pages.max_pages_per_row;
      bad.indptr[0] = 1;
      CHECK(has(first_error(bad), "pages.indptr[0] = 1 must be 0"));
      bad.indptr[0] = 0;
      std::vector<std::int32_t> prefix = {3, 24};  // sequence 1 holds 23 tokens
      bad.in.pages.protected_prefix = prefix.data();
      CHECK(has(first_error(bad), "pages.protected_prefix[1] = 24 is outside [0, 23]"));
      bad.in.pages.protected_prefix = nullptr;
      std::vector<std::int32_t> so(static_cast<std::size_t>(bad.in.pages.rows(2)), 0);
      bad.in.pages.start_offset = so.data();
      so[1] = 16;
      CHECK(has(first_error(bad), "pages.start_offset[1] = 16 must be in [0, page_size = 16)"));
      so[1] = -2;
      CHECK(has(first_error(bad), "pages.start_offset[1] = -2 must be in [0, page_size = 16)"));
      bad.in.pages.start_offset = nullptr;
      {  // a one-page row whose offset leaves no token; a row without pages keeps its offset with length 0
        std::vector<std::int32_t> ip1 = {0, 1, 1}, ix1 = {0}, lp1 = {5, 0}, so1 = {5, 3}, ln1 = {3, 0};
        kv::cuda::detail::paged_table_args a;
        a.t = kv::make_page_table(ip1.data(), ix1.data(), lp1.data(), 2, 1);
        a.t.start_offset = so1.data();
        a.P = 1, a.H = 1, a.ps = 16;
        auto first = [&]() {
          kv::cuda::device_status e{};
          for (std::int64_t r = 0; r < a.rows() && e.code == 0; ++r)
            kv::cuda::detail::check_page_row(a, r, [&](kv::cuda::device_check k, std::int64_t a0, std::int64_t a1, std::int64_t a2, std::int64_t a3) {
              e.code = static_cast<std::int32_t>(kv::errc::invalid_argument);
              e.check = static_cast<std::int32_t>(k);
              e.a0 = static_cast<std::int32_t>(a0), e.a1 = static_cast<std::int32_t>(a1), e.a2 = static_cast<std::int32_t>(a2),
              e.a3 = static_cast<std::int32_t>(a3);
            });
          return kv::cuda::to_status(e);
        };
        CHECK(has(first(), "pages.start_offset[0] = 5 >= last_page_len = 5 of a row of one page"));
        so1[0] = 2;
        CHECK(first().ok());  // row 0: 3 tokens; row 1: no pages, offset 3, length 0
        a.t.last_page_len = nullptr;
        a.lens = kv::per_head_lengths(ln1.data(), 2, 1);
        CHECK(first().ok());
        ln1[0] = 15;
        CHECK(has(first(), "lengths(0, 0) = 15 is outside [0, pages * page_size - start_offset = 14]"));
      }
      {
        kv::cuda::device_status e{};
        e.code = static_cast<std::int32_t>(kv::errc::invalid_argument);
        e.check = static_cast<std::int32_t>(kv::cuda::device_check::page_start_empty);
        e.a0 = 2, e.a1 = 9, e.a2 = 9;
        CHECK(has(kv::cuda::to_status(e), "pages.start_offset[2] = 9 >= last_page_len = 9 of a row of one page"));
      }
      std::vector<std::int32_t> lens = {40, 40, 23, 23};  // lengths beside last_page_len: must agree
      bad.in.lengths = kv::per_head_lengths(lens.data(), 2, 2);
      lens[2] = 22;
      CHECK(has(first_error(bad), "lengths(1, 0) = 22 != the page table's 23 tokens"));
      bad.in.pages.last_page_len = nullptr;  // lengths alone: at most pages * page_size
      lens[2] = 33;
      CHECK(has(first_error(bad), "lengths(1, 0) = 33 is outside [0, pages * page_size - start_offset = 32]"));
    }
  }
}

namespace {

/// The paged copy's pools as mutable views and its table (host pointers into pc).
template <class T>
kv::kv_view<T> mutable_pool(kvtest::paged_copy<T>& pc, bool values) {
  kv::kv_view<T> v;
  v.data = values ? pc.vpool.data() : pc.kpool.data();
  for (int k = 0; k < 4; ++k) v.extent[k] = pc.in.keys.extent[k], v.stride[k] = pc.in.keys.stride[k];
  return v;
}

/// After a compaction of `pc0` by the selection (ip, ix) (rows b * H + h, or b with
/// per_sequence_set): every kept token i of (b, h) reads, through the table, the original token
/// ix[ip[r] + i] (a naive gather of the contiguous view), and every other pool element is the
/// original's (dropped slots past the kept count, other heads, spare pages: nothing else written).
template <class T>
long verify_compacted(const kvtest::paged_copy<T>& pc0, const std::vector<T>& kpool, const std::vector<T>& vpool, const kv::layer_inputs<T>& hin,
                      const std::vector<std::int32_t>& ip, const std::vector<std::int32_t>& ix, bool per_sequence_set, long& moved) {
  long bad = 0;
  const int B = static_cast<int>(hin.batch()), H = static_cast<int>(hin.kv_heads());
  kv::page_table_view t = pc0.in.pages;
  t.indptr = pc0.indptr.data(), t.indices = pc0.indices.data();
  std::vector<char> written(kpool.size(), 0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int r = per_sequence_set ? b : b * H + h;
      const auto rows = kv::cuda::head_rows(pc0.in.keys, t, b, h);
      for (int i = 0; i < ip[r + 1] - ip[r]; ++i)
        for (int c = 0; c < hin.head_dim(); ++c) {
          const std::size_t o = static_cast<std::size_t>(&rows.at(i, c) - pc0.in.keys.data);
          written[o] = 1;
          ++moved;
          bad += std::memcmp(&kpool[o], &hin.keys(b, h, ix[static_cast<std::size_t>(ip[r] + i)], c), sizeof(T)) != 0;
          bad += std::memcmp(&vpool[o], &hin.values(b, h, ix[static_cast<std::size_t>(ip[r] + i)], c), sizeof(T)) != 0;
        }
    }
  for (std::size_t o = 0; o < written.size(); ++o)
    if (!written[o]) {
      bad += std::memcmp(&kpool[o], &pc0.kpool[o], sizeof(T)) != 0;
      bad += std::memcmp(&vpool[o], &pc0.vpool[o], sizeof(T)) != 0;
    }
  return bad;
}

/// Run compact_paged_head (the CUDA compaction's block code) with `nt` host threads per (b, h)
/// and tensor on a copy of pc0, then verify_compacted.
template <class T>
void check_compact_head(const kvtest::paged_copy<T>& pc0, const kv::layer_inputs<T>& hin, const std::vector<std::int32_t>& ip,
                        const std::vector<std::int32_t>& ix, bool per_sequence_set, int nt, long& moved, long& bad) {
  kvtest::paged_copy<T> pc = pc0;
  const int B = static_cast<int>(hin.batch()), H = static_cast<int>(hin.kv_heads());
  const kv::kv_view<T> kpool = mutable_pool(pc, false), vpool = mutable_pool(pc, true);
  kv::page_table_view t = pc0.in.pages;
  t.indptr = pc0.indptr.data(), t.indices = pc0.indices.data();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int r = per_sequence_set ? b : b * H + h;
      for (int which = 0; which < 2; ++which) {
        host_team_shared sh;
        sh.nt = nt;
        std::vector<std::thread> th;
        for (int tid = 0; tid < nt; ++tid)
          th.emplace_back([&, tid] {
            host_team cx{&sh, tid};
            kv::cuda::detail::compact_paged_head<T>(cx, tid, nt, which ? vpool : kpool, t, b, h, ix.data() + ip[r], ip[r + 1] - ip[r]);
          });
        for (auto& x : th) x.join();
      }
    }
  bad += verify_compacted(pc0, pc.kpool, pc.vpool, hin, ip, ix, per_sequence_set, moved);
}

/// A selection of every (b, h): ascending random subsets (the first `pre` tokens always kept),
/// the same count in every head of a sequence when equal_counts.
std::vector<std::int32_t> random_selection(const case_meta& c, std::uint64_t seed, int rows_per_seq, bool equal_counts, int pre,
                                           std::vector<std::int32_t>& ip) {
  std::mt19937_64 g(seed);
  std::vector<std::int32_t> ix;
  ip.assign(1, 0);
  for (int b = 0; b < c.B; ++b) {
    int minlen = 1 << 30;
    for (int h = 0; h < c.Hkv; ++h) minlen = std::min(minlen, c.len_of(b, h));
    const int keep_eq = pre + static_cast<int>(g() % static_cast<std::uint64_t>(std::max(1, minlen - pre + 1)));
    for (int h = 0; h < rows_per_seq; ++h) {
      const int L = rows_per_seq == 1 ? minlen : c.len_of(b, h);
      const int keep = equal_counts ? std::min(keep_eq, L) : pre + static_cast<int>(g() % static_cast<std::uint64_t>(std::max(1, L - pre + 1)));
      std::vector<std::int32_t> all(static_cast<std::size_t>(L - pre));
      std::iota(all.begin(), all.end(), pre);
      std::shuffle(all.begin(), all.end(), g);
      all.resize(static_cast<std::size_t>(std::max(0, keep - pre)));
      std::sort(all.begin(), all.end());
      for (int i = 0; i < pre; ++i) ix.push_back(i);
      ix.insert(ix.end(), all.begin(), all.end());
      ip.push_back(static_cast<std::int32_t>(ix.size()));
    }
  }
  return ix;
}

}  // namespace

namespace {

/// n random selections of `rows` rows (ascending subsets of [0, len) per row, some rows empty).
struct random_selections {
  std::vector<std::vector<std::int32_t>> ip, ix;
  std::vector<kv::const_selection_view> views;
  random_selections(int n, std::int64_t rows, int slots, std::uint64_t seed) : ip(n), ix(n) {
    std::mt19937_64 g(seed);
    for (int k = 0; k < n; ++k) {
      ip[k].assign(1, 0);
      ix[k].reserve(1);  // a non-null indices pointer when every row is empty
      for (std::int64_t r = 0; r < rows; ++r) {
        const int len = static_cast<int>(g() % static_cast<std::uint64_t>(slots + 1));
        const int keep = (r + k) % 5 == 0 ? 0 : static_cast<int>(g() % static_cast<std::uint64_t>(len + 1));
        std::vector<std::int32_t> all(static_cast<std::size_t>(len));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), g);
        all.resize(static_cast<std::size_t>(keep));
        std::sort(all.begin(), all.end());
        ix[k].insert(ix[k].end(), all.begin(), all.end());
        ip[k].push_back(static_cast<std::int32_t>(ix[k].size()));
      }
    }
    for (int k = 0; k < n; ++k) views.emplace_back(ip[k].data(), ix[k].data(), rows);
  }
  std::size_t total() const {
    std::size_t t = 0;
    for (const auto& x : ix) t += x.size();
    return t;
  }
};

}  // namespace

TEST_CASE("host: union_selections' block code (union_mark_row, union_emit_word) equals cpu::union_selections; bad indices named") {
  long compared = 0;
  for (std::int64_t group : {1, 4, 12})
    for (int slots : {1, 31, 32, 33, 300, 1000}) {
      CAPTURE(group);
      CAPTURE(slots);
      const std::int64_t rows = 12, Q = rows / group, W = (slots + 31) / 32;
      const random_selections rs(3, rows, slots, static_cast<std::uint64_t>(slots * 7 + group));
      std::vector<std::int32_t> wptr(static_cast<std::size_t>(Q + 1)), widx(rs.total() + 1);
      const kv::status cs = kvevict_test::cpu_union_selections(rs.views.data(), 3, group, kv::selection_view{wptr.data(), widx.data(), nullptr, static_cast<std::int64_t>(widx.size())});
      REQUIRE_MESSAGE(cs.ok(), cs.message());
      // the kernels' steps on the host: marks (4 "threads" per row), counts, exclusive scan, emit
      std::vector<std::uint32_t> bits(static_cast<std::size_t>(Q * W), 0u);
      int reports = 0;
      for (int k = 0; k < 3; ++k)
        for (std::int64_t r = 0; r < rows; ++r)
          for (int t = 0; t < 4; ++t)
            kv::cuda::detail::union_mark_row(
                rs.views[static_cast<std::size_t>(k)], k, r, slots, bits.data() + (r / group) * W, t, 4,
                [](std::uint32_t* w, std::uint32_t m) { *w |= m; }, [&](kv::cuda::device_check, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { ++reports; });
      CHECK(reports == 0);
      std::vector<std::int32_t> gptr(1, 0), gidx(rs.total() + 1);
      for (std::int64_t q = 0; q < Q; ++q) {
        long long n = 0;
        for (std::int64_t j = 0; j < W; ++j) n += kv::cuda::detail::popcount32(bits[static_cast<std::size_t>(q * W + j)]);
        std::int64_t base = gptr.back();
        for (std::int64_t j = 0; j < W; ++j) base += kv::cuda::detail::union_emit_word(bits[static_cast<std::size_t>(q * W + j)], j, gidx.data() + base);
        CHECK(base - gptr.back() == n);
        gptr.push_back(static_cast<std::int32_t>(base));
      }
      CHECK(gptr == wptr);
      CHECK(std::equal(gidx.begin(), gidx.begin() + gptr.back(), widx.begin()));
      compared += gptr.back();
    }
  MESSAGE("union on the host: ", compared, " kept slots compared with cpu::union_selections");
  CHECK(compared > 5000);
  // an index outside [0, slots) and a row not ascending are reported and skipped
  std::vector<std::int32_t> ip = {0, 3, 6}, ix = {0, 5, 40, 3, 3, 7};
  const kv::const_selection_view bad(ip.data(), ix.data(), 2);
  std::vector<std::uint32_t> bits(2, 0u);
  std::vector<std::vector<std::int64_t>> got;
  for (std::int64_t r = 0; r < 2; ++r)
    kv::cuda::detail::union_mark_row(bad, 1, r, 32, bits.data(), 0, 1, [](std::uint32_t* w, std::uint32_t m) { *w |= m; },
                                     [&](kv::cuda::device_check c, std::int64_t a0, std::int64_t a1, std::int64_t a2, std::int64_t a3) {
                                       got.push_back({static_cast<std::int64_t>(c), a0, a1, a2, a3});
                                     });
  REQUIRE(got.size() == 2);
  CHECK(got[0] == std::vector<std::int64_t>{static_cast<std::int64_t>(kv::cuda::device_check::union_index), 1, 0, 40, 32});
  CHECK(got[1] == std::vector<std::int64_t>{static_cast<std::int64_t>(kv::cuda::device_check::union_order), 1, 1, 4, 3});
  CHECK(bits[0] == ((1u << 0) | (1u << 5) | (1u << 3) | (1u << 7)));
  auto msg = [](kv::cuda::device_check c, int a0, int a1, int a2, int a3, kv::errc e = kv::errc::invalid_argument) {
    kv::cuda::device_status s{};
    s.code = static_cast<std::int32_t>(e), s.check = static_cast<std::int32_t>(c), s.a0 = a0, s.a1 = a1, s.a2 = a2, s.a3 = a3;
    return std::string(kv::cuda::to_status(s).message());
  };
  CHECK(msg(kv::cuda::device_check::union_index, 1, 0, 40, 32).find("selection 1 row 0 holds index 40 outside [0, slots = 32)") != std::string::npos);
  CHECK(msg(kv::cuda::device_check::union_order, 1, 1, 4, 3).find("selection 1 row 1 is not strictly ascending at 4 (index 3") != std::string::npos);
  CHECK(msg(kv::cuda::device_check::union_indptr, 0, 2, 9, 4).find("selection 0 indptr decreases at row 2 (9 then 4") != std::string::npos);
  CHECK(msg(kv::cuda::device_check::union_capacity, 90, 80, 0, 0, kv::errc::insufficient_capacity).find("keeps 90 tokens > out.capacity = 80") != std::string::npos);
  // host-side errors: named, nothing enqueued
  std::vector<unsigned char> ws(64);
  std::int32_t optr[3], oidx[8];
  const kv::selection_view out{optr, oidx, nullptr, 8};
  auto host_err = [&](const kv::const_selection_view* s, int n, std::int64_t group, std::int64_t slots, kv::selection_view o, std::size_t bytes) {
    return std::string(kv::cuda::union_selections(s, n, group, slots, o, ws.data(), bytes).message());
  };
  CHECK(host_err(&bad, 0, 1, 32, out, 64).find("n = 0 selections") != std::string::npos);
  CHECK(host_err(&bad, 1, 0, 32, out, 64).find("group = 0 must be >= 1") != std::string::npos);
  CHECK(host_err(&bad, 1, 1, 0, out, 64).find("slots = 0 must be in [1, 2^31)") != std::string::npos);
  CHECK(host_err(&bad, 1, 3, 32, out, 64).find("rows = 2 is not a positive multiple of group = 3") != std::string::npos);
  CHECK(host_err(&bad, 1, 1, 32, kv::selection_view{nullptr, oidx, nullptr, 8}, 64).find("out indptr/indices is null") != std::string::npos);
  CHECK(host_err(&bad, 1, 1, 32, out, 64).find("workspace_bytes = 64 <") != std::string::npos);
  const kv::const_selection_view two[2] = {bad, kv::const_selection_view(ip.data(), ix.data(), 1)};
  CHECK(host_err(two, 2, 1, 32, out, 64).find("selection 1 has 1 rows != 2") != std::string::npos);
  CHECK(kv::cuda::union_selections_workspace_size(2, 3, 32) == 0);
}

TEST_CASE("cuda: union_selections equals cpu::union_selections (heads, layers); bad indices and capacity leave out untouched") {
  for (std::int64_t group : {1, 4, 12})
    for (int slots : {1, 33, 1000, 5000}) {
      CAPTURE(group);
      CAPTURE(slots);
      const std::int64_t rows = 12, Q = rows / group;
      const int n = 5;  // five "layers"
      const random_selections rs(n, rows, slots, static_cast<std::uint64_t>(slots * 3 + group));
      std::vector<std::int32_t> wptr(static_cast<std::size_t>(Q + 1)), widx(rs.total() + 1);
      REQUIRE(kvevict_test::cpu_union_selections(rs.views.data(), n, group, kv::selection_view{wptr.data(), widx.data(), nullptr, static_cast<std::int64_t>(widx.size())}).ok());
      std::vector<std::unique_ptr<dbuf<std::int32_t>>> dptr, didx;
      std::vector<kv::const_selection_view> dv;
      for (int k = 0; k < n; ++k) {
        dptr.emplace_back(new dbuf<std::int32_t>(rs.ip[static_cast<std::size_t>(k)]));
        didx.emplace_back(new dbuf<std::int32_t>(rs.ix[static_cast<std::size_t>(k)].empty() ? std::vector<std::int32_t>{0} : rs.ix[static_cast<std::size_t>(k)]));
        dv.emplace_back(dptr.back()->p, didx.back()->p, rows);
      }
      const std::vector<std::int32_t> sentinel(rs.total() + 1, -9);
      dbuf<std::int32_t> optr(std::vector<std::int32_t>(static_cast<std::size_t>(Q + 1), -9)), oidx(sentinel);
      dbuf<unsigned char> ws(kv::cuda::union_selections_workspace_size(rows, group, slots));
      const kv::selection_view out{optr.p, oidx.p, nullptr, static_cast<std::int64_t>(sentinel.size())};
      REQUIRE(kv::cuda::union_selections(dv.data(), n, group, slots, out, ws.p, ws.n).ok());
      const kv::status dev = kv::cuda::read_device_status(kv::cuda::union_selections_status(ws.p));
      REQUIRE_MESSAGE(dev.ok(), dev.message());
      CHECK(optr.get(wptr.size()) == wptr);
      const auto gi = oidx.get(sentinel.size());
      CHECK(std::equal(gi.begin(), gi.begin() + wptr.back(), widx.begin()));
      CHECK(std::all_of(gi.begin() + wptr.back(), gi.end(), [](std::int32_t x) { return x == -9; }));
      // the union larger than out.capacity: an error, out untouched
      if (wptr.back() > 0) {
        dbuf<std::int32_t> p2(std::vector<std::int32_t>(static_cast<std::size_t>(Q + 1), -9)), i2(sentinel);
        REQUIRE(kv::cuda::union_selections(dv.data(), n, group, slots, kv::selection_view{p2.p, i2.p, nullptr, wptr.back() - 1}, ws.p, ws.n).ok());
        const kv::status cap = kv::cuda::read_device_status(kv::cuda::union_selections_status(ws.p));
        CHECK(cap.code() == kv::errc::insufficient_capacity);
        CHECK(p2.get(static_cast<std::size_t>(Q + 1)) == std::vector<std::int32_t>(static_cast<std::size_t>(Q + 1), -9));
        CHECK(i2.get(sentinel.size()) == sentinel);
      }
    }
  // an index outside [0, slots): named, out untouched
  std::vector<std::int32_t> ip = {0, 2, 4}, ix = {0, 5, 3, 40};  // one bad index: row 1's 40
  dbuf<std::int32_t> dip(ip), dix(ix);
  const kv::const_selection_view bad(dip.p, dix.p, 2);
  dbuf<std::int32_t> optr(std::vector<std::int32_t>(3, -9)), oidx(std::vector<std::int32_t>(8, -9));
  dbuf<unsigned char> ws(kv::cuda::union_selections_workspace_size(2, 1, 32));
  REQUIRE(kv::cuda::union_selections(&bad, 1, 1, 32, kv::selection_view{optr.p, oidx.p, nullptr, 8}, ws.p, ws.n).ok());
  const kv::status e = kv::cuda::read_device_status(kv::cuda::union_selections_status(ws.p));
  INFO(e.message());
  CHECK(std::string(e.message()).find("selection 0 row 1 holds index 40 outside [0, slots = 32)") != std::string::npos);
  CHECK(optr.get(3) == std::vector<std::int32_t>(3, -9));
  CHECK(oidx.get(8) == std::vector<std::int32_t>(8, -9));
  // a decreasing indptr, and a negative indptr[0]: named, never followed, out untouched
  for (const std::vector<std::int32_t>& bp : {std::vector<std::int32_t>{0, 3, 2}, std::vector<std::int32_t>{-5, 1, 2}}) {
    dbuf<std::int32_t> dbp(bp);
    const kv::const_selection_view bs(dbp.p, dix.p, 2);
    REQUIRE(kv::cuda::union_selections(&bs, 1, 1, 32, kv::selection_view{optr.p, oidx.p, nullptr, 8}, ws.p, ws.n).ok());
    const kv::status ei = kv::cuda::read_device_status(kv::cuda::union_selections_status(ws.p));
    INFO(ei.message());
    CHECK(std::string(ei.message()).find(bp[0] < 0 ? "selection 0 indptr[0] = -5 must be >= 0" : "selection 0 indptr decreases at row 1 (3 then 2") !=
          std::string::npos);
    CHECK(optr.get(3) == std::vector<std::int32_t>(3, -9));
    CHECK(oidx.get(8) == std::vector<std::int32_t>(8, -9));
  }
}

TEST_CASE("host: compact_paged_head (the CUDA compaction's block code, host threads) equals a naive gather") {
  long moved = 0, bad = 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto c = make_case<T>(403, 2, 2, 1, 150, 8, 24, kv::kv_layout::nhd, false);
    c.per_head = true;
    c.lens = {150, 150, 97, 61};
    for_paged_copies(c, [&](const kvtest::paged_copy<T>& pc, const kv::layer_inputs<T>& hin, const std::string& label) {
      CAPTURE(label);
      const bool per_seq_table = !pc.in.pages.per_head;
      std::vector<std::int32_t> ip;
      // modes a (per-sequence table: equal counts) and b (per-head tables), then c (one set per sequence)
      auto ix = random_selection(c, moved + 17, c.Hkv, per_seq_table, 2, ip);
      check_compact_head(pc, hin, ip, ix, false, 4, moved, bad);
      ix = random_selection(c, moved + 29, 1, false, 0, ip);
      check_compact_head(pc, hin, ip, ix, true, 3, moved, bad);
    });
  };
  run(float{});
  run(kv::bfloat16_t{});
  MESSAGE("compact_paged_head: ", moved, " kept elements compared, ", bad, " wrong");
  CHECK(bad == 0);
  CHECK(moved > 100000);
}

namespace {

/// Device copies of a paged copy (pools, table, lengths) and of the case's queries, W_O factors
/// and positions, and the device layer_inputs over them.
template <class T>
struct device_paged {
  dbuf<T> k, v, q;
  dbuf<float> wo;
  dbuf<std::int32_t> ip, ix, lpl, lens, pos, so;
  kv::layer_inputs<T> in;
  device_paged(const kvtest::paged_copy<T>& pc, const host_case<T>& c)
      : k(pc.kpool), v(pc.vpool), q(c.q), wo(c.wo), ip(pc.indptr), ix(pc.indices), lpl(pc.last_page_len), lens(pc.lens), pos(c.pos),
        so(pc.starts) {
    in = pc.in;
    in.keys.data = k.p;
    if (in.values.data) in.values.data = v.p;
    if (in.queries.data) in.queries.data = q.p;
    if (in.wo_factor.data) in.wo_factor.data = wo.p;
    if (in.positions.data) in.positions.data = pos.p;
    in.pages.indptr = ip.p;
    in.pages.indices = ix.p;
    in.pages.last_page_len = pc.in.pages.last_page_len ? lpl.p : nullptr;
    in.pages.start_offset = pc.in.pages.start_offset ? so.p : nullptr;
    if (in.lengths.data) in.lengths.data = lens.p;
  }
};

struct paged_stats {
  long runs = 0, bad = 0, kept = 0, start_runs = 0;  ///< start_runs: copies with pages.start_offset compared
};

/// One policy on the contiguous view and on paged copies of the same case (page sizes 1, 16, 64;
/// per-sequence, per-head and one-head-page tables; NHD, HND and token-innermost pools; shuffled
/// and descending page ids; lengths from last_page_len or from lengths; every other run without
/// host lengths, so that the device derives them from the table): identical CSR, positions and
/// scores over every valid slot. The capacity is kept at S (max_pages_per_row = S / page_size) so
/// that the kernels split the keys as for the contiguous view.
template <class P, class T>
void compare_paged(const char* name, const host_case<T>& c, const typename P::params& p, kv::budget_request budget, paged_stats& ps) {
  CAPTURE(name);
  const auto want = gpu_run<P>(c, p, budget);
  REQUIRE_MESSAGE(want.st.ok(), want.st.message());
  REQUIRE_MESSAGE(want.dev.ok(), want.dev.message());
  const std::vector<std::int32_t> hl = host_lengths_of(c);
  for_paged_copies(c, [&](const kvtest::paged_copy<T>& pc0, const kv::layer_inputs<T>&, const std::string& label) {
    CAPTURE(label);
    kvtest::paged_copy<T> pc = pc0;
    pc.in.pages.max_pages_per_row = c.S / pc.page_size;
    std::int64_t need = 0;  // a row that starts inside its first page may need one page more than S / page_size
    for (std::size_t r = 0; r + 1 < pc.indptr.size(); ++r) need = std::max<std::int64_t>(need, pc.indptr[r + 1] - pc.indptr[r]);
    if (need > pc.in.pages.max_pages_per_row) return;  // another capacity would split the keys differently: not comparable bit for bit
    if (pc.in.pages.start_offset) ++ps.start_runs;
    device_paged<T> dp(pc, c);
    const bool host_lengths = (ps.runs % 2) == 0;
    const auto got = gpu_run_inputs<P>(dp.in, host_lengths ? hl.data() : nullptr, p, budget);
    ++ps.runs;
    REQUIRE_MESSAGE(got.st.ok(), got.st.message());
    CHECK_MESSAGE(got.dev.ok(), got.dev.message());
    bool same = got.indptr == want.indptr && got.indices == want.indices && got.positions == want.positions;
    const std::int64_t rows = static_cast<std::int64_t>(want.indptr.size()) - 1, H = rows / c.B;
    for (std::int64_t r = 0; r < rows && same; ++r) {
      const int L = c.len_of(r / H, (r % H) / (H / c.Hkv));
      same = std::memcmp(&got.scores[static_cast<std::size_t>(r * c.S)], &want.scores[static_cast<std::size_t>(r * c.S)],
                         sizeof(float) * static_cast<std::size_t>(L)) == 0;
    }
    if (!same && ps.bad++ < 5) MESSAGE(name, " ", label, ": paged differs from contiguous");
    ps.kept += want.indptr.back();
  });
}

template <class T>
void run_paged_grid(paged_stats& ps) {
  auto c = make_case<T>(500u + static_cast<unsigned>(kv::dtype_of<T>::value), 2, 2, 2, 128, 8, 64, kv::kv_layout::hnd, false);
  c.lens = {128, 77};
  const auto tok = kv::budget_request::tokens(40);
  {
    using P = kv::presets::restkv;
    auto p = P::defaults();
    compare_paged<P>("restkv", c, p, tok, ps);
    p.scorer.aggregation = kv::scorers::output_reconstruction::mode::before;
    p.gqa = kv::gqa_reduction::per_query_head;
    compare_paged<P>("restkv before, per query head", c, p, tok, ps);
  }
  compare_paged<kv::presets::snapkv>("snapkv", c, kv::presets::snapkv::defaults(), tok, ps);
  {
    auto cl = c;
    cl.layer_idx = 3;
    cl.num_layers = 8;
    compare_paged<kv::presets::pyramidkv>("pyramidkv", cl, kv::presets::pyramidkv::defaults(), tok, ps);
  }
  compare_paged<kv::presets::adakv>("adakv", c, kv::presets::adakv::defaults(), tok, ps);
  {
    auto ch = make_case<T>(600u, 2, 2, 2, 128, 128, 64, kv::kv_layout::nhd, false);  // W = L
    compare_paged<kv::presets::h2o>("h2o", ch, kv::presets::h2o::defaults(), tok, ps);
  }
  compare_paged<kv::presets::tova>("tova", c, kv::presets::tova::defaults(), tok, ps);
  compare_paged<kv::presets::streaming_llm>("streaming_llm", c, kv::presets::streaming_llm::defaults(), tok, ps);
  compare_paged<kv::presets::key_norm>("key_norm", c, kv::presets::key_norm::defaults(), kv::budget_request::fraction(0.3), ps);
  compare_paged<kvevict_test::user_scorer_policy>("user value_norm", c, kvevict_test::user_scorer_policy::defaults(), tok, ps);
  {
    const auto art = make_tables(601u, 2, 2, 64, 32, kv::lkv_activation::silu, 1.0f);
    kv::cuda::lkv_device_tables tables;
    REQUIRE(tables.upload(art).ok());
    auto cl = c;
    cl.layer_idx = 1;
    cl.num_layers = 2;
    compare_paged<kv::lkv::full>("lkv full", cl, lkv_params<kv::lkv::full>(nullptr, &tables), kv::budget_request::fraction(0.3), ps);
  }
}

}  // namespace

TEST_CASE("cuda: paged views give the contiguous view's selections and scores, every preset") {
  paged_stats ps;
  run_paged_grid<float>(ps);
  run_paged_grid<kv::half_t>(ps);
  run_paged_grid<kv::bfloat16_t>(ps);
  MESSAGE("paged vs contiguous on the device: ", ps.runs, " runs (", ps.start_runs, " with start offsets), ", ps.kept,
          " kept tokens compared, ", ps.bad, " differing");
  CHECK(ps.bad == 0);
  CHECK(ps.runs > 300);
  CHECK(ps.start_runs > 20);
}

TEST_CASE("cuda: a protected prefix (pages.protected_prefix) is kept as sinks, as the contiguous view with num_sink = prefix") {
  auto c = make_case<float>(615, 2, 2, 2, 128, 8, 64, kv::kv_layout::hnd, false);
  c.lens = {128, 77};
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  kvtest::paged_copy<float> pc;
  kvtest::make_paged(hin, 16, kvtest::pool_layout::nhd, false, false, 9, pc, true);
  pc.in.pages.max_pages_per_row = c.S / 16;  // capacity S: the same key splits as the contiguous view
  const std::vector<std::int32_t> prefix = {32, 32};
  dbuf<std::int32_t> dprefix(prefix);
  auto run = [&](auto tag) {
    using P = decltype(tag);
    for (double f : {0.3, 0.6}) {
      CAPTURE(f);
      auto ref = P::defaults();
      ref.selector.num_sink = 32;
      const auto want = gpu_run<P>(c, ref, kv::budget_request::fraction(f));
      device_paged<float> dp(pc, c);
      dp.in.pages.protected_prefix = dprefix.p;
      const auto got = gpu_run_inputs<P>(dp.in, nullptr, P::defaults(), kv::budget_request::fraction(f));
      REQUIRE_MESSAGE(got.st.ok(), got.st.message());
      CHECK_MESSAGE(got.dev.ok(), got.dev.message());
      CHECK(got.indptr == want.indptr);
      CHECK(got.indices == want.indices);
      CHECK(got.capacity >= want.indptr.back());
    }
  };
  run(kv::presets::snapkv{});
  run(kv::presets::adakv{});
}

TEST_CASE("cuda: bad page tables and NaN in a used page land in the device status word") {
  using P = kv::presets::snapkv;
  auto c = make_case<float>(610, 2, 2, 1, 64, 8, 8, kv::kv_layout::hnd, false);
  c.lens = {64, 40};
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  kvtest::paged_copy<float> pc;
  kvtest::make_paged(hin, 16, kvtest::pool_layout::nhd, false, false, 3, pc, true);
  auto run = [&](kvtest::paged_copy<float> bad) {
    device_paged<float> dp(bad, c);
    return gpu_run_inputs<P>(dp.in, nullptr, P::defaults(), kv::budget_request::tokens(20));
  };
  auto expect = [](const gpu_result& r, kv::errc code, const char* text) {
    REQUIRE_MESSAGE(r.st.ok(), r.st.message());
    INFO(r.dev.message());
    CHECK(r.dev.code() == code);
    CHECK(std::string(r.dev.message()).find(text) != std::string::npos);
  };
  CHECK(run(pc).dev.ok());
  {
    auto b = pc;
    b.indices[5] = b.indices[1];  // row 1's second page repeats row 0's
    expect(run(b), kv::errc::invalid_argument, "repeats a page");
  }
  {
    auto b = pc;
    b.indices[2] = static_cast<std::int32_t>(pc.num_pages);
    expect(run(b), kv::errc::invalid_argument, "is outside [0, num_pages)");
  }
  {
    auto b = pc;
    b.last_page_len[1] = 0;
    expect(run(b), kv::errc::invalid_argument, "pages.last_page_len[1] = 0");
  }
  {
    auto b = pc;  // NaN in a used slot: sequence 1, head 0, token 3
    b.kpool[static_cast<std::size_t>(b.indices[static_cast<std::size_t>(b.indptr[1])] * pc.in.keys.stride[0] + 3 * pc.in.keys.stride[2])] = std::nanf("");
    expect(run(b), kv::errc::non_finite_input, "keys(b=1, h=0, row 3)");
  }
}

namespace {

/// The host's expectation of a compaction's result: pages kept and last_page_len per table row,
/// lengths per (b, h), the freed pages (ascending).
struct paged_expect {
  std::vector<std::int32_t> pages_kept, last_page_len, lengths, freed;
};
template <class T>
paged_expect expect_result(const kvtest::paged_copy<T>& pc, const case_meta& c, const std::vector<std::int32_t>& ip, bool per_sequence_set) {
  paged_expect e;
  const int H = c.Hkv, ps = static_cast<int>(pc.page_size);
  const bool per_head = pc.in.pages.per_head;
  const int R = per_head ? c.B * H : c.B;
  auto kept = [&](int b, int h) { const int r = per_sequence_set ? b : b * H + h; return ip[r + 1] - ip[r]; };
  std::vector<int> state(static_cast<std::size_t>(pc.num_pages), 0);
  for (int r = 0; r < R; ++r) {
    const int b = per_head ? r / H : r, h = per_head ? r % H : 0;
    int len = 0;
    for (int hh = per_head ? h : 0; hh < (per_head ? h + 1 : H); ++hh) len = std::max(len, c.len_of(b, hh));
    const int st = pc.in.pages.start_offset ? pc.starts[static_cast<std::size_t>(r)] : 0;  // table position of slot 0
    const int k = kept(b, h), np = k == 0 ? 0 : (st + k + ps - 1) / ps, used = len == 0 ? 0 : (st + len + ps - 1) / ps;
    e.pages_kept.push_back(np);
    e.last_page_len.push_back(k == 0 ? 0 : st + k - (np - 1) * ps);
    for (int i = 0; i < used; ++i) state[static_cast<std::size_t>(pc.indices[static_cast<std::size_t>(pc.indptr[r] + i)])] |= i < np ? 1 : 2;
  }
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < H; ++h) e.lengths.push_back(kept(b, h));
  for (std::size_t p = 0; p < state.size(); ++p)
    if (state[p] == 2) e.freed.push_back(static_cast<std::int32_t>(p));
  return e;
}

/// cuda::compact_paged of a paged copy by the selection (ip, ix); returns the device status and,
/// when it is ok, checks the pools (verify_compacted) and the result against expect_result.
template <class T>
kv::status device_compact(const kvtest::paged_copy<T>& pc, const host_case<T>& c, const kv::layer_inputs<T>& hin,
                          const std::vector<std::int32_t>& ip, const std::vector<std::int32_t>& ix, bool per_sequence_set, long& moved,
                          long& bad, std::int64_t freed_capacity = -1, const std::int32_t* prefix = nullptr) {
  device_paged<T> dp(pc, c);
  dbuf<std::int32_t> dprefix(static_cast<std::size_t>(c.B));
  if (prefix) {
    CUDA_OK(cudaMemcpy(dprefix.p, prefix, sizeof(std::int32_t) * static_cast<std::size_t>(c.B), cudaMemcpyHostToDevice));
    dp.in.pages.protected_prefix = dprefix.p;
  }
  kv::paged_cache<T> cache;
  cache.keys = kv::kv_view<T>{};
  cache.values = kv::kv_view<T>{};
  for (int k = 0; k < 4; ++k) {
    cache.keys.extent[k] = cache.values.extent[k] = dp.in.keys.extent[k];
    cache.keys.stride[k] = cache.values.stride[k] = dp.in.keys.stride[k];
  }
  cache.keys.data = dp.k.p;
  cache.values.data = dp.v.p;
  cache.pages = dp.in.pages;
  cache.lengths = dp.in.lengths;
  dbuf<std::int32_t> sip(ip), six(ix);
  const std::int64_t R = dp.in.pages.rows(c.Hkv), cap = freed_capacity >= 0 ? freed_capacity : static_cast<std::int64_t>(pc.indices.size());
  const std::vector<std::int32_t> sentinel(static_cast<std::size_t>(std::max<std::int64_t>(R, std::max<std::int64_t>(cap, c.B * c.Hkv))), -9);
  dbuf<std::int32_t> pk(sentinel), lp(sentinel), ln(sentinel), fr(sentinel);
  dbuf<std::int64_t> nf(1);
  kv::paged_compaction_result out;
  out.pages_kept = pk.p;
  out.last_page_len = lp.p;
  out.lengths = ln.p;
  out.freed_pages = fr.p;
  out.freed_capacity = cap;
  out.num_freed = nf.p;
  dbuf<unsigned char> ws(kv::cuda::compact_paged_workspace_size(cache));
  const kv::status st = kv::cuda::compact_paged(cache, kv::const_selection_view(sip.p, six.p, static_cast<std::int64_t>(ip.size()) - 1), out,
                                                ws.p, ws.n);
  REQUIRE_MESSAGE(st.ok(), st.message());
  const kv::status dev = kv::cuda::read_device_status(kv::cuda::compact_paged_status(ws.p));
  const auto kpool = dp.k.get(pc.kpool.size()), vpool = dp.v.get(pc.vpool.size());
  // kvevict::cpu::compact_paged on a host copy: the same verdict, pools and result (freed pages sorted)
  kvtest::paged_copy<T> hc = pc;
  kv::paged_cache<T> hcache = cache;
  hcache.keys.data = hc.kpool.data();
  hcache.values.data = hc.vpool.data();
  hcache.pages.indptr = hc.indptr.data();
  hcache.pages.indices = hc.indices.data();
  hcache.pages.last_page_len = pc.in.pages.last_page_len ? hc.last_page_len.data() : nullptr;
  hcache.pages.start_offset = pc.in.pages.start_offset ? hc.starts.data() : nullptr;
  hcache.pages.protected_prefix = prefix;
  if (cache.lengths.data) hcache.lengths = kv::per_head_lengths(hc.lens.data(), c.B, c.Hkv);
  std::vector<std::int32_t> hpk(static_cast<std::size_t>(R)), hlp(static_cast<std::size_t>(R)), hln(static_cast<std::size_t>(c.B) * c.Hkv),
      hfr(static_cast<std::size_t>(std::max<std::int64_t>(cap, 1)));
  std::int64_t hnf = -1;
  kv::paged_compaction_result hout{hpk.data(), hlp.data(), hln.data(), hfr.data(), cap, &hnf};
  const kv::status cpu = kvevict_test::cpu_compact_paged(hcache, kv::const_selection_view(ip.data(), ix.data(), static_cast<std::int64_t>(ip.size()) - 1), hout);
  CHECK_MESSAGE(cpu.code() == dev.code(), "cpu: ", cpu.message(), " / cuda: ", dev.message());
  if (!dev.ok()) {  // untouched: the pools and the result buffers
    bad += std::memcmp(kpool.data(), pc.kpool.data(), kpool.size() * sizeof(T)) != 0;
    bad += std::memcmp(vpool.data(), pc.vpool.data(), vpool.size() * sizeof(T)) != 0;
    bad += pk.get(sentinel.size()) != sentinel || fr.get(sentinel.size()) != sentinel;
    return dev;
  }
  if (cpu.ok()) {
    bad += std::memcmp(kpool.data(), hc.kpool.data(), kpool.size() * sizeof(T)) != 0;
    bad += std::memcmp(vpool.data(), hc.vpool.data(), vpool.size() * sizeof(T)) != 0;
    std::vector<std::int32_t> hf(hfr.begin(), hfr.begin() + std::max<std::int64_t>(hnf, 0));
    std::sort(hf.begin(), hf.end());
    bad += pk.get(static_cast<std::size_t>(R)) != hpk || lp.get(static_cast<std::size_t>(R)) != hlp || ln.get(hln.size()) != hln;
    bad += fr.get(hf.size()) != hf || nf.get(1)[0] != hnf;
  }
  bad += verify_compacted(pc, kpool, vpool, hin, ip, ix, per_sequence_set, moved);
  const paged_expect e = expect_result(pc, c, ip, per_sequence_set);
  const std::int64_t n = nf.get(1)[0];
  bad += pk.get(static_cast<std::size_t>(R)) != e.pages_kept;
  bad += lp.get(static_cast<std::size_t>(R)) != e.last_page_len;
  bad += ln.get(e.lengths.size()) != e.lengths;
  bad += n != static_cast<std::int64_t>(e.freed.size()) || fr.get(e.freed.size()) != e.freed;
  return dev;
}

}  // namespace

namespace {

/// A paged copy built by hand (HND pool of P pages, last_page_len from the lengths): rows[r] is table
/// row r's page list (per-sequence rows, or per (sequence, KV head) with per_head, pages spanning
/// every head). Pages may repeat across rows (shared prefix pages, or per-head rows sharing a page
/// id in different head slots); every row writes its tokens from hin, so shared tokens must be equal.
template <class T>
void hand_paged(const kv::layer_inputs<T>& hin, int ps, bool per_head, const std::vector<std::vector<std::int32_t>>& rows, int P,
                kvtest::paged_copy<T>& out) {
  const int B = static_cast<int>(hin.batch()), H = static_cast<int>(hin.kv_heads()), d = static_cast<int>(hin.head_dim());
  out.indptr.assign(1, 0);
  out.indices.clear();
  std::int64_t maxp = 0;
  for (const auto& r : rows) {
    out.indices.insert(out.indices.end(), r.begin(), r.end());
    out.indptr.push_back(static_cast<std::int32_t>(out.indices.size()));
    maxp = std::max<std::int64_t>(maxp, static_cast<std::int64_t>(r.size()));
  }
  out.num_pages = P;
  out.page_size = ps;
  const T nan = kv::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  out.kpool.assign(static_cast<std::size_t>(P) * H * ps * d, nan);
  out.vpool = out.kpool;
  const auto kvw = kvtest::paged_copy<T>::pool_view(out.kpool, P, H, ps, d, kvtest::pool_layout::hnd, false);
  out.last_page_len.clear();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int r = per_head ? b * H + h : b;
      for (int t = 0; t < hin.length(b, h); ++t)
        for (int c = 0; c < d; ++c) {
          const std::int64_t o = rows[static_cast<std::size_t>(r)][static_cast<std::size_t>(t / ps)] * kvw.stride[0] + h * kvw.stride[1] +
                                 (t % ps) * kvw.stride[2] + c;
          out.kpool[static_cast<std::size_t>(o)] = hin.keys(b, h, t, c);
          out.vpool[static_cast<std::size_t>(o)] = hin.values(b, h, t, c);
        }
    }
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const int b = per_head ? static_cast<int>(r) / H : static_cast<int>(r), h = per_head ? static_cast<int>(r) % H : 0;
    const int L = static_cast<int>(hin.length(b, h));
    out.last_page_len.push_back(L == 0 ? 0 : L - (L - 1) / ps * ps);
  }
  out.in = hin;
  out.in.keys = kvw;
  out.in.values = kvtest::paged_copy<T>::pool_view(out.vpool, P, H, ps, d, kvtest::pool_layout::hnd, false);
  out.in.pages = kv::page_table_view{};
  out.in.pages.indptr = out.indptr.data();
  out.in.pages.indices = out.indices.data();
  out.in.pages.last_page_len = out.last_page_len.data();
  out.in.pages.batch = B;
  out.in.pages.max_pages_per_row = maxp;
  out.in.pages.per_head = per_head;
  out.in.lengths = {};
}

}  // namespace

TEST_CASE("cuda: compact_paged with shared prefix pages and page ids shared by the heads of a sequence equals the CPU") {
  long moved = 0, bad = 0;
  {  // two sequences share their first 2 pages (a protected prefix of 8 tokens); mode a
    auto c = make_case<float>(630, 2, 2, 1, 16, 4, 8, kv::kv_layout::hnd, false);
    c.lens = {16, 13};
    for (int h = 0; h < 2; ++h)  // sequence 1's prefix tokens are sequence 0's
      for (int t = 0; t < 8; ++t)
        for (int x = 0; x < 8; ++x) {
          const std::size_t o0 = ((static_cast<std::size_t>(0) * 2 + h) * 16 + t) * 8 + x, o1 = ((static_cast<std::size_t>(1) * 2 + h) * 16 + t) * 8 + x;
          c.k[o1] = c.k[o0];
          c.v[o1] = c.v[o0];
        }
    const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
    kvtest::paged_copy<float> pc;
    hand_paged(hin, 4, false, {{3, 0, 5, 7}, {3, 0, 2, 6}}, 9, pc);
    const std::int32_t prefix[2] = {8, 8};
    const std::vector<std::int32_t> ip = {0, 10, 20, 30, 40};
    std::vector<std::int32_t> ix;
    for (int r = 0; r < 4; ++r) ix.insert(ix.end(), {0, 1, 2, 3, 4, 5, 6, 7, 9, 12});  // keeps the prefix; row 0 frees 1 page
    CHECK(device_compact(pc, c, hin, ip, ix, false, moved, bad, -1, prefix).ok());
    const paged_expect e = expect_result(pc, c, ip, false);
    CHECK(e.freed == std::vector<std::int32_t>{6, 7});  // never the shared pages 3 and 0
  }
  {  // per-head tables over pages of every head: heads 0 and 1 of sequence 0 share page ids 4 and 1
    auto c = make_case<float>(631, 1, 2, 1, 12, 4, 8, kv::kv_layout::hnd, false);
    c.lens = {12};
    const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
    kvtest::paged_copy<float> pc;
    hand_paged(hin, 4, true, {{4, 1, 2}, {4, 1, 3}}, 6, pc);
    const std::vector<std::int32_t> ip = {0, 3, 9}, ix = {0, 5, 11, 0, 1, 2, 6, 8, 10};  // head 0 keeps 1 page, head 1 two
    CHECK(device_compact(pc, c, hin, ip, ix, false, moved, bad).ok());
    const paged_expect e = expect_result(pc, c, ip, false);
    CHECK(e.freed == std::vector<std::int32_t>{2, 3});  // page 1 stays: head 1 still keeps tokens in it
  }
  CHECK(bad == 0);
  CHECK(moved > 0);
}

TEST_CASE("cuda: a malformed page-table or selection indptr is reported, never followed") {
  using P = kv::presets::snapkv;
  auto c = make_case<float>(640, 2, 2, 1, 64, 8, 8, kv::kv_layout::hnd, false);
  c.lens = {64, 40};
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  kvtest::paged_copy<float> pc;
  kvtest::make_paged(hin, 16, kvtest::pool_layout::nhd, false, false, 3, pc, true);
  auto run = [&](const kvtest::paged_copy<float>& bad) {
    device_paged<float> dp(bad, c);
    return gpu_run_inputs<P>(dp.in, nullptr, P::defaults(), kv::budget_request::tokens(20));
  };
  {
    auto b = pc;  // a slice of a larger table: indptr starts at 100 (indices holds 7 entries)
    for (auto& x : b.indptr) x += 100;
    const auto r = run(b);
    REQUIRE(r.st.ok());
    CHECK(r.dev.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.dev.message()).find("pages.indptr[0] = 100 must be 0") != std::string::npos);
  }
  {
    auto b = pc;  // a decreasing row: row 1 would read 4 entries before row 0's start
    b.indptr = {0, 4, 0};
    const auto r = run(b);
    REQUIRE(r.st.ok());
    CHECK(r.dev.code() == kv::errc::invalid_argument);
    CHECK(std::string(r.dev.message()).find("holds -4 pages") != std::string::npos);
  }
  {
    long m = 0, bad = 0;
    std::vector<std::int32_t> ip = {100, 104, 108, 112, 116}, ix(16, 0);
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 4; ++i) ix[static_cast<std::size_t>(r * 4 + i)] = i;
    const auto dev = device_compact(pc, c, hin, ip, ix, false, m, bad);
    CHECK(dev.code() == kv::errc::invalid_argument);
    CHECK(std::string(dev.message()).find("selection indptr[0] = 100 must be 0") != std::string::npos);
    CHECK(bad == 0);
  }
}

TEST_CASE("cuda: compact_paged equals a naive gather in modes a, b and c; freed pages; errors leave the cache untouched") {
  long moved = 0, bad = 0, runs = 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto c = make_case<T>(620, 2, 2, 1, 150, 8, 24, kv::kv_layout::nhd, false);
    c.per_head = true;
    c.lens = {150, 150, 97, 61};
    for_paged_copies(c, [&](const kvtest::paged_copy<T>& pc, const kv::layer_inputs<T>& hin, const std::string& label) {
      CAPTURE(label);
      std::vector<std::int32_t> ip;
      auto ix = random_selection(c, static_cast<std::uint64_t>(runs) + 17, c.Hkv, !pc.in.pages.per_head, 2, ip);
      CHECK(device_compact(pc, c, hin, ip, ix, false, moved, bad).ok());
      ix = random_selection(c, static_cast<std::uint64_t>(runs) + 29, 1, false, 0, ip);
      CHECK(device_compact(pc, c, hin, ip, ix, true, moved, bad).ok());
      runs += 2;
    });
  };
  run(float{});
  run(kv::bfloat16_t{});
  CHECK(bad == 0);
  CHECK(runs > 100);
  MESSAGE("device compact_paged: ", runs, " runs, ", moved, " elements compared");

  // errors: nothing written
  auto c = make_case<float>(621, 2, 2, 1, 64, 8, 8, kv::kv_layout::nhd, false);
  c.lens = {64, 40};
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  kvtest::paged_copy<float> pc;
  kvtest::make_paged(hin, 16, kvtest::pool_layout::hnd, false, false, 5, pc, true);
  // explicit selections: every row keeps slots {0, 1, 5, 9} (row 0 frees 3 of its 4 pages)
  const std::vector<std::int32_t> ip = {0, 4, 8, 12, 16};
  std::vector<std::int32_t> ix;
  for (int r = 0; r < 4; ++r) ix.insert(ix.end(), {0, 1, 5, 9});
  long m2 = 0, bad2 = 0;
  CHECK(device_compact(pc, c, hin, ip, ix, false, m2, bad2).ok());
  auto expect_error = [&](const kv::status& dev, kv::errc code, const char* text) {
    INFO(dev.message());
    CHECK(dev.code() == code);
    CHECK(std::string(dev.message()).find(text) != std::string::npos);
  };
  {
    const std::int32_t prefix[2] = {3, 3};  // slot 2 of the protected prefix is dropped
    expect_error(device_compact(pc, c, hin, ip, ix, false, m2, bad2, -1, prefix), kv::errc::invalid_argument, "protected prefix");
  }
  {
    const std::vector<std::int32_t> ipu = {0, 3, 5, 6, 7}, ixu = {0, 1, 2, 0, 1, 0, 0};  // sequence 0 keeps 3 and 2
    expect_error(device_compact(pc, c, hin, ipu, ixu, false, m2, bad2), kv::errc::invalid_argument, "keeps 3 tokens in KV head 0 and 2");
  }
  {
    auto ixb = ix;
    ixb[3] = 64;  // sequence 0 holds 64 tokens
    expect_error(device_compact(pc, c, hin, ip, ixb, false, m2, bad2), kv::errc::invalid_argument, "selection index 64 of row 0");
  }
  expect_error(device_compact(pc, c, hin, ip, ix, false, m2, bad2, 0), kv::errc::insufficient_capacity, "pages become free");
  {
    auto b = pc;
    b.indices[4] = b.indices[0];  // sequence 1's first page is sequence 0's
    expect_error(device_compact(b, c, hin, ip, ix, false, m2, bad2), kv::errc::invalid_argument, "repeats a page");
  }
  CHECK(bad2 == 0);
}

// ---- sharded eviction (run_sharded, docs/distributed.md) over in-process thread ranks ----

namespace {

/// The case's KV heads `heads` (in that order) as a case of their own (HND layout): K, V, each
/// head's G query heads and W_O blocks, per-head lengths, positions.
template <class T>
host_case<T> slice_heads(const host_case<T>& c, const std::vector<std::int32_t>& heads) {
  host_case<T> s = c;
  const int Hl = static_cast<int>(heads.size()), G = c.G;
  const std::size_t sd = static_cast<std::size_t>(c.S) * c.d, wd = static_cast<std::size_t>(c.W) * c.d, dd = static_cast<std::size_t>(c.d) * c.d;
  s.Hkv = Hl;
  s.per_head = true;
  s.k.assign(static_cast<std::size_t>(c.B) * Hl * sd, T{});
  s.v = s.k;
  s.q.assign(static_cast<std::size_t>(c.B) * Hl * G * wd, T{});
  s.wo.assign(static_cast<std::size_t>(Hl) * G * dd, 0.0f);
  s.lens.assign(static_cast<std::size_t>(c.B) * Hl, 0);
  s.pos.assign(static_cast<std::size_t>(c.B) * Hl * c.S, 0);
  for (int b = 0; b < c.B; ++b)
    for (int i = 0; i < Hl; ++i) {
      const std::size_t h = static_cast<std::size_t>(heads[static_cast<std::size_t>(i)]), src = static_cast<std::size_t>(b) * c.Hkv + h,
                        dst = static_cast<std::size_t>(b) * Hl + static_cast<std::size_t>(i);
      std::copy_n(c.k.begin() + src * sd, sd, s.k.begin() + dst * sd);
      std::copy_n(c.v.begin() + src * sd, sd, s.v.begin() + dst * sd);
      std::copy_n(c.pos.begin() + src * c.S, c.S, s.pos.begin() + dst * c.S);
      s.lens[dst] = c.len_of(b, static_cast<std::int64_t>(h));
      for (int g = 0; g < G; ++g)
        std::copy_n(c.q.begin() + (src * G + g) * wd, wd, s.q.begin() + (dst * G + g) * wd);
    }
  for (int i = 0; i < Hl; ++i)
    for (int g = 0; g < G; ++g)
      std::copy_n(c.wo.begin() + (static_cast<std::size_t>(heads[static_cast<std::size_t>(i)]) * G + g) * dd, dd,
                  s.wo.begin() + (static_cast<std::size_t>(i) * G + g) * dd);
  return s;
}

/// Global KV heads per rank: `ranks` groups of Hkv heads, blocks (Megatron-style) or dealt
/// round-robin in reverse order (any order is allowed).
std::vector<std::vector<std::int32_t>> shard_layout(int Hkv, int ranks, bool dealt) {
  std::vector<std::vector<std::int32_t>> heads(static_cast<std::size_t>(ranks));
  for (int h = 0; h < Hkv; ++h) {
    const int r = dealt ? h % ranks : h * ranks / Hkv;
    auto& v = heads[static_cast<std::size_t>(r)];
    if (dealt) v.insert(v.begin(), h);
    else v.push_back(h);
  }
  return heads;
}

/// Local row (b, i) of a rank holding `heads` (gout out rows per KV head) as a global row.
std::int64_t global_row_of(const std::vector<std::int32_t>& heads, int global_kv_heads, int gout, std::int64_t local_row) {
  const std::int64_t H = static_cast<std::int64_t>(heads.size()) * gout, b = local_row / H, h = local_row % H;
  return b * global_kv_heads * gout + static_cast<std::int64_t>(heads[static_cast<std::size_t>(h / gout)]) * gout + h % gout;
}

/// Every local row of a rank equals its global row in a single-process result (indices; scores
/// bit for bit when given).
void check_rows_equal(const std::vector<std::int32_t>& heads, int global_kv_heads, int gout, std::int64_t S,
                      const std::vector<std::int32_t>& lp, const std::vector<std::int32_t>& li, const std::vector<float>* ls,
                      const std::vector<std::int32_t>& gp, const std::vector<std::int32_t>& gi, const std::vector<float>* gs) {
  const std::int64_t rows = static_cast<std::int64_t>(lp.size()) - 1;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t g = global_row_of(heads, global_kv_heads, gout, r);
    CAPTURE(r);
    CAPTURE(g);
    const std::vector<std::int32_t> a(li.begin() + lp[static_cast<std::size_t>(r)], li.begin() + lp[static_cast<std::size_t>(r) + 1]);
    const std::vector<std::int32_t> e(gi.begin() + gp[static_cast<std::size_t>(g)], gi.begin() + gp[static_cast<std::size_t>(g) + 1]);
    CHECK(a == e);
    if (ls && gs)
      CHECK(std::equal(ls->begin() + r * S, ls->begin() + (r + 1) * S, gs->begin() + g * S));
  }
}

}  // namespace

TEST_CASE("host: the thread-rank harness drives the CPU run_sharded to the single-process selection (AdaKV, PyramidKV; 1-4 ranks)") {
  // The harness of the CUDA sharded test below (slice_heads, shard_layout, the thread
  // communicator, the row mapping) checked on the CPU backend, which runs without a device.
  auto c = make_case<float>(901, 2, 4, 2, 150, 8, 16, kv::kv_layout::hnd, false);
  c.per_head = true;
  c.lens = {150, 121, 97, 150, 64, 150, 150, 33};
  const auto budget = kv::budget_request::fraction(0.3);
  const auto hin = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  auto check_policy = [&](auto tag) {
    using P = decltype(tag);
    const auto p = P::defaults();
    const cpu_result whole = kvevict_test::cpu_run<P, float>(hin, p, budget);
    REQUIRE_MESSAGE(whole.st.ok(), whole.st.message());
    for (int ranks = 1; ranks <= 4; ++ranks)
      for (bool dealt : {false, true}) {
        CAPTURE(ranks);
        CAPTURE(dealt);
        const auto heads = shard_layout(c.Hkv, ranks, dealt);
        std::vector<host_case<float>> parts;
        for (const auto& hs : heads) parts.push_back(slice_heads(c, hs));
        std::vector<cpu_result> got(static_cast<std::size_t>(ranks));
        kvevict_test::thread_group group(ranks);
        kvevict_test::run_ranks(ranks, [&](int r) {
          kvevict_test::thread_communicator comm(&group, r);
          const auto& pc = parts[static_cast<std::size_t>(r)];
          const auto& hs = heads[static_cast<std::size_t>(r)];
          const kv::distributed::shard sh{c.Hkv, hs.data(), static_cast<std::int32_t>(hs.size())};
          got[static_cast<std::size_t>(r)] = kvevict_test::cpu_run_sharded<P, float>(
              pc.views(pc.k.data(), pc.v.data(), pc.q.data(), pc.wo.data(), pc.lens.data(), pc.pos.data()), p, budget, &comm, sh);
        });
        std::int64_t kept = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto& g = got[static_cast<std::size_t>(r)];
          REQUIRE_MESSAGE(g.st.ok(), g.st.message());
          check_rows_equal(heads[static_cast<std::size_t>(r)], c.Hkv, 1, c.S, g.indptr, g.indices, &g.scores, whole.indptr, whole.indices,
                           &whole.scores);
          kept += g.indptr.back();
        }
        CHECK(kept == whole.indptr.back());  // budgets sum exactly
      }
  };
  check_policy(kv::presets::adakv{});
  check_policy(kv::presets::pyramidkv{});
}

TEST_CASE("host: CUDA plan(sharded) and run_sharded's host-side refusals (no device needed)") {
  auto c = make_case<float>(902, 1, 2, 2, 64, 8, 16, kv::kv_layout::hnd, false);
  // device pointers are never read on these paths: host copies stand in for them
  const auto in = c.views(c.k.data(), c.v.data(), c.q.data(), c.wo.data(), c.lens.data(), c.pos.data());
  const auto budget = kv::budget_request::fraction(0.3);
  const std::vector<std::int32_t> hl = host_lengths_of(c);
  kv::plan_options opt;
  opt.host_lengths = hl.data();
  opt.sharded = true;
  SUBCASE("AdaKV: a sharded plan bounds every row by its length; run() refuses it, run_sharded refuses a plain plan on every rank") {
    kv::evictor<kv::presets::adakv, kv::cuda::backend> ev;
    kv::eviction_plan pl;
    REQUIRE(ev.plan(in, budget, &pl, opt).ok());
    CHECK(pl.sharded);
    CHECK_FALSE(pl.max_selected_exact);
    CHECK(pl.max_selected == static_cast<std::int64_t>(c.lens[0]) * c.Hkv);
    std::vector<std::int32_t> indptr(3), indices(static_cast<std::size_t>(pl.max_selected));
    std::vector<unsigned char> ws(pl.workspace_bytes);
    kv::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = indices.data();
    sel.capacity = pl.max_selected;
    const kv::status r1 = ev.run(pl, in, sel, ws.data(), ws.size());
    CHECK(r1.code() == kv::errc::invalid_argument);
    CHECK(std::string(r1.message()).find("call run_sharded()") != std::string::npos);
    kv::eviction_plan plain;
    REQUIRE(ev.plan(in, budget, &plain).ok());
    const std::vector<std::int32_t> heads = {1, 0};
    const kv::distributed::shard sh{2, heads.data(), 2};
    kv::distributed::self_communicator self;
    kv::distributed::exchange_stats stats;
    const kv::status r2 = ev.run_sharded(plain, in, &self, sh, sel, ws.data(), ws.size(), nullptr, &stats);
    CHECK(r2.code() == kv::errc::invalid_argument);
    CHECK(std::string(r2.message()).find("plan_options::sharded") != std::string::npos);
    CHECK(stats.rounds == 1);  // the error travelled in round 1
    CHECK(ev.run_sharded(pl, in, nullptr, sh, sel, ws.data(), ws.size()).code() == kv::errc::null_pointer);
    // a bad shard is this rank's round-1 error (before anything is enqueued)
    const std::vector<std::int32_t> twice = {1, 1};
    const kv::status r3 = ev.run_sharded(pl, in, &self, kv::distributed::shard{2, twice.data(), 2}, sel, ws.data(), ws.size());
    CHECK(r3.code() == kv::errc::invalid_argument);
    CHECK(std::string(r3.message()).find("a head held twice") != std::string::npos);
    CHECK(indptr == std::vector<std::int32_t>(3, 0));  // nothing written
  }
  SUBCASE("gqa = layer_mean cannot be sharded") {
    auto p = kv::presets::snapkv::defaults();
    p.gqa = kv::gqa_reduction::layer_mean;
    kv::evictor<kv::presets::snapkv, kv::cuda::backend> ev(p);
    kv::eviction_plan pl;
    CHECK(ev.plan(in, budget, &pl, opt).code() == kv::errc::not_supported);
  }
  SUBCASE("LKV-H: a sharded plan takes the whole model's table (more KV heads than this rank's)") {
    using P = kv::lkv::full;
    auto p = P::defaults();
    p.scorer.weights = c.wo.data();  // never read by plan()
    p.scorer.num_layers = 1;
    p.scorer.kv_heads = 2;
    p.scorer.head_dim = 16;
    p.scorer.hidden = 4;
    p.scorer.on_device = true;
    const std::vector<double> ratios(8, 0.125);
    p.budgeter.logits = c.wo.data();
    p.budgeter.num_layers = 1;
    p.budgeter.kv_heads = 8;  // the global layer: 8 KV heads, 2 on this rank
    p.budgeter.on_device = true;
    p.budgeter.ratios = ratios.data();
    p.budgeter.ratios_temperature = p.budgeter.temperature;
    kv::evictor<P, kv::cuda::backend> ev(p);
    auto nq = c;
    nq.no_queries = true;
    const auto in2 = nq.views(c.k.data(), c.v.data(), nullptr, nullptr, c.lens.data(), c.pos.data());
    kv::eviction_plan pl;
    const kv::status sp = ev.plan(in2, budget, &pl, opt);
    CHECK_MESSAGE(sp.ok(), sp.message());
    kv::plan_options plain = opt;
    plain.sharded = false;
    CHECK(ev.plan(in2, budget, &pl, plain).code() == kv::errc::shape_mismatch);  // unsharded, the table must be the layer's
  }
}

namespace {

/// A memory_space::device communicator over a thread_group (an NCCL stand-in): the collectives
/// take device buffers and have completed when they return.
class device_thread_communicator final : public kv::distributed::communicator {
 public:
  device_thread_communicator(kvevict_test::thread_group* g, int rank) : host_(g, rank) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  kv::distributed::memory_space space() const override { return kv::distributed::memory_space::device; }
  kv::status all_reduce_sum(std::int64_t* data, std::int64_t count) override {
    std::vector<std::int64_t> h(static_cast<std::size_t>(count));
    if (cudaMemcpy(h.data(), data, h.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) device_errors++;
    KVEVICT_TRY(host_.all_reduce_sum(h.data(), count));
    if (cudaMemcpy(data, h.data(), h.size() * 8, cudaMemcpyHostToDevice) != cudaSuccess) device_errors++;
    return {};
  }
  kv::status all_gather(const std::int64_t* send, std::int64_t count, std::int64_t* recv) override {
    std::vector<std::int64_t> h(static_cast<std::size_t>(count)), all(static_cast<std::size_t>(count * size()));
    if (cudaMemcpy(h.data(), send, h.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) device_errors++;
    KVEVICT_TRY(host_.all_gather(h.data(), count, all.data()));
    if (cudaMemcpy(recv, all.data(), all.size() * 8, cudaMemcpyHostToDevice) != cudaSuccess) device_errors++;
    return {};
  }
  int device_errors = 0;

 private:
  kvevict_test::thread_communicator host_;
};

/// One rank's device state for a sharded CUDA run (allocated on the calling thread).
template <class T>
struct sharded_rank {
  host_case<T> part;
  std::vector<std::int32_t> heads;
  std::unique_ptr<dbuf<T>> k, v, q;
  std::unique_ptr<dbuf<float>> wo, scores;
  std::unique_ptr<dbuf<std::int32_t>> lens, pos, indptr, indices;
  std::unique_ptr<dbuf<unsigned char>> ws;
  kv::status st;
  kv::distributed::exchange_stats stats;
  std::vector<std::int32_t> got_indptr, got_indices;
  std::vector<float> got_scores;
};

/// run_sharded of policy P on `ranks` thread ranks (one stream each) over the heads of c;
/// params_of(rank, heads) gives a rank's params; `edit(rank, part)` may spoil a rank's inputs.
/// Fills each rank's status and (on success) its selection and scores.
template <class P, class T, class Params, class Edit>
std::vector<sharded_rank<T>> gpu_run_sharded(const host_case<T>& c, const std::vector<std::vector<std::int32_t>>& heads, Params params_of,
                                             kv::budget_request budget, bool device_comm, Edit edit) {
  const int ranks = static_cast<int>(heads.size());
  std::vector<sharded_rank<T>> rs(static_cast<std::size_t>(ranks));
  std::vector<kv::eviction_plan> plans(static_cast<std::size_t>(ranks));
  std::vector<kv::layer_inputs<T>> ins(static_cast<std::size_t>(ranks));
  std::vector<std::int64_t> caps(static_cast<std::size_t>(ranks));
  std::vector<typename P::params> params;  // built here: params_of may assert (never inside a rank thread)
  for (int r = 0; r < ranks; ++r) {
    auto& x = rs[static_cast<std::size_t>(r)];
    x.heads = heads[static_cast<std::size_t>(r)];
    x.part = slice_heads(c, x.heads);
    edit(r, x.part);
    x.k.reset(new dbuf<T>(x.part.k));
    x.v.reset(new dbuf<T>(x.part.v));
    x.q.reset(new dbuf<T>(x.part.q));
    x.wo.reset(new dbuf<float>(x.part.wo));
    x.lens.reset(new dbuf<std::int32_t>(x.part.lens));
    x.pos.reset(new dbuf<std::int32_t>(x.part.pos));
    ins[static_cast<std::size_t>(r)] = x.part.views(x.k->p, x.v->p, x.q->p, x.wo->p, x.lens->p, x.pos->p);
    params.push_back(params_of(r, x.heads));
    kv::evictor<P, kv::cuda::backend> ev(params.back());
    const std::vector<std::int32_t> hl = host_lengths_of(x.part);
    kv::plan_options opt;
    opt.host_lengths = hl.data();
    opt.sharded = true;
    const kv::status ps = ev.plan(ins[static_cast<std::size_t>(r)], budget, &plans[static_cast<std::size_t>(r)], opt);
    REQUIRE_MESSAGE(ps.ok(), ps.message());
    const auto& pl = plans[static_cast<std::size_t>(r)];
    caps[static_cast<std::size_t>(r)] = pl.max_selected;
    x.indptr.reset(new dbuf<std::int32_t>(static_cast<std::size_t>(pl.rows + 1)));
    x.indices.reset(new dbuf<std::int32_t>(static_cast<std::size_t>(std::max<std::int64_t>(1, pl.max_selected))));
    x.scores.reset(new dbuf<float>(static_cast<std::size_t>(pl.rows * c.S)));
    x.ws.reset(new dbuf<unsigned char>(pl.workspace_bytes));
    CUDA_OK(cudaMemset(x.indptr->p, 0xff, x.indptr->n * sizeof(std::int32_t)));
  }
  CUDA_OK(cudaDeviceSynchronize());  // the copies and the memset above, before the ranks' non-blocking streams
  kvevict_test::thread_group group(ranks);
  kvevict_test::run_ranks(ranks, [&](int r) {
    auto& x = rs[static_cast<std::size_t>(r)];
    cudaStream_t s = nullptr;
    const bool own_stream = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
    if (!own_stream) s = nullptr;  // the legacy stream: this rank must still take part
    kv::cuda::backend be;
    be.stream = s;
    // The evictor is rebuilt with the rank's stream: its plan is then another object's, so plan again.
    kv::evictor<P, kv::cuda::backend> ev(params[static_cast<std::size_t>(r)], be);
    const std::vector<std::int32_t> hl = host_lengths_of(x.part);
    kv::plan_options opt;
    opt.host_lengths = hl.data();
    opt.sharded = true;
    kv::eviction_plan pl;
    const kv::status ps = ev.plan(ins[static_cast<std::size_t>(r)], budget, &pl, opt);  // the same plan as above
    kv::selection_view sel;
    sel.indptr = x.indptr->p;
    sel.indices = x.indices->p;
    sel.capacity = caps[static_cast<std::size_t>(r)];
    const kv::distributed::shard sh{c.Hkv, x.heads.data(), static_cast<std::int32_t>(x.heads.size())};
    kvevict_test::thread_communicator hc(&group, r);
    device_thread_communicator dc(&group, r);
    kv::distributed::communicator* comm = device_comm ? static_cast<kv::distributed::communicator*>(&dc) : &hc;
    // called whatever plan() said (an invalid plan is this rank's round-1 error): no rank left waiting
    x.st = ev.run_sharded(pl, ins[static_cast<std::size_t>(r)], comm, sh, sel, x.ws->p, x.ws->n, x.scores->p, &x.stats);
    if (!ps.ok()) x.st = ps;
    if (cudaStreamSynchronize(s) != cudaSuccess && x.st.ok()) x.st = kv::status::error(kv::errc::cuda_error, "stream");
    if (dc.device_errors && x.st.ok()) x.st = kv::status::error(kv::errc::cuda_error, "device communicator copy failed");
    if (own_stream) cudaStreamDestroy(s);
  });
  for (auto& x : rs) {
    if (!x.st.ok()) continue;
    const std::int64_t rows = static_cast<std::int64_t>(x.indptr->n) - 1;
    x.got_indptr = x.indptr->get(static_cast<std::size_t>(rows + 1));
    x.got_indices = x.indices->get(static_cast<std::size_t>(std::max(0, x.got_indptr.back())));
    x.got_scores = x.scores->get(static_cast<std::size_t>(rows * c.S));
  }
  return rs;
}

/// Sharded runs of P at 1-4 ranks (two head layouts, host and device communicators) against
/// the single-device run of the whole layer: every local row equal (indices, scores bit for
/// bit), the budgets summing to the single-device total, 3 + (AdaKV) radix rounds.
template <class P, class T, class Params>
void check_sharded_equals_whole(const host_case<T>& c, Params params_of, const typename P::params& whole_params, kv::budget_request budget) {
  const auto whole = gpu_run<P>(c, whole_params, budget);
  REQUIRE_MESSAGE(whole.st.ok(), whole.st.message());
  REQUIRE_MESSAGE(whole.dev.ok(), whole.dev.message());
  for (int ranks = 1; ranks <= 4; ++ranks)
    for (bool dealt : {false, true})
      for (bool device_comm : {false, true}) {
        CAPTURE(ranks);
        CAPTURE(dealt);
        CAPTURE(device_comm);
        const auto heads = shard_layout(c.Hkv, ranks, dealt);
        const auto rs = gpu_run_sharded<P>(c, heads, params_of, budget, device_comm, [](int, host_case<T>&) {});
        std::int64_t kept = 0;
        for (const auto& x : rs) {
          REQUIRE_MESSAGE(x.st.ok(), x.st.message());
          check_rows_equal(x.heads, c.Hkv, 1, c.S, x.got_indptr, x.got_indices, &x.got_scores, whole.indptr, whole.indices, &whole.scores);
          kept += x.got_indptr.back();
          CHECK(x.stats.rounds >= 3);
          CHECK(x.stats.bytes < 64 * 1024);
        }
        CHECK(kept == whole.indptr.back());
      }
}

}  // namespace

TEST_CASE("cuda: run_sharded over 1-4 thread ranks (host and device communicators) equals the single-device run: AdaKV, PyramidKV, LKV") {
  auto c = make_case<kv::bfloat16_t>(903, 2, 4, 2, 160, 8, 32, kv::kv_layout::hnd, false);
  c.per_head = true;
  c.lens = {160, 131, 97, 160, 64, 160, 160, 40};
  const auto budget = kv::budget_request::fraction(0.3);
  SUBCASE("AdaKV") {
    const auto p = kv::presets::adakv::defaults();
    check_sharded_equals_whole<kv::presets::adakv>(c, [&](int, const std::vector<std::int32_t>&) { return p; }, p, budget);
  }
  SUBCASE("PyramidKV") {
    auto c2 = c;
    c2.layer_idx = 1;
    c2.num_layers = 4;
    const auto p = kv::presets::pyramidkv::defaults();
    check_sharded_equals_whole<kv::presets::pyramidkv>(c2, [&](int, const std::vector<std::int32_t>&) { return p; }, p, budget);
  }
  SUBCASE("LKV (per-rank LKV-T tables, the whole model's LKV-H table)") {
    using P = kv::lkv::full;
    auto cl = c;
    cl.no_queries = true;
    cl.layer_idx = 1;
    cl.num_layers = 2;
    const auto art = make_tables(904, 2, 4, 32, 16, kv::lkv_activation::silu, 1.0f);
    kv::cuda::lkv_device_tables whole_tables;
    REQUIRE(whole_tables.upload(art).ok());
    // each rank's LKV-T rows (every layer, its heads), uploaded as an artifact of its own
    std::vector<std::unique_ptr<kv::cuda::lkv_device_tables>> rank_tables;
    std::vector<std::vector<std::int32_t>> table_heads;
    auto params_of = [&](int, const std::vector<std::int32_t>& hs) {
      std::size_t t = 0;
      while (t < table_heads.size() && table_heads[t] != hs) ++t;
      REQUIRE(t < table_heads.size());
      P::params p = lkv_params<P>(nullptr, &whole_tables);
      p.scorer = rank_tables[t]->scorer_params();
      p.budgeter.num_tokens = cl.S;  // ragged heads: the allocation is made for S tokens per head
      return p;
    };
    auto whole_params = lkv_params<P>(nullptr, &whole_tables);
    whole_params.budgeter.num_tokens = cl.S;
    for (int ranks = 1; ranks <= 4; ++ranks)
      for (bool dealt : {false, true})
        for (const auto& hs : shard_layout(4, ranks, dealt)) {
          kv::io::lkv_artifact a = art;
          a.kv_heads = static_cast<std::int32_t>(hs.size());
          a.logits.assign(static_cast<std::size_t>(a.heads()), 0.0f);
          const std::int64_t blk = art.block();
          a.mlp.assign(static_cast<std::size_t>(a.heads() * blk), 0.0f);
          for (int l = 0; l < art.num_layers; ++l)
            for (std::size_t i = 0; i < hs.size(); ++i)
              std::copy_n(art.mlp.begin() + (static_cast<std::int64_t>(l) * art.kv_heads + hs[i]) * blk, blk,
                          a.mlp.begin() + (static_cast<std::int64_t>(l) * a.kv_heads + static_cast<std::int64_t>(i)) * blk);
          rank_tables.emplace_back(new kv::cuda::lkv_device_tables());
          REQUIRE(rank_tables.back()->upload(a).ok());
          table_heads.push_back(hs);
        }
    check_sharded_equals_whole<P>(cl, params_of, whole_params, budget);
  }
}

TEST_CASE("cuda: run_sharded errors reach every rank, none left waiting, nothing written") {
  auto c = make_case<float>(905, 1, 4, 2, 96, 8, 16, kv::kv_layout::hnd, false);
  const auto budget = kv::budget_request::fraction(0.3);
  const auto p = kv::presets::adakv::defaults();
  const auto heads = shard_layout(4, 3, false);
  auto params_of = [&](int, const std::vector<std::int32_t>&) { return p; };
  for (bool device_comm : {false, true}) {
    CAPTURE(device_comm);
    // a NaN in rank 1's keys (found by the device scan before round 1)
    const auto rs = gpu_run_sharded<kv::presets::adakv>(c, heads, params_of, budget, device_comm, [](int r, host_case<float>& part) {
      if (r == 1) part.k[5] = std::numeric_limits<float>::quiet_NaN();
    });
    for (std::size_t r = 0; r < rs.size(); ++r) {
      CAPTURE(r);
      CHECK(rs[r].st.code() == kv::errc::non_finite_input);
      CHECK(rs[r].indptr->get(2) == std::vector<std::int32_t>(2, -1));  // indptr untouched
    }
    // overlapping shards (head 1 on ranks 0 and 1): found in round 1, after every rank's stages 0-1
    const std::vector<std::vector<std::int32_t>> overlap = {{0, 1}, {1, 2}, {3}};
    const auto rs2 = gpu_run_sharded<kv::presets::adakv>(c, overlap, params_of, budget, device_comm, [](int, host_case<float>&) {});
    for (std::size_t r = 0; r < rs2.size(); ++r) {
      CAPTURE(r);
      CHECK(rs2[r].st.code() == kv::errc::invalid_argument);
      CHECK_MESSAGE(std::string(rs2[r].st.message()).find("hold 5 KV heads in all") != std::string::npos, rs2[r].st.message());
      CHECK(rs2[r].indptr->get(2) == std::vector<std::int32_t>(2, -1));
      CHECK(rs2[r].stats.rounds == 1);
    }
  }
}

int main(int argc, char** argv) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("test_cuda: SKIPPED - no usable CUDA device (cudaGetDeviceCount: %s, count %d); only the host-side tests "
                "(\"host: ...\") run\n",
                e == cudaSuccess ? "no devices" : cudaGetErrorString(e), n);
    doctest::Context host_ctx;
    host_ctx.applyCommandLine(argc, argv);
    host_ctx.setOption("test-case", "host:*");
    return host_ctx.run();
  }
  const char* grid = std::getenv("KVEVICT_CUDA_TEST_GRID");
  g_small = grid && std::string(grid) == "small";
  g_tiny = grid && std::string(grid) == "tiny";
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("test_cuda: device %s (sm_%d%d), grid %s\n", prop.name, prop.major, prop.minor, g_tiny ? "tiny" : g_small ? "small" : "full");
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
