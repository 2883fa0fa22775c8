// The top-level handle: evictor<Policy, Backend>.
//
// Lifecycle (CUTLASS adapter + CUB two-phase workspace):
//   kvevict::evictor<kvevict::presets::restkv, kvevict::cpu::backend> ev;   // defaults()
//   status s = ev.can_implement(inputs, budget);            // shapes, params, budget
//   std::size_t bytes = ev.workspace_size(inputs);          // scratch the run needs
//   std::int64_t cap = ev.max_selected(inputs, budget);     // size of selection.indices
//   s = ev.run(inputs, budget, selection, workspace, bytes);
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
