// The body of every translation unit of kvevict::compiled (src/cpu/*.cpp): each unit defines
// KVEVICT_COMPILED_UNIT_<name> for its group of KVEVICT_CPU_COMPILED_PRESETS
// (kvevict/backends/cpu/compiled.hpp, the one list of what the compiled mode holds) and includes
// this file, which explicitly instantiates the presets of that group for every storage type.
// The unit `functions` instantiates the backend's free function templates instead.
#pragma once

#define KVEVICT_COMPILED_BUILDING 1  // the definitions below, not the extern declarations
#include "kvevict/cpu.hpp"
#include "kvevict/backends/cpu/compiled.hpp"

#define KVEVICT_SRC_EVICTOR_(POLICY, T) KVEVICT_CPU_EVICTOR_INSTANCE(, POLICY, T)
#define KVEVICT_SRC_PRESET_(POLICY) KVEVICT_CPU_COMPILED_TYPES(KVEVICT_SRC_EVICTOR_, POLICY)
#define KVEVICT_SRC_SKIP_(POLICY)

#ifdef KVEVICT_COMPILED_UNIT_restkv
#define KVEVICT_SRC_UNIT_restkv_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_restkv_ KVEVICT_SRC_SKIP_
#endif
#ifdef KVEVICT_COMPILED_UNIT_lkv_restkv
#define KVEVICT_SRC_UNIT_lkv_restkv_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_lkv_restkv_ KVEVICT_SRC_SKIP_
#endif
#ifdef KVEVICT_COMPILED_UNIT_snapkv
#define KVEVICT_SRC_UNIT_snapkv_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_snapkv_ KVEVICT_SRC_SKIP_
#endif
#ifdef KVEVICT_COMPILED_UNIT_adakv
#define KVEVICT_SRC_UNIT_adakv_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_adakv_ KVEVICT_SRC_SKIP_
#endif
#ifdef KVEVICT_COMPILED_UNIT_criticalkv
#define KVEVICT_SRC_UNIT_criticalkv_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_criticalkv_ KVEVICT_SRC_SKIP_
#endif
#ifdef KVEVICT_COMPILED_UNIT_rules
#define KVEVICT_SRC_UNIT_rules_ KVEVICT_SRC_PRESET_
#else
#define KVEVICT_SRC_UNIT_rules_ KVEVICT_SRC_SKIP_
#endif

#define KVEVICT_SRC_SELECT_(UNIT, POLICY) KVEVICT_SRC_UNIT_##UNIT##_(POLICY)
KVEVICT_CPU_COMPILED_PRESETS(KVEVICT_SRC_SELECT_)

#ifdef KVEVICT_COMPILED_UNIT_functions
#define KVEVICT_SRC_FUNCTIONS_(UNUSED, T) KVEVICT_CPU_FUNCTIONS_INSTANCE(, T)
KVEVICT_CPU_COMPILED_TYPES(KVEVICT_SRC_FUNCTIONS_, unused)
#endif
