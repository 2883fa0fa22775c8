// CriticalKV rows of the fidelity report (registry: methods.hpp; method: docs/criticalkv.md).
//
//   CriticalKV      presets::criticalkv: SnapKV-style window attention (mean over the 32-query window,
//                   avg-pool 5, GQA mean), uniform per-head budgets, two-stage selection: half of each
//                   head's candidate budget by attention, the rest by (a + 1e-4) * ||v W_O^h||_1.
//                   Compare with the SnapKV row (same budgets, attention-only selection).
//   CriticalAdaKV   presets::critical_adakv: the same with AdaKV head-wise budgets (alpha 0.2).
//                   Compare with the AdaKV row.
// CriticalKV reads the layer's full output projection (layer_inputs::wo), which the engine's
// evict_layer() does not pass (it passes the d x d factors of ReST-KV only), so the rows build the
// layer inputs here: the same views as evict_layer(), plus wo = model::wo(layer), fp32 (dim, dim)
// row-major [out][in], then the same in-place compaction (apply_selection).
#include "methods.hpp"

#include <string>
#include <vector>

namespace {

template <class Policy>
kvevict_engine::result evict_layer_with_wo(const kvevict_engine::layer_state& s, const typename Policy::params& p, int window) {
    using kvevict_engine::result;
    if (!s.m || !s.cache) return result::failure("criticalkv: layer_state.m and .cache must be set");
    kvevict_engine::kv_cache& c = *s.cache;
    const kvevict_engine::config& cfg = s.m->cfg;
    if (s.layer < 0 || s.layer >= c.n_layers())
        return result::failure("criticalkv: layer " + std::to_string(s.layer) + " outside 0.." + std::to_string(c.n_layers() - 1));
    const int l = s.layer, H = c.n_kv_heads();
    kvevict::layer_inputs<float> in;
    in.keys = kvevict::make_kv_view<const float>(c.keys(l), 1, H, c.capacity(), c.head_dim(), kvevict::kv_layout::hnd);
    in.values = kvevict::make_kv_view<const float>(c.values(l), 1, H, c.capacity(), c.head_dim(), kvevict::kv_layout::hnd);
    in.lengths = kvevict::per_head_lengths(c.lengths(l), 1, H);
    in.positions = kvevict::make_positions_view(c.positions(l), 1, H, c.capacity());
    if (s.queries && window != 0) in.queries = s.queries->view(l, window);
    const kvevict_engine::matrix& wo = s.m->wo(l);  // (dim, n_heads * head_dim), [out][in]
    in.wo = kvevict::strided_view<const float, 2>{wo.data(), {wo.rows(), wo.cols()}, {wo.cols(), 1}};
    in.layer_idx = l;
    in.num_layers = cfg.n_layers;

    kvevict::evictor<Policy, kvevict::cpu::backend> ev(p, kvevict::cpu::backend{s.num_threads});
    if (const kvevict::status st = ev.can_implement(in, s.budget); !st.ok())
        return result::failure("criticalkv: layer " + std::to_string(l) + ": " + st.message());
    const std::int64_t cap = ev.max_selected(in, s.budget);
    std::vector<std::int32_t> indptr(size_t(H) + 1), indices(size_t(std::max<std::int64_t>(cap, 1)));
    kvevict::selection_view sel;
    sel.indptr = indptr.data();
    sel.indices = indices.data();
    sel.capacity = std::int64_t(indices.size());
    if (const kvevict::status st = ev.run(in, s.budget, sel); !st.ok())
        return result::failure("criticalkv: layer " + std::to_string(l) + ": " + st.message());
    return kvevict_engine::apply_selection(c, l, indptr.data(), indices.data());
}

template <class Policy>
kvevict_engine::method criticalkv_method(std::string name, int window = 32) {
    kvevict_engine::method m;
    m.name = std::move(name);
    m.window = window;
    const typename Policy::params p = Policy::defaults();
    m.evict = [p, window](const kvevict_engine::layer_state& s) { return evict_layer_with_wo<Policy>(s, p, window); };
    return m;
}

const kvevict_fidelity::register_method criticalkv_row(35, criticalkv_method<kvevict::presets::criticalkv>("CriticalKV"));
const kvevict_fidelity::register_method critical_adakv_row(36, criticalkv_method<kvevict::presets::critical_adakv>("CriticalAdaKV"));

}  // namespace
