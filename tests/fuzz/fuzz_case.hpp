// SPDX-License-Identifier: Apache-2.0
// The libFuzzer target's test case, shared by its translation units (tests/fuzz/fuzz_evictor.cpp
// is the entry point; fuzz_presets_a.cpp and fuzz_presets_b.cpp instantiate run_case for half of
// the presets each, so the two compile in parallel). What it asserts: fuzz_evictor.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "fuzz/fuzz_common.hpp"
#include "robustness/robust_common.hpp"

namespace kvevict_fuzz {

using namespace robust;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float special(std::uint8_t b) {
  const float table[] = {kNaN,     kInf,      -kInf,    std::numeric_limits<float>::denorm_min(),
                         3.0e38f,  -3.4e38f,  65504.0f, -65504.0f,
                         0.0f,     -0.0f,     1.0e-40f, 1.0e20f,
                         -1.0e20f, 1.17e-38f, 1.0f,     -1.0f};
  return table[b % 16];
}

/// A float from a parameter byte: mostly small ordinary values, sometimes extreme ones.
inline float param_float(reader& r, float ordinary) {
  const std::uint8_t m = r.u8();
  if (m < 128) return ordinary;
  if (m < 192) return special(r.u8());
  if (m < 224) return static_cast<float>(r.u8()) / 64.0f;
  return r.f32();
}

template <class P>
void mutate_params(typename P::params& p, reader& r) {
  using S = typename P::scorer;
  using Tm = typename P::temporal_smoother;
  using Sp = typename P::spatial_smoother;
  using Bu = typename P::budgeter;
  const std::uint8_t sel = r.u8();
  if (sel & 1) p.selector.num_sink = static_cast<std::int32_t>(r.range(0, 8));
  if (sel & 2) p.selector.num_recent = static_cast<std::int32_t>(r.range(-2, 9));
  if (sel & 4) p.selector.recent_share = param_float(r, -1.0f);
  if (sel & 8) p.selector.num_sink = (sel & 16) ? 2147483647 : -1;
  if (sel & 32) p.gqa = static_cast<kvevict::gqa_reduction>(r.range(0, 4));
  if constexpr (std::is_same<Tm, kvevict::temporal::ema>::value) p.temporal.alpha = param_float(r, p.temporal.alpha);
  if constexpr (std::is_same<Sp, kvevict::spatial::avg_pool>::value) {
    const std::uint8_t k = r.u8();
    if (k & 128) p.spatial.kernel = (k & 64) ? 2147483647 : static_cast<int>(k % 16) - 1;
  }
  if constexpr (std::is_same<Sp, kvevict::spatial::max_pool>::value) {  // AdaKV as published
    const std::uint8_t k = r.u8();
    if (k & 128) p.spatial.kernel = (k & 64) ? 2147483647 : static_cast<int>(k % 16) - 1;
  }
  if constexpr (std::is_same<Bu, kvevict::budgeters::headwise_learned>::value) {  // LKV-H
    p.budgeter.temperature = param_float(r, p.budgeter.temperature);
    const std::uint8_t m = r.u8();
    if (m & 128) p.budgeter.min_budget = (m & 64) ? -1 : static_cast<std::int32_t>(m % 8);
  }
  if constexpr (std::is_same<S, kvevict::scorers::learned_mlp>::value) {  // LKV-T
    const std::uint8_t m = r.u8();
    if (m & 128) p.scorer.activation = static_cast<kvevict::lkv_activation>(m % 3);  // 2: not an activation
    if (m & 64) p.scorer.layer = static_cast<std::int32_t>(m % 8) - 2;  // -2: an error; >= num_layers: an error
  }
  if constexpr (std::is_same<Sp, kvevict::spatial::adaptive_window>::value) {
    p.spatial.beta = param_float(r, p.spatial.beta);
    const std::uint8_t k = r.u8();
    if (k & 128) p.spatial.k_min = (k & 64) ? 2147483647 : static_cast<int>(k % 16) - 1;
    p.spatial.reference_exact = (k & 1) == 0;
  }
  if constexpr (std::is_same<S, kvevict::scorers::output_reconstruction>::value) {
    const std::uint8_t m = r.u8();
    p.scorer.aggregation = static_cast<kvevict::scorers::output_reconstruction::mode>(m % 3 == 2 ? 1 : m % 2);
    p.scorer.use_wo = (m & 4) == 0;
    p.scorer.include_window_in_output = (m & 8) != 0;
    p.scorer.tau = param_float(r, 1.0f);
  }
  if constexpr (std::is_same<S, kvevict::scorers::accumulated_attention>::value) p.scorer.normalize_by_visible = r.u8() & 1;
  if constexpr (std::is_same<Bu, kvevict::budgeters::pyramid>::value) {
    p.budgeter.beta = param_float(r, p.budgeter.beta);
    p.budgeter.exact_total = (r.u8() & 1) == 0;
  }
  if constexpr (std::is_same<Bu, kvevict::budgeters::adakv>::value) p.budgeter.alpha = param_float(r, p.budgeter.alpha);
  if constexpr (std::is_same<typename P::selector, kvevict::selectors::two_stage>::value) {  // CriticalKV
    p.selector.first_stage_ratio = param_float(r, p.selector.first_stage_ratio);
    p.selector.eps = param_float(r, p.selector.eps);
  }
}

/// LKV tables (learned_mlp weights, headwise_learned logits) for a layer of kv_heads x head_dim:
/// random normal values from the case's seed. Mode byte: bits 0-1 the MLP hidden size - 1, bit 2 a
/// table for one KV head more (an error), bit 3 a table of fewer layers than the layer index
/// needs, bit 4 one NaN / inf weight, bit 5 one NaN / inf logit, bits 6-7 num_tokens (0, the
/// capacity, a random count, 2^40). Kept alive by the caller for as long as the evictor.
struct lkv_case {
  std::vector<float> mlp, logits;
  template <class P>
  void apply(typename P::params& p, reader& r, std::int64_t kv_heads, std::int64_t head_dim, int num_layers, std::int64_t capacity,
             std::uint32_t seed) {
    using S = typename P::scorer;
    using Bu = typename P::budgeter;
    constexpr bool scorer = std::is_same<S, kvevict::scorers::learned_mlp>::value;
    constexpr bool budgeter = std::is_same<Bu, kvevict::budgeters::headwise_learned>::value;
    if constexpr (scorer || budgeter) {
      const std::uint8_t m = r.u8();
      const int hid = 1 + (m & 3);
      const std::int32_t heads = static_cast<std::int32_t>(kv_heads + ((m & 4) ? 1 : 0));
      const std::int32_t layers = (m & 8) ? std::max(1, num_layers / 2) : num_layers;
      kvtest::rng g(seed + 7);
      if constexpr (scorer) {
        const std::int64_t n = layers * heads * S::block_floats(head_dim, hid);
        mlp.resize(static_cast<std::size_t>(n));
        for (auto& x : mlp) x = static_cast<float>(0.5 * g.normal());
        if (m & 16) mlp[seed % mlp.size()] = special(static_cast<std::uint8_t>(seed >> 8));
        p.scorer.weights = mlp.data();
        p.scorer.num_layers = layers;
        p.scorer.kv_heads = heads;
        p.scorer.head_dim = static_cast<std::int32_t>(head_dim);
        p.scorer.hidden = hid;
      }
      if constexpr (budgeter) {
        logits.resize(static_cast<std::size_t>(layers * heads));
        for (auto& x : logits) x = static_cast<float>(g.normal());
        if (m & 32) logits[seed % logits.size()] = special(static_cast<std::uint8_t>(seed >> 16));
        p.budgeter.logits = logits.data();
        p.budgeter.num_layers = layers;
        p.budgeter.kv_heads = heads;
        const int t = m >> 6;
        p.budgeter.num_tokens = t == 0 ? 0 : t == 1 ? capacity : t == 2 ? static_cast<std::int64_t>(r.u8()) : (std::int64_t{1} << 40);
      }
    }
  }
};

/// Overwrite a fraction of the valid entries of a 4-D buffer with special values.
template <class T>
void inject(buffer4<T>& buf, reader& r, std::uint8_t rate, std::uint64_t seed) {
  if (rate == 0 || buf.data.empty()) return;
  kvtest::rng g(seed);
  for (auto& x : buf.data)
    if (g.integer(0, 1023) < rate) x = kvevict::from_float<T>(special(static_cast<std::uint8_t>(g.next())));
  (void)r;
}

template <class T>
bool any_nonfinite_valid(const problem<T>& pr, bool keys, bool values, bool queries, bool wo, bool wo_matrix) {
  const auto& s = pr.sh;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hkv; ++h)
      for (std::int64_t t = 0; t < pr.length(b, h); ++t)
        for (std::int64_t d = 0; d < s.D; ++d) {
          if (keys && !kvevict::is_finite_value(pr.in.keys(b, h, t, d))) return true;
          if (values && !kvevict::is_finite_value(pr.in.values(b, h, t, d))) return true;
        }
  if (queries)
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t hq = 0; hq < s.Hq(); ++hq) {
        const std::int64_t L = pr.length(b, hq / s.G);
        for (std::int64_t j = s.W - std::min(s.W, L); j < s.W; ++j)
          for (std::int64_t d = 0; d < s.D; ++d)
            if (!kvevict::is_finite_value(pr.in.queries(b, hq, j, d))) return true;
      }
  if (wo)
    for (float x : pr.wo)
      if (!std::isfinite(x)) return true;
  if (wo_matrix)  // through the view: a broadcast W_O reads only part of wo_mat
    for (std::int64_t c = 0; c < pr.in.wo.extent[0]; ++c)
      for (std::int64_t i = 0; i < pr.in.wo.extent[1]; ++i)
        if (!kvevict::is_finite_value(pr.in.wo(c, i))) return true;
  return false;
}

struct outputs {
  std::unique_ptr<std::int32_t[]> indptr, indices, positions;
  std::unique_ptr<float[]> scores;
  std::unique_ptr<unsigned char[]> ws;
  std::int64_t rows = 0, cap = 0, seq = 0;
  std::size_t ws_bytes = 0;
  void allocate(std::int64_t r, std::int64_t c, std::int64_t s, std::size_t w, unsigned char fill) {
    rows = r;
    cap = c;
    seq = s;
    ws_bytes = w;
    // Exactly sized (at least one element so the pointers are valid): ASan sees any overrun.
    indptr.reset(new std::int32_t[static_cast<std::size_t>(r + 1)]);
    indices.reset(new std::int32_t[static_cast<std::size_t>(std::max<std::int64_t>(c, 1))]);
    positions.reset(new std::int32_t[static_cast<std::size_t>(std::max<std::int64_t>(c, 1))]);
    scores.reset(new float[static_cast<std::size_t>(std::max<std::int64_t>(r * s, 1))]);
    ws.reset(new unsigned char[std::max<std::size_t>(w, 1)]);
    std::fill(indptr.get(), indptr.get() + r + 1, -9);
    std::fill(indices.get(), indices.get() + std::max<std::int64_t>(c, 1), -9);
    std::fill(positions.get(), positions.get() + std::max<std::int64_t>(c, 1), -9);
    std::fill(scores.get(), scores.get() + std::max<std::int64_t>(r * s, 1), kNaN);
    std::memset(ws.get(), fill, std::max<std::size_t>(w, 1));
  }
  kvevict::selection_view view() const { return {indptr.get(), indices.get(), positions.get(), cap}; }
};

template <class P, class T>
void run_case(reader& r) {
  using ev_t = kvevict::evictor<P, kvevict::cpu::backend>;
  const std::uint8_t flags = r.u8();
  shape s;
  s.layout = (flags & 1) ? kvevict::kv_layout::nhd : kvevict::kv_layout::hnd;
  s.with_queries = traits<P>::needs_queries || (flags & 2);
  s.with_values = true;
  const int len_mode = (flags >> 2) & 3;  // 0 none, 1 per sequence, 2 per head, 3 per head + broadcast K/V heads
  const bool check_finite = (flags & 16) == 0;
  const bool with_positions = (flags & 32) != 0;
  const int threads = (flags >> 6) & 3;
  s.B = r.range(1, 3);
  s.Hkv = r.range(1, 3);
  s.G = r.range(1, 3);
  s.S = r.range(0, 40);
  s.W = r.range(1, std::max<std::int64_t>(1, s.S + 1));  // may exceed S: an error
  s.D = r.range(1, 17);
  s.pad = r.range(0, 3);
  if (len_mode == 1 || len_mode == 2) {
    s.per_sequence_lengths = len_mode == 1;
    for (std::int64_t i = 0; i < s.B * s.Hkv; ++i) {
      const std::uint8_t lb = r.u8();
      // mostly valid lengths, sometimes just outside [0, S] (an error)
      s.lengths.push_back(static_cast<std::int32_t>(lb >= 250 ? (lb == 255 ? -1 : s.S + 1) : lb % (s.S + 1)));
    }
  }
  // budget
  kvevict::budget_request budget;
  const std::uint8_t bm = r.u8();
  switch (bm % 4) {
    case 0: budget.keep_tokens = static_cast<std::int32_t>(r.range(0, 48)); break;
    case 1: budget.keep_fraction = static_cast<double>(r.u8()) / 255.0; break;
    case 2: budget.keep_fraction = static_cast<double>(param_float(r, 0.5f)); break;
    default:
      budget.keep_tokens = static_cast<std::int32_t>(r.u32());
      if (bm & 4) budget.keep_fraction = 0.5;  // both set: an error
  }
  // params
  auto params = P::defaults();
  if (r.u8() & 1) mutate_params<P>(params, r);
  params.check_finite = check_finite;
  const int num_layers = static_cast<int>(r.range(1, 40));
  const int layer_idx = static_cast<int>(r.range(0, 40));  // >= num_layers: an error
  // values
  const std::uint32_t seed = r.u32();
  const int exp2 = static_cast<int>(static_cast<std::int8_t>(r.u8()));  // scale 2^(-128..127)
  const float scale = std::ldexp(1.0f, std::max(-126, std::min(exp2, 127)));
  const float poison = special(r.u8());
  const std::uint8_t rate_k = r.u8() & 15, rate_v = r.u8() & 15, rate_q = r.u8() & 15;
  const unsigned char ws_fill = r.u8();
  // CriticalKV's full W_O (layer_inputs::wo, (hidden, Hq * D)): bits 0-2 the view (0-3 row-major,
  // 4 rows aliased by stride 0, 5 one scalar (strides 0, 0), 6 hidden 1, 7 transposed strides
  // over the same memory), bit 3 a wrong column extent (an error), bit 4 a special value at one
  // weight, bit 5 weights of magnitude ~1e38.
  const std::uint8_t wo_mode = r.u8();

  problem<T> pr;
  pr.init(s, seed, scale, poison);
  inject(pr.k, r, rate_k, seed + 1);
  if (s.with_values) inject(pr.v, r, rate_v, seed + 2);
  if (s.with_queries) inject(pr.q, r, rate_q, seed + 3);
  if (rate_q > 12) pr.wo[0] = special(static_cast<std::uint8_t>(seed));
  if (traits<P>::needs_wo_matrix) {
    if (wo_mode & 32)
      for (std::size_t i = 0; i < pr.wo_mat.size(); i += 3) pr.wo_mat[i] = kvevict::from_float<T>(i % 2 ? -1.0e38f : 1.0e38f);
    if (wo_mode & 16) pr.wo_mat[seed % pr.wo_mat.size()] = kvevict::from_float<T>(special(static_cast<std::uint8_t>(seed >> 8)));
  }
  if (with_positions) {
    pr.pos.assign(static_cast<std::size_t>(s.B * s.Hkv * s.S), 0);
    kvtest::rng g(seed + 4);
    for (auto& x : pr.pos) x = static_cast<std::int32_t>(g.next());
  }
  pr.rebuild_views();
  if (len_mode == 3) {  // every KV head reads head 0's memory (stride 0 broadcast)
    pr.in.keys.stride[1] = 0;
    pr.in.values.stride[1] = 0;
  }
  pr.in.num_layers = num_layers;
  pr.in.layer_idx = layer_idx;
  lkv_case tables;  // LKV presets: their tables (outlive the evictors below)
  tables.apply<P>(params, r, s.Hkv, s.D, num_layers, s.S, seed);
  if (traits<P>::needs_wo_matrix) {
    auto& w = pr.in.wo;
    switch (wo_mode & 7) {
      case 4: w.stride[0] = 0; break;
      case 5: w.stride[0] = w.stride[1] = 0; break;
      case 6: w.extent[0] = 1; break;
      case 7:  // [in][out] strides over the same buffer: hidden * (Hq * D) elements either way
        w.stride[0] = 1;
        w.stride[1] = w.extent[0];
        break;
      default: break;
    }
    if (wo_mode & 8) w.extent[1] += (seed & 1) ? 1 : -1;
  }

  const ev_t ev(params, kvevict::cpu::backend{threads});
  const kvevict::status st = ev.can_implement(pr.in, budget);
  const std::int64_t cap = ev.max_selected(pr.in, budget);
  if (!st.ok()) {
    const char* msg = st.message();
    FUZZ_ASSERT(std::strlen(msg) < kvevict::status::message_capacity, msg);
    FUZZ_ASSERT(std::strncmp(msg, kvevict::to_string(st.code()), std::strlen(kvevict::to_string(st.code()))) == 0, msg);
    FUZZ_ASSERT(cap == -1, msg);
    // run() refuses with the same category and writes nothing.
    outputs o;
    o.allocate(s.B * std::max<std::int64_t>(s.Hq(), s.Hkv), 4, std::max<std::int64_t>(s.S, 1), 4096, ws_fill);
    const kvevict::status st2 = ev.run(pr.in, budget, o.view(), o.ws.get(), o.ws_bytes, o.scores.get());
    FUZZ_ASSERT(st2.code() == st.code(), st2.message());
    for (std::int64_t i = 0; i <= o.rows; ++i) FUZZ_ASSERT(o.indptr[static_cast<std::size_t>(i)] == -9, msg);
    if (verbose()) std::fprintf(stderr, "[%s %s] %s\n", preset_name<P>().c_str(), type_name<T>().c_str(), msg);
    return;
  }
  FUZZ_ASSERT(cap >= 0, "max_selected < 0 after can_implement ok");
  const std::int64_t rows = s.B * ev.out_heads(pr.in);
  outputs o;
  o.allocate(rows, cap, s.S, ev.workspace_size(pr.in), ws_fill);
  const kvevict::status rs = ev.run(pr.in, budget, o.view(), o.ws.get(), o.ws_bytes, o.scores.get());
  using Sc = typename P::scorer;
  const bool expect_nonfinite =
      check_finite && any_nonfinite_valid(pr, Sc::has_scores, Sc::needs_values, Sc::needs_queries && s.with_queries,
                                          Sc::needs_wo_factor(params.scorer), traits<P>::needs_wo_matrix);
  if (!rs.ok()) {
    FUZZ_ASSERT(rs.code() == kvevict::errc::non_finite_input, rs.message());
    FUZZ_ASSERT(expect_nonfinite, rs.message());
    for (std::int64_t i = 0; i <= rows; ++i) FUZZ_ASSERT(o.indptr[static_cast<std::size_t>(i)] == -9, "output written on error");
    if (verbose()) std::fprintf(stderr, "[%s %s] run: %s\n", preset_name<P>().c_str(), type_name<T>().c_str(), rs.message());
    return;
  }
  FUZZ_ASSERT(!expect_nonfinite, "non-finite valid input accepted with check_finite on");

  // The contract, re-derived independently of the library's planner.
  result res;
  res.rows = rows;
  res.seq = s.S;
  res.max_selected = cap;
  res.indptr.assign(o.indptr.get(), o.indptr.get() + rows + 1);
  res.indices.assign(o.indices.get(), o.indices.get() + cap);
  res.positions.assign(o.positions.get(), o.positions.get() + cap);
  res.scores.assign(o.scores.get(), o.scores.get() + rows * s.S);
  const std::string bad = check_contract(ev, pr, res, budget);
  if (!bad.empty() && verbose()) {  // the first row's scores and kept slots, to read a violation
    for (std::int64_t t = 0; t < s.S; ++t) std::fprintf(stderr, "%lld:%.9g ", static_cast<long long>(t), static_cast<double>(res.scores[static_cast<std::size_t>(t)]));
    std::fprintf(stderr, "\nrow 0 keeps:");
    for (std::int32_t i = res.indptr[0]; i < res.indptr[1]; ++i) std::fprintf(stderr, " %d", res.indices[static_cast<std::size_t>(i)]);
    std::fprintf(stderr, "\n");
  }
  FUZZ_ASSERT(bad.empty(), bad.c_str());
  if (verbose()) {
    std::int64_t valid = 0;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hkv; ++h) valid += pr.length(b, h) * (rows / (s.B * s.Hkv));
    std::fprintf(stderr, "[%s %s] ok: kept %lld of %lld (rows %lld, S %lld, W %lld)\n", preset_name<P>().c_str(),
                 type_name<T>().c_str(), static_cast<long long>(cap), static_cast<long long>(valid),
                 static_cast<long long>(rows), static_cast<long long>(s.S), static_cast<long long>(pr.in.window()));
  }

  // Determinism: other garbage in the workspace, another thread count, the same bytes.
  const ev_t ev2(params, kvevict::cpu::backend{threads == 1 ? 2 : 1});
  outputs o2;
  o2.allocate(rows, cap, s.S, ev2.workspace_size(pr.in), static_cast<unsigned char>(~ws_fill));
  const kvevict::status rs2 = ev2.run(pr.in, budget, o2.view(), o2.ws.get(), o2.ws_bytes, o2.scores.get());
  FUZZ_ASSERT(rs2.ok(), rs2.message());
  FUZZ_ASSERT(std::memcmp(o.indptr.get(), o2.indptr.get(), static_cast<std::size_t>(rows + 1) * 4) == 0, "indptr differs");
  FUZZ_ASSERT(cap == 0 || std::memcmp(o.indices.get(), o2.indices.get(), static_cast<std::size_t>(cap) * 4) == 0, "indices differ");
  FUZZ_ASSERT(rows * s.S == 0 || std::memcmp(o.scores.get(), o2.scores.get(), static_cast<std::size_t>(rows * s.S) * 4) == 0,
              "scores differ");

  // Compaction of the selection gathers exactly the selected rows.
  if (cap > 0 && len_mode != 3) {
    std::unique_ptr<T[]> dst(new T[static_cast<std::size_t>(cap * s.D)]);
    const kvevict::const_selection_view sel(o.indptr.get(), o.indices.get(), rows);
    const kvevict::status cs = kvevict::cpu::compact_ragged<T>(pr.in.keys, sel, dst.get(), cap * s.D);
    FUZZ_ASSERT(cs.ok(), cs.message());
    const std::int64_t Gout = rows / (s.B * s.Hkv);
    for (std::int64_t row = 0; row < rows; ++row)
      for (std::int32_t i = o.indptr[static_cast<std::size_t>(row)]; i < o.indptr[static_cast<std::size_t>(row + 1)]; ++i)
        for (std::int64_t d = 0; d < s.D; ++d) {
          const T a = dst[static_cast<std::size_t>(i * s.D + d)];
          const T b = pr.in.keys(row / (rows / s.B), (row % (rows / s.B)) / Gout, o.indices[static_cast<std::size_t>(i)], d);
          FUZZ_ASSERT(std::memcmp(&a, &b, sizeof(T)) == 0, "compact_ragged gathered the wrong row");
        }
  }
}

/// f(type_tag<T>{}) for storage type number t of the corpus format: 0 fp32, 1 fp16, else bf16
/// (one storage-type byte modulo 3 in fuzz_evictor and fuzz_views).
template <class F>
void visit_storage_type(int t, F&& f) {
  switch (t) {
    case 0: f(type_tag<float>{}); break;
    case 1: f(type_tag<half_t>{}); break;
    default: f(type_tag<bfloat16_t>{}); break;
  }
}

template <class P>
void dispatch_type(reader& r) {
  visit_storage_type(r.u8() % 3, [&](auto t) { run_case<P, typename decltype(t)::type>(r); });
}

/// Runs the case of preset number `which` (the first input byte modulo 15; the numbering is the
/// corpus format, docs/failure-kinds.md): 0 restkv, 1 snapkv, 2 pyramidkv, 3 adakv, 4 h2o, 5 tova,
/// 6 streaming_llm, 7 key_norm, 8 criticalkv, 9 critical_adakv, 10 adakv_published, 11 lkv,
/// 12 lkv_uniform_budgets, 13 lkv_budgets_restkv, 14 lkv_budgets_attention. run_presets_a takes 0,
/// 4-7 (fuzz_presets_a.cpp), run_presets_b 1-3, 8, 9 (fuzz_presets_b.cpp), run_presets_c 10-14
/// (fuzz_presets_c.cpp).
void run_presets_a(int which, reader& r);
void run_presets_b(int which, reader& r);
void run_presets_c(int which, reader& r);

}  // namespace kvevict_fuzz
