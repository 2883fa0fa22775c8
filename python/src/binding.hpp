// kvevict Python binding: what the pybind11 module (module.cpp) and the method translation units
// (methods_*.cpp) share. No pybind11 here: the method units compile the evictors only, so that
// the heavy template instantiations build in parallel and pybind11 is parsed once.
//
// Tensors reach this layer as tensor_arg: a pointer with logical extents and strides in elements,
// already in kvevict's axis order (the Python layer permutes NHD views to (batch, heads, seq,
// head_dim) without copying; module.cpp reads them from DLPack capsules).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <kvevict/kvevict.hpp>

namespace kvevict_py {

/// Storage type of a tensor argument (DLPack dtype mapped).
enum class dtype : int { none = 0, f32, f16, bf16, i32, other };

inline const char* to_string(dtype t) {
  switch (t) {
    case dtype::none: return "none";
    case dtype::f32: return "float32";
    case dtype::f16: return "float16";
    case dtype::bf16: return "bfloat16";
    case dtype::i32: return "int32";
    case dtype::other: return "other";
  }
  return "?";
}

/// One tensor argument: data == nullptr means "not given". Extents and strides in elements,
/// in kvevict's logical axis order; ndim <= 4.
struct tensor_arg {
  void* data = nullptr;
  int device_type = 1;  ///< DLPack's: 1 CPU, 2 CUDA
  int device_id = 0;
  dtype type = dtype::none;
  int ndim = 0;
  std::int64_t shape[4] = {0, 0, 0, 0};
  std::int64_t strides[4] = {0, 0, 0, 0};
  bool given() const { return data != nullptr || type != dtype::none; }
};

/// A parameter value: bool, integer, float or a name (enums: "after", "mean", ...).
using param_value = std::variant<bool, std::int64_t, double, std::string>;
/// Parameters by dotted name, as kvevict's error messages spell them ("temporal.alpha",
/// "spatial.kernel", "selector.num_sink", "gqa", "check_finite").
using param_map = std::map<std::string, param_value>;

/// What select() reads (see kvevict/core/inputs.hpp for every shape).
struct select_args {
  tensor_arg queries;    ///< (batch, q_heads, window, head_dim)
  tensor_arg keys;       ///< (batch, kv_heads, seq, head_dim)
  tensor_arg values;     ///< (batch, kv_heads, seq, head_dim)
  tensor_arg lengths;    ///< (batch, kv_heads) int32
  tensor_arg positions;  ///< (batch, kv_heads, seq) int32
  tensor_arg wo;         ///< (hidden, q_heads * head_dim), the queries' storage type
  tensor_arg wo_factor;  ///< (q_heads, head_dim, head_dim) fp32
  std::int32_t keep_tokens = 0;
  double keep_fraction = 0.0;
  std::int32_t layer_idx = 0;
  std::int32_t num_layers = 1;
  bool want_scores = false;
  int num_threads = 0;  ///< plan_options::num_threads (0: OpenMP's)
  std::uintptr_t stream = 0;  ///< CUDA: the cudaStream_t to run on (the tensors' current stream)
};

/// std::allocator whose value-initialisation (resize(n), vector(n)) leaves elements
/// uninitialised: the result buffers that run() writes in full are not zero-filled first (for a
/// position-only method the fill cost as much as the selection).
template <class T>
struct uninit_allocator : std::allocator<T> {
  using std::allocator<T>::allocator;
  template <class U>
  struct rebind {
    using other = uninit_allocator<U>;
  };
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

/// An int32 result buffer (see uninit_allocator): resize() leaves it for the evictor to write.
using index_buffer = std::vector<std::int32_t, uninit_allocator<std::int32_t>>;

/// The selection (CSR over rows b * out_heads + h) and, on request, the final scores.
struct select_result {
  std::int64_t batch = 0, out_heads = 0, seq = 0;
  index_buffer indptr;                  ///< rows + 1
  index_buffer indices;                 ///< kept slots, ascending per row
  index_buffer positions;               ///< logical positions of the kept slots
  std::vector<float> scores;            ///< (batch, out_heads, seq) when want_scores
};

/// Counters of an evictor's plan cache (tests and the benchmark read them).
struct cache_stats {
  std::int64_t plans = 0;            ///< plan() calls made (a cache miss each)
  std::int64_t runs = 0;             ///< run() calls made
  std::size_t workspace_bytes = 0;   ///< bytes of the workspace held now
  std::int64_t workspace_allocs = 0; ///< times the workspace grew
};

/// One method with fixed parameters, its plan cache and workspace. Not thread-safe: one object
/// per thread (the CPU backend parallelises inside a call).
class evictor_iface {
 public:
  virtual ~evictor_iface() = default;
  /// Select one layer's kept tokens; on error *out is untouched.
  virtual kvevict::status select(const select_args& a, select_result* out) = 0;
  /// The parameters in force, by dotted name (learned tables are not listed).
  virtual param_map params() const = 0;
  virtual const char* method() const = 0;
  virtual cache_stats stats() const = 0;
  /// Decode-time eviction: kvevict::decode_schedule::apply(a, params, window, budget) on a copy of
  /// this evictor's params. *params gets every parameter after it (the schedule's protection:
  /// selector sinks / recent tokens, PyramidKV's and LKV-H's num_tokens), *budget the budget to run
  /// with. The evictor itself is unchanged. Errors: apply()'s (a cap below the protected tokens, an
  /// action of another request, ...), *params and *budget untouched.
  virtual kvevict::status schedule_params(const kvevict::decode_schedule& s, const kvevict::decode_action& a, std::int64_t window,
                                          param_map* params, kvevict::budget_request* budget) const = 0;
};

/// Builds the evictor of `method` (a presets:: name: "restkv", "snapkv", ..., "lkv") with its
/// papers' defaults, overridden by `overrides` (dotted names; unknown names and bad values are
/// errors naming them). LKV methods read their tables from `artifact` (an LKV artifact path).
kvevict::status make_evictor(const std::string& method, const param_map& overrides, const std::string& artifact,
                             std::unique_ptr<evictor_iface>* out);

/// The names make_evictor accepts, in the README's order.
std::vector<std::string> method_names();

/// Compaction of one K or V cache in place: slot i of row r takes slot indices[indptr[r] + i]
/// (kvevict::cpu::compact). cache: (batch, heads, seq, head_dim) of f32/f16/bf16.
kvevict::status compact_in_place(const tensor_arg& cache, const std::int32_t* indptr, const std::int32_t* indices,
                                 std::int64_t rows);

/// The ReST-KV W_O factors (kvevict::cpu::compute_wo_factors): wo (hidden, q_heads * head_dim)
/// of f32/f16/bf16, any strides; out: (q_heads, head_dim, head_dim) fp32 row-major.
kvevict::status wo_factors(const tensor_arg& wo, std::int64_t q_heads, std::int64_t head_dim, float* out);

/// True when the module was built with the CUDA backend (methods_cuda.cu).
bool cuda_built();

/// The evictor of `method` on the CUDA backend for device `device` (as make_evictor). Inputs
/// must be device memory of that device; select() runs on select_args::stream, waits for it,
/// reads the device status word and returns the selection in host memory. Errors: not_supported
/// when the module has no CUDA backend or the method has no CUDA implementation (CriticalKV).
kvevict::status make_cuda_evictor(const std::string& method, const param_map& overrides, const std::string& artifact, int device,
                                  std::unique_ptr<evictor_iface>* out);

// Factories of the method units (methods_*.cpp); each returns false when `method` is not its.
bool make_window_methods(const std::string& method, const param_map& overrides, const std::string& artifact,
                         kvevict::status* st, std::unique_ptr<evictor_iface>* out);
bool make_other_methods(const std::string& method, const param_map& overrides, const std::string& artifact,
                        kvevict::status* st, std::unique_ptr<evictor_iface>* out);
bool make_learned_methods(const std::string& method, const param_map& overrides, const std::string& artifact,
                          kvevict::status* st, std::unique_ptr<evictor_iface>* out);

}  // namespace kvevict_py
