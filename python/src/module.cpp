// kvevict Python binding: the extension module kvevict._C (pybind11). Tensors arrive as DLPack
// capsules (dlpack/dlpack.h from Debian's libdlpack-dev) and are read in place: no copy, strides
// honoured. The Python package (python/kvevict/__init__.py) is the documented API; this module is
// its private engine room.
//
// Errors: every kvevict status becomes kvevict._C.Error (a ValueError) carrying the library's
// message, which names the argument and the value; nothing is written on error.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlpack/dlpack.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <kvevict/backends/cpu/compact.hpp>
#include <kvevict/version.hpp>

#include "binding.hpp"

namespace py = pybind11;

namespace kvevict_py {

struct error : std::exception {
  explicit error(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
  std::string msg;
};

[[noreturn]] void raise(const kvevict::status& st) {
  throw error(std::string("kvevict: ") + st.message());
}

kvevict::status make_evictor(const std::string& method, const param_map& overrides, const std::string& artifact,
                             std::unique_ptr<evictor_iface>* out) {
  if (!artifact.empty() && method.rfind("lkv", 0) != 0)
    return kvevict::status::error(kvevict::errc::invalid_argument,
                                  "artifact = '%s' is given, but method '%s' reads no LKV artifact (only the lkv* methods do)",
                                  artifact.c_str(), method.c_str());
  kvevict::status st;
  if (make_window_methods(method, overrides, artifact, &st, out) || make_other_methods(method, overrides, artifact, &st, out) ||
      make_learned_methods(method, overrides, artifact, &st, out))
    return st;
  std::string names;
  for (const std::string& n : method_names()) names += (names.empty() ? "" : ", ") + n;
  return kvevict::status::error(kvevict::errc::invalid_argument, "method = '%s' is not a kvevict method (one of: %s)", method.c_str(),
                                names.c_str());
}

std::vector<std::string> method_names() {
  return {"restkv", "snapkv", "pyramidkv", "adakv", "adakv_published", "criticalkv", "critical_adakv", "defensivekv", "h2o", "tova", "streaming_llm", "key_norm",
          "lkv", "lkv_uniform_budgets", "lkv_budgets_restkv", "lkv_budgets_attention"};
}

namespace {

/// Owns the DLManagedTensors taken from capsules during one call and releases them at its end
/// (the producer's deleter; the Python caller keeps the tensors alive meanwhile).
struct dlpack_scope {
  std::vector<DLManagedTensor*> taken;
  ~dlpack_scope() {
    for (DLManagedTensor* m : taken)
      if (m && m->deleter) m->deleter(m);
  }
};

dtype dtype_of(const DLDataType& t) {
  if (t.lanes != 1) return dtype::other;
  if (t.code == kDLFloat && t.bits == 32) return dtype::f32;
  if (t.code == kDLFloat && t.bits == 16) return dtype::f16;
  if (t.code == kDLBfloat && t.bits == 16) return dtype::bf16;
  if (t.code == kDLInt && t.bits == 32) return dtype::i32;
  return dtype::other;
}

/// The tensor behind a DLPack capsule (None: not given). Rank <= 4, CPU memory.
tensor_arg take(py::handle obj, const char* name, dlpack_scope& scope) {
  tensor_arg t;
  if (obj.is_none()) return t;
  if (!PyCapsule_CheckExact(obj.ptr()) || !PyCapsule_IsValid(obj.ptr(), "dltensor"))
    throw error(std::string("kvevict: ") + name + " must be a DLPack capsule (a tensor exported with to_dlpack) or None");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(obj.ptr(), "dltensor"));
  if (!m) throw error(std::string("kvevict: ") + name + ": empty DLPack capsule");
  PyCapsule_SetName(obj.ptr(), "used_dltensor");  // consumed: the producer's deleter is ours to call
  scope.taken.push_back(m);
  const DLTensor& d = m->dl_tensor;
  if (d.device.device_type != kDLCPU && d.device.device_type != kDLCUDA) {
    throw error(std::string("kvevict: ") + name + " is on DLPack device type " + std::to_string(d.device.device_type) +
                "; kvevict reads CPU or CUDA tensors");
  }
  if (d.device.device_type == kDLCUDA && !cuda_built())
    throw error(std::string("kvevict: ") + name + " is on cuda:" + std::to_string(d.device.device_id) +
                ", but this kvevict module was built without the CUDA backend (pass CPU tensors)");
  t.device_type = d.device.device_type;
  t.device_id = d.device.device_id;
  if (d.ndim > 4) throw error(std::string("kvevict: ") + name + " has " + std::to_string(d.ndim) + " dimensions; at most 4 are expected");
  t.type = dtype_of(d.dtype);
  t.ndim = d.ndim;
  t.data = static_cast<char*>(d.data) + d.byte_offset;
  // An empty tensor may carry no storage (data == null). It is still a given argument: point it
  // at a sentinel (never read: an extent is 0) so that its shape is checked, not taken as absent.
  static unsigned char empty_sentinel[16];
  if (!d.data) t.data = empty_sentinel;
  std::int64_t st = 1;
  for (int k = d.ndim - 1; k >= 0; --k) {
    t.shape[k] = d.shape[k];
    t.strides[k] = d.strides ? d.strides[k] : st;  // null strides: compact row-major
    st *= d.shape[k];
  }
  return t;
}

template <class T, class A>
py::array_t<T> to_numpy(std::vector<T, A>&& v, std::vector<py::ssize_t> shape) {
  auto* held = new std::vector<T, A>(std::move(v));
  py::capsule owner(held, [](void* p) { delete static_cast<std::vector<T, A>*>(p); });
  return py::array_t<T>(shape, held->data(), owner);
}

py::dict to_dict(const param_map& m) {
  py::dict d;
  for (const auto& kv : m) std::visit([&](const auto& v) { d[py::str(kv.first)] = v; }, kv.second);
  return d;
}

param_map from_dict(const py::dict& d) {
  param_map m;
  for (auto item : d) {
    const std::string k = py::cast<std::string>(item.first);
    py::handle v = item.second;
    if (py::isinstance<py::bool_>(v)) m[k] = v.cast<bool>();
    else if (py::isinstance<py::int_>(v)) {
      int overflow = 0;
      const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
      if (overflow) throw error("kvevict: parameter " + k + " = " + std::string(py::str(v)) + " is out of range");
      m[k] = static_cast<std::int64_t>(x);
    }
    else if (py::isinstance<py::float_>(v)) m[k] = v.cast<double>();
    else if (py::isinstance<py::str>(v)) m[k] = v.cast<std::string>();
    else throw error("kvevict: parameter " + k + " must be a bool, int, float or str, got " + std::string(py::str(v.get_type())));
  }
  return m;
}

class py_evictor {
 public:
  py_evictor(const std::string& method, const py::dict& params, const std::string& artifact)
      : method_(method), overrides_(from_dict(params)), artifact_(artifact) {
    const kvevict::status st = make_evictor(method, overrides_, artifact, &impl_);
    if (!st.ok()) raise(st);
  }

  py::tuple select(py::object queries, py::object keys, py::object values, py::object lengths, py::object positions, py::object wo,
                   py::object wo_factor, std::int64_t keep_tokens, double keep_fraction, std::int64_t layer_idx,
                   std::int64_t num_layers, bool want_scores, std::int64_t num_threads, std::uintptr_t stream) {
    if (num_threads < 0 || num_threads > 256)
      throw error("kvevict: num_threads = " + std::to_string(num_threads) + " must be in [0, 256] (0: OpenMP's default)");
    dlpack_scope scope;
    select_args a;
    a.queries = take(queries, "queries", scope);
    a.keys = take(keys, "keys", scope);
    a.values = take(values, "values", scope);
    a.lengths = take(lengths, "lengths", scope);
    a.positions = take(positions, "positions", scope);
    a.wo = take(wo, "wo", scope);
    a.wo_factor = take(wo_factor, "wo_factor", scope);
    auto int32_arg = [](std::int64_t v, const char* name) {
      if (v < INT32_MIN || v > INT32_MAX) throw error(std::string("kvevict: ") + name + " = " + std::to_string(v) + " is out of the int32 range");
      return static_cast<std::int32_t>(v);
    };
    if (a.keys.ndim == 4 && a.keys.shape[0] > 0 && a.keys.shape[1] > 0 &&
        (a.keys.shape[0] > INT32_MAX / a.keys.shape[1] || a.keys.shape[0] * a.keys.shape[1] > INT32_MAX / std::max<std::int64_t>(a.keys.shape[2], 1)))
      throw error("kvevict: keys (batch " + std::to_string(a.keys.shape[0]) + ", kv_heads " + std::to_string(a.keys.shape[1]) +
                  ", seq " + std::to_string(a.keys.shape[2]) + ") hold more than 2^31 - 1 slots: the selection's offsets are int32");
    if (num_layers > (1 << 16))
      throw error("kvevict: num_layers = " + std::to_string(num_layers) + " must be at most 65536");
    a.keep_tokens = int32_arg(keep_tokens, "budget");
    a.keep_fraction = keep_fraction;
    a.layer_idx = int32_arg(layer_idx, "layer_idx");
    a.num_layers = int32_arg(num_layers, "num_layers");
    a.want_scores = want_scores;
    a.num_threads = static_cast<int>(num_threads);
    a.stream = stream;
    evictor_iface* impl = impl_.get();
    if (a.keys.device_type == kDLCUDA) {  // the CUDA evictor of the keys' device, made on first use
      std::lock_guard<std::mutex> lock(mutex_);  // (the GIL is held here; the lock orders with select)
      std::unique_ptr<evictor_iface>& c = cuda_[a.keys.device_id];
      if (!c) {
        const kvevict::status st = make_cuda_evictor(method_, overrides_, artifact_, a.keys.device_id, &c);
        if (!st.ok()) raise(st);
      }
      impl = c.get();
    } else {
      for (const tensor_arg* t : {&a.queries, &a.values, &a.lengths, &a.positions, &a.wo, &a.wo_factor})
        if (t->given() && t->device_type != kDLCPU)
          throw error("kvevict: keys are CPU tensors but another argument is on cuda:" + std::to_string(t->device_id) +
                      "; kvevict needs every tensor on the keys' device");
    }
    select_result r;
    kvevict::status st;
    {
      py::gil_scoped_release nogil;  // the tensors stay referenced by the caller's frame
      // One call at a time per object: the plans and the workspace are shared (kvevict.select's
      // module-level evictors can be reached from several threads).
      std::lock_guard<std::mutex> lock(mutex_);
      const auto t0 = std::chrono::steady_clock::now();
      st = impl->select(a, &r);
      cpp_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!st.ok()) raise(st);
    const py::ssize_t rows = static_cast<py::ssize_t>(r.batch * r.out_heads), n = static_cast<py::ssize_t>(r.indices.size());
    py::object scores = py::none();
    if (want_scores)
      scores = to_numpy(std::move(r.scores), {static_cast<py::ssize_t>(r.batch), static_cast<py::ssize_t>(r.out_heads),
                                             static_cast<py::ssize_t>(r.seq)});
    return py::make_tuple(to_numpy(std::move(r.indptr), {rows + 1}), to_numpy(std::move(r.indices), {n}),
                          to_numpy(std::move(r.positions), {n}), scores, r.batch, r.out_heads);
  }

  py::dict params() const { return to_dict(impl_->params()); }
  /// (params after the schedule's apply(), keep_tokens, keep_fraction) for eviction `a` of `s`.
  py::tuple schedule_params(const kvevict::decode_schedule& s, const kvevict::decode_action& a, std::int64_t window) const {
    param_map p;
    kvevict::budget_request b;
    const kvevict::status st = impl_->schedule_params(s, a, window, &p, &b);
    if (!st.ok()) raise(st);
    return py::make_tuple(to_dict(p), b.keep_tokens, b.keep_fraction);
  }
  std::string method() const { return impl_->method(); }
  /// Counters of the CPU evictor, or of the CUDA evictor of `device` (>= 0).
  py::dict stats(int device) const {
    const evictor_iface* e = impl_.get();
    if (device >= 0) {
      auto it = cuda_.find(device);
      if (it == cuda_.end() || !it->second) throw error("kvevict: no CUDA evictor for cuda:" + std::to_string(device) + " yet");
      e = it->second.get();
    }
    const cache_stats s = e->stats();
    py::dict d;
    d["plans"] = s.plans;
    d["runs"] = s.runs;
    d["workspace_bytes"] = s.workspace_bytes;
    d["workspace_allocs"] = s.workspace_allocs;
    d["cpp_seconds"] = cpp_seconds_;
    return d;
  }

 private:
  std::string method_;
  param_map overrides_;
  std::string artifact_;
  std::unique_ptr<evictor_iface> impl_;                      // CPU
  std::map<int, std::unique_ptr<evictor_iface>> cuda_;       // CUDA, by device
  std::mutex mutex_;
  double cpp_seconds_ = 0.0;  // wall time inside the C++ select (plan, run, result buffers)
};

void compact(py::object cache, py::object indptr, py::object indices) {
  dlpack_scope scope;
  const tensor_arg c = take(cache, "cache", scope);
  const tensor_arg ip = take(indptr, "indptr", scope);
  const tensor_arg ix = take(indices, "indices", scope);
  if (c.device_type != kDLCPU || ip.device_type != kDLCPU || ix.device_type != kDLCPU)
    throw error("kvevict: compact here takes CPU tensors (the Python layer gathers CUDA caches with torch)");
  if (ip.type != dtype::i32 || ip.ndim != 1) throw error("kvevict: selection.indptr must be a 1-D int32 tensor");
  if (ix.type != dtype::i32 || ix.ndim != 1) throw error("kvevict: selection.indices must be a 1-D int32 tensor");
  if (ip.strides[0] != 1 || ix.strides[0] != 1) throw error("kvevict: selection.indptr and selection.indices must be contiguous");
  if (ip.shape[0] < 1) throw error("kvevict: selection.indptr is empty (it holds rows + 1 offsets)");
  const std::int64_t rows = ip.shape[0] - 1;
  const auto* ipp = static_cast<const std::int32_t*>(ip.data);
  if (ipp[0] != 0) throw error("kvevict: selection.indptr[0] = " + std::to_string(ipp[0]) + " must be 0");
  for (std::int64_t r = 0; r < rows; ++r)  // the library reads indices[indptr[r] .. indptr[r + 1]) per row
    if (ipp[r + 1] < ipp[r] || ipp[r + 1] > ix.shape[0])
      throw error("kvevict: selection.indptr[" + std::to_string(r + 1) + "] = " + std::to_string(ipp[r + 1]) +
                  " must be in [indptr[" + std::to_string(r) + "] = " + std::to_string(ipp[r]) + ", len(indices) = " +
                  std::to_string(ix.shape[0]) + "]");
  // A cache whose rows share memory (expand(), as_strided) cannot be compacted in place: rows
  // would overwrite each other. Sufficient test for no overlap: with the axes of extent > 1 sorted
  // by stride, each stride exceeds the span of the smaller ones.
  {
    std::vector<std::pair<std::int64_t, std::int64_t>> ax;  // (stride, extent)
    for (int k = 0; k < c.ndim; ++k)
      if (c.shape[k] > 1) ax.emplace_back(c.strides[k], c.shape[k]);
    std::sort(ax.begin(), ax.end());
    std::int64_t span = 0;  // largest offset reachable with the axes so far
    for (const auto& a : ax) {
      if (a.first <= span)
        throw error("kvevict: cache's strides let different elements share memory (an expand()ed or as_strided view); "
                    "compact a tensor that owns its rows (.contiguous())");
      span += a.first * (a.second - 1);
    }
  }
  if (ipp[rows] == 0) return;  // nothing kept: nothing moves (and indices may have no storage)
  kvevict::status st;
  {
    py::gil_scoped_release nogil;
    st = compact_in_place(c, ipp, static_cast<const std::int32_t*>(ix.data), rows);
  }
  if (!st.ok()) raise(st);
}

void wo_factors_py(py::object wo, std::int64_t q_heads, std::int64_t head_dim, py::object out) {
  dlpack_scope scope;
  const tensor_arg w = take(wo, "wo", scope);
  const tensor_arg o = take(out, "out", scope);
  if (w.device_type != kDLCPU || o.device_type != kDLCPU)
    throw error("kvevict: wo_factors reads CPU tensors (the Python layer copies a CUDA wo to the host: once per model)");
  if (o.type != dtype::f32 || o.ndim != 3 || o.shape[0] != q_heads || o.shape[1] != head_dim || o.shape[2] != head_dim ||
      o.strides[2] != 1 || o.strides[1] != head_dim || o.strides[0] != head_dim * head_dim)
    throw error("kvevict: wo_factors out must be a contiguous float32 tensor of shape (q_heads, head_dim, head_dim)");
  kvevict::status st;
  {
    py::gil_scoped_release nogil;
    st = wo_factors(w, q_heads, head_dim, static_cast<float*>(o.data));
  }
  if (!st.ok()) raise(st);
}

}  // namespace

template <class T>
static kvevict::status compact_t(const tensor_arg& c, const kvevict::const_selection_view& sel) {
  kvevict::kv_view<T> v;
  v.data = static_cast<T*>(c.data);
  for (int k = 0; k < 4; ++k) {
    v.extent[k] = c.shape[k];
    v.stride[k] = c.strides[k];
    if (c.strides[k] < 0)
      return kvevict::status::error(kvevict::errc::invalid_argument, "cache.stride[%d] = %lld is negative", k,
                                    static_cast<long long>(c.strides[k]));
  }
  kvevict::kv_view<const T> src;
  src.data = v.data;
  for (int k = 0; k < 4; ++k) {
    src.extent[k] = v.extent[k];
    src.stride[k] = v.stride[k];
  }
  return kvevict::cpu::compact<T>(src, sel, v);
}

kvevict::status compact_in_place(const tensor_arg& cache, const std::int32_t* indptr, const std::int32_t* indices, std::int64_t rows) {
  if (cache.ndim != 4)
    return kvevict::status::error(kvevict::errc::invalid_argument, "cache has %d dimensions; kvevict needs 4 (batch, heads, seq, head_dim)",
                                  cache.ndim);
  if (rows != cache.shape[0] * cache.shape[1])
    return kvevict::status::error(kvevict::errc::shape_mismatch, "selection has %lld rows != batch * heads = %lld of the cache",
                                  static_cast<long long>(rows), static_cast<long long>(cache.shape[0] * cache.shape[1]));
  const kvevict::const_selection_view sel(indptr, indices, rows);
  switch (cache.type) {
    case dtype::f32: return compact_t<float>(cache, sel);
    case dtype::f16: return compact_t<kvevict::half_t>(cache, sel);
    case dtype::bf16: return compact_t<kvevict::bfloat16_t>(cache, sel);
    case dtype::i32: return compact_t<std::int32_t>(cache, sel);  // positions, (batch, heads, seq, 1)
    default:
      return kvevict::status::error(kvevict::errc::invalid_argument, "cache.dtype = %s; kvevict compacts float32, float16, bfloat16 or int32",
                                    to_string(cache.type));
  }
}

}  // namespace kvevict_py

PYBIND11_MODULE(_C, m) {
  using namespace kvevict_py;
  m.doc() = "kvevict's compiled core (private: use the kvevict package)";
  static py::exception<error> exc(m, "Error", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const error& e) {
      PyErr_SetString(exc.ptr(), e.what());
    }
  });
  m.attr("version") = std::to_string(KVEVICT_VERSION_MAJOR) + "." + std::to_string(KVEVICT_VERSION_MINOR) + "." + std::to_string(KVEVICT_VERSION_PATCH);
  m.def("methods", &method_names);
  m.attr("cuda") = cuda_built();
  // How the CPU backend was compiled (kvevict.build_info(); docs/performance.md "Against plain PyTorch on a real BLAS").
#if defined(KVEVICT_WITH_BLIS)
  m.attr("cpu_gemm") = "blis";
#else
  m.attr("cpu_gemm") = "eigen";
#endif
#if defined(__AVX512F__)
  m.attr("cpu_isa") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  m.attr("cpu_isa") = "avx2+fma";
#elif defined(__AVX2__)
  m.attr("cpu_isa") = "avx2";
#elif defined(__AVX__)
  m.attr("cpu_isa") = "avx";
#elif defined(__x86_64__)
  m.attr("cpu_isa") = "sse2";
#else
  m.attr("cpu_isa") = "generic";
#endif
  py::class_<py_evictor>(m, "Evictor")
      .def(py::init<const std::string&, const py::dict&, const std::string&>(), py::arg("method"), py::arg("params"),
           py::arg("artifact") = "")
      .def("select", &py_evictor::select, py::arg("queries"), py::arg("keys"), py::arg("values"), py::arg("lengths"),
           py::arg("positions"), py::arg("wo"), py::arg("wo_factor"), py::arg("keep_tokens"), py::arg("keep_fraction"),
           py::arg("layer_idx"), py::arg("num_layers"), py::arg("want_scores"), py::arg("num_threads"), py::arg("stream") = 0)
      .def("params", &py_evictor::params)
      .def("schedule_params", &py_evictor::schedule_params, py::arg("schedule"), py::arg("action"), py::arg("window"))
      .def("stats", &py_evictor::stats, py::arg("device") = -1)
      .def_property_readonly("method", &py_evictor::method);
  // kvevict::decode_schedule and its action, as they are (the Python layer documents them).
  py::class_<kvevict::decode_action>(m, "DecodeAction")
      .def_readonly("evict", &kvevict::decode_action::evict)
      .def_readonly("periods", &kvevict::decode_action::periods)
      .def_readonly("tokens_seen", &kvevict::decode_action::tokens_seen)
      .def_readonly("generated", &kvevict::decode_action::generated)
      .def_readonly("request", &kvevict::decode_action::request)
      .def_property_readonly("keep_tokens", [](const kvevict::decode_action& a) { return a.budget.keep_tokens; });
  py::class_<kvevict::decode_schedule>(m, "DecodeSchedule")
      .def(py::init([](std::int64_t interval, std::int64_t keep_tokens, double keep_fraction, std::int64_t protect_prefix,
                       std::int64_t protect_recent, bool evict_after_prefill) {
             auto i32 = [](std::int64_t v, const char* name) {
               if (v < INT32_MIN || v > INT32_MAX) throw error(std::string("kvevict: ") + name + " = " + std::to_string(v) + " is out of the int32 range");
               return static_cast<std::int32_t>(v);
             };
             kvevict::decode_schedule_options o;
             o.interval = i32(interval, "interval");
             o.budget.keep_tokens = i32(keep_tokens, "budget");
             o.budget.keep_fraction = keep_fraction;
             o.protect_prefix = i32(protect_prefix, "protect_prefix");
             o.protect_recent = i32(protect_recent, "protect_recent");
             o.evict_after_prefill = evict_after_prefill;
             kvevict::decode_schedule s;
             const kvevict::status st = s.init(o);
             if (!st.ok()) raise(st);
             return s;
           }),
           py::arg("interval"), py::arg("keep_tokens"), py::arg("keep_fraction"), py::arg("protect_prefix"), py::arg("protect_recent"),
           py::arg("evict_after_prefill"))
      .def("after_prefill", [](kvevict::decode_schedule& s, std::int64_t tokens) {
             kvevict::decode_action a;
             const kvevict::status st = s.after_prefill(tokens, &a);
             if (!st.ok()) raise(st);
             return a;
           }, py::arg("tokens"))
      .def("after_decode", [](kvevict::decode_schedule& s, std::int64_t tokens) {
             kvevict::decode_action a;
             const kvevict::status st = s.after_decode(tokens, &a);
             if (!st.ok()) raise(st);
             return a;
           }, py::arg("tokens"))
      .def("evicted", [](kvevict::decode_schedule& s, const kvevict::decode_action& a) {
             const kvevict::status st = s.evicted(a);
             if (!st.ok()) raise(st);
           }, py::arg("action"))
      .def("reset", &kvevict::decode_schedule::reset)
      .def("copy", [](const kvevict::decode_schedule& s) { return s; })
      .def("budget_at", &kvevict::decode_schedule::budget_at, py::arg("tokens_seen"))
      .def_property_readonly("tokens_seen", &kvevict::decode_schedule::tokens_seen)
      .def_property_readonly("pending_tokens", &kvevict::decode_schedule::pending_tokens)
      .def_property_readonly("protected_prefix", &kvevict::decode_schedule::protected_prefix)
      .def_property_readonly("evictions", &kvevict::decode_schedule::evictions)
      .def_property_readonly("interval", [](const kvevict::decode_schedule& s) { return s.options().interval; })
      .def_property_readonly("keep_tokens", [](const kvevict::decode_schedule& s) { return s.options().budget.keep_tokens; })
      .def_property_readonly("keep_fraction", [](const kvevict::decode_schedule& s) { return s.options().budget.keep_fraction; })
      .def_property_readonly("protect_prefix", [](const kvevict::decode_schedule& s) { return s.options().protect_prefix; })
      .def_property_readonly("protect_recent", [](const kvevict::decode_schedule& s) { return s.options().protect_recent; })
      .def_property_readonly("evict_after_prefill", [](const kvevict::decode_schedule& s) { return s.options().evict_after_prefill; });
  m.def("wo_factors", &wo_factors_py, py::arg("wo"), py::arg("q_heads"), py::arg("head_dim"), py::arg("out"));
  m.def("compact", &compact, py::arg("cache"), py::arg("indptr"), py::arg("indices"));
}
