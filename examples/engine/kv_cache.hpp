// kvevict_engine: per-layer KV cache in HND layout, compactable in place by an eviction library.
#pragma once

#include "model.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvevict_engine {

/// KV cache for all layers.
///
/// Layout per layer (HND), all strides in elements:
///   keys / values: contiguous fp32, shape (n_kv_heads, capacity, head_dim);
///                  element (h, s, d) at h * head_stride() + s * slot_stride() + d.
///   lengths:       int32 (n_kv_heads): valid slots of each head; slots len[h]..capacity-1 are garbage.
///   positions:     int32 (n_kv_heads, capacity); (h, s) at h * capacity() + s: the logical position the
///                  token had when its key was RoPE-rotated. Within a head, slots are in increasing position.
/// Keys are stored after RoPE. Attention reads slots 0..len[h]-1 only, so an eviction library compacts a
/// head by moving kept rows (keys, values, positions) down in order and writing the kept count to len[h].
/// Heads (and layers) may hold different lengths. `next_position` is the logical position of the next
/// token and is independent of the lengths (it never decreases on eviction).
class kv_cache {
public:
    kv_cache() = default;
    /// Allocates n_layers x (n_kv_heads, capacity, head_dim) keys and values; all lengths 0.
    kv_cache(int n_layers, int n_kv_heads, int head_dim, int capacity) { init(n_layers, n_kv_heads, head_dim, capacity); }
    /// Cache shaped for model config `c` with `capacity` slots per head.
    kv_cache(const config& c, int capacity) : kv_cache(c.n_layers, c.n_kv_heads, c.head_dim(), capacity) {}

    void init(int n_layers, int n_kv_heads, int head_dim, int capacity) {
        n_layers_ = n_layers; n_kv_heads_ = n_kv_heads; head_dim_ = head_dim; capacity_ = capacity;
        const size_t kv = size_t(n_kv_heads) * size_t(capacity) * size_t(head_dim);
        layers_.assign(size_t(n_layers), layer{std::vector<float>(kv), std::vector<float>(kv),
                                               std::vector<std::int32_t>(size_t(n_kv_heads), 0),
                                               std::vector<std::int32_t>(size_t(n_kv_heads) * size_t(capacity), 0)});
        next_position = 0;
    }
    /// Empties every head and sets next_position = 0 (memory is kept; contents become garbage).
    void reset() {
        for (auto& l : layers_) std::fill(l.len.begin(), l.len.end(), 0);
        next_position = 0;
    }

    int n_layers() const { return n_layers_; }
    int n_kv_heads() const { return n_kv_heads_; }
    int head_dim() const { return head_dim_; }
    int capacity() const { return capacity_; }
    /// Elements between consecutive heads in keys()/values() (= capacity * head_dim).
    std::int64_t head_stride() const { return std::int64_t(capacity_) * head_dim_; }
    /// Elements between consecutive slots of one head in keys()/values() (= head_dim).
    std::int64_t slot_stride() const { return head_dim_; }
    /// Elements between consecutive heads in positions() (= capacity).
    std::int64_t position_head_stride() const { return capacity_; }

    /// Base pointer of layer `l` keys, shape (n_kv_heads, capacity, head_dim), post-RoPE. Precondition: valid l.
    float* keys(int l) { return layers_[size_t(l)].k.data(); }
    const float* keys(int l) const { return layers_[size_t(l)].k.data(); }
    /// Base pointer of layer `l` values, shape (n_kv_heads, capacity, head_dim).
    float* values(int l) { return layers_[size_t(l)].v.data(); }
    const float* values(int l) const { return layers_[size_t(l)].v.data(); }
    /// Layer `l` per-head valid lengths, int32 (n_kv_heads). Writable: the eviction code sets kept counts.
    std::int32_t* lengths(int l) { return layers_[size_t(l)].len.data(); }
    const std::int32_t* lengths(int l) const { return layers_[size_t(l)].len.data(); }
    /// Layer `l` logical positions, int32 (n_kv_heads, capacity).
    std::int32_t* positions(int l) { return layers_[size_t(l)].pos.data(); }
    const std::int32_t* positions(int l) const { return layers_[size_t(l)].pos.data(); }

    /// Convenience accessors: row of slot `s` of KV head `h` in layer `l` (head_dim floats).
    float* key(int l, int h, int s) { return keys(l) + h * head_stride() + s * slot_stride(); }
    const float* key(int l, int h, int s) const { return keys(l) + h * head_stride() + s * slot_stride(); }
    float* value(int l, int h, int s) { return values(l) + h * head_stride() + s * slot_stride(); }
    const float* value(int l, int h, int s) const { return values(l) + h * head_stride() + s * slot_stride(); }
    int length(int l, int h) const { return layers_[size_t(l)].len[size_t(h)]; }
    int position(int l, int h, int s) const { return layers_[size_t(l)].pos[size_t(h) * size_t(capacity_) + size_t(s)]; }
    /// Sets len[h] of layer l. Error if n is outside 0..capacity.
    result set_length(int l, int h, int n) {
        if (n < 0 || n > capacity_) return result::failure("set_length: " + std::to_string(n) + " outside 0.." + std::to_string(capacity_));
        layers_[size_t(l)].len[size_t(h)] = n;
        return result::success();
    }

    /// Appends one token to layer `l`: for every KV head h writes slot len[h] with k/v (each kv_dim floats,
    /// head-major: head h at [h*head_dim, (h+1)*head_dim)) and `position`, then increments len[h].
    /// Error (nothing written) if any head of the layer is full.
    result append(int l, const float* k, const float* v, std::int32_t position) {
        layer& L = layers_[size_t(l)];
        for (int h = 0; h < n_kv_heads_; ++h)
            if (L.len[size_t(h)] >= capacity_)
                return result::failure("kv_cache full: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                       " holds " + std::to_string(capacity_) + " slots (capacity)");
        for (int h = 0; h < n_kv_heads_; ++h) {
            const int s = L.len[size_t(h)]++;
            std::memcpy(key(l, h, s), k + size_t(h) * size_t(head_dim_), sizeof(float) * size_t(head_dim_));
            std::memcpy(value(l, h, s), v + size_t(h) * size_t(head_dim_), sizeof(float) * size_t(head_dim_));
            L.pos[size_t(h) * size_t(capacity_) + size_t(s)] = position;
        }
        return result::success();
    }

    /// Reference in-place compaction of one head: keeps slots `keep[0..n)` (strictly increasing, each < len)
    /// by moving their key/value rows and positions down to slots 0..n-1, then sets len = n.
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
        layers_[size_t(l)].len[size_t(h)] = n;
        return result::success();
    }

    /// Logical position of the next token to be processed (advanced by forward()).
    std::int32_t next_position = 0;

private:
    struct layer {
        std::vector<float> k, v;
        std::vector<std::int32_t> len, pos;
    };
    int n_layers_ = 0, n_kv_heads_ = 0, head_dim_ = 0, capacity_ = 0;
    std::vector<layer> layers_;
};

}  // namespace kvevict_engine
