// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of selectors::two_stage (CriticalKV, Feng et al. 2025): protection as topk,
// then k1 candidates by the primary score and the rest by (a + eps) * u of the secondary row
// (select_head_two_stage). A head that was not scored keeps only its protected tokens.
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/select.hpp"
#include "kvevict/policies/selectors.hpp"

namespace kvevict {
namespace cpu {

template <>
struct selector_impl<selectors::two_stage> {
  static std::int64_t select(const selectors::two_stage::params& p, const kvevict::detail::head_plan& h, std::int64_t budget,
                             const float* scores, const float* scores2, std::int32_t* out, std::int32_t* idx, float* tmp) {
    return scores ? detail::select_head_two_stage(h, budget, scores, scores2, p, out, idx, tmp)
                  : detail::select_head(h, budget, nullptr, out, idx);
  }
};

}  // namespace cpu
}  // namespace kvevict
