// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of selectors::topk: sinks and recent tokens by rule, the top k of the
// candidates by score (NaN last, ties to the lower index), ascending (select_head).
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/select.hpp"
#include "kvevict/policies/selectors.hpp"

namespace kvevict {
namespace cpu {

template <>
struct selector_impl<selectors::topk> {
  static std::int64_t select(const selectors::topk::params&, const kvevict::detail::head_plan& h, std::int64_t budget,
                             const float* scores, const float* /*scores2*/, std::int32_t* out, std::int32_t* idx, float* /*tmp*/) {
    return detail::select_head(h, budget, scores, out, idx);
  }
};

}  // namespace cpu
}  // namespace kvevict
