// IWYU pragma: private, include "kvevict/cuda.cuh"
// Per-head budgeters on CUDA (budgeters::uniform, budgeters::pyramid, and any budgeter whose
// allocation is a KVEVICT_HOST_DEVICE head_budget(params, plan, layer, num_layers) with neither
// needs_scores nor a whole-layer layer_budgets): nothing to launch. The plan kernel calls
// head_budget for every row (budget_kind::per_head), so budgets are the CPU's bit for bit and the
// host computes the same numbers for max_selected.
#pragma once

#include <type_traits>

#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/frontend/frontend.hpp"

namespace kvevict {
namespace cuda {

template <class Budgeter>
struct budgeter_impl<Budgeter, std::enable_if_t<kvevict::detail::budget_kind_of<Budgeter> == kvevict::detail::budget_kind::per_head>>
    : budgeter_impl_base {};

}  // namespace cuda
}  // namespace kvevict
