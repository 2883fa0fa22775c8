// kvevict: header-only, policy-based KV-cache eviction for LLM inference.
// Umbrella of the core types, the policies and the front-end (no backend, no Eigen, no CUDA).
// For the CPU backend include kvevict/cpu.hpp; for CUDA, kvevict/cuda.cuh.
#pragma once

#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/core/config.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/numeric.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/status.hpp"
#include "kvevict/core/tensor_view.hpp"
#include "kvevict/core/workspace.hpp"
#include "kvevict/dispatch/dispatch.hpp"
#include "kvevict/evictor.hpp"
#include "kvevict/frontend/frontend.hpp"
#include "kvevict/frontend/plan.hpp"
#include "kvevict/policies/policy.hpp"
#include "kvevict/presets.hpp"
#include "kvevict/schedule/decode.hpp"
#include "kvevict/schedule/layer_wide.hpp"
#include "kvevict/version.hpp"
