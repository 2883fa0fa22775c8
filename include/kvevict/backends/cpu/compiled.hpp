// IWYU pragma: private, include "kvevict/cpu.hpp"
// The compiled mode of the CPU backend (docs/compiled-mode.md): the instantiations that the
// library target kvevict::compiled holds, and the explicit instantiation declarations that keep a
// user translation unit from instantiating them again.
//
// What is instantiated: for every preset of kvevict/presets.hpp (the published methods and the
// LKV compositions) and every storage type (fp32 `float`, fp16 `half_t`, bf16 `bfloat16_t`),
// the three members of evictor<Preset, cpu::backend> that instantiate the stages (plan, the run
// driver, the workspace sizing; backends/cpu/evictor.hpp defines them outside the class so that
// they are not inline); and cpu::compute_wo_factors, compact, compact_ragged, compact_paged and
// compact_paged_workspace_size for the same three storage types. Everything else (the thin public
// wrappers, custom policies, other storage types) stays header-only and is instantiated where it is
// used, as without the compiled mode.
//
// Use: link kvevict::compiled (CMake; it defines KVEVICT_COMPILED=1 for its users) and include
// kvevict/cpu.hpp as usual; this header is included at its end when KVEVICT_COMPILED is defined.
// Results are bit-identical to header-only use when the library and the user's code are compiled
// with the same flags (the same template code, compiled once).
#pragma once

#include <cstddef>

#include "kvevict/backends/cpu/compact.hpp"
#include "kvevict/backends/cpu/compact_paged.hpp"
#include "kvevict/backends/cpu/evictor.hpp"
#include "kvevict/backends/cpu/wo_factor.hpp"
#include "kvevict/presets.hpp"

/// The presets of the compiled mode, as X(unit, policy): `unit` names the library translation unit
/// (src/cpu/presets_<unit>.cpp) that instantiates the policy, grouped so that the units cost
/// about the same to compile.
#define KVEVICT_CPU_COMPILED_PRESETS(X)                  \
  X(restkv, ::kvevict::presets::restkv)                   \
  X(lkv_restkv, ::kvevict::presets::lkv_budgets_restkv)   \
  X(snapkv, ::kvevict::presets::snapkv)                   \
  X(snapkv, ::kvevict::presets::pyramidkv)                \
  X(adakv, ::kvevict::presets::adakv)                     \
  X(adakv, ::kvevict::presets::adakv_published)           \
  X(adakv, ::kvevict::presets::lkv_budgets_attention)     \
  X(criticalkv, ::kvevict::presets::criticalkv)           \
  X(criticalkv, ::kvevict::presets::critical_adakv)       \
  X(rules, ::kvevict::presets::h2o)                       \
  X(rules, ::kvevict::presets::tova)                      \
  X(rules, ::kvevict::presets::streaming_llm)             \
  X(rules, ::kvevict::presets::key_norm)                  \
  X(rules, ::kvevict::presets::lkv)                       \
  X(rules, ::kvevict::presets::lkv_uniform_budgets)

/// The storage types of the compiled mode.
#define KVEVICT_CPU_COMPILED_TYPES(X, ARG) \
  X(ARG, float)                            \
  X(ARG, ::kvevict::bfloat16_t)            \
  X(ARG, ::kvevict::half_t)

/// Explicit instantiation (KW empty) or its declaration (KW extern) of one evictor for one type.
#define KVEVICT_CPU_EVICTOR_INSTANCE(KW, POLICY, T)                                                                             \
  KW template ::kvevict::status kvevict::evictor<POLICY, ::kvevict::cpu::backend>::plan<T>(                                   \
      const ::kvevict::layer_inputs<T>&, const ::kvevict::budget_request&, ::kvevict::eviction_plan*,                           \
      const ::kvevict::plan_options&) const;                                                                                    \
  KW template ::kvevict::status kvevict::evictor<POLICY, ::kvevict::cpu::backend>::run_impl<T>(                               \
      const ::kvevict::eviction_plan&, const ::kvevict::layer_inputs<T>&, ::kvevict::selection_view, void*, std::size_t, float*, \
      ::kvevict::distributed::detail::layer_exchange*, const ::kvevict::distributed::shard*) const;                             \
  KW template std::size_t kvevict::evictor<POLICY, ::kvevict::cpu::backend>::workspace_bytes<T>(                              \
      const ::kvevict::layer_inputs<T>&, int) const;

/// The same for the backend's free function templates of one type.
#define KVEVICT_CPU_FUNCTIONS_INSTANCE(KW, T)                                                                                       \
  KW template ::kvevict::status kvevict::cpu::compute_wo_factors<T>(::kvevict::strided_view<const T, 2>, std::int64_t,             \
                                                                    std::int64_t, float*);                                          \
  KW template ::kvevict::status kvevict::cpu::compact<T>(::kvevict::kv_view<const T>, ::kvevict::const_selection_view,             \
                                                         ::kvevict::kv_view<T>);                                                    \
  KW template ::kvevict::status kvevict::cpu::compact_ragged<T>(::kvevict::kv_view<const T>, ::kvevict::const_selection_view, T*, \
                                                                std::int64_t);                                                      \
  KW template std::size_t kvevict::cpu::compact_paged_workspace_size<T>(const ::kvevict::paged_cache<T>&);                         \
  KW template ::kvevict::status kvevict::cpu::compact_paged<T>(const ::kvevict::paged_cache<T>&, ::kvevict::const_selection_view,  \
                                                               ::kvevict::paged_compaction_result, void*, std::size_t);

#if defined(KVEVICT_COMPILED) && !defined(KVEVICT_COMPILED_BUILDING)
#define KVEVICT_CPU_EXTERN_EVICTOR_(POLICY, T) KVEVICT_CPU_EVICTOR_INSTANCE(extern, POLICY, T)
#define KVEVICT_CPU_EXTERN_PRESET_(UNIT, POLICY) KVEVICT_CPU_COMPILED_TYPES(KVEVICT_CPU_EXTERN_EVICTOR_, POLICY)
#define KVEVICT_CPU_EXTERN_FUNCTIONS_(UNUSED, T) KVEVICT_CPU_FUNCTIONS_INSTANCE(extern, T)
KVEVICT_CPU_COMPILED_PRESETS(KVEVICT_CPU_EXTERN_PRESET_)
KVEVICT_CPU_COMPILED_TYPES(KVEVICT_CPU_EXTERN_FUNCTIONS_, unused)
#undef KVEVICT_CPU_EXTERN_EVICTOR_
#undef KVEVICT_CPU_EXTERN_PRESET_
#undef KVEVICT_CPU_EXTERN_FUNCTIONS_
#endif
