// The top-level handle: evictor<Policy, Backend>.
//
// Lifecycle (CUTLASS initialize / FlashInfer plan-run + CUB two-phase workspace):
//   kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev;   // defaults()
//   kvevict::eviction_plan plan;
//   status s = ev.plan(inputs, budget, &plan);              // every check; sizes (frontend/plan.hpp)
//   // plan.workspace_bytes: scratch the run needs; plan.max_selected: size of selection.indices
//   s = ev.run(plan, inputs, selection, workspace, plan.workspace_bytes);  // repeats no check
// Thin wrappers: can_implement(inputs, budget), workspace_size(inputs), max_selected(inputs,
// budget), run(inputs, budget, selection, workspace, bytes) (plan + run).
// Each backend specialises evictor for its tag (kvevict/cpu.hpp, kvevict/cuda.cuh).
#pragma once

#include "kvevict/core/config.hpp"

namespace kvevict {

/// Primary template: a Backend without an evictor implementation fails at the call site.
template <class Policy, class Backend>
class evictor {
  static_assert(detail::dependent_false<Policy, Backend>,
                "kvevict: no evictor for this Backend; include kvevict/cpu.hpp (cpu::backend) or "
                "kvevict/cuda.cuh (cuda::backend)");
};

}  // namespace kvevict
