// IWYU pragma: private, include "kvevict/cuda.cuh"
// CUDA kernels of the scorers: fp32 query staging, window attention statistics (split-key
// online softmax), fused temporal aggregation, the adaptive-window drift statistic, key norm
// and the output-reconstruction (ReST-KV) score in both aggregation modes with its exact
// dominant-token paths. Same math as kvevict/backends/cpu/scorers.hpp; logits are computed
// in fp64 from fp32-widened inputs (so no logit can overflow and no fp64 recompute is needed).
//
// Work decomposition: "warp per key": a warp holds one key (or value) row in registers, lane l
// holding elements l, l + 32, ... (head_dim <= 256), and dot products are warp reductions.
// Kernels are templates over the storage type T only (float, half_t, bfloat16_t).
#pragma once

#include <math_constants.h>

#include <cmath>
#include <cstdint>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/paged.cuh"
#include "kvevict/core/budget_rules.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

/// Per-launch description of the heads a scoring kernel sees. Query head qh = b * Hq + hq
/// belongs to KV head h = hq / G; its length is len[b * Hkv + h] (already validated and
/// clamped on the device), its effective window w = min(W, L), window row j (0 <= j < w) is
/// the staged query row W - w + j and sees keys [0, L - w + j].
template <class T>
struct head_args {
  kv_view<const T> keys;    ///< contiguous (batch, kv_heads, seq, d), or a page pool read through `pages`
  kv_view<const T> values;
  page_table_view pages;     ///< device page table of a paged cache (empty: contiguous)
  const float* q = nullptr;              ///< staged queries, fp32 [B * Hq][W][d]
  const std::int32_t* len = nullptr;     ///< [B * Hkv]
  const std::uint8_t* needkv = nullptr;  ///< [B * Hkv] 1: this KV head is scored
  const float* cw = nullptr;             ///< temporal weights [B * Hkv][W] over the effective window
  int Hkv = 0, Hq = 0, G = 1, W = 0, d = 0;
  std::int64_t S = 0;
  double scale = 0.0;    ///< (double)(float)(1 / sqrt(d)), as the CPU backend
  int last_only = 0;     ///< only the last window row (last_query)

  struct head {
    int b, hq, h, kvi;
    std::int64_t L, w, row0;
  };
  __device__ head locate(int qh) const {
    head r;
    r.b = qh / Hq;
    r.hq = qh % Hq;
    r.h = r.hq / G;
    r.kvi = r.b * Hkv + r.h;
    r.L = len[r.kvi];
    r.w = r.L < W ? r.L : W;
    r.row0 = last_only ? r.w - 1 : 0;
    return r;
  }
  __device__ kv_rows<const T> key_rows(const head& hd) const { return head_rows(keys, pages, hd.b, hd.h); }
  __device__ kv_rows<const T> value_rows(const head& hd) const { return head_rows(values, pages, hd.b, hd.h); }
  __device__ const float* qrow(int qh, const head& hd, std::int64_t j) const {
    return q + (static_cast<std::int64_t>(qh) * W + (W - hd.w + j)) * d;
  }
};

/// qs[((b * Hq + hq) * W + j) * d + c] = float(q(b, hq, j, c)).
template <class T>
__global__ void stage_queries_kernel(query_view<const T> q, float* qs, std::int64_t n) {
  const std::int64_t W = q.extent[2], D = q.extent[3], Hq = q.extent[1];
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % D, j = (i / D) % W, hq = (i / (D * W)) % Hq, b = i / (D * W * Hq);
    qs[i] = to_float(q(b, hq, j, c));
  }
}

/// Rt[(hq * d + c) * d + i] = wo_factor(hq, i, c): the transposed, contiguous W_O factors.
template <int Unused = 0>
__global__ void stage_rt_kernel(strided_view<const float, 3> r, float* rt, std::int64_t n) {
  const std::int64_t D = r.extent[1];
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = k % D, c = (k / D) % D, hq = k / (D * D);
    rt[k] = r(hq, i, c);
  }
}

/// Online softmax state of one window row over a range of keys: the running max logit m, the
/// sum of exp(l - m) over the OTHER keys (zo; the row normaliser is 1 + zo) and the argmax
/// (lowest index among equal maxima). zo excludes the argmax so that 1 - a_max = zo / (1 + zo)
/// is available without cancellation (the exact paths need it).
struct softmax_state {
  double m;
  double zo;
  int arg;
  __device__ static softmax_state empty() { return softmax_state{-CUDART_INF, 0.0, 0x7fffffff}; }
  __device__ void push(double l, int n) {  // keys pushed in increasing n
    if (l > m) {
      zo = (m == -CUDART_INF) ? 0.0 : (zo + 1.0) * exp(m - l);
      m = l;
      arg = n;
    } else {
      zo += exp(l - m);
    }
  }
  __device__ static softmax_state merge(const softmax_state& a, const softmax_state& b) {
    const bool a_wins = a.m > b.m || (a.m == b.m && a.arg < b.arg);
    const softmax_state& w = a_wins ? a : b;
    const softmax_state& l = a_wins ? b : a;
    if (l.m == -CUDART_INF) return w;
    softmax_state r = w;
    r.zo = w.zo + (1.0 + l.zo) * exp(l.m - w.m);
    return r;
  }
};

/// Split-key partial softmax statistics. grid (nsplit, B * Hq, row chunks); blockIdx.z takes the
/// 32-row chunks z, z + gridDim.z, ... of the window; dynamic smem 32 * d floats.
/// Partials [qh][split][W] (effective row index j).
template <class T>
__global__ void attn_stats_partial_kernel(head_args<T> a, int nsplit, double* pm, double* pz, int* pa) {
  extern __shared__ float smq[];  // 32 x d
  __shared__ double sm_m[block_warps][32], sm_z[block_warps][32];
  __shared__ int sm_a[block_warps][32];
  const int qh = blockIdx.y, split = blockIdx.x;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi] || hd.w <= 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t per = (hd.L + nsplit - 1) / nsplit;
  const std::int64_t n0 = split * per, n1 = (n0 + per < hd.L) ? n0 + per : hd.L;
  const kv_rows<const T> kb = a.key_rows(hd);
  for (std::int64_t jc = hd.row0 + 32 * static_cast<std::int64_t>(blockIdx.z); jc < hd.w; jc += 32 * static_cast<std::int64_t>(gridDim.z)) {
    const int nj = static_cast<int>((hd.w - jc) < 32 ? (hd.w - jc) : 32);
    __syncthreads();
    for (int i = threadIdx.x; i < nj * a.d; i += blockDim.x) smq[i] = a.qrow(qh, hd, jc)[i];
    __syncthreads();
    softmax_state st = softmax_state::empty();  // lane jj owns row jc + jj
    for (std::int64_t n = n0 + warp; n < n1; n += block_warps) {
      float kr[lane_slots];
      load_row(kb, n, a.d, lane, kr);
      for (int jj = 0; jj < nj; ++jj) {
        const std::int64_t vis = hd.L - hd.w + jc + jj + 1;
        if (n >= vis) continue;
        const double l = warp_dot(kr, smq + jj * a.d, a.d, lane) * a.scale;
        if (lane == jj) st.push(l, static_cast<int>(n));
      }
    }
    sm_m[warp][lane] = st.m;
    sm_z[warp][lane] = st.zo;
    sm_a[warp][lane] = st.arg;
    __syncthreads();
    if (threadIdx.x < nj) {
      softmax_state r = softmax_state::empty();
      for (int wv = 0; wv < block_warps; ++wv)
        r = softmax_state::merge(r, softmax_state{sm_m[wv][threadIdx.x], sm_z[wv][threadIdx.x], sm_a[wv][threadIdx.x]});
      const std::int64_t o = (static_cast<std::int64_t>(qh) * nsplit + split) * a.W + jc + threadIdx.x;
      pm[o] = r.m;
      pz[o] = r.zo;
      pa[o] = r.arg;
    }
  }
}

/// Merge the split partials in split order: rm/rz/ra [qh][W]. One thread per (qh, j).
template <class T>
__global__ void attn_stats_combine_kernel(head_args<T> a, int nsplit, int nheads, const double* pm, const double* pz,
                                          const int* pa, double* rm, double* rz, int* ra) {
  const std::int64_t total = static_cast<std::int64_t>(nheads) * a.W;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int qh = static_cast<int>(i / a.W);
    const std::int64_t j = i % a.W;
    const auto hd = a.locate(qh);
    if (!a.needkv[hd.kvi] || j < hd.row0 || j >= hd.w) continue;
    softmax_state r = softmax_state::empty();
    for (int s = 0; s < nsplit; ++s) {
      const std::int64_t o = (static_cast<std::int64_t>(qh) * nsplit + s) * a.W + j;
      r = softmax_state::merge(r, softmax_state{pm[o], pz[o], pa[o]});
    }
    rm[i] = r.m;
    rz[i] = r.zo;
    ra[i] = r.arg;
  }
}

/// Fused softmax + temporal aggregation: out[qh * S + n] = sum_j c_j A[j, n] for n < L.
/// grid (ceil(S / 256), B * Hq); each warp owns 32 keys (lane i accumulates key i across
/// all window rows); dynamic smem 32 * d floats.
///  mode 0: write the aggregated attention as is (LOR's a_bar, fp32);
///  mode 1: saturate (final attention-weight / last-query score);
///  mode 2: divide by the number of rows that see the key, then saturate (H2O normalised).
template <class T>
__global__ void attn_accum_kernel(head_args<T> a, const double* rm, const double* rz, int mode, float* out) {
  extern __shared__ float smq[];
  __shared__ double sm_m[32], sm_z[32];
  __shared__ float sm_c[32];
  const int qh = blockIdx.y;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi] || hd.w <= 0) return;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * block_threads;
  if (base >= hd.L) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const kv_rows<const T> kb = a.key_rows(hd);
  const float* cw = a.cw + static_cast<std::int64_t>(hd.kvi) * a.W;
  double acc = 0.0;  // for key base + warp + block_warps * lane
  for (std::int64_t jc = hd.row0; jc < hd.w; jc += 32) {
    const int nj = static_cast<int>((hd.w - jc) < 32 ? (hd.w - jc) : 32);
    __syncthreads();
    for (int i = threadIdx.x; i < nj * a.d; i += blockDim.x) smq[i] = a.qrow(qh, hd, jc)[i];
    if (threadIdx.x < nj) {
      const std::int64_t o = static_cast<std::int64_t>(qh) * a.W + jc + threadIdx.x;
      sm_m[threadIdx.x] = rm[o];
      sm_z[threadIdx.x] = rz[o];
      sm_c[threadIdx.x] = cw[jc + threadIdx.x];
    }
    __syncthreads();
    for (int i = 0; i < 32; ++i) {
      const std::int64_t n = base + warp + block_warps * i;
      if (n >= hd.L) break;
      float kr[lane_slots];
      load_row(kb, n, a.d, lane, kr);
      for (int jj = 0; jj < nj; ++jj) {
        const std::int64_t vis = hd.L - hd.w + jc + jj + 1;
        if (n >= vis || sm_c[jj] == 0.0f) continue;
        const double l = warp_dot(kr, smq + jj * a.d, a.d, lane) * a.scale;
        if (lane == i) {
          const float p = static_cast<float>(exp(l - sm_m[jj]) / (1.0 + sm_z[jj]));
          acc += static_cast<double>(sm_c[jj]) * static_cast<double>(p);
        }
      }
    }
  }
  const std::int64_t n = base + warp + block_warps * lane;
  if (n < hd.L) {
    double v = acc;
    if (mode == 2) {
      const std::int64_t first_row = n - (hd.L - hd.w) > 0 ? n - (hd.L - hd.w) : 0;
      const std::int64_t cnt = hd.w - first_row;
      v = cnt > 0 ? static_cast<double>(static_cast<float>(v) / static_cast<float>(cnt)) : 0.0;
    }
    out[static_cast<std::int64_t>(qh) * a.S + n] = mode == 0 ? static_cast<float>(v) : saturate(static_cast<float>(v));
  }
}

/// Adaptive-window drift, per window row: the mean index of the top-K probabilities of row j
/// (value desc, index asc; K = max(1, base_budget - w) clamped to the visible keys). The row's
/// probabilities are materialised in buf (one S-float slice per block), then an exact block
/// radix select (4 passes of 8 bits) finds the K-th value and an ordered block scan takes the
/// ties from the lowest indices. Blocks loop over the B * Hq * W rows (grid-stride).
template <class T>
__global__ void drift_rows_kernel(head_args<T> a, const double* rm, const double* rz, const kvevict::detail::head_plan* plankv,
                                  std::int64_t total_rows, float* buf, double* rowmean) {
  __shared__ select_smem sm;
  __shared__ unsigned long long idx_sum;
  float* row = buf + static_cast<std::int64_t>(blockIdx.x) * a.S;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (std::int64_t vr = blockIdx.x; vr < total_rows; vr += gridDim.x) {
    const int qh = static_cast<int>(vr / a.W);
    const std::int64_t j = vr % a.W;
    const auto hd = a.locate(qh);
    if (!a.needkv[hd.kvi] || j < hd.row0 || j >= hd.w) continue;  // block-uniform
    const std::int64_t vis = hd.L - hd.w + j + 1;
    const double m = rm[vr], z1 = 1.0 + rz[vr];
    const float* qj = a.qrow(qh, hd, j);
    const kv_rows<const T> kb = a.key_rows(hd);
    __syncthreads();
    for (std::int64_t n = warp; n < vis; n += block_warps) {
      float kr[lane_slots];
      load_row(kb, n, a.d, lane, kr);
      const double l = warp_dot(kr, qj, a.d, lane) * a.scale;
      if (lane == 0) row[n] = static_cast<float>(exp(l - m) / z1);
    }
    if (threadIdx.x == 0) idx_sum = 0ull;
    __syncthreads();
    std::int64_t K = plankv[hd.kvi].base_budget - hd.w;
    if (K < 1) K = 1;
    if (K > vis) K = vis;
    auto key = [row](long long i) { return order_key(row[i]); };
    const kth_result sel = block_select_kth(key, vis, K, sm);
    unsigned long long local = 0ull;
    block_take_ordered(key, vis, sel, [&](long long i, long long) { local += static_cast<unsigned long long>(i); }, sm);
    atomicAdd(&idx_sum, local);
    __syncthreads();
    if (threadIdx.x == 0) rowmean[vr] = static_cast<double>(idx_sum) / static_cast<double>(K);
  }
}

/// Drift per query head: mean row index of the front half minus that of the rear half
/// (rows j < w/2 are the front), 0 when either half is empty. One thread per query head.
template <class T>
__global__ void drift_finalize_kernel(head_args<T> a, int nheads, const double* rowmean, double* qdrift) {
  const int qh = blockIdx.x * blockDim.x + threadIdx.x;
  if (qh >= nheads) return;
  const auto hd = a.locate(qh);
  double f = 0.0, r = 0.0;
  std::int64_t nf = 0, nr = 0;
  if (a.needkv[hd.kvi]) {
    for (std::int64_t j = hd.row0; j < hd.w; ++j) {
      const double v = rowmean[static_cast<std::int64_t>(qh) * a.W + j];
      if (j < hd.w / 2) {
        f += v;
        ++nf;
      } else {
        r += v;
        ++nr;
      }
    }
  }
  qdrift[qh] = (nf > 0 && nr > 0) ? f / static_cast<double>(nf) - r / static_cast<double>(nr) : 0.0;
}

/// Key norm: out[row * S + n] = -||k_n|| (fp64 accumulation), for the Gq rows of each KV head.
/// grid (ceil(S / 8), B * Hkv * Gq), warp per key.
template <class T>
__global__ void key_norm_kernel(kv_view<const T> keys, page_table_view pages, const std::int32_t* len, const std::uint8_t* needkv, int Hkv, int Gq,
                                std::int64_t S, float* out) {
  const int row = blockIdx.y;
  const int b = row / (Hkv * Gq), h = (row % (Hkv * Gq)) / Gq, kvi = b * Hkv + h;
  if (!needkv[kvi]) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * block_warps + warp;
  const std::int64_t L = len[kvi];
  if (n >= L) return;
  const int d = static_cast<int>(keys.extent[3]);
  float kr[lane_slots];
  load_row(head_rows(keys, pages, b, h), n, d, lane, kr);
  double s = 0.0;
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) s += static_cast<double>(kr[t]) * kr[t];
  s = warp_sum(s);
  if (lane == 0) out[static_cast<std::int64_t>(row) * S + n] = saturate(-sqrt(s));
}

/// Tables of one layer for lkv_mlp_kernel (scorers::learned_mlp, policies/learned.hpp).
struct lkv_mlp_args {
  const float* w = nullptr;  ///< device fp32 (kv_heads, block): the layer's MLPs
  std::int64_t block = 0;    ///< floats per KV head: hidden * 2d + 2 * hidden + 1
  int hidden = 0;
  int relu = 0;  ///< 1: relu, 0: silu
};

/// Tile of lkv_mlp_kernel: tokens per block, inputs (of x = [k ; v]) and hidden units per step.
inline constexpr int lkv_tile_tokens = 128;
inline constexpr int lkv_tile_k = 32;
inline constexpr int lkv_tile_h = 32;

/// lkv_mlp_kernel (below), LKV-T utilities: out[((b * Hkv + h) * Gq + g) * S + n] = u_n for
/// every valid token n of every scored KV head, the same value in its Gq query-head rows, with
/// u = b2 + sum_j w2_j act(b1_j + W1_j . [k_n ; v_n]) (scorers::learned_mlp::utility: fp32
/// tables and inputs, fp64 products and sums, NaN -> 0, saturated to the float range).
/// The layer's MLP applied to a tile of tokens is a small GEMM, X (tokens x 2d) W1^T (2d x
/// hidden), done as a shared-memory tiled fp64 GEMM: grid (ceil(S / 128), B * Hkv), 256
/// threads, one block per 128 tokens of one KV head; per step a 32-input slice of the 128
/// tokens' [k ; v] (widened once to fp64) and the matching 32 x 32 slice of W1 are staged in
/// shared memory (41 KB, static), and each thread accumulates a 4 token x 4 hidden-unit
/// register tile with fp64 FMAs (exact products of the fp32 operands, as the CPU). Hidden
/// units beyond 32 are further passes over the inputs. The epilogue adds b1, applies the
/// activation, weights by w2 and sums the hidden units of a token across the 8 threads that
/// hold them (warp shuffles). The weights are read once per block from global memory (L2
/// resident: a head's MLP is 33 KB at head_dim 128, hidden 32); K and V once in all.
///
/// Shared memory of one lkv_mlp_tile() block.
struct lkv_mlp_smem {
  double xs[lkv_tile_k][lkv_tile_tokens + 1];  ///< a 32-input slice of the tile's [k ; v] (padded rows)
  double ws[lkv_tile_k][lkv_tile_h + 1];       ///< the matching 32 x 32 slice of W1
};

/// The work of one block of lkv_mlp_kernel (block (bx, kvi), thread tid of 256), written
/// against a context `cx` with sync() (block barrier) and shfl_xor(double, int) (warp
/// butterfly), so the host test can run the very same code with host threads. Every thread of
/// the block calls it; the early returns are uniform over the block.
#pragma nv_exec_check_disable
template <class T, class Ctx>
KVEVICT_HOST_DEVICE inline void lkv_mlp_tile(Ctx& cx, int tid, int bx, int kvi, lkv_mlp_smem& sm, const kv_view<const T>& keys,
                                             const kv_view<const T>& values, const page_table_view& pages, const std::int32_t* len, const std::uint8_t* needkv,
                                             int Hkv, int Gq, std::int64_t S, const lkv_mlp_args& m, float* out) {
  if (!needkv[kvi]) return;
  const std::int64_t L = len[kvi];
  const std::int64_t n0 = static_cast<std::int64_t>(bx) * lkv_tile_tokens;
  if (n0 >= L) return;  // uniform over the block
  const int b = kvi / Hkv, h = kvi % Hkv;
  const int d = static_cast<int>(keys.extent[3]), in_dim = 2 * d, hidden = m.hidden;
  const kv_rows<const T> kb = head_rows(keys, pages, b, h), vb = head_rows(values, pages, b, h);
  const float* W1 = m.w + static_cast<std::int64_t>(h) * m.block;
  const float* b1 = W1 + static_cast<std::int64_t>(hidden) * in_dim;
  const float* w2 = b1 + hidden;
  const int tx = tid & 7, ty = tid >> 3;  // tokens ty + 32 a, hidden units tx + 8 c
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  for (int jc = 0; jc < hidden; jc += lkv_tile_h) {
    double acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][c] = 0.0;
    for (int kc = 0; kc < in_dim; kc += lkv_tile_k) {
      cx.sync();  // the previous slice is consumed
#pragma unroll 4
      for (int q = 0; q < (lkv_tile_k * lkv_tile_tokens) / block_threads; ++q) {
        const int e = tid + block_threads * q, kk = e & (lkv_tile_k - 1), tok = e / lkv_tile_k;
        const int i = kc + kk;
        const std::int64_t n = n0 + tok;
        float x = 0.0f;
        if (n < L && i < in_dim)
          x = i < d ? to_float(kb.at(n, i)) : to_float(vb.at(n, i - d));
        sm.xs[kk][tok] = static_cast<double>(x);
      }
#pragma unroll
      for (int q = 0; q < (lkv_tile_k * lkv_tile_h) / block_threads; ++q) {
        const int e = tid + block_threads * q, kk = e & (lkv_tile_k - 1), jj = e / lkv_tile_k;
        const int i = kc + kk, j = jc + jj;
        sm.ws[kk][jj] = (i < in_dim && j < hidden) ? static_cast<double>(W1[static_cast<std::int64_t>(j) * in_dim + i]) : 0.0;
      }
      cx.sync();
#pragma unroll 8
      for (int k = 0; k < lkv_tile_k; ++k) {
        double xv[4], wv[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) xv[a] = sm.xs[k][ty + 32 * a];
#pragma unroll
        for (int c = 0; c < 4; ++c) wv[c] = sm.ws[k][tx + 8 * c];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[a][c] = fma(xv[a], wv[c], acc[a][c]);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = jc + tx + 8 * c;
      if (j >= hidden) continue;
      const double bj = static_cast<double>(b1[j]), w2j = static_cast<double>(w2[j]);
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        double z = acc[a][c] + bj;
        if (m.relu) z = z > 0.0 ? z : 0.0;
        else z = z / (1.0 + exp(-z));
        part[a] += w2j * z;
      }
    }
  }
  // the 8 threads of a token group are consecutive lanes (tid = 8 ty + tx)
#pragma unroll
  for (int a = 0; a < 4; ++a)
    for (int o = 4; o > 0; o >>= 1) part[a] += cx.shfl_xor(part[a], o);
  if (tx == 0) {
    const double b2 = static_cast<double>(w2[hidden]);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const std::int64_t n = n0 + ty + 32 * a;
      if (n >= L) continue;
      double u = b2 + part[a];  // NaN -> 0, saturated to the float range (as learned_mlp::utility)
      const double mx = 3.4028234663852886e38;
      u = (u == u) ? (u > mx ? mx : (u < -mx ? -mx : u)) : 0.0;
      for (int g = 0; g < Gq; ++g) out[(static_cast<std::int64_t>(kvi) * Gq + g) * S + n] = static_cast<float>(u);
    }
  }
}

/// The device context of lkv_mlp_tile().
struct lkv_device_ctx {
  __device__ void sync() { __syncthreads(); }
  __device__ double shfl_xor(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
};

template <class T>
__global__ void __launch_bounds__(block_threads) lkv_mlp_kernel(kv_view<const T> keys, kv_view<const T> values,
                                                                page_table_view pages, const std::int32_t* len, const std::uint8_t* needkv, int Hkv,
                                                                int Gq, std::int64_t S, lkv_mlp_args m, float* out) {
  __shared__ lkv_mlp_smem sm;
  lkv_device_ctx cx;
  lkv_mlp_tile<T>(cx, static_cast<int>(threadIdx.x), static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), sm, keys, values,
                  pages, len, needkv, Hkv, Gq, S, m, out);
}

/// Power-of-two value scale of a KV head (as the CPU backend): values whose largest |v| is
/// outside [2^-32, 2^32] are divided by 2^e (frexp exponent of the max) before the distances.
__device__ inline float value_scale_of(float vmax) {
  if (vmax > 0.0f && (vmax > 0x1p32f || vmax < 0x1p-32f)) {
    int e;
    frexpf(vmax, &e);
    return ldexpf(1.0f, e);
  }
  return 1.0f;
}

/// vscale[kvi] for every scored KV head: block per KV head, max |v| over the valid rows.
template <class T>
__global__ void value_scale_kernel(kv_view<const T> values, page_table_view pages, const std::int32_t* len, const std::uint8_t* needkv, int Hkv,
                                   float* vscale) {
  __shared__ float red[block_threads];
  const int kvi = blockIdx.x, b = kvi / Hkv, h = kvi % Hkv;
  if (!needkv[kvi]) return;
  const std::int64_t L = len[kvi], D = values.extent[3];
  const kv_rows<const T> vr = head_rows(values, pages, b, h);
  float mx = 0.0f;
  for (std::int64_t i = threadIdx.x; i < L * D; i += blockDim.x) mx = fmaxf(mx, fabsf(to_float(vr.at(i / D, i % D))));
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int s = block_threads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) vscale[kvi] = value_scale_of(red[0]);
}

/// Output reconstruction, shared arguments.
struct lor_args {
  const float* vscale = nullptr;  ///< [B * Hkv]
  const float* rt = nullptr;      ///< transposed W_O factors [Hq][d][d] (null: value space)
  float tau = 1.0f;
  int include_window = 0;
};

/// Load a value row scaled by the head's power-of-two scale.
template <class T>
__device__ inline void load_value(const head_args<T>& a, const typename head_args<T>::head& hd, std::int64_t n, float vs,
                                  int lane, float (&vr)[lane_slots]) {
  load_row(a.value_rows(hd), n, a.d, lane, vr);
  if (vs != 1.0f) {
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) vr[t] /= vs;
  }
}

/// "after" mode, step 1: split partials of z = sum_{n < zlim} a_bar[n] v_n (fp64).
/// grid (nsz, B * Hq), warp per key; zpart [qh][split][d].
template <class T>
__global__ void lor_z_partial_kernel(head_args<T> a, lor_args o, const float* abar, int nsz, double* zpart) {
  __shared__ double red[block_warps][max_head_dim];
  const int qh = blockIdx.y, split = blockIdx.x;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi]) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t zlim = o.include_window ? hd.L : hd.L - hd.w;
  const std::int64_t per = (zlim + nsz - 1) / nsz;
  const std::int64_t n0 = split * per, n1 = (n0 + per < zlim) ? n0 + per : zlim;
  const float vs = o.vscale[hd.kvi];
  double acc[lane_slots];
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) acc[t] = 0.0;
  for (std::int64_t n = n0 + warp; n < n1; n += block_warps) {
    float vr[lane_slots];
    load_value(a, hd, n, vs, lane, vr);
    const double an = abar[static_cast<std::int64_t>(qh) * a.S + n];
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) acc[t] += an * vr[t];
  }
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) red[warp][lane + 32 * t] = acc[t];
  __syncthreads();
  for (int c = threadIdx.x; c < a.d; c += blockDim.x) {
    double s = 0.0;
    for (int wv = 0; wv < block_warps; ++wv) s += red[wv][c];
    zpart[(static_cast<std::int64_t>(qh) * nsz + split) * a.d + c] = s;
  }
}

/// "after" mode, step 2: z (fp32, as the CPU's Eigen product) and rz = R z. Block per qh.
template <class T>
__global__ void lor_z_finalize_kernel(head_args<T> a, lor_args o, int nsz, const double* zpart, float* rzv) {
  __shared__ float z[max_head_dim];
  const int qh = blockIdx.x;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi]) return;
  for (int c = threadIdx.x; c < a.d; c += blockDim.x) {
    double s = 0.0;
    for (int sp = 0; sp < nsz; ++sp) s += zpart[(static_cast<std::int64_t>(qh) * nsz + sp) * a.d + c];
    z[c] = static_cast<float>(s);
  }
  __syncthreads();
  const float* rt = o.rt ? o.rt + static_cast<std::int64_t>(hd.hq) * a.d * a.d : nullptr;
  for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
    if (!rt) {
      rzv[static_cast<std::int64_t>(qh) * a.d + i] = z[i];
    } else {
      float s = 0.0f;
      for (int c = 0; c < a.d; ++c) s = fmaf(rt[static_cast<std::int64_t>(c) * a.d + i], z[c], s);
      rzv[static_cast<std::int64_t>(qh) * a.d + i] = s;
    }
  }
}

/// "after" mode, step 3: s[n] = a/(1-a) * ||R z - R v_n||^tau * vscale^tau (0 where a <= 0).
/// grid (ceil(S / 8), B * Hq), warp per key.
template <class T>
__global__ void lor_after_dist_kernel(head_args<T> a, lor_args o, const float* abar, const float* rzv, float* out) {
  const int qh = blockIdx.y;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi]) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * block_warps + warp;
  if (n >= hd.L) return;
  const float vs = o.vscale[hd.kvi];
  const double out_scale = pow(static_cast<double>(vs), static_cast<double>(o.tau));
  const float an = abar[static_cast<std::int64_t>(qh) * a.S + n];
  float vr[lane_slots], y[lane_slots];
  load_value(a, hd, n, vs, lane, vr);
  if (o.rt) {
    warp_matvec_t(o.rt + static_cast<std::int64_t>(hd.hq) * a.d * a.d, vr, a.d, lane, y);
  } else {
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) y[t] = vr[t];
  }
  const float* rz = rzv + static_cast<std::int64_t>(qh) * a.d;
  double s = 0.0;
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) {
    const int c = lane + 32 * t;
    if (c < a.d) {
      const double df = static_cast<double>(rz[c] - y[t]);
      s += df * df;
    }
  }
  const double dist = sqrt(warp_sum(s));
  if (lane == 0) {
    float r = 0.0f;
    if (an > 0.0f) {
      const double dd = o.tau == 1.0f ? dist : pow(dist, static_cast<double>(o.tau));
      r = saturate(static_cast<double>(an) / (1.0 - static_cast<double>(an)) * dd * out_scale);
    }
    out[static_cast<std::int64_t>(qh) * a.S + n] = r;
  }
}

/// Block reduction helpers (block_threads threads).
__device__ inline double block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int i = 0; i < block_threads; ++i) s += red[i];
    red[0] = s;
  }
  __syncthreads();
  const double r = red[0];
  __syncthreads();
  return r;
}
__device__ inline double block_max(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = red[0];
    for (int i = 1; i < block_threads; ++i) s = red[i] > s ? red[i] : s;
    red[0] = s;
  }
  __syncthreads();
  const double r = red[0];
  __syncthreads();
  return r;
}

/// ||R x|| in fp64 for a d-vector x in shared memory (R from the transposed factors, or the
/// identity). Uses red (block_threads doubles) and tmp (max_head_dim doubles).
__device__ inline double block_rnorm(const double* x, const float* rt, int d, double* red) {
  double part = 0.0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    double y = 0.0;
    if (rt) {
      for (int c = 0; c < d; ++c) y += static_cast<double>(rt[static_cast<std::int64_t>(c) * d + i]) * x[c];
    } else {
      y = x[i];
    }
    part += y * y;
  }
  return sqrt(block_sum(part, red));
}

/// "after" mode, step 4: the exact score of the dominant token (a_bar > 15/16), computed as
/// a * (1-a)^(tau-1) * ||R (z_{-n} - v_n)||^tau with the other tokens' weights taken relative
/// to their largest log-weight E (no cancellation). Block per qh; does nothing unless the
/// head's a_bar maximum exceeds 15/16. Same math as the CPU backend.
template <class T>
__global__ void lor_after_dominant_kernel(head_args<T> a, lor_args o, const double* rm, const double* rz, const float* abar,
                                          float* out) {
  __shared__ double red[block_threads];
  __shared__ double numw[block_warps][max_head_dim];
  __shared__ double diff[max_head_dim];
  __shared__ int red_i[block_threads];
  const int qh = blockIdx.x;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi] || hd.L <= 0) return;
  const float* ab = abar + static_cast<std::int64_t>(qh) * a.S;
  // argmax of a_bar (lowest index among equal maxima)
  float best = -1.0f;
  int bi = 0x7fffffff;
  for (std::int64_t n = threadIdx.x; n < hd.L; n += blockDim.x)
    if (ab[n] > best) {
      best = ab[n];
      bi = static_cast<int>(n);
    }
  red[threadIdx.x] = best;
  red_i[threadIdx.x] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < block_threads; ++i)
      if (red[i] > red[0] || (red[i] == red[0] && red_i[i] < red_i[0])) {
        red[0] = red[i];
        red_i[0] = red_i[i];
      }
  }
  __syncthreads();
  const float amax = static_cast<float>(red[0]);
  const int n0 = red_i[0];
  __syncthreads();
  if (!(amax > 15.0f / 16.0f)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const kv_rows<const T> kb = a.key_rows(hd);
  const float* cw = a.cw + static_cast<std::int64_t>(hd.kvi) * a.W;
  const std::int64_t zlim = o.include_window ? hd.L : hd.L - hd.w;
  const float vs = o.vscale[hd.kvi];
  auto lam_of = [&](std::int64_t j) {
    const std::int64_t i = static_cast<std::int64_t>(qh) * a.W + j;
    return log(static_cast<double>(cw[j])) - log1p(rz[i]) - rm[i];
  };
  // pass 1: E = max over (j, n != n0) of l_jn + lambda_j
  double E = -CUDART_INF;
  for (std::int64_t n = warp; n < hd.L; n += block_warps) {
    if (n == n0) continue;
    float kr[lane_slots];
    load_row(kb, n, a.d, lane, kr);
    for (std::int64_t j = hd.row0; j < hd.w; ++j) {
      if (!(cw[j] > 0.0f) || n >= hd.L - hd.w + j + 1) continue;
      const double l = warp_dot(kr, a.qrow(qh, hd, j), a.d, lane) * a.scale;
      const double v = l + lam_of(j);
      E = v > E ? v : E;
    }
  }
  E = block_max(E, red);
  if (E == -CUDART_INF) return;
  // pass 2: weights W_n = sum_j exp(l_jn + lambda_j - E); num = sum_{n < zlim} W_n v_n, den = sum W_n
  double den = 0.0, num[lane_slots];
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) num[t] = 0.0;
  for (std::int64_t n = warp; n < hd.L; n += block_warps) {
    if (n == n0) continue;
    float kr[lane_slots];
    load_row(kb, n, a.d, lane, kr);
    double wn = 0.0;
    for (std::int64_t j = hd.row0; j < hd.w; ++j) {
      if (!(cw[j] > 0.0f) || n >= hd.L - hd.w + j + 1) continue;
      const double l = warp_dot(kr, a.qrow(qh, hd, j), a.d, lane) * a.scale;
      wn += exp(l + lam_of(j) - E);
    }
    if (wn == 0.0) continue;
    den += wn;
    if (n < zlim) {
      float vr[lane_slots];
      load_value(a, hd, n, vs, lane, vr);
#pragma unroll
      for (int t = 0; t < lane_slots; ++t) num[t] += wn * vr[t];
    }
  }
  if (lane != 0) den = 0.0;
  den = block_sum(den, red);
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) numw[warp][lane + 32 * t] = num[t];
  __syncthreads();
  if (!(den > 0.0)) return;
  for (int c = threadIdx.x; c < a.d; c += blockDim.x) {
    double s = 0.0;
    for (int wv = 0; wv < block_warps; ++wv) s += numw[wv][c];
    const float vn = to_float(a.value_rows(hd).at(n0, c)) / vs;
    diff[c] = s / den - static_cast<double>(vn);
  }
  __syncthreads();
  const float* rt = o.rt ? o.rt + static_cast<std::int64_t>(hd.hq) * a.d * a.d : nullptr;
  const double dist = block_rnorm(diff, rt, a.d, red);
  if (threadIdx.x == 0) {
    const double log1m = log(den) + E;
    const double av = amax;
    const double sc = av * exp((static_cast<double>(o.tau) - 1.0) * log1m) * pow(dist, static_cast<double>(o.tau));
    out[static_cast<std::int64_t>(qh) * a.S + n0] = saturate(sc * pow(static_cast<double>(vs), static_cast<double>(o.tau)));
  }
}

/// "before" mode, per window row j (block per (j, qh)): z_j = A_j V, RZ_j = R z_j (fp32),
/// |RZ_j|^2, and the row argmax's contribution c_j * s (the exact limit when its weight
/// exceeds 15/16, else a/(1-a) ||RZ_j - R v_am||^tau) into amc[qh][j].
template <class T>
__global__ void lor_before_row_kernel(head_args<T> a, lor_args o, const double* rm, const double* rz, const int* ra,
                                      float* RZ, double* rz2, float* amc) {
  __shared__ double red[block_threads];
  __shared__ double zw[block_warps][max_head_dim];
  __shared__ double dv[max_head_dim];
  __shared__ float zf[max_head_dim];
  __shared__ float rzs[max_head_dim];
  const int qh = blockIdx.y;
  const std::int64_t j = blockIdx.x;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi] || j >= hd.w) return;
  const float c = a.cw[static_cast<std::int64_t>(hd.kvi) * a.W + j];
  const std::int64_t ri = static_cast<std::int64_t>(qh) * a.W + j;
  if (c == 0.0f) {
    if (threadIdx.x == 0) amc[ri] = 0.0f;
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t vis = hd.L - hd.w + j + 1;
  const double M = rm[ri], z1 = 1.0 + rz[ri];
  const int am = ra[ri];
  const float vs = o.vscale[hd.kvi];
  const kv_rows<const T> kb = a.key_rows(hd);
  const float* qj = a.qrow(qh, hd, j);
  const float* rt = o.rt ? o.rt + static_cast<std::int64_t>(hd.hq) * a.d * a.d : nullptr;
  double acc[lane_slots];
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) acc[t] = 0.0;
  double m2 = -CUDART_INF;
  for (std::int64_t n = warp; n < vis; n += block_warps) {
    float kr[lane_slots], vr[lane_slots];
    load_row(kb, n, a.d, lane, kr);
    const double l = warp_dot(kr, qj, a.d, lane) * a.scale;
    if (n != am && l > m2) m2 = l;
    const float p = static_cast<float>(exp(l - M) / z1);
    load_value(a, hd, n, vs, lane, vr);
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) acc[t] += static_cast<double>(p) * vr[t];
  }
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) zw[warp][lane + 32 * t] = acc[t];
  m2 = block_max(m2, red);  // synchronises zw too
  for (int cc = threadIdx.x; cc < a.d; cc += blockDim.x) {
    double s = 0.0;
    for (int wv = 0; wv < block_warps; ++wv) s += zw[wv][cc];
    zf[cc] = static_cast<float>(s);
  }
  __syncthreads();
  double part = 0.0;
  for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
    float s;
    if (rt) {
      s = 0.0f;
      for (int cc = 0; cc < a.d; ++cc) s = fmaf(rt[static_cast<std::int64_t>(cc) * a.d + i], zf[cc], s);
    } else {
      s = zf[i];
    }
    rzs[i] = s;
    RZ[ri * a.d + i] = s;
    part += static_cast<double>(s) * s;
  }
  const double r2 = block_sum(part, red);
  if (threadIdx.x == 0) rz2[ri] = r2;
  // argmax contribution
  const float pm = static_cast<float>(1.0 / z1);
  double sc;
  if (pm <= 15.0f / 16.0f) {
    for (int cc = threadIdx.x; cc < a.d; cc += blockDim.x) dv[cc] = static_cast<double>(to_float(a.value_rows(hd).at(am, cc)) / vs);
    __syncthreads();
    // ||RZ_j - R v_am||
    double p2 = 0.0;
    for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
      double y = 0.0;
      if (rt) {
        for (int cc = 0; cc < a.d; ++cc) y += static_cast<double>(rt[static_cast<std::int64_t>(cc) * a.d + i]) * static_cast<float>(dv[cc]);
      } else {
        y = dv[i];
      }
      const double df = static_cast<double>(rzs[i]) - y;
      p2 += df * df;
    }
    const double d2 = block_sum(p2, red);
    const double dist = o.tau == 1.0f ? sqrt(d2) : pow(d2, 0.5 * o.tau);
    sc = pm / (1.0 - pm) * dist;
  } else {
    // exact limit: zhat = sum_{n != am} e^{l_n - m2} v_n / den
    double den = 0.0;
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) acc[t] = 0.0;
    if (m2 != -CUDART_INF) {
      for (std::int64_t n = warp; n < vis; n += block_warps) {
        if (n == am) continue;
        float kr[lane_slots], vr[lane_slots];
        load_row(kb, n, a.d, lane, kr);
        const double l = warp_dot(kr, qj, a.d, lane) * a.scale;
        const double e = exp(l - m2);
        if (e == 0.0) continue;
        den += e;
        load_value(a, hd, n, vs, lane, vr);
#pragma unroll
        for (int t = 0; t < lane_slots; ++t) acc[t] += e * vr[t];
      }
    }
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) zw[warp][lane + 32 * t] = acc[t];
    if (lane != 0) den = 0.0;
    den = block_sum(den, red);
    for (int cc = threadIdx.x; cc < a.d; cc += blockDim.x) {
      double s = 0.0;
      for (int wv = 0; wv < block_warps; ++wv) s += zw[wv][cc];
      const double zh = den > 0.0 ? s / den : 0.0;
      dv[cc] = zh - static_cast<double>(to_float(a.value_rows(hd).at(am, cc)) / vs);
    }
    __syncthreads();
    const double dist = block_rnorm(dv, rt, a.d, red);
    if (den > 0.0) {
      const double log_zo = (m2 - M) + log(den);
      const double log1m = log_zo - log1p(exp(log_zo));
      const double av = 1.0 / (1.0 + exp(log_zo));
      sc = av * exp((static_cast<double>(o.tau) - 1.0) * log1m) * pow(dist, static_cast<double>(o.tau));
    } else {
      sc = 0.0;  // the token is the only one visible: nothing to renormalise, no contribution
    }
  }
  if (threadIdx.x == 0) amc[ri] = c * static_cast<float>(sc);
}

/// "before" mode, accumulation: s[n] = sum_j c_j A/(1-A) ||RZ_j - R v_n||^tau over the rows
/// where n is not the argmax (dist^2 = |RZ_j|^2 - 2 RZ_j . Y_n + |Y_n|^2, as the CPU), plus the
/// argmax contributions of lor_before_row_kernel. grid (ceil(S / 8), B * Hq), warp per key.
template <class T>
__global__ void lor_before_acc_kernel(head_args<T> a, lor_args o, const double* rm, const double* rz, const int* ra,
                                      const float* RZ, const double* rz2, const float* amc, float* out) {
  const int qh = blockIdx.y;
  const auto hd = a.locate(qh);
  if (!a.needkv[hd.kvi]) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * block_warps + warp;
  if (n >= hd.L) return;
  const float vs = o.vscale[hd.kvi];
  const float* cw = a.cw + static_cast<std::int64_t>(hd.kvi) * a.W;
  float kr[lane_slots], vr[lane_slots], y[lane_slots];
  load_row(a.key_rows(hd), n, a.d, lane, kr);
  load_value(a, hd, n, vs, lane, vr);
  if (o.rt) {
    warp_matvec_t(o.rt + static_cast<std::int64_t>(hd.hq) * a.d * a.d, vr, a.d, lane, y);
  } else {
#pragma unroll
    for (int t = 0; t < lane_slots; ++t) y[t] = vr[t];
  }
  double yn = 0.0;
#pragma unroll
  for (int t = 0; t < lane_slots; ++t) yn += static_cast<double>(y[t]) * y[t];
  const double yn2 = static_cast<float>(warp_sum(yn));
  double acc = 0.0;
  for (std::int64_t j = 0; j < hd.w; ++j) {
    const float c = cw[j];
    if (c == 0.0f || n >= hd.L - hd.w + j + 1) continue;
    const std::int64_t ri = static_cast<std::int64_t>(qh) * a.W + j;
    if (n == ra[ri]) continue;
    const double l = warp_dot(kr, a.qrow(qh, hd, j), a.d, lane) * a.scale;
    const float p = static_cast<float>(exp(l - rm[ri]) / (1.0 + rz[ri]));
    if (p == 0.0f) continue;
    const double cross = static_cast<float>(warp_dot(y, RZ + ri * a.d, a.d, lane));
    double d2 = rz2[ri] - 2.0 * cross + yn2;
    if (d2 < 0.0) d2 = 0.0;
    const double dist = o.tau == 1.0f ? sqrt(d2) : pow(d2, 0.5 * o.tau);
    acc += static_cast<double>(c) * (static_cast<double>(p) / (1.0 - static_cast<double>(p)) * dist);
  }
  if (lane == 0) {
    for (std::int64_t j = 0; j < hd.w; ++j) {
      const std::int64_t ri = static_cast<std::int64_t>(qh) * a.W + j;
      if (cw[j] != 0.0f && ra[ri] == n) acc += amc[ri];
    }
    out[static_cast<std::int64_t>(qh) * a.S + n] = saturate(acc * pow(static_cast<double>(vs), static_cast<double>(o.tau)));
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
