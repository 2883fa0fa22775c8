// kvevict CPU backend (Eigen 3.4): evictor<Policy, cpu::backend>, compaction, W_O factors, and
// the CPU implementation of every built-in stage (backends/cpu/impl.hpp lists the traits).
#pragma once

//
// The CPU stage list: every built-in policy's CPU implementation is included here (scorers.hpp
// and smoothers.hpp list theirs; budgeters and selectors below). A new built-in adds its file to
// its stage's list; the evictor itself includes none of them.
#include "kvevict/kvevict.hpp"
#include "kvevict/backends/cpu/backend.hpp"
#include "kvevict/backends/cpu/budgeters/adakv.hpp"
#include "kvevict/backends/cpu/budgeters/threshold.hpp"
#include "kvevict/backends/cpu/compact.hpp"
#include "kvevict/backends/cpu/compact_paged.hpp"
#include "kvevict/backends/cpu/evictor.hpp"
#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/backends/cpu/scorers.hpp"
#include "kvevict/backends/cpu/select.hpp"
#include "kvevict/backends/cpu/selectors/topk.hpp"
#include "kvevict/backends/cpu/selectors/two_stage.hpp"
#include "kvevict/backends/cpu/smoothers.hpp"
#include "kvevict/backends/cpu/wo_factor.hpp"

// The compiled mode (kvevict::compiled defines KVEVICT_COMPILED): the presets' instantiations live
// in the library; this declares them extern (docs/compiled-mode.md).
#if defined(KVEVICT_COMPILED)
#include "kvevict/backends/cpu/compiled.hpp"
#endif
