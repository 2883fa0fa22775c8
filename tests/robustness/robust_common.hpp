// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the robustness tests (tests/robustness) and the fuzz target (tests/fuzz):
// the preset registry, owning problem buffers with arbitrary layouts and padding, and an
// INDEPENDENT checker of the selection contract (docs/semantics.md) that re-derives the
// budget rule from the documentation instead of calling kvevict::detail::plan_head.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/random.hpp"    // kvtest::rng
#include "kvevict/cpu.hpp"      // evictor<Policy, cpu::backend>, compact

namespace robust {

using kvevict::bfloat16_t;
using kvevict::half_t;

// ---------------------------------------------------------------------------------------------
// Preset registry: every named preset of kvevict/presets.hpp, in one list (kvpress-style
// default_presses). Tests iterate it with TEST_CASE_TEMPLATE(..., KVEVICT_ROBUST_PRESETS).
#define KVEVICT_ROBUST_PRESETS                                                                                  \
  kvevict::presets::restkv, kvevict::presets::snapkv, kvevict::presets::pyramidkv, kvevict::presets::adakv, \
      kvevict::presets::h2o, kvevict::presets::tova, kvevict::presets::streaming_llm, kvevict::presets::key_norm, \
      kvevict::presets::criticalkv, kvevict::presets::critical_adakv, kvevict::presets::defensivekv

template <class P>
inline std::string preset_name() {
  using namespace kvevict::presets;
  if (std::is_same<P, restkv>::value) return "restkv";
  if (std::is_same<P, snapkv>::value) return "snapkv";
  if (std::is_same<P, pyramidkv>::value) return "pyramidkv";
  if (std::is_same<P, adakv>::value) return "adakv";
  if (std::is_same<P, h2o>::value) return "h2o";
  if (std::is_same<P, tova>::value) return "tova";
  if (std::is_same<P, streaming_llm>::value) return "streaming_llm";
  if (std::is_same<P, key_norm>::value) return "key_norm";
  if (std::is_same<P, criticalkv>::value) return "criticalkv";
  if (std::is_same<P, critical_adakv>::value) return "critical_adakv";
  if (std::is_same<P, defensivekv>::value) return "defensivekv";
  if (std::is_same<P, adakv_published>::value) return "adakv_published";
  if (std::is_same<P, lkv>::value) return "lkv";
  if (std::is_same<P, lkv_uniform_budgets>::value) return "lkv_uniform_budgets";
  if (std::is_same<P, lkv_budgets_restkv>::value) return "lkv_budgets_restkv";
  if (std::is_same<P, lkv_budgets_attention>::value) return "lkv_budgets_attention";
  return "custom";
}

template <class T>
inline std::string type_name() {
  if (std::is_same<T, float>::value) return "float";
  if (std::is_same<T, half_t>::value) return "half_t";
  return "bfloat16_t";
}

/// Calls f(type_tag<T>{}) for the three storage types.
template <class T>
struct type_tag {
  using type = T;
};
template <class F>
inline void for_each_storage_type(F&& f) {
  f(type_tag<float>{});
  f(type_tag<half_t>{});
  f(type_tag<bfloat16_t>{});
}

/// Whether a preset's scorer reads queries / values / the W_O factor with default params.
template <class P>
struct traits {
  using S = typename P::scorer;
  static constexpr bool needs_queries = S::needs_queries;
  static constexpr bool needs_values = S::needs_values;
  static bool needs_wo(const typename P::params& p) { return S::needs_wo_factor(p.scorer); }
  /// Reads the full output projection layer_inputs::wo (CriticalKV).
  static constexpr bool needs_wo_matrix = kvevict::detail::scorer_needs_wo_matrix<S>::value;
};

/// Smallest keep_tokens budget a preset accepts for window W (documented rule: budget >=
/// num_sink + fixed recent tokens, the window by default).
template <class P>
inline std::int32_t min_tokens_budget(const typename P::params& p, std::int64_t W) {
  const auto& s = p.selector;
  const std::int64_t fixed_recent = s.recent_share >= 0.0f ? 0 : (s.num_recent >= 0 ? s.num_recent : W);
  return static_cast<std::int32_t>(std::max<std::int64_t>(1, s.num_sink + fixed_recent));
}

// ---------------------------------------------------------------------------------------------
// Owning problem buffers.

/// Shape and layout of one eviction problem. Lengths are per (sequence, kv head); empty means
/// "every head holds S tokens". `pad` elements are inserted after each row/head/sequence so that
/// strides are not contiguous; pads and padding slots can be filled with poison values.
struct shape {
  std::int64_t B = 1, Hkv = 1, G = 1, S = 8, W = 2, D = 4;
  kvevict::kv_layout layout = kvevict::kv_layout::hnd;
  std::int64_t pad = 0;           ///< extra elements per row (head_dim stride gap)
  bool with_queries = true;
  bool with_values = true;
  std::vector<std::int32_t> lengths;  ///< B * Hkv, or empty
  bool per_sequence_lengths = false;  ///< lengths[b * Hkv] used for every head (stride 0)
  std::int64_t Hq() const { return Hkv * G; }
};

/// Strided 4-D buffer of storage type T: (n0, n1, n2, n3) with the given layout and a row pad.
template <class T>
struct buffer4 {
  std::vector<T> data;
  kvevict::strided_view<T, 4> view;
  void allocate(std::int64_t n0, std::int64_t n1, std::int64_t n2, std::int64_t n3, kvevict::kv_layout layout,
                std::int64_t pad) {
    const std::int64_t row = n3 + pad;
    view.extent[0] = n0;
    view.extent[1] = n1;
    view.extent[2] = n2;
    view.extent[3] = n3;
    view.stride[3] = 1;
    if (layout == kvevict::kv_layout::hnd) {
      view.stride[2] = row;
      view.stride[1] = n2 * row;
      view.stride[0] = n1 * n2 * row;
    } else {
      view.stride[1] = row;
      view.stride[2] = n1 * row;
      view.stride[0] = n2 * n1 * row;
    }
    data.assign(static_cast<std::size_t>(std::max<std::int64_t>(1, n0 * n1 * n2 * row)), kvevict::from_float<T>(0.0f));
    view.data = data.data();
  }
  T& at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) { return view(a, b, c, d); }
  void fill_all(float v) { std::fill(data.begin(), data.end(), kvevict::from_float<T>(v)); }
};

/// Q, K, V, W_O factor, lengths and positions of one problem, with layer_inputs<T> views.
template <class T>
struct problem {
  shape sh;
  buffer4<T> q, k, v;
  std::vector<float> wo;  // (Hq, D, D) row-major
  std::vector<T> wo_mat;  // (hidden = D + 3, Hq * D) row-major [out][in]: the full W_O (CriticalKV)
  std::vector<std::int32_t> lens;
  std::vector<std::int32_t> pos;  // (B, Hkv, S) or empty
  kvevict::layer_inputs<T> in;

  /// Hidden size of the full W_O (different from every other extent).
  std::int64_t hidden() const { return sh.D + 3; }

  std::int64_t length(std::int64_t b, std::int64_t h) const {
    if (lens.empty()) return sh.S;
    return sh.per_sequence_lengths ? lens[static_cast<std::size_t>(b * sh.Hkv)] : lens[static_cast<std::size_t>(b * sh.Hkv + h)];
  }

  /// Allocate for `s`, fill valid entries with N(0, scale^2) values from `seed`, and fill every
  /// pad element and padding slot with `poison`.
  void init(const shape& s, std::uint64_t seed, float scale = 1.0f, float poison = std::numeric_limits<float>::quiet_NaN()) {
    sh = s;
    kvtest::rng r(seed);
    k.allocate(s.B, s.Hkv, s.S, s.D, s.layout, s.pad);
    k.fill_all(poison);
    if (s.with_values) {
      v.allocate(s.B, s.Hkv, s.S, s.D, s.layout, s.pad);
      v.fill_all(poison);
    }
    if (s.with_queries) {
      q.allocate(s.B, s.Hq(), s.W, s.D, s.layout, s.pad);
      q.fill_all(poison);
    }
    lens = s.lengths;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hkv; ++h) {
        const std::int64_t L = std::max<std::int64_t>(0, std::min(length(b, h), s.S));  // invalid lengths: fill nothing past S
        for (std::int64_t t = 0; t < L; ++t)
          for (std::int64_t d = 0; d < s.D; ++d) {
            k.at(b, h, t, d) = kvevict::from_float<T>(static_cast<float>(scale * r.normal()));
            if (s.with_values) v.at(b, h, t, d) = kvevict::from_float<T>(static_cast<float>(r.normal()));
          }
      }
    if (s.with_queries) {
      for (std::int64_t b = 0; b < s.B; ++b)
        for (std::int64_t hq = 0; hq < s.Hq(); ++hq) {
          const std::int64_t L = std::max<std::int64_t>(0, std::min(length(b, hq / s.G), s.S));
          const std::int64_t first = s.W - std::min(s.W, L);  // rows of a short head before its start are pads
          for (std::int64_t j = first; j < s.W; ++j)
            for (std::int64_t d = 0; d < s.D; ++d) q.at(b, hq, j, d) = kvevict::from_float<T>(static_cast<float>(scale * r.normal()));
        }
    }
    wo.assign(static_cast<std::size_t>(s.Hq() * s.D * s.D), 0.0f);
    for (auto& x : wo) x = static_cast<float>(r.normal());
    wo_mat.assign(static_cast<std::size_t>(hidden() * s.Hq() * s.D), kvevict::from_float<T>(0.0f));
    for (auto& x : wo_mat) x = kvevict::from_float<T>(static_cast<float>(r.normal() / std::sqrt(static_cast<double>(hidden()))));
    rebuild_views();
  }

  void rebuild_views() {
    in = kvevict::layer_inputs<T>{};
    in.keys = k.view;
    if (sh.with_values) in.values = v.view;
    if (sh.with_queries) in.queries = q.view;
    in.wo_factor = kvevict::cpu::wo_factor_view(wo.data(), sh.Hq(), sh.D);
    if (!wo_mat.empty()) in.wo = kvevict::strided_view<const T, 2>{wo_mat.data(), {hidden(), sh.Hq() * sh.D}, {sh.Hq() * sh.D, 1}};
    if (!lens.empty())
      in.lengths = sh.per_sequence_lengths ? per_seq_view() : kvevict::per_head_lengths(lens.data(), sh.B, sh.Hkv);
    if (!pos.empty()) in.positions = kvevict::make_positions_view(pos.data(), sh.B, sh.Hkv, sh.S);
  }

 private:
  kvevict::lengths_view per_seq_view() const {
    kvevict::lengths_view lv;
    lv.data = lens.data();
    lv.extent[0] = sh.B;
    lv.extent[1] = sh.Hkv;
    lv.stride[0] = sh.Hkv;
    lv.stride[1] = 0;
    return lv;
  }
};

// ---------------------------------------------------------------------------------------------
// Running an evictor with exactly-sized, owned outputs.

struct result {
  kvevict::status st;
  std::vector<std::int32_t> indptr, indices, positions;
  std::vector<float> scores;
  std::int64_t max_selected = -1;
  std::size_t workspace_bytes = 0;
  std::int64_t rows = 0, seq = 0;
  bool same_selection(const result& o) const { return indptr == o.indptr && indices == o.indices && positions == o.positions; }
  /// Indices of row r.
  std::vector<std::int32_t> row(std::int64_t r) const {
    return std::vector<std::int32_t>(indices.begin() + indptr[static_cast<std::size_t>(r)],
                                     indices.begin() + indptr[static_cast<std::size_t>(r + 1)]);
  }
};

/// can_implement + workspace_size + max_selected + run with a workspace of exactly
/// workspace_size() bytes, pre-filled with `ws_fill` bytes (garbage must not matter), and
/// indices / positions / scores buffers of exactly the documented sizes.
template <class P, class T>
inline result run_evictor(const kvevict::evictor<P, kvevict::cpu::backend>& ev, const kvevict::layer_inputs<T>& in,
                          kvevict::budget_request budget, unsigned char ws_fill = 0xFF,
                          std::vector<unsigned char>* ws_reuse = nullptr) {
  result res;
  res.st = ev.can_implement(in, budget);
  if (!res.st.ok()) return res;
  res.rows = in.batch() * ev.out_heads(in);
  res.seq = in.capacity();
  res.workspace_bytes = ev.workspace_size(in);
  res.max_selected = ev.max_selected(in, budget);
  std::vector<unsigned char> local;
  std::vector<unsigned char>& ws = ws_reuse ? *ws_reuse : local;
  if (ws.size() < res.workspace_bytes) ws.resize(res.workspace_bytes);
  std::memset(ws.data(), ws_fill, ws.size());
  res.indptr.assign(static_cast<std::size_t>(res.rows + 1), -7);
  res.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(res.max_selected, 0)), -7);
  res.positions.assign(res.indices.size(), -7);
  res.scores.assign(static_cast<std::size_t>(res.rows * res.seq), std::numeric_limits<float>::quiet_NaN());
  kvevict::selection_view sel;
  sel.indptr = res.indptr.data();
  sel.indices = res.indices.empty() ? nullptr : res.indices.data();
  sel.positions = res.positions.empty() ? nullptr : res.positions.data();
  sel.capacity = res.max_selected;
  // A zero-sized selection still needs a non-null indices pointer.
  std::int32_t dummy = 0;
  if (!sel.indices) {
    sel.indices = &dummy;
    sel.positions = &dummy;
  }
  res.st = ev.run(in, budget, sel, ws.empty() ? nullptr : ws.data(), res.workspace_bytes,
                  res.scores.empty() ? nullptr : res.scores.data());
  return res;
}

// ---------------------------------------------------------------------------------------------
// Independent contract checker (docs/semantics.md). Returns "" when every rule holds, else the
// first violation. `lengths(b, hkv)` are the valid lengths; `W` the window; `positions(b, hkv,
// slot)` the logical positions (or slot when null). Checks:
//  * indptr[0] = 0, non-decreasing, indptr[rows] = max_selected (exact count; <= for AdaKV's reference rounding);
//  * each row strictly ascending, inside [0, L) of its head (pads never kept);
//  * pass-through (L <= base budget): the row is exactly 0..L-1;
//  * otherwise the sinks and the R recent tokens are kept, and the count is >= protected;
//  * for uniform budgeters the count is exactly the base budget;
//  * the candidates kept are the top of maybe_scores (higher first, ties to lower index);
//  * maybe_scores is finite everywhere and 0 at protected slots and on pass-through rows;
//  * positions = positions(slot) of each kept slot.
struct contract {
  std::int32_t num_sink = 0, num_recent = -1;
  float recent_share = -1.0f;
  bool uniform_budget = true;
  /// budgeters::headwise_learned (LKV-H): a head's budget is its learned share, not the base
  /// budget, so a head shorter than the base budget is not always passed through; a row that
  /// keeps every token is whole (a pass-through, or a budget raised to L by its protected tokens).
  bool learned_budget = false;
  bool scorer_has_scores = true;
  /// selectors::two_stage (CriticalKV): only the stage-1 part of the rank rule can be checked
  /// from maybe_scores (stage 2 ranks a score the evictor does not return).
  bool two_stage = false;
  float first_stage_ratio = 1.0f;
  /// false for AdaKV with the reference's per-head rounding (budgeters::adakv exact_total = false,
  /// presets::adakv_published): max_selected is then an upper bound, not the count.
  bool exact_count = true;
  std::int64_t W = 0;
  std::int64_t out_heads = 1, kv_heads = 1;
  kvevict::budget_request budget;

  template <class P>
  static contract of(const typename P::params& p, std::int64_t W, std::int64_t out_heads, std::int64_t kv_heads,
                     kvevict::budget_request budget) {
    contract c;
    c.num_sink = p.selector.num_sink;
    c.num_recent = p.selector.num_recent;
    c.recent_share = p.selector.recent_share;
    c.uniform_budget = std::is_same<typename P::budgeter, kvevict::budgeters::uniform>::value;
    c.learned_budget = std::is_same<typename P::budgeter, kvevict::budgeters::headwise_learned>::value;
    c.scorer_has_scores = P::scorer::has_scores;
    if constexpr (std::is_same<typename P::selector, kvevict::selectors::two_stage>::value) {
      c.two_stage = true;
      c.first_stage_ratio = p.selector.first_stage_ratio;
    }
    if constexpr (std::is_same<typename P::budgeter, kvevict::budgeters::adakv>::value) c.exact_count = p.budgeter.exact_total;
    c.W = W;
    c.out_heads = out_heads;
    c.kv_heads = kv_heads;
    c.budget = budget;
    return c;
  }

  /// Base budget of a head of length L by the documented rule.
  std::int64_t base_budget(std::int64_t L) const {
    if (budget.keep_tokens > 0) return budget.keep_tokens;
    std::int64_t b = static_cast<std::int64_t>(std::floor(budget.keep_fraction * static_cast<double>(L)));
    const std::int64_t fixed_recent = recent_share >= 0.0f ? 0 : (num_recent >= 0 ? num_recent : W);
    const std::int64_t floor_b = std::min<std::int64_t>(L, num_sink + fixed_recent);
    return std::max<std::int64_t>({b, floor_b, 1});
  }
  std::int64_t recent(std::int64_t L, std::int64_t B) const {
    const std::int64_t sinks = std::min<std::int64_t>(num_sink, L);
    std::int64_t r;
    if (recent_share >= 0.0f) {
      const std::int64_t free = B - num_sink;
      r = free > 0 ? static_cast<std::int64_t>(std::floor(static_cast<double>(recent_share) * static_cast<double>(free))) : 0;
    } else {
      r = num_recent >= 0 ? num_recent : W;
    }
    return std::min(r, L - sinks);
  }

  /// Not a template (one copy per translation unit, not one per preset x storage type: the
  /// robustness units and the fuzzer call it for every combination; docs/compiled-mode.md).
  using lengths_fn = std::function<std::int64_t(std::int64_t b, std::int64_t hkv)>;
  using positions_fn = std::function<std::int32_t(std::int64_t b, std::int64_t hkv, std::int32_t slot)>;
  std::string check(const result& res, const lengths_fn& lengths, const positions_fn& positions,
                    std::int64_t batch) const {
    auto fail = [](const std::string& s) { return s; };
    const std::int64_t rows = batch * out_heads;
    if (res.rows != rows) return fail("rows " + std::to_string(res.rows) + " != " + std::to_string(rows));
    if (res.indptr[0] != 0) return fail("indptr[0] != 0");
    if (exact_count ? res.indptr[static_cast<std::size_t>(rows)] != res.max_selected
                    : res.indptr[static_cast<std::size_t>(rows)] > res.max_selected)
      return fail("indptr[rows] = " + std::to_string(res.indptr[static_cast<std::size_t>(rows)]) +
                  (exact_count ? " != max_selected = " : " > max_selected = ") + std::to_string(res.max_selected));
    const std::int64_t G = out_heads / kv_heads;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / out_heads, hk = (r % out_heads) / G;
      const std::int64_t L = lengths(b, hk);
      const std::int32_t a = res.indptr[static_cast<std::size_t>(r)], e = res.indptr[static_cast<std::size_t>(r + 1)];
      const std::string at = " (row " + std::to_string(r) + ", L " + std::to_string(L) + ")";
      if (e < a) return fail("indptr decreasing" + at);
      const std::int64_t n = e - a;
      for (std::int32_t i = a; i < e; ++i) {
        const std::int32_t s = res.indices[static_cast<std::size_t>(i)];
        if (s < 0 || s >= L) return fail("index " + std::to_string(s) + " outside [0, L)" + at);
        if (i > a && s <= res.indices[static_cast<std::size_t>(i - 1)]) return fail("indices not strictly ascending" + at);
        if (res.positions[static_cast<std::size_t>(i)] != positions(b, hk, s)) return fail("positions misaligned" + at);
      }
      const float* sc = res.scores.data() + r * res.seq;
      for (std::int64_t t = 0; t < res.seq; ++t)
        if (!std::isfinite(sc[t])) return fail("maybe_scores[" + std::to_string(t) + "] not finite" + at);
      for (std::int64_t t = L; t < res.seq; ++t)
        if (sc[t] != 0.0f) return fail("maybe_scores nonzero at a pad slot" + at);
      const std::int64_t B = base_budget(L);
      if (learned_budget && n == L) continue;  // whole row (ascending + in range + count L => 0..L-1)
      if (!learned_budget && L <= B) {
        if (n != L) return fail("pass-through row keeps " + std::to_string(n) + " of " + std::to_string(L) + at);
        for (std::int64_t t = 0; t < L; ++t)
          if (sc[t] != 0.0f) return fail("maybe_scores nonzero on a pass-through row" + at);
        continue;  // ascending + in range + count L => 0..L-1
      }
      // (recent_share splits the base budget, as the front-end plans every head before any budgeter)
      const std::int64_t sinks = std::min<std::int64_t>(num_sink, L), R = recent(L, B);
      if (n < sinks + R) return fail("keeps fewer than the protected tokens" + at);
      if (n > L) return fail("keeps more than L" + at);
      if (uniform_budget && n != B) return fail("keeps " + std::to_string(n) + " != budget " + std::to_string(B) + at);
      // (a learned budget may be 0: LKV-H's per-head floor is 0 in the paper's setting, spec lkv.md)
      if (L > 0 && n == 0 && !learned_budget) return fail("empty row of a non-empty head" + at);
      std::vector<char> kept(static_cast<std::size_t>(L), 0);
      for (std::int32_t i = a; i < e; ++i) kept[static_cast<std::size_t>(res.indices[static_cast<std::size_t>(i)])] = 1;
      for (std::int64_t t = 0; t < sinks; ++t)
        if (!kept[static_cast<std::size_t>(t)]) return fail("sink " + std::to_string(t) + " lost" + at);
      for (std::int64_t t = L - R; t < L; ++t)
        if (!kept[static_cast<std::size_t>(t)]) return fail("recent token " + std::to_string(t) + " lost" + at);
      for (std::int64_t t = 0; t < sinks; ++t)
        if (sc[t] != 0.0f) return fail("maybe_scores nonzero at a sink" + at);
      for (std::int64_t t = L - R; t < L; ++t)
        if (sc[t] != 0.0f) return fail("maybe_scores nonzero at a recent token" + at);
      // Candidates: the kept ones must be the top (n - protected) by (score desc, index asc).
      if (scorer_has_scores) {
        std::vector<std::int32_t> cand;
        for (std::int64_t t = sinks; t < L - R; ++t) cand.push_back(static_cast<std::int32_t>(t));
        std::stable_sort(cand.begin(), cand.end(), [sc](std::int32_t x, std::int32_t y) { return sc[x] > sc[y]; });
        const std::int64_t k = n - sinks - R;
        if (two_stage) {  // the first floor(ratio * k) by maybe_scores (stage 1) must be kept
          const std::int64_t k1 =
              static_cast<std::int64_t>(std::floor(static_cast<double>(first_stage_ratio) * static_cast<double>(k)));
          for (std::int64_t i = 0; i < k1; ++i)
            if (!kept[static_cast<std::size_t>(cand[static_cast<std::size_t>(i)])])
              return fail("stage-1 candidate " + std::to_string(cand[static_cast<std::size_t>(i)]) +
                          " (maybe_scores rank " + std::to_string(i) + " < " + std::to_string(k1) + ") evicted" + at);
          continue;
        }
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(cand.size()); ++i) {
          const bool should = i < k;
          if (should != static_cast<bool>(kept[static_cast<std::size_t>(cand[static_cast<std::size_t>(i)])]))
            return fail("candidate " + std::to_string(cand[static_cast<std::size_t>(i)]) +
                        (should ? " should be kept" : " should be evicted") + " by its maybe_scores rank (score " +
                        std::to_string(sc[cand[static_cast<std::size_t>(i)]]) + ", rank " + std::to_string(i) + " of " +
                        std::to_string(cand.size()) + ", " + std::to_string(k) + " kept; the score at rank k - 1: " +
                        (k > 0 ? std::to_string(sc[cand[static_cast<std::size_t>(k - 1)]]) : std::string("none")) + ")" + at);
        }
      } else {
        // No scorer (StreamingLLM): the most recent candidates fill the rest.
        const std::int64_t k = n - sinks - R;
        for (std::int64_t t = L - R - k; t < L - R; ++t)
          if (!kept[static_cast<std::size_t>(t)]) return fail("scoreless selection is not the most recent" + at);
      }
    }
    return "";
  }
};

/// Checker bound to a problem's lengths and positions.
template <class P, class T>
inline std::string check_contract(const kvevict::evictor<P, kvevict::cpu::backend>& ev, const problem<T>& pr,
                                  const result& res, kvevict::budget_request budget) {
  const contract c = contract::of<P>(ev.params(), pr.in.window(), ev.out_heads(pr.in), pr.sh.Hkv, budget);
  return c.check(
      res, [&](std::int64_t b, std::int64_t h) { return pr.length(b, h); },
      [&](std::int64_t b, std::int64_t h, std::int32_t s) {
        return pr.pos.empty() ? s : pr.pos[static_cast<std::size_t>((b * pr.sh.Hkv + h) * pr.sh.S + s)];
      },
      pr.sh.B);
}

/// Default parameters of a preset adapted to a multi-layer problem (PyramidKV needs a layer
/// schedule to be non-trivial).
template <class P, class T>
inline void set_layer(problem<T>& pr) {
  pr.in.num_layers = 4;
  pr.in.layer_idx = 1;
}

}  // namespace robust
