// kvevict_engine: one layer of a kv_cache as kvevict reads it (contiguous or paged), and the in-place
// compaction of a paged layer, example code.
//
//   layer_page_table     a paged layer's page table in kvevict's CSR vocabulary (FlashInfer's indptr,
//                        indices, last_page_len), one row per KV head (batch 1, pages.per_head), built
//                        from kv_cache's per-head tables for each eviction
//   set_cache_inputs()   keys, values, lengths, positions (and pages) of kvevict::layer_inputs for one
//                        layer: HND views over the capacity (contiguous), or the layer's pools of one-head
//                        pages (kvevict::page_pool_per_head) with the per-head table (paged)
//   compact_layer_paged() kvevict::cpu::compact_paged (mode b: each head compacts into its own pages) and
//                        kvevict::cpu::compact on the positions, then every head's new length; the pages
//                        compact_paged reports free go back to the layer's free list
//   page_counts          pages each head holds, to print "pages in use" before and after an eviction
//
// kvevict never allocates: kv_cache owns the pools and the free lists (kv_cache.hpp).
#pragma once

#include "kv_cache.hpp"
#include "model.hpp"

#include <kvevict/cpu.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kvevict_engine {

/// Layer `l`'s page table as kvevict::page_table_view: per_head rows (row h = KV head h, batch 1), indices
/// = each head's pages in logical order, last_page_len = tokens in its last page (0 for a head without
/// pages), max_pages_per_row = capacity / page_size. `view` points into the vectors: do not copy a
/// layer_page_table after build().
struct layer_page_table {
    std::vector<std::int32_t> indptr, indices, last_page_len;
    kvevict::page_table_view view;

    /// Builds the table of layer `l` of the paged cache `c` (O(pages)).
    void build(const kv_cache& c, int l) {
        const int H = c.n_kv_heads(), ps = c.page_size();
        indptr.assign(size_t(H) + 1, 0);
        indices.clear();
        last_page_len.assign(size_t(H), 0);
        for (int h = 0; h < H; ++h) {
            const int n = c.pages_in_use(l, h);
            indices.insert(indices.end(), c.page_ids(l, h), c.page_ids(l, h) + n);
            indptr[size_t(h) + 1] = std::int32_t(indices.size());
            last_page_len[size_t(h)] = n > 0 ? c.length(l, h) - (n - 1) * ps : 0;
        }
        if (indices.empty()) indices.push_back(0);  // a valid pointer; indptr says no pages
        view = kvevict::make_page_table(indptr.data(), indices.data(), last_page_len.data(), 1, c.max_pages_per_head());
        view.per_head = true;
    }
};

/// Sets in.keys, in.values, in.lengths, in.positions (and in.pages for a paged cache, through `table`,
/// which is built here and must outlive `in`) to layer `l` of `c`.
inline void set_cache_inputs(kvevict::layer_inputs<float>& in, const kv_cache& c, int l, layer_page_table& table) {
    const int H = c.n_kv_heads();
    if (c.paged()) {
        table.build(c, l);
        in.keys = kvevict::page_pool_per_head<const float>(c.keys(l), c.num_pages(), H, c.page_size(), c.head_dim());
        in.values = kvevict::page_pool_per_head<const float>(c.values(l), c.num_pages(), H, c.page_size(), c.head_dim());
        in.pages = table.view;
    } else {
        in.keys = kvevict::make_kv_view<const float>(c.keys(l), 1, H, c.capacity(), c.head_dim(), kvevict::kv_layout::hnd);
        in.values = kvevict::make_kv_view<const float>(c.values(l), 1, H, c.capacity(), c.head_dim(), kvevict::kv_layout::hnd);
    }
    in.lengths = kvevict::per_head_lengths(c.lengths(l), 1, H);
    in.positions = kvevict::make_positions_view(c.positions(l), 1, H, c.capacity());
}

/// The positions of layer `l`, (n_kv_heads, capacity) int32, as a (1, n_kv_heads, capacity, 1) kv_view
/// (rows of one int32) for kvevict::cpu::compact.
inline kvevict::kv_view<std::int32_t> positions_rows(kv_cache& c, int l) {
    kvevict::kv_view<std::int32_t> p;
    const int H = c.n_kv_heads();
    p.data = c.positions(l);
    p.extent[0] = 1; p.extent[1] = H; p.extent[2] = c.capacity(); p.extent[3] = 1;
    p.stride[0] = std::int64_t(H) * c.capacity(); p.stride[1] = c.capacity(); p.stride[2] = 1; p.stride[3] = 1;
    return p;
}

/// Compacts layer `layer` of the paged cache `c` in place from a CSR selection with n_kv_heads rows
/// (kept logical slots of each head, strictly ascending, each < its length): kvevict::cpu::compact_paged
/// over the per-head table (each head keeps ceil(kept / page_size) pages), kvevict::cpu::compact on the
/// positions, then len[h] = kept count and the freed pages back to the layer's free list. The freed pages
/// reported by compact_paged are checked against the table's tail pages.
/// Errors (cache unchanged): not a paged cache, every compact_paged error (message kept).
inline result compact_layer_paged(kv_cache& c, int layer, const std::int32_t* indptr, const std::int32_t* indices) {
    if (!c.paged()) return result::failure("compact_layer_paged: the cache is not paged");
    const int H = c.n_kv_heads(), l = layer;
    layer_page_table t;
    t.build(c, l);
    kvevict::cpu::paged_cache<float> pc;
    pc.keys = kvevict::page_pool_per_head(c.keys(l), c.num_pages(), H, c.page_size(), c.head_dim());
    pc.values = kvevict::page_pool_per_head(c.values(l), c.num_pages(), H, c.page_size(), c.head_dim());
    pc.pages = t.view;
    pc.lengths = kvevict::per_head_lengths(c.lengths(l), 1, H);
    std::vector<std::int32_t> pages_kept(static_cast<size_t>(H)), last(static_cast<size_t>(H)), lens(static_cast<size_t>(H)),
        freed(t.indices.size());
    std::int64_t num_freed = 0;
    kvevict::cpu::paged_compaction_result out;
    out.pages_kept = pages_kept.data();
    out.last_page_len = last.data();
    out.lengths = lens.data();
    out.freed_pages = freed.data();
    out.freed_capacity = std::int64_t(freed.size());
    out.num_freed = &num_freed;
    std::vector<unsigned char> ws(std::max<std::size_t>(kvevict::cpu::compact_paged_workspace_size(pc), 1));
    const kvevict::const_selection_view sel(indptr, indices, H);
    if (const kvevict::status s = kvevict::cpu::compact_paged(pc, sel, out, ws.data(), ws.size()); !s.ok())
        return result::failure("compact_layer_paged: layer " + std::to_string(l) + ": " + s.message());
    const kvevict::kv_view<std::int32_t> p = positions_rows(c, l);
    if (const kvevict::status s = kvevict::cpu::compact<std::int32_t>(p, sel, p); !s.ok())
        return result::failure("compact_layer_paged: positions: " + std::string(s.message()));
    // The freed pages are each head's table entries past pages_kept, head by head: check, then release.
    std::int64_t f = 0;
    for (int h = 0; h < H; ++h)
        for (int i = pages_kept[size_t(h)]; i < c.pages_in_use(l, h); ++i, ++f)
            if (f >= num_freed || freed[size_t(f)] != c.page_ids(l, h)[i])
                return result::failure("compact_layer_paged: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                       ": freed pages do not match the table's tail");
    if (f != num_freed) return result::failure("compact_layer_paged: layer " + std::to_string(l) + ": more pages freed than the tables' tails");
    for (int h = 0; h < H; ++h)
        if (result r = c.set_length(l, h, lens[size_t(h)]); !r) return r;  // releases the tail pages
    return result::success();
}

/// Pages each head of each layer holds (paged cache; all 0 for a contiguous one): counts[l][h].
using page_counts = std::vector<std::vector<int>>;
inline page_counts count_pages(const kv_cache& c) {
    page_counts n(size_t(c.n_layers()), std::vector<int>(size_t(c.n_kv_heads()), 0));
    for (int l = 0; l < c.n_layers(); ++l)
        for (int h = 0; h < c.n_kv_heads(); ++h) n[size_t(l)][size_t(h)] = c.pages_in_use(l, h);
    return n;
}

/// "layer L: 37 -> 9 (head 0: 10 -> 2, head 1: ...)" for one layer's page counts before and after.
inline std::string pages_line(int layer, const std::vector<int>& before, const std::vector<int>& after) {
    int b = 0, a = 0;
    std::string heads;
    for (size_t h = 0; h < before.size(); ++h) {
        b += before[h];
        a += after[h];
        heads += (h ? ", head " : "head ") + std::to_string(h) + ": " + std::to_string(before[h]) + " -> " + std::to_string(after[h]);
    }
    return "layer " + std::to_string(layer) + ": " + std::to_string(b) + " -> " + std::to_string(a) + " (" + heads + ")";
}

}  // namespace kvevict_engine
