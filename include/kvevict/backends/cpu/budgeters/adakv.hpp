// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of budgeters::adakv (Feng et al. 2024), the score-driven budgeter: the
// layer's top-T candidate scores over the heads of a sequence decide each head's share, then
// budgeters::adakv::apportion_budgets (host-device, shared with CUDA) rounds it (adakv_budgets).
// The per-head and whole-layer budgeters (uniform, pyramid, headwise_learned) need no CPU code:
// the front-end runs them (frontend/frontend.hpp).
#pragma once

#include <cstdint>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/select.hpp"
#include "kvevict/policies/budgeters.hpp"

namespace kvevict {
namespace cpu {

template <>
struct budgeter_impl<budgeters::adakv> {
  static void score_budgets(const budgeters::adakv::params& p, const kvevict::detail::head_plan* plans, const float* const* rows,
                            std::int64_t H, std::int64_t* budgets) {
    detail::adakv_budgets(p, plans, rows, H, budgets);
  }
};

}  // namespace cpu
}  // namespace kvevict
