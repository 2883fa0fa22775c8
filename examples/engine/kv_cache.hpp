// kvevict_engine: per-layer KV cache in HND layout, compactable in place by an eviction library.
#pragma once

#include "model.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvevict_engine {

/// KV cache for all layers, contiguous (the default) or paged.
///
/// Contiguous mode, layout per layer (HND), all strides in elements:
///   keys / values: contiguous fp32, shape (n_kv_heads, capacity, head_dim);
///                  element (h, s, d) at h * head_stride() + s * slot_stride() + d.
///   lengths:       int32 (n_kv_heads): valid slots of each head; slots len[h]..capacity-1 are garbage.
///   positions:     int32 (n_kv_heads, capacity); (h, s) at h * capacity() + s: the logical position the
///                  token had when its key was RoPE-rotated. Within a head, slots are in increasing position.
/// Keys are stored after RoPE. Attention reads slots 0..len[h]-1 only, so an eviction library compacts a
/// head by moving kept rows (keys, values, positions) down in order and writing the kept count to len[h].
/// Heads (and layers) may hold different lengths. `next_position` is the logical position of the next
/// token and is independent of the lengths (it never decreases on eviction).
///
/// Paged mode (kv_cache(config, capacity, page_size) or init_paged()): every layer owns a pool of
/// num_pages() pages of page_size() slots that each hold ONE KV head's tokens, [num_pages][page_size][head_dim]
/// for keys and the same for values (keys(l) / values(l) are the pool bases), and a page table per KV head:
/// slot s of head h lies in page page_ids(l, h)[s / page_size] at row s % page_size. A head holds exactly
/// ceil(len[h] / page_size) pages: append() takes a page from the layer's free list when the head's last page
/// is full, and shrinking a head (compact_head, set_length, release_pages) returns its tail pages, so
/// head-wise budgets free real pages. The pool has n_kv_heads * ceil(capacity / page_size) pages (every head
/// can reach the capacity at once); capacity is rounded up to a multiple of the page size. Lengths and
/// positions stay as in the contiguous mode (positions: a contiguous (n_kv_heads, capacity) array).
/// key(l, h, s) / value(l, h, s) address through the table; rows of one head are contiguous only within a
/// page, so code that reads a head's rows as one matrix uses head_keys() / head_values() (a gather to
/// scratch in paged mode, the cache itself in contiguous mode). head_stride() is meaningless there.
///
/// Repeated KV heads (kv_repeat() = r > 1; kv_cache(config, capacity, page_size, r) or repeated()): the cache
/// holds r copies of every model KV head, n_kv_heads() = model KV heads * r; cache head j is a copy of model
/// KV head j / r, and append() writes each model head's key/value into its r copies. With r = the model's
/// GQA group (kv_group()) every query head owns one cache head (query head h reads cache head h), as in
/// the reference code of ReST-KV, SnapKV and AdaKV, which repeat K/V to q_heads heads (HF's repeat_kv)
/// before eviction: gqa_reduction::per_query_head selections then fit the cache, at r times the memory.
/// In general query head h reads cache head h / (n_heads / n_kv_heads()) (forward.hpp: query_heads_per_cache_head).
class kv_cache {
public:
    kv_cache() = default;
    /// Allocates n_layers x (n_kv_heads, capacity, head_dim) keys and values; all lengths 0.
    kv_cache(int n_layers, int n_kv_heads, int head_dim, int capacity) { init(n_layers, n_kv_heads, head_dim, capacity); }
    /// Cache shaped for model config `c` with `capacity` slots per head.
    kv_cache(const config& c, int capacity) : kv_cache(c.n_layers, c.n_kv_heads, c.head_dim(), capacity) {}
    /// Paged cache shaped for `c` (page_size >= 1 slots per page; page_size <= 0: contiguous), with every
    /// model KV head repeated `kv_repeat` times (1: the GQA-native cache; c.kv_group(): one cache head per
    /// query head). kv_repeat < 1 is taken as 1; a kv_repeat that does not divide c.kv_group() builds a cache
    /// that forward() refuses with an error naming both.
    kv_cache(const config& c, int capacity, int page_size, int kv_repeat = 1) {
        const int r = std::max(kv_repeat, 1);
        if (page_size > 0) init_paged(c.n_layers, c.n_kv_heads * r, c.head_dim(), capacity, page_size);
        else init(c.n_layers, c.n_kv_heads * r, c.head_dim(), capacity);
        repeat_ = r;
    }

    void init(int n_layers, int n_kv_heads, int head_dim, int capacity) {
        n_layers_ = n_layers; n_kv_heads_ = n_kv_heads; head_dim_ = head_dim; capacity_ = capacity;
        const size_t kv = size_t(n_kv_heads) * size_t(capacity) * size_t(head_dim);
        layers_.assign(size_t(n_layers), layer{std::vector<float>(kv), std::vector<float>(kv),
                                               std::vector<std::int32_t>(size_t(n_kv_heads), 0),
                                               std::vector<std::int32_t>(size_t(n_kv_heads) * size_t(capacity), 0), {}, {}, {}});
        page_size_ = 0;
        max_pages_ = 0;
        repeat_ = 1;
        next_position = 0;
    }
    /// Paged mode: per layer a pool of n_kv_heads * ceil(capacity / page_size) one-head pages, every page
    /// free, all lengths 0; capacity() becomes capacity rounded up to a multiple of page_size.
    /// Precondition: page_size >= 1, capacity >= 0.
    void init_paged(int n_layers, int n_kv_heads, int head_dim, int capacity, int page_size) {
        const int maxp = (std::max(capacity, 0) + page_size - 1) / page_size;
        n_layers_ = n_layers; n_kv_heads_ = n_kv_heads; head_dim_ = head_dim; capacity_ = maxp * page_size;
        page_size_ = page_size;
        max_pages_ = maxp;
        repeat_ = 1;
        const size_t P = size_t(n_kv_heads) * size_t(maxp), kv = P * size_t(page_size) * size_t(head_dim);
        layers_.assign(size_t(n_layers), layer{std::vector<float>(kv), std::vector<float>(kv),
                                               std::vector<std::int32_t>(size_t(n_kv_heads), 0),
                                               std::vector<std::int32_t>(size_t(n_kv_heads) * size_t(capacity_), 0), {}, {}, {}});
        for (auto& l : layers_) {
            l.table.assign(P, -1);
            l.npages.assign(size_t(n_kv_heads), 0);
        }
        free_all_pages();
        next_position = 0;
    }
    /// Empties every head and sets next_position = 0 (memory is kept; contents become garbage; paged: every
    /// page back on the free list, in the initial order).
    void reset() {
        for (auto& l : layers_) std::fill(l.len.begin(), l.len.end(), 0);
        if (paged()) free_all_pages();
        next_position = 0;
    }

    int n_layers() const { return n_layers_; }
    /// Cache heads per layer: the model's KV heads times kv_repeat().
    int n_kv_heads() const { return n_kv_heads_; }
    /// Copies of each model KV head (1 unless built with kv_repeat > 1 or by repeated()).
    int kv_repeat() const { return repeat_; }
    /// A copy of this cache with every head repeated `r` times (r >= 1): cache head j of the copy holds the
    /// slots, positions and length of head j / r here; same capacity, page size and next_position (paged:
    /// pages taken in head order). The engine's way to hold a cache repeated to q_heads heads
    /// (r = kv_group() on a GQA-native cache), e.g. to run gqa_reduction::per_query_head presets on a
    /// prefilled cache. r == 1 gives a plain copy.
    kv_cache repeated(int r) const {
        r = std::max(r, 1);
        kv_cache out;
        if (paged()) out.init_paged(n_layers_, n_kv_heads_ * r, head_dim_, capacity_, page_size_);
        else out.init(n_layers_, n_kv_heads_ * r, head_dim_, capacity_);
        out.repeat_ = repeat_ * r;
        out.next_position = next_position;
        for (int l = 0; l < n_layers_; ++l)
            for (int j = 0; j < out.n_kv_heads_; ++j)
                for (int s = 0; s < length(l, j / r); ++s)
                    out.push_row(l, j, key(l, j / r, s), value(l, j / r, s), position(l, j / r, s));
        return out;
    }
    int head_dim() const { return head_dim_; }
    int capacity() const { return capacity_; }
    /// True for a paged cache (init_paged).
    bool paged() const { return page_size_ > 0; }
    /// Paged: slots per page; 0 for a contiguous cache.
    int page_size() const { return page_size_; }
    /// Paged: pages in each layer's pool (n_kv_heads * capacity / page_size); 0 for a contiguous cache.
    int num_pages() const { return n_kv_heads_ * max_pages_; }
    /// Paged: the most pages one head can hold (capacity / page_size).
    int max_pages_per_head() const { return max_pages_; }
    /// Paged: pages head h of layer l holds (= ceil(len / page_size)); 0 for a contiguous cache.
    int pages_in_use(int l, int h) const { return paged() ? layers_[size_t(l)].npages[size_t(h)] : 0; }
    /// Paged: pages layer l holds over all its heads.
    int pages_in_use(int l) const {
        int n = 0;
        for (int h = 0; h < n_kv_heads_; ++h) n += pages_in_use(l, h);
        return n;
    }
    /// Paged: free pages in layer l's pool.
    int free_pages(int l) const { return paged() ? int(layers_[size_t(l)].free.size()) : 0; }
    /// Paged: the page ids of head h of layer l in logical order (pages_in_use(l, h) of them).
    const std::int32_t* page_ids(int l, int h) const { return layers_[size_t(l)].table.data() + size_t(h) * size_t(max_pages_); }
    /// Paged: gives head h of layer l's pages beyond its first `keep` back to the free list (the next page
    /// taken is then the first of them).
    /// Error if keep is outside 0..pages_in_use(l, h) or would not hold the head's length.
    result release_pages(int l, int h, int keep) {
        layer& L = layers_[size_t(l)];
        const int n = L.npages[size_t(h)];
        if (!paged() || keep < 0 || keep > n || std::int64_t(keep) * page_size_ < L.len[size_t(h)])
            return result::failure("release_pages: layer " + std::to_string(l) + " head " + std::to_string(h) + ": keep " +
                                   std::to_string(keep) + " of " + std::to_string(n) + " pages cannot hold " +
                                   std::to_string(L.len[size_t(h)]) + " slots");
        std::int32_t* t = L.table.data() + size_t(h) * size_t(max_pages_);
        for (int i = n - 1; i >= keep; --i) {
            L.free.push_back(t[i]);
            t[i] = -1;
        }
        L.npages[size_t(h)] = keep;
        return result::success();
    }

    /// Elements between consecutive heads in keys()/values() (= capacity * head_dim). Contiguous mode only.
    std::int64_t head_stride() const { return std::int64_t(capacity_) * head_dim_; }
    /// Elements between consecutive slots of one head in keys()/values() (= head_dim).
    std::int64_t slot_stride() const { return head_dim_; }
    /// Elements between consecutive heads in positions() (= capacity).
    std::int64_t position_head_stride() const { return capacity_; }

    /// Base pointer of layer `l` keys, shape (n_kv_heads, capacity, head_dim), post-RoPE (paged: the page
    /// pool, [num_pages][page_size][head_dim]). Precondition: valid l.
    float* keys(int l) { return layers_[size_t(l)].k.data(); }
    const float* keys(int l) const { return layers_[size_t(l)].k.data(); }
    /// Base pointer of layer `l` values, shape (n_kv_heads, capacity, head_dim) (paged: the page pool).
    float* values(int l) { return layers_[size_t(l)].v.data(); }
    const float* values(int l) const { return layers_[size_t(l)].v.data(); }
    /// Layer `l` per-head valid lengths, int32 (n_kv_heads). Writable: the eviction code sets kept counts.
    std::int32_t* lengths(int l) { return layers_[size_t(l)].len.data(); }
    const std::int32_t* lengths(int l) const { return layers_[size_t(l)].len.data(); }
    /// Layer `l` logical positions, int32 (n_kv_heads, capacity).
    std::int32_t* positions(int l) { return layers_[size_t(l)].pos.data(); }
    const std::int32_t* positions(int l) const { return layers_[size_t(l)].pos.data(); }

    /// Convenience accessors: row of slot `s` of KV head `h` in layer `l` (head_dim floats). Paged: through
    /// the head's page table (s must lie in one of its pages: s < pages_in_use(l, h) * page_size).
    float* key(int l, int h, int s) { return keys(l) + row_offset(l, h, s); }
    const float* key(int l, int h, int s) const { return keys(l) + row_offset(l, h, s); }
    float* value(int l, int h, int s) { return values(l) + row_offset(l, h, s); }
    const float* value(int l, int h, int s) const { return values(l) + row_offset(l, h, s); }
    /// Slots 0..len-1 of head h's keys as one row-major (len, head_dim) matrix: the cache itself in
    /// contiguous mode; paged, the rows gathered page by page into `scratch` (resized). For attention code.
    const float* head_keys(int l, int h, std::vector<float>& scratch) const { return head_rows(keys(l), l, h, scratch); }
    /// As head_keys() for the values.
    const float* head_values(int l, int h, std::vector<float>& scratch) const { return head_rows(values(l), l, h, scratch); }
    int length(int l, int h) const { return layers_[size_t(l)].len[size_t(h)]; }
    int position(int l, int h, int s) const { return layers_[size_t(l)].pos[size_t(h) * size_t(capacity_) + size_t(s)]; }
    /// Sets len[h] of layer l. Error if n is outside 0..capacity (paged: outside 0..the slots of the head's
    /// pages; a shorter length returns the pages it no longer needs to the free list).
    result set_length(int l, int h, int n) {
        if (n < 0 || n > capacity_) return result::failure("set_length: " + std::to_string(n) + " outside 0.." + std::to_string(capacity_));
        if (paged()) {
            const int have = layers_[size_t(l)].npages[size_t(h)];
            if (std::int64_t(n) > std::int64_t(have) * page_size_)
                return result::failure("set_length: " + std::to_string(n) + " slots exceed the " + std::to_string(have) +
                                       " pages head " + std::to_string(h) + " of layer " + std::to_string(l) + " holds");
            layers_[size_t(l)].len[size_t(h)] = n;
            return release_pages(l, h, (n + page_size_ - 1) / page_size_);
        }
        layers_[size_t(l)].len[size_t(h)] = n;
        return result::success();
    }

    /// Appends one token to layer `l`: for every KV head h writes slot len[h] with k/v (each the model's
    /// kv_dim floats, head-major: model KV head m at [m*head_dim, (m+1)*head_dim); cache head h takes model
    /// head h / kv_repeat()) and `position`, then increments len[h].
    /// Paged: a head whose last page is full first takes a page from the layer's free list.
    /// Error (nothing written) if any head of the layer is full (or, paged, the free list runs short).
    result append(int l, const float* k, const float* v, std::int32_t position) {
        layer& L = layers_[size_t(l)];
        int need = 0;
        for (int h = 0; h < n_kv_heads_; ++h) {
            if (L.len[size_t(h)] >= capacity_)
                return result::failure("kv_cache full: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                       " holds " + std::to_string(capacity_) + " slots (capacity)");
            if (paged() && std::int64_t(L.len[size_t(h)]) == std::int64_t(L.npages[size_t(h)]) * page_size_) ++need;
        }
        if (need > int(L.free.size()))
            return result::failure("kv_cache: layer " + std::to_string(l) + " needs " + std::to_string(need) + " pages, " +
                                   std::to_string(L.free.size()) + " free");
        for (int h = 0; h < n_kv_heads_; ++h) {
            const size_t src = size_t(h / repeat_) * size_t(head_dim_);
            push_row(l, h, k + src, v + src, position);
        }
        return result::success();
    }

    /// Reference in-place compaction of one head: keeps slots `keep[0..n)` (strictly increasing, each < len)
    /// by moving their key/value rows and positions down to slots 0..n-1, then sets len = n (paged: the
    /// pages past ceil(n / page_size) go back to the free list).
    /// Error (nothing changed) if `keep` is not strictly increasing or out of range.
    result compact_head(int l, int h, const std::int32_t* keep, int n) {
        const int len = length(l, h);
        for (int i = 0; i < n; ++i)
            if (keep[i] < 0 || keep[i] >= len || (i > 0 && keep[i] <= keep[i - 1]))
                return result::failure("compact_head: keep list must be strictly increasing slots in 0.." + std::to_string(len - 1));
        std::int32_t* pos = positions(l) + h * position_head_stride();
        for (int i = 0; i < n; ++i) {
            if (keep[i] == i) continue;
            std::memmove(key(l, h, i), key(l, h, keep[i]), sizeof(float) * size_t(head_dim_));
            std::memmove(value(l, h, i), value(l, h, keep[i]), sizeof(float) * size_t(head_dim_));
            pos[i] = pos[keep[i]];
        }
        return set_length(l, h, n);
    }

    /// Logical position of the next token to be processed (advanced by forward()).
    std::int32_t next_position = 0;

private:
    struct layer {
        std::vector<float> k, v;
        std::vector<std::int32_t> len, pos;
        // paged mode only
        std::vector<std::int32_t> table;   // (n_kv_heads, max_pages): head h's page ids, -1 past npages[h]
        std::vector<std::int32_t> npages;  // (n_kv_heads): pages each head holds
        std::vector<std::int32_t> free;    // free page ids; the next page taken is free.back()
    };
    std::int64_t row_offset(int l, int h, int s) const {
        if (!paged()) return h * head_stride() + s * slot_stride();
        const std::int32_t page = layers_[size_t(l)].table[size_t(h) * size_t(max_pages_) + size_t(s / page_size_)];
        return (std::int64_t(page) * page_size_ + s % page_size_) * head_dim_;
    }
    /// Writes one row at slot len[h] of head h (paged: taking a page first when the last one is full) and
    /// increments len[h]. Precondition: room checked by the caller.
    void push_row(int l, int h, const float* k, const float* v, std::int32_t position) {
        layer& L = layers_[size_t(l)];
        if (paged() && std::int64_t(L.len[size_t(h)]) == std::int64_t(L.npages[size_t(h)]) * page_size_) {
            L.table[size_t(h) * size_t(max_pages_) + size_t(L.npages[size_t(h)]++)] = L.free.back();
            L.free.pop_back();
        }
        const int s = L.len[size_t(h)]++;
        std::memcpy(key(l, h, s), k, sizeof(float) * size_t(head_dim_));
        std::memcpy(value(l, h, s), v, sizeof(float) * size_t(head_dim_));
        L.pos[size_t(h) * size_t(capacity_) + size_t(s)] = position;
    }
    const float* head_rows(const float* base, int l, int h, std::vector<float>& scratch) const {
        if (!paged()) return base + h * head_stride();
        const int len = length(l, h);
        scratch.resize(size_t(std::max(len, 1)) * size_t(head_dim_));
        const std::int32_t* t = page_ids(l, h);
        for (int s = 0; s < len; s += page_size_) {
            const int rows = std::min(page_size_, len - s);
            std::memcpy(scratch.data() + size_t(s) * size_t(head_dim_), base + std::int64_t(t[s / page_size_]) * page_size_ * head_dim_,
                        sizeof(float) * size_t(rows) * size_t(head_dim_));
        }
        return scratch.data();
    }
    void free_all_pages() {
        for (auto& l : layers_) {
            std::fill(l.table.begin(), l.table.end(), -1);
            std::fill(l.npages.begin(), l.npages.end(), 0);
            // ids n-1 .. 0: the first pages taken are 0, 1, 2, ... (heads interleave, so a head's pages are
            // not adjacent in the pool)
            l.free.resize(size_t(num_pages()));
            for (int i = 0; i < num_pages(); ++i) l.free[size_t(i)] = num_pages() - 1 - i;
        }
    }
    int n_layers_ = 0, n_kv_heads_ = 0, head_dim_ = 0, capacity_ = 0, page_size_ = 0, max_pages_ = 0, repeat_ = 1;
    std::vector<layer> layers_;
};

}  // namespace kvevict_engine
