// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of scorers::accumulated_attention (H2O, Zhang et al. 2023): column sums of the
// attention of all prompt queries (the window is the whole prompt), optionally divided by the
// number of queries that see each token (normalize_by_visible).
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/scorers/window_scorer.hpp"
#include "kvevict/policies/scorers.hpp"

namespace kvevict {
namespace cpu {

template <>
struct scorer_impl<scorers::accumulated_attention> : detail::window_scorer<scorer_impl<scorers::accumulated_attention>>,
                                                     detail::window_hooks {
  /// H2O accumulates: its window is every prompt query (no candidates before it for a floor) and
  /// normalize_by_visible divides a sum; a row maximum has no meaning here.
  static constexpr bool linear_temporal_only = true;
  using detail::window_scorer<scorer_impl<scorers::accumulated_attention>>::score;
  template <class Ctx>
  static void finish_head(Ctx& c, detail::head_scratch&, std::int64_t, float* out, float*) {
    const std::int64_t L = c.L, w = c.w;
    if (c.P.scorer.normalize_by_visible) {
      for (std::int64_t n = 0; n < L; ++n) {
        const std::int64_t first_row = std::max<std::int64_t>(0, n - (L - w));
        const std::int64_t cnt = w - first_row;
        out[n] = cnt > 0 ? out[n] / static_cast<float>(cnt) : 0.0f;
      }
    }
    for (std::int64_t n = 0; n < L; ++n) out[n] = detail::saturate(out[n]);
  }
};

}  // namespace cpu
}  // namespace kvevict
