// IWYU pragma: private, include "kvevict/kvevict.hpp"
// kvevict::layer_wide_topk: one budget over every layer and KV head of a sequence (Layer-DefensiveKV,
// Feng et al., ICLR 2026, arXiv 2510.13334; the authors' EfficientAdaGlobalScorerPress).
//
// A per-layer method keeps B tokens per head in every layer. A layer-wide one ranks the candidates of
// every layer and head of the sequence together and keeps the best T = sum over (layer, head) of
// (B - protected) of them, so a layer whose scores are high keeps more. It needs every layer's scores
// before any layer is cut; during a layer-wise prefill that means:
//   1. as each layer is prefilled, run its evictor with maybe_scores (the selection is discarded;
//      nothing is compacted yet) and add_layer() the scores: the object copies each row's candidate
//      scores (4 bytes and a 1-byte flag per candidate: a 5 / (2 head_dim x bytes per element)
//      fraction of the KV it ranks, 1/102 of an fp16 cache at head_dim 128; cut() takes 4 more bytes
//      per candidate while it runs);
//   2. after the last layer, cut(T): one flattened top-T over every stored candidate (ties: the lower
//      layer, then the lower row, then the lower index; NaN below every number);
//   3. selection(l, ...) writes layer l's kept slots (the row's protected tokens and its winners,
//      ascending) in the evictor's selection format, for the engine's compaction (cpu::compact,
//      compact_paged, ...); kept(l) its size.
// The total is exact: T candidates plus the protected tokens, whatever the layers' shares. The
// attention of the prefill itself never needs the cut (every layer sees its full cache while it is
// prefilled, as the reference does), so the cut costs one extra pass of scoring and no accuracy.
// Scores must be comparable across layers (DefensiveKV's are: attention mass times a value-norm share
// that sums to 1 over the heads). One object per sequence.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"

namespace kvevict {

class layer_wide_topk {
 public:
  /// Starts an allocation over num_layers layers of `rows` rows each (the evictor's out_heads of one
  /// sequence). Errors: num_layers < 1, rows < 1.
  status reset(int num_layers, std::int64_t rows) {
    if (num_layers < 1) return status::error(errc::invalid_argument, "num_layers = %d must be >= 1", num_layers);
    if (rows < 1) return status::error(errc::invalid_argument, "rows = %lld must be >= 1", static_cast<long long>(rows));
    layers_.assign(static_cast<std::size_t>(num_layers), layer_data{});
    rows_ = rows;
    cut_ = false;
    return {};
  }

  /// Layer `layer`'s scores: `scores` row r at scores + r * stride (what run(..., maybe_scores) writes
  /// for a batch of one), and per row its length L, protected first tokens `sinks` and protected last
  /// tokens `recent` (the candidates are [sinks, L - recent)). A row with L <= its budget that the
  /// evictor kept whole is added with sinks + recent = L (no candidates). Copies the candidates.
  /// Errors: layer out of range or added twice, null pointers, stride < max L, a row's sinks, recent
  /// or L negative or sinks + recent > L, a call after cut().
  status add_layer(int layer, const float* scores, std::int64_t stride, const std::int64_t* lengths, const std::int64_t* sinks,
                   const std::int64_t* recent) {
    if (cut_) return status::error(errc::invalid_argument, "add_layer after cut(): reset() first");
    if (layer < 0 || layer >= static_cast<int>(layers_.size()))
      return status::error(errc::invalid_argument, "layer = %d outside [0, %d)", layer, static_cast<int>(layers_.size()));
    layer_data& ly = layers_[static_cast<std::size_t>(layer)];
    if (ly.added) return status::error(errc::invalid_argument, "layer = %d was added twice", layer);
    if (!scores || !lengths || !sinks || !recent) return status::error(errc::null_pointer, "add_layer: scores, lengths, sinks and recent must be set");
    for (std::int64_t r = 0; r < rows_; ++r) {
      const std::int64_t L = lengths[r], s = sinks[r], t = recent[r];
      if (L < 0 || s < 0 || t < 0 || s + t > L)
        return status::error(errc::invalid_argument, "row %lld: length %lld, sinks %lld, recent %lld (need 0 <= sinks + recent <= length)",
                             static_cast<long long>(r), static_cast<long long>(L), static_cast<long long>(s), static_cast<long long>(t));
      if (L > stride)
        return status::error(errc::invalid_argument, "stride = %lld is below row %lld's length %lld", static_cast<long long>(stride),
                             static_cast<long long>(r), static_cast<long long>(L));
    }
    ly.begin.resize(static_cast<std::size_t>(rows_ + 1));
    ly.len.assign(lengths, lengths + rows_);
    ly.sinks.assign(sinks, sinks + rows_);
    ly.recent.assign(recent, recent + rows_);
    ly.scores.clear();
    for (std::int64_t r = 0; r < rows_; ++r) {
      ly.begin[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(ly.scores.size());
      ly.scores.insert(ly.scores.end(), scores + r * stride + sinks[r], scores + r * stride + lengths[r] - recent[r]);
    }
    ly.begin[static_cast<std::size_t>(rows_)] = static_cast<std::int64_t>(ly.scores.size());
    ly.won.assign(ly.scores.size(), 0);
    ly.added = true;
    return {};
  }

  /// Keeps `total` candidates over every layer and row (all of them when total exceeds their number):
  /// the T-th largest score by nth_element over a float copy, O(candidates). Errors: a layer not
  /// added, total < 0 (nothing changes on error).
  status cut(std::int64_t total) {
    if (total < 0) return status::error(errc::invalid_argument, "total = %lld must be >= 0", static_cast<long long>(total));
    std::vector<float> numbers;  // every stored score that is a number (4 bytes per candidate)
    std::int64_t all = 0;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (!layers_[l].added) return status::error(errc::invalid_argument, "layer %d was not added before cut()", static_cast<int>(l));
      all += static_cast<std::int64_t>(layers_[l].scores.size());
    }
    numbers.reserve(static_cast<std::size_t>(all));
    for (auto& ly : layers_) {
      std::fill(ly.won.begin(), ly.won.end(), 0);
      for (float x : ly.scores)
        if (x == x) numbers.push_back(x);
    }
    const std::int64_t T = std::min(total, all), nnum = static_cast<std::int64_t>(numbers.size());
    // Winners: every number above the T-th largest, then the ties at it and (when T reaches past the
    // numbers) the NaNs, each in (layer, row, index) order until T are taken.
    std::int64_t above = 0;
    float theta = 0.0f;
    bool nan_cut = T > nnum;  // every number wins; NaNs fill the rest
    if (!nan_cut && T > 0) {
      std::nth_element(numbers.begin(), numbers.begin() + (T - 1), numbers.end(), [](float a, float b) { return a > b; });
      theta = numbers[static_cast<std::size_t>(T - 1)];
    }
    if (T > 0) {
      for (auto& ly : layers_)
        for (std::size_t i = 0; i < ly.scores.size(); ++i) {
          const float x = ly.scores[i];
          if (x == x && (nan_cut || x > theta)) {
            ly.won[i] = 1;
            ++above;
          }
        }
      std::int64_t left = T - above;  // ties at theta (or NaNs), in order
      for (auto& ly : layers_)
        for (std::size_t i = 0; i < ly.scores.size() && left > 0; ++i) {
          const float x = ly.scores[i];
          if (ly.won[i]) continue;
          if (nan_cut ? !(x == x) : x == theta) {
            ly.won[i] = 1;
            --left;
          }
        }
    }
    cut_ = true;
    return {};
  }

  /// Tokens layer `layer` keeps in all (protected + winners) after cut(); -1 before cut() or out of range.
  std::int64_t kept(int layer) const {
    if (!cut_ || layer < 0 || layer >= static_cast<int>(layers_.size())) return -1;
    const layer_data& ly = layers_[static_cast<std::size_t>(layer)];
    std::int64_t n = 0;
    for (std::int64_t r = 0; r < rows_; ++r) n += ly.sinks[static_cast<std::size_t>(r)] + ly.recent[static_cast<std::size_t>(r)];
    for (unsigned char w : ly.won) n += w;
    return n;
  }

  /// Layer `layer`'s selection after cut(): out.indptr (rows + 1) and out.indices (kept(layer)), each
  /// row's protected tokens and winners in ascending slot order. out.positions must be null: the object
  /// never saw the cache's positions (map the kept slots through the cache's own position table, as
  /// compaction does). Errors: before cut(), layer out of range, null indptr / indices, positions set,
  /// capacity below kept(layer). Nothing is written on error.
  status selection(int layer, selection_view out) const {
    if (!cut_) return status::error(errc::invalid_argument, "selection() before cut()");
    if (layer < 0 || layer >= static_cast<int>(layers_.size()))
      return status::error(errc::invalid_argument, "layer = %d outside [0, %d)", layer, static_cast<int>(layers_.size()));
    if (!out.indptr || !out.indices) return status::error(errc::null_pointer, "selection.indptr and selection.indices must be set");
    if (out.positions)
      return status::error(errc::invalid_argument,
                           "selection.positions must be null: layer_wide_topk does not know the cache's positions (map the kept slots)");
    const std::int64_t need = kept(layer);
    if (out.capacity < need)
      return status::error(errc::insufficient_capacity, "selection.capacity = %lld < kept tokens = %lld", static_cast<long long>(out.capacity),
                           static_cast<long long>(need));
    const layer_data& ly = layers_[static_cast<std::size_t>(layer)];
    std::int64_t k = 0;
    out.indptr[0] = 0;
    for (std::int64_t r = 0; r < rows_; ++r) {
      const std::int64_t L = ly.len[static_cast<std::size_t>(r)], s = ly.sinks[static_cast<std::size_t>(r)],
                         t = ly.recent[static_cast<std::size_t>(r)], b = ly.begin[static_cast<std::size_t>(r)];
      auto put = [&](std::int64_t slot) {
        out.indices[k++] = static_cast<std::int32_t>(slot);
      };
      for (std::int64_t n = 0; n < s; ++n) put(n);
      for (std::int64_t n = s; n < L - t; ++n)
        if (ly.won[static_cast<std::size_t>(b + n - s)]) put(n);
      for (std::int64_t n = L - t; n < L; ++n) put(n);
      out.indptr[r + 1] = static_cast<std::int32_t>(k);
    }
    return {};
  }

 private:
  struct layer_data {
    bool added = false;
    std::vector<std::int64_t> begin, len, sinks, recent;
    std::vector<float> scores;
    std::vector<unsigned char> won;
  };
  std::vector<layer_data> layers_;
  std::int64_t rows_ = 0;
  bool cut_ = false;
};

}  // namespace kvevict
