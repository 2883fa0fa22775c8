// LKV artifact reader: the trained head logits and token-scorer MLPs written by
// tools/lkv/train.py (format version 1, documented in docs/lkv.md "Artifact format").
// Dependency-free C++17 (standard library and kvevict/core only): no Eigen, no CUDA.
//
//   kvevict::io::lkv_artifact art;
//   kvevict::status s = kvevict::io::read_lkv_artifact("artifacts/lkv/stories260K.lkv", &art);
//   kvevict::io::lkv_model_identity id;
//   s = kvevict::io::checkpoint_identity(".../stories260K.bin", &id);  // the model you run
//   s = kvevict::io::check_model(art, id);                             // refuses a foreign model
//
// Layout (all little-endian; offsets in bytes; 128-byte header, then the payload):
//    0 char[8] magic "KVEVLKV\0"           8 u32 version (= 1)        12 u32 header_bytes (= 128)
//   16 i32[7] model header (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size as stored
//             (negative: untied classifier), seq_len) of the llama2.c checkpoint   44 u32 0
//   48 u64 checkpoint file size in bytes   56 u64 checkpoint hash (FNV-1a 64 of the file's first
//             min(size, 28 + 65536) bytes: the header and the first weights)
//   64 i32 num_layers  68 i32 kv_heads  72 i32 head_dim  76 i32 mlp_hidden
//   80 i32 activation (0 silu, 1 relu)  84 i32 flags (= 0)
//   88 f32 keep_ratio_min  92 f32 keep_ratio_max (the range of R sampled in training)
//   96 f32 temperature (of r = softmax(z / temperature))  100 f32 0
//  104 u64 payload float count = N + N * block, N = num_layers * kv_heads,
//          block = mlp_hidden * 2 * head_dim + 2 * mlp_hidden + 1
//  112 u64 payload hash (FNV-1a 64 of the payload bytes)   120 u64 0
//  128 f32 logits[N] ((layer, KV head) row-major), then f32 mlp[N][block]
//          (per head: W1 (mlp_hidden, 2*head_dim) row-major over [k ; v], b1, w2, b2).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvevict/core/status.hpp"
#include "kvevict/policies/learned.hpp"

namespace kvevict {
namespace io {

constexpr char lkv_magic[8] = {'K', 'V', 'E', 'V', 'L', 'K', 'V', '\0'};
constexpr std::uint32_t lkv_format_version = 1;
constexpr std::uint32_t lkv_header_bytes = 128;
/// Bytes of the checkpoint covered by its identity hash (header + first weights).
constexpr std::uint64_t lkv_identity_prefix = 28 + 65536;

/// Which model an artifact was trained for.
struct lkv_model_identity {
  std::int32_t header[7] = {0, 0, 0, 0, 0, 0, 0};  ///< the checkpoint's 7 int32 header fields
  std::uint64_t checkpoint_bytes = 0;               ///< file size
  std::uint64_t checkpoint_hash = 0;                ///< FNV-1a 64 of the first lkv_identity_prefix bytes
};

/// A loaded artifact (owns its tables; the policy params point into them).
struct lkv_artifact {
  std::uint32_t version = 0;
  lkv_model_identity model;
  std::int32_t num_layers = 0, kv_heads = 0, head_dim = 0, mlp_hidden = 0;
  lkv_activation activation = lkv_activation::silu;
  float keep_ratio_min = 0.0f, keep_ratio_max = 0.0f;  ///< R range used in training
  float temperature = 1.0f;
  std::vector<float> logits;  ///< (num_layers, kv_heads)
  std::vector<float> mlp;     ///< (num_layers, kv_heads, block)

  std::int64_t heads() const { return static_cast<std::int64_t>(num_layers) * kv_heads; }
  std::int64_t block() const { return scorers::learned_mlp::block_floats(head_dim, mlp_hidden); }
};

namespace detail {

/// FNV-1a 64-bit hash, continuing from h (start: 14695981039346656037).
inline std::uint64_t fnv1a64(const unsigned char* p, std::size_t n, std::uint64_t h = 14695981039346656037ull) {
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}
inline std::uint32_t rd_u32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) | (static_cast<std::uint32_t>(p[2]) << 16) |
         (static_cast<std::uint32_t>(p[3]) << 24);
}
inline std::int32_t rd_i32(const unsigned char* p) {
  const std::uint32_t u = rd_u32(p);
  std::int32_t v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline std::uint64_t rd_u64(const unsigned char* p) { return static_cast<std::uint64_t>(rd_u32(p)) | (static_cast<std::uint64_t>(rd_u32(p + 4)) << 32); }
inline float rd_f32(const unsigned char* p) {
  const std::uint32_t u = rd_u32(p);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline status read_whole_file(const char* path, std::vector<unsigned char>* bytes, std::uint64_t limit = ~0ull,
                              std::uint64_t* file_size = nullptr) {
  if (!path) return status::error(errc::null_pointer, "path is null");
  std::FILE* f = std::fopen(path, "rb");
  if (!f) return status::error(errc::io_error, "cannot open '%s' (missing or unreadable)", path);
  bytes->clear();
  unsigned char buf[1 << 16];
  std::uint64_t total = 0;
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    const std::uint64_t room = limit > bytes->size() ? limit - bytes->size() : 0;
    bytes->insert(bytes->end(), buf, buf + (n < room ? n : static_cast<std::size_t>(room)));
    total += n;
  }
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) return status::error(errc::io_error, "read error on '%s'", path);
  if (file_size) *file_size = total;
  return {};
}

}  // namespace detail

/// Identity of a llama2.c checkpoint file (header, size, prefix hash). Errors: io_error
/// (missing/unreadable), format_error (shorter than the 28-byte header).
inline status checkpoint_identity(const char* checkpoint_path, lkv_model_identity* out) {
  if (!out) return status::error(errc::null_pointer, "out is null");
  std::vector<unsigned char> b;
  std::uint64_t size = 0;
  KVEVICT_TRY(detail::read_whole_file(checkpoint_path, &b, lkv_identity_prefix, &size));
  if (b.size() < 28)
    return status::error(errc::format_error, "checkpoint '%s' has %llu bytes, shorter than the 28-byte header", checkpoint_path,
                         static_cast<unsigned long long>(b.size()));
  lkv_model_identity id;
  for (int i = 0; i < 7; ++i) id.header[i] = detail::rd_i32(b.data() + 4 * i);
  id.checkpoint_bytes = size;
  id.checkpoint_hash = detail::fnv1a64(b.data(), b.size());
  *out = id;
  return {};
}

/// Parse an artifact held in memory. `name` only labels messages. On error *out is unchanged.
/// Errors (format_error unless noted): shorter than the header ("truncated"), wrong magic,
/// unsupported version, header_bytes != 128, non-positive or absurd shapes, unknown
/// activation, payload count not matching the shapes, file shorter than the payload
/// ("truncated"), trailing bytes, payload hash mismatch (corrupted), non-finite values,
/// temperature <= 0, keep ratios outside (0, 1].
inline status parse_lkv_artifact(const unsigned char* data, std::size_t n, lkv_artifact* out, const char* name = "<memory>") {
  if (!out) return status::error(errc::null_pointer, "out is null");
  if (!data && n > 0) return status::error(errc::null_pointer, "data is null");
  if (n < lkv_header_bytes)
    return status::error(errc::format_error, "truncated LKV artifact '%s': %zu bytes, shorter than the %u-byte header", name, n,
                         lkv_header_bytes);
  if (std::memcmp(data, lkv_magic, 8) != 0)
    return status::error(errc::format_error, "'%s' is not an LKV artifact (bad magic; expected \"KVEVLKV\")", name);
  lkv_artifact a;
  a.version = detail::rd_u32(data + 8);
  if (a.version != lkv_format_version)
    return status::error(errc::format_error, "LKV artifact '%s' has format version %u; this reader supports version %u", name,
                         a.version, lkv_format_version);
  const std::uint32_t hb = detail::rd_u32(data + 12);
  if (hb != lkv_header_bytes)
    return status::error(errc::format_error, "LKV artifact '%s': header_bytes = %u != %u", name, hb, lkv_header_bytes);
  for (int i = 0; i < 7; ++i) a.model.header[i] = detail::rd_i32(data + 16 + 4 * i);
  a.model.checkpoint_bytes = detail::rd_u64(data + 48);
  a.model.checkpoint_hash = detail::rd_u64(data + 56);
  a.num_layers = detail::rd_i32(data + 64);
  a.kv_heads = detail::rd_i32(data + 68);
  a.head_dim = detail::rd_i32(data + 72);
  a.mlp_hidden = detail::rd_i32(data + 76);
  const std::int32_t act = detail::rd_i32(data + 80);
  const std::int32_t flags = detail::rd_i32(data + 84);
  a.keep_ratio_min = detail::rd_f32(data + 88);
  a.keep_ratio_max = detail::rd_f32(data + 92);
  a.temperature = detail::rd_f32(data + 96);
  const std::uint64_t count = detail::rd_u64(data + 104);
  const std::uint64_t phash = detail::rd_u64(data + 112);
  auto bad_dim = [](std::int32_t v) { return v < 1 || v > (1 << 16); };
  if (bad_dim(a.num_layers) || bad_dim(a.kv_heads) || bad_dim(a.head_dim) || bad_dim(a.mlp_hidden))
    return status::error(errc::format_error, "LKV artifact '%s': shapes (num_layers %d, kv_heads %d, head_dim %d, mlp_hidden %d) must be in 1..65536",
                         name, a.num_layers, a.kv_heads, a.head_dim, a.mlp_hidden);
  if (act != 0 && act != 1) return status::error(errc::format_error, "LKV artifact '%s': activation code %d is not 0 (silu) or 1 (relu)", name, act);
  a.activation = static_cast<lkv_activation>(act);
  if (flags != 0) return status::error(errc::format_error, "LKV artifact '%s': flags = %d, version 1 defines none", name, flags);
  if (!(a.temperature > 0.0f) || !std::isfinite(a.temperature))
    return status::error(errc::format_error, "LKV artifact '%s': temperature = %g must be finite and > 0", name, static_cast<double>(a.temperature));
  if (!(a.keep_ratio_min > 0.0f && a.keep_ratio_min <= a.keep_ratio_max && a.keep_ratio_max <= 1.0f))
    return status::error(errc::format_error, "LKV artifact '%s': keep ratios [%g, %g] must satisfy 0 < min <= max <= 1", name,
                         static_cast<double>(a.keep_ratio_min), static_cast<double>(a.keep_ratio_max));
  const std::uint64_t N = static_cast<std::uint64_t>(a.num_layers) * static_cast<std::uint64_t>(a.kv_heads);
  // Bound the products by what the file can hold before multiplying (no u64 wrap-around).
  const std::uint64_t max_floats = n > lkv_header_bytes ? (n - lkv_header_bytes) / 4 : 0;
  const std::uint64_t blk = static_cast<std::uint64_t>(a.block());
  if (N == 0 || N > max_floats || blk + 1 > max_floats / N)
    return status::error(errc::format_error, "truncated LKV artifact '%s': shapes (%d layers x %d KV heads, %llu floats per head) exceed the file's %zu bytes",
                         name, a.num_layers, a.kv_heads, static_cast<unsigned long long>(blk), n);
  const std::uint64_t want = N + N * blk;
  if (count != want)
    return status::error(errc::format_error, "LKV artifact '%s': payload holds %llu floats, the shapes need %llu", name,
                         static_cast<unsigned long long>(count), static_cast<unsigned long long>(want));
  const std::uint64_t need = lkv_header_bytes + 4 * want;
  if (n < need)
    return status::error(errc::format_error, "truncated LKV artifact '%s': %zu bytes, the header implies %llu", name, n,
                         static_cast<unsigned long long>(need));
  if (n > need)
    return status::error(errc::format_error, "LKV artifact '%s': %zu bytes, %llu trailing bytes after the payload", name, n,
                         static_cast<unsigned long long>(n - need));
  const unsigned char* pl = data + lkv_header_bytes;
  if (detail::fnv1a64(pl, static_cast<std::size_t>(4 * want)) != phash)
    return status::error(errc::format_error, "LKV artifact '%s': payload hash mismatch (corrupted file)", name);
  a.logits.resize(static_cast<std::size_t>(N));
  a.mlp.resize(static_cast<std::size_t>(want - N));
  for (std::uint64_t i = 0; i < N; ++i) a.logits[static_cast<std::size_t>(i)] = detail::rd_f32(pl + 4 * i);
  for (std::uint64_t i = 0; i < want - N; ++i) a.mlp[static_cast<std::size_t>(i)] = detail::rd_f32(pl + 4 * (N + i));
  for (std::size_t i = 0; i < a.logits.size(); ++i)
    if (!std::isfinite(a.logits[i])) return status::error(errc::format_error, "LKV artifact '%s': logits[%zu] is not finite", name, i);
  for (std::size_t i = 0; i < a.mlp.size(); ++i)
    if (!std::isfinite(a.mlp[i])) return status::error(errc::format_error, "LKV artifact '%s': mlp[%zu] is not finite", name, i);
  *out = std::move(a);
  return {};
}

/// Read and validate an artifact file (see parse_lkv_artifact; io_error when unreadable).
inline status read_lkv_artifact(const char* path, lkv_artifact* out) {
  std::vector<unsigned char> b;
  KVEVICT_TRY(detail::read_whole_file(path, &b));
  return parse_lkv_artifact(b.data(), b.size(), out, path);
}

/// Refuse an artifact trained for another model: compares the 7 header fields, the file size
/// and the prefix hash. Error: format_error naming the first difference.
inline status check_model(const lkv_artifact& a, const lkv_model_identity& m) {
  static const char* const field[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i)
    if (a.model.header[i] != m.header[i])
      return status::error(errc::format_error, "LKV artifact is for another model: %s = %d in the artifact, %d in the checkpoint",
                           field[i], a.model.header[i], m.header[i]);
  if (a.model.checkpoint_bytes != m.checkpoint_bytes)
    return status::error(errc::format_error, "LKV artifact is for another model: checkpoint size %llu in the artifact, %llu here",
                         static_cast<unsigned long long>(a.model.checkpoint_bytes), static_cast<unsigned long long>(m.checkpoint_bytes));
  if (a.model.checkpoint_hash != m.checkpoint_hash)
    return status::error(errc::format_error, "LKV artifact is for another model: checkpoint hash %016llx in the artifact, %016llx here",
                         static_cast<unsigned long long>(a.model.checkpoint_hash), static_cast<unsigned long long>(m.checkpoint_hash));
  const std::int32_t hd = m.header[3] > 0 ? m.header[0] / m.header[3] : 0;
  if (a.num_layers != m.header[2] || a.kv_heads != m.header[4] || a.head_dim != hd)
    return status::error(errc::format_error, "LKV artifact shapes (num_layers %d, kv_heads %d, head_dim %d) do not match the model (%d, %d, %d)",
                         a.num_layers, a.kv_heads, a.head_dim, m.header[2], m.header[4], hd);
  return {};
}

/// Policy parameters pointing into `a` (which must outlive them).
inline budgeters::headwise_learned::params budgeter_params(const lkv_artifact& a) {
  budgeters::headwise_learned::params p;
  p.logits = a.logits.data();
  p.num_layers = a.num_layers;
  p.kv_heads = a.kv_heads;
  p.temperature = a.temperature;
  return p;
}
inline scorers::learned_mlp::params scorer_params(const lkv_artifact& a) {
  scorers::learned_mlp::params p;
  p.weights = a.mlp.data();
  p.num_layers = a.num_layers;
  p.kv_heads = a.kv_heads;
  p.head_dim = a.head_dim;
  p.hidden = a.mlp_hidden;
  p.activation = a.activation;
  return p;
}

}  // namespace io
}  // namespace kvevict
