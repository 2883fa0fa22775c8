// kvevict_fidelity: the registry of report rows (methods).
//
// A row is a kvevict_engine::method: a name, the number of window queries it reads, and a function that
// evicts one layer of the engine's cache given the engine state (kvevict_engine::layer_state).
// Built-in rows: ReST-KV, SnapKV, PyramidKV, AdaKV, H2O, TOVA, StreamingLLM, KeyNorm, the random floor and the
// oracle (orders 0..99). To add rows from a separate file, create examples/fidelity/methods_<name>.cpp
// (CMake picks up every methods_*.cpp) containing, for example:
//
//   #include "methods.hpp"
//   static kvevict_fidelity::register_method lkv_row(100, kvevict_engine::policy_method<my_policy>("LKV"));
//
// or any method whose `evict` function compacts the layer itself (see oracle.hpp for a hand-made one).
// Rows are reported in increasing `order`, then registration order. See docs/fidelity.md.
#pragma once

#include "evict.hpp"
#include "oracle.hpp"
#include "random_policy.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <vector>

namespace kvevict_fidelity {

struct registered_method {
    int order = 0;
    kvevict_engine::method m;
};

/// The global list of extra rows (function-local static: safe to use from static initialisers).
inline std::vector<registered_method>& method_registry() {
    static std::vector<registered_method> r;
    return r;
}

/// Registers a row at static-initialisation time: `static register_method r(order, method);`.
struct register_method {
    register_method(int order, kvevict_engine::method m) { method_registry().push_back({order, std::move(m)}); }
};

/// The built-in rows, papers' default parameters, window 32 (H2O: every prompt query). Defined in
/// methods_builtin.cpp, compiled once for every report program (the evictors of every preset are
/// instantiated there, not in each program's translation unit).
/// `full`: also the rows that cost most and say least (Greedy-W-pqh), kvevict_fidelity --full.
std::vector<registered_method> builtin_methods(bool full = false);

/// ReST-KV ablation rows (kvevict_fidelity --ablations), one change each from the published defaults,
/// along the paper's ablation axes. Diagnostics only: the report's ReST-KV row keeps the defaults.
std::vector<registered_method> restkv_ablation_methods();

/// Built-in rows followed by the registered ones, sorted by order (stable).
/// `ablations`: also the ReST-KV ablation rows; `full`: builtin_methods(full).
std::vector<kvevict_engine::method> report_methods(bool ablations = false, bool full = false);

}  // namespace kvevict_fidelity
