// kvevict_engine: minimal CPU inference engine for llama2.c checkpoints (example code).
// model.hpp: checkpoint configuration, weights, and a validating loader (no exceptions).
#pragma once

#include <Eigen/Dense>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace kvevict_engine {

/// Outcome of an operation that can fail: `ok == false` comes with a human-readable `error`.
struct result {
    bool ok = true;
    std::string error;
    explicit operator bool() const { return ok; }
    static result success() { return {}; }
    static result failure(std::string message) { return {false, std::move(message)}; }
};
/// Result of `load_model` / `tokenizer::load`.
using load_result = result;

/// Row-major fp32 matrix; weight matrices are stored [out][in] so that y = W x.
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using vector = Eigen::VectorXf;

/// Model hyper-parameters from the 7-int32 llama2.c header.
struct config {
    int dim = 0;          ///< residual width
    int hidden_dim = 0;   ///< FFN inner width
    int n_layers = 0;
    int n_heads = 0;      ///< query heads
    int n_kv_heads = 0;   ///< key/value heads (GQA when < n_heads)
    int vocab_size = 0;   ///< always positive here (sign of the header field decoded into `shared_classifier`)
    int seq_len = 0;      ///< training context; longer positions still run
    bool shared_classifier = true;  ///< classifier tied to the token embedding

    int head_dim() const { return dim / n_heads; }
    int kv_dim() const { return n_kv_heads * head_dim(); }
    /// Query heads per KV head: query head h reads KV head h / kv_group().
    int kv_group() const { return n_heads / n_kv_heads; }
};

/// Weights of one transformer block. Shapes are [out][in].
struct layer_weights {
    vector rms_att;  ///< (dim)
    matrix wq;       ///< (dim, dim); output is n_heads blocks of head_dim
    matrix wk;       ///< (kv_dim, dim)
    matrix wv;       ///< (kv_dim, dim)
    matrix wo;       ///< (dim, dim); input is the concatenation of the n_heads head outputs
    vector rms_ffn;  ///< (dim)
    matrix w1;       ///< (hidden_dim, dim)
    matrix w2;       ///< (dim, hidden_dim)
    matrix w3;       ///< (hidden_dim, dim)
};

/// A loaded llama2.c model.
struct model {
    config cfg;
    matrix tok_emb;                    ///< (vocab, dim)
    std::vector<layer_weights> layers; ///< n_layers entries
    vector rms_final;                  ///< (dim)
    matrix wcls;                       ///< (vocab, dim); empty when the classifier is tied

    /// Classifier matrix (vocab, dim): `wcls` when untied, else `tok_emb`.
    const matrix& classifier() const { return cfg.shared_classifier ? tok_emb : wcls; }
    /// Output projection of `layer` (dim, dim), [out][in], y = W x. Column block
    /// [h*head_dim, (h+1)*head_dim) is the per-head factor W_o^h. Precondition: 0 <= layer < n_layers.
    const matrix& wo(int layer) const { return layers[static_cast<size_t>(layer)].wo; }
};

namespace detail {
inline bool read_file(const std::string& path, std::vector<char>& bytes, std::string& error) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) { error = "cannot open file '" + path + "' (missing or unreadable)"; return false; }
    bytes.clear();
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
    bool bad = std::ferror(f) != 0;
    std::fclose(f);
    if (bad) { error = "read error on '" + path + "'"; return false; }
    return true;
}
}  // namespace detail

/// Number of floats the checkpoint must hold after the 28-byte header for config `c`
/// (including the two RoPE tables of seq_len*head_dim/2 floats each, and wcls when untied).
inline std::uint64_t expected_float_count(const config& c) {
    using u = std::uint64_t;
    const u d = u(c.dim), hd = u(c.hidden_dim), L = u(c.n_layers), V = u(c.vocab_size);
    const u kv = u(c.kv_dim()), S = u(c.seq_len), h = u(c.head_dim());
    u n = V * d;                   // tok_emb
    n += L * d;                    // rms_att
    n += L * d * d;                // wq
    n += 2 * L * kv * d;           // wk, wv
    n += L * d * d;                // wo
    n += L * d;                    // rms_ffn
    n += 3 * L * hd * d;           // w1, w2, w3
    n += d;                        // rms_final
    n += 2 * S * (h / 2);          // freq_cis_real, freq_cis_imag
    if (!c.shared_classifier) n += V * d;  // wcls
    return n;
}

/// Checks a decoded header. Returns an error naming the offending field(s).
inline result validate_config(const config& c) {
    auto bad = [](const char* what, long long v, const char* why) {
        return result::failure(std::string("bad header: ") + what + " = " + std::to_string(v) + " (" + why + ")");
    };
    if (c.dim <= 0 || c.dim > 65536) return bad("dim", c.dim, "must be in 1..65536");
    if (c.hidden_dim <= 0 || c.hidden_dim > (1 << 20)) return bad("hidden_dim", c.hidden_dim, "must be in 1..1048576");
    if (c.n_layers <= 0 || c.n_layers > 4096) return bad("n_layers", c.n_layers, "must be in 1..4096");
    if (c.n_heads <= 0 || c.n_heads > c.dim) return bad("n_heads", c.n_heads, "must be in 1..dim");
    if (c.n_kv_heads <= 0 || c.n_kv_heads > c.n_heads) return bad("n_kv_heads", c.n_kv_heads, "must be in 1..n_heads");
    if (c.vocab_size <= 0 || c.vocab_size > (1 << 22)) return bad("|vocab_size|", c.vocab_size, "must be in 1..4194304");
    if (c.seq_len <= 0 || c.seq_len > (1 << 24)) return bad("seq_len", c.seq_len, "must be in 1..16777216");
    if (c.n_heads % c.n_kv_heads != 0)
        return result::failure("bad header: n_heads = " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads = " +
                               std::to_string(c.n_kv_heads));
    if (c.dim % c.n_heads != 0)
        return result::failure("bad header: dim = " + std::to_string(c.dim) + " is not a multiple of n_heads = " +
                               std::to_string(c.n_heads));
    if (c.head_dim() % 2 != 0)
        return result::failure("bad header: head_dim = " + std::to_string(c.head_dim()) + " is odd (RoPE needs pairs)");
    return result::success();
}

/// Loads a llama2.c legacy checkpoint from `path` into `out`.
/// Format: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
/// vocab_size < 0 means an untied classifier stored last), then fp32 arrays tok_emb, rms_att, wq, wk, wv,
/// wo, rms_ffn, w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag[, wcls].
/// Errors (returned, never thrown): missing/unreadable file, file shorter than the header, invalid header
/// (non-positive or absurd dims, n_heads % n_kv_heads != 0, dim % n_heads != 0, odd head_dim), and
/// file size different from 28 + 4 * expected_float_count (truncated or trailing data).
/// On failure `out` is left unchanged.
inline load_result load_model(const std::string& path, model& out) {
    std::vector<char> bytes;
    std::string err;
    if (!detail::read_file(path, bytes, err)) return result::failure(err);
    const std::uint64_t header_bytes = 7 * sizeof(std::int32_t);
    if (bytes.size() < header_bytes)
        return result::failure("truncated file '" + path + "': " + std::to_string(bytes.size()) +
                               " bytes, shorter than the 28-byte header");
    std::int32_t h[7];
    std::memcpy(h, bytes.data(), sizeof h);
    config c;
    c.dim = h[0]; c.hidden_dim = h[1]; c.n_layers = h[2]; c.n_heads = h[3]; c.n_kv_heads = h[4];
    c.shared_classifier = h[5] > 0;
    c.vocab_size = h[5] == INT32_MIN ? -1 : (h[5] < 0 ? -h[5] : h[5]);
    c.seq_len = h[6];
    if (result r = validate_config(c); !r) return result::failure(r.error + " in '" + path + "'");
    const std::uint64_t want = header_bytes + 4 * expected_float_count(c);
    if (bytes.size() != want)
        return result::failure(std::string(bytes.size() < want ? "truncated file" : "file size mismatch") + " '" + path +
                               "': header implies " + std::to_string(want) + " bytes, file has " +
                               std::to_string(bytes.size()));

    const float* p = reinterpret_cast<const float*>(bytes.data() + header_bytes);  // memcpy'd below, alignment-safe
    auto take_mat = [&p](int rows, int cols) {
        matrix m(rows, cols);
        std::memcpy(m.data(), p, sizeof(float) * size_t(rows) * size_t(cols));
        p += size_t(rows) * size_t(cols);
        return m;
    };
    auto take_vec = [&p](int n) {
        vector v(n);
        std::memcpy(v.data(), p, sizeof(float) * size_t(n));
        p += n;
        return v;
    };
    model m;
    m.cfg = c;
    const int L = c.n_layers, d = c.dim, kv = c.kv_dim(), hd = c.hidden_dim;
    m.tok_emb = take_mat(c.vocab_size, d);
    m.layers.resize(size_t(L));
    for (auto& l : m.layers) l.rms_att = take_vec(d);
    for (auto& l : m.layers) l.wq = take_mat(d, d);
    for (auto& l : m.layers) l.wk = take_mat(kv, d);
    for (auto& l : m.layers) l.wv = take_mat(kv, d);
    for (auto& l : m.layers) l.wo = take_mat(d, d);
    for (auto& l : m.layers) l.rms_ffn = take_vec(d);
    for (auto& l : m.layers) l.w1 = take_mat(hd, d);
    for (auto& l : m.layers) l.w2 = take_mat(d, hd);
    for (auto& l : m.layers) l.w3 = take_mat(hd, d);
    m.rms_final = take_vec(d);
    p += 2 * size_t(c.seq_len) * size_t(c.head_dim() / 2);  // RoPE tables: recomputed in forward
    if (!c.shared_classifier) m.wcls = take_mat(c.vocab_size, d);
    out = std::move(m);
    return result::success();
}

}  // namespace kvevict_engine
