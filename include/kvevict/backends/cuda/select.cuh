// IWYU pragma: private, include "kvevict/cuda.cuh"
// CUDA kernel library of the stages after scoring: per-head plans and score-free budgets
// (device-side length checks), temporal weights, GQA reduction, spatial smoothing (avg / max /
// adaptive window), AdaKV budgets, the LKV-H block code, CSR counts and the per-head top-k
// selection with protected tokens. The stages' implementation traits (backends/cuda/impl.cuh and
// the files beside it) launch them. Budget arithmetic is the host-device code of
// core/budget_rules.hpp, policies/budgeters.hpp and core/apportion.hpp (LKV-H:
// budgeters::headwise_learned::layer_slice of policies/learned.hpp), so budgets are bit-identical
// to the CPU backend's.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/core/apportion.hpp"
#include "kvevict/core/budget_rules.hpp"
#include "kvevict/frontend/frontend.hpp"
#include "kvevict/policies/policy.hpp"
#include "kvevict/policies/budgeters.hpp"
#include "kvevict/policies/learned.hpp"
#include "kvevict/policies/spatial.hpp"

namespace kvevict {
namespace cuda {
namespace detail {

using kvevict::detail::head_plan;

/// Shapes of the plan kernel.
struct plan_shape {
  int B = 0, Hkv = 0, H = 0, Gout = 1;  ///< H = out rows per sequence, Gout = H / Hkv
  std::int64_t S = 0, W = 0;
  int layer = 0, num_layers = 1;
  int layer_mean = 0;
  int sharded = 0;  ///< run_sharded: whole-layer budgets wait for the exchange (the host sets them)
};

/// detail::apportion (core/apportion.hpp) by a team of threads, bit for bit: the floor pass is
/// split over the team, the "too many" pass (rounding excess; water-filled shares never
/// produce it) runs on rank 0 exactly as the serial code, and each step of the "too few" pass
/// is a team argmax of the serial code's key (fraction s - out, or -0.5 for a non-positive
/// share; > -1 to count; capped heads skipped) with ties to the lower index, which is the
/// serial scan's choice whatever the reduction order (the comparison is exact). Host and
/// device; Team provides rank(), size(), sum(long long) and best(double key, long long index)
/// (both collective: every rank calls them, every rank gets the result). Cost: n / size per
/// rank and one collective per unit handed out (at most n).
#pragma nv_exec_check_disable
template <class Team>
KVEVICT_HOST_DEVICE void team_apportion(Team& tm, const double* share, const std::int64_t* cap, std::int64_t n, std::int64_t total,
                                        std::int64_t* out) {
  const int rank = tm.rank(), size = tm.size();
  long long part = 0;
  for (std::int64_t i = rank; i < n; i += size) {
    double s = share[i];
    if (!(s > 0.0) || !(s < 9.0e18)) s = (s >= 9.0e18) ? 9.0e18 : 0.0;
    std::int64_t f = static_cast<std::int64_t>(std::floor(s));
    if (cap && f > cap[i]) f = cap[i];
    out[i] = f;
    part += f;
  }
  long long assigned = tm.sum(part);  // collective: the floors are visible to every rank after it
  if (assigned > total) {
    if (rank == 0) {  // the serial "too many" pass, verbatim
      while (assigned > total) {
        std::int64_t best = -1;
        double best_frac = 2.0;
        for (std::int64_t i = n - 1; i >= 0; --i) {
          if (out[i] <= 0) continue;
          double fr = share[i] - std::floor(share[i]);
          if (!(fr >= 0.0)) fr = 0.0;
          if (fr < best_frac) {
            best_frac = fr;
            best = i;
          }
        }
        if (best < 0) break;
        --out[best];
        --assigned;
      }
    }
    assigned = tm.sum(rank == 0 ? assigned : 0);  // broadcast (and make rank 0's writes visible)
  }
  while (assigned < total) {
    double best_frac = -1.0;
    long long best = -1;
    for (std::int64_t i = rank; i < n; i += size) {  // ascending: the first maximum of this rank
      if (cap && out[i] >= cap[i]) continue;
      const double s = share[i];
      const double fr = (s > 0.0 && s < 9.0e18) ? s - static_cast<double>(out[i]) : -0.5;
      if (fr > best_frac) {
        best_frac = fr;
        best = i;
      }
    }
    const long long w = tm.best(best_frac, best);
    if (w < 0) break;  // every head at its cap
    if (w % size == rank) ++out[w];  // its owner: the only rank that reads out[w] in this pass
    ++assigned;
  }
}

/// The team of team_apportion as one CUDA block (blockDim.x a multiple of 32, <= block_threads).
struct block_team {
  struct storage {
    double f[block_warps];
    long long i[block_warps];
    long long v;
  };
  storage& sm;
  __device__ int rank() const { return static_cast<int>(threadIdx.x); }
  __device__ int size() const { return static_cast<int>(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  __device__ long long sum(long long v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __syncthreads();  // the previous collective's readers are done with sm
    if ((threadIdx.x & 31) == 0) sm.i[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      long long t = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) t += sm.i[w];
      sm.v = t;
    }
    __syncthreads();
    return sm.v;
  }
  /// (f, i) with i < 0 = no candidate; the winner has the largest f, ties to the lower i.
  __device__ static bool better(double fo, long long io, double f, long long i) {
    return io >= 0 && (i < 0 || fo > f || (fo == f && io < i));
  }
  __device__ long long best(double f, long long i) {
    for (int o = 16; o > 0; o >>= 1) {
      const double fo = __shfl_down_sync(0xffffffffu, f, o);
      const long long io = __shfl_down_sync(0xffffffffu, i, o);
      if (better(fo, io, f, i)) {
        f = fo;
        i = io;
      }
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
      sm.f[threadIdx.x >> 5] = f;
      sm.i[threadIdx.x >> 5] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double bf = sm.f[0];
      long long bi = sm.i[0];
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
        if (better(sm.f[w], sm.i[w], bf, bi)) {
          bf = sm.f[w];
          bi = sm.i[w];
        }
      sm.v = bi;
    }
    __syncthreads();
    return sm.v;
  }
};

/// The LKV-H budgets of one sequence (every rank of the team calls it; on the device the
/// plan kernel's block): rank 0 runs headwise_learned::slice_begin and the water-filling
/// shares, the team apportions (team_apportion), rank 0 applies the layer's slice and sets the
/// "needs scoring" flags. plans / budgets / need: the sequence's `rows` out rows; scratch:
/// the sequence's slice of the workspace. lst, lrc, lbad: storage shared by the team (CUDA
/// shared memory); after the call lrc is the slice_result and, when it is not slice_ok, lbad
/// holds its arguments (budgets are then the lengths). Host and device (the host test runs it
/// with host threads).
#pragma nv_exec_check_disable
template <class Budgeter, class Team>
KVEVICT_HOST_DEVICE void lkv_sequence_budgets(Team& tm, typename Budgeter::slice_state& lst, int& lrc, long long* lbad,
                                              const typename Budgeter::params& bp, const budget_request& req, const head_plan* plans,
                                              int rows, int layer, bool has_scores, const kvevict::detail::lkv_fill_scratch& s,
                                              std::int64_t* all, std::int64_t* budgets, std::uint8_t* need) {
  if (tm.rank() == 0) {
    std::int64_t bad[3] = {0, 0, 0};
    lst = Budgeter::slice_begin(bp, req, plans, rows, bad);
    int rc = lst.rc;
    if (rc == Budgeter::slice_ok && !lst.all_pass && !Budgeter::slice_shares(lst, bp.ratios, s, bad))
      rc = Budgeter::slice_cannot_apportion;
    for (int i = 0; i < 3; ++i) lbad[i] = bad[i];
    lrc = rc;
  }
  tm.sync();
  if (lrc == Budgeter::slice_ok && !lst.all_pass) team_apportion(tm, s.share, s.capv, lst.n, lst.total - lst.n * lst.fl, all);
  tm.sync();
  if (tm.rank() == 0) {
    if (lrc == Budgeter::slice_ok) Budgeter::slice_end(bp, lst, plans, rows, layer, all, budgets);
    for (int h = 0; h < rows; ++h) {
      if (lrc != Budgeter::slice_ok) budgets[h] = plans[h].length;
      need[h] = (has_scores && budgets[h] < plans[h].length) ? 1 : 0;
    }
  }
  tm.sync();
}

/// One block per sequence: validate and clamp lengths (device status on error), plan every
/// KV head and out row, score-free budgets, the "needs scoring" flags (per row and per KV head):
/// the budget rules of frontend<Policy>::sequence_budgets on the device. By the budgeter's
/// budget_kind: per_head: Budgeter::head_budget (host-device); score_driven: base budgets (the
/// budgeter's implementation moves them after scoring); whole_layer (LKV-H):
/// BudgeterImpl::sequence_budgets, called by the whole block after the sequence's plans are
/// written (it synchronises the block before reading them; budgeters::headwise_learned: lkv_sequence_budgets below, budgets bit-identical to the
/// CPU's; its scratch `bs` comes from the workspace). Protection: the selector's parameters
/// (num_sink, num_recent, recent_share). prefix: a paged cache's pages.protected_prefix (device,
/// [B], validated by the table check) or null: sequence b's first prefix[b] tokens are protected
/// as sinks (plan_head_protected).
template <class Budgeter, class BudgeterImpl, bool HasScores, class Protection>
__global__ void plan_kernel(lengths_view lens, const std::int32_t* prefix, plan_shape sh, budget_request req, Protection sp, typename Budgeter::params bp,
                            device_status* st, std::int32_t* len_kv, head_plan* plankv, std::uint8_t* needkv, head_plan* plans,
                            std::int64_t* budgets, std::uint8_t* need, typename BudgeterImpl::scratch bs) {
  using kvevict::detail::budget_kind;
  constexpr budget_kind kind = kvevict::detail::budget_kind_of<Budgeter>;
  (void)bs;
  const int b = blockIdx.x;
  for (int h = threadIdx.x; h < sh.Hkv; h += blockDim.x) {
    std::int64_t L = lens.data ? static_cast<std::int64_t>(lens(b, h)) : sh.S;
    if (L < 0 || L > sh.S) {
      report(st, errc::invalid_argument, device_check::length_range, b, h, L, sh.S);
      L = L < 0 ? 0 : sh.S;
    }
    len_kv[b * sh.Hkv + h] = static_cast<std::int32_t>(L);
    plankv[b * sh.Hkv + h] = kvevict::detail::plan_row<Budgeter>(bp, req, sp, L, sh.W, prefix ? prefix[b] : 0, sh.layer, sh.num_layers);
  }
  __syncthreads();
  if (sh.layer_mean && threadIdx.x == 0) {
    for (int h = 1; h < sh.Hkv; ++h)
      if (len_kv[b * sh.Hkv + h] != len_kv[b * sh.Hkv]) {
        report(st, errc::invalid_argument, device_check::layer_mean_lengths, b, len_kv[b * sh.Hkv], len_kv[b * sh.Hkv + h], h);
        break;
      }
  }
  for (int h = threadIdx.x; h < sh.H; h += blockDim.x) {
    const std::int64_t r = static_cast<std::int64_t>(b) * sh.H + h;
    const head_plan pl = plankv[b * sh.Hkv + h / sh.Gout];
    plans[r] = pl;
    // The front-end's rule (whole-layer: the length, set below once the sequence's plans are known).
    kvevict::detail::initial_row_budget<Budgeter>(bp, pl, sh.layer, sh.num_layers, HasScores, budgets + r, need + r);
  }
  if constexpr (kind == budget_kind::whole_layer) {
    // sharded: the allocation is over every rank's rows; the host sets budgets and flags after the exchange
    if (!sh.sharded) BudgeterImpl::sequence_budgets(b, sh, req, bp, HasScores, plans, budgets, need, st, bs);  // synchronises first
  }
  __syncthreads();
  if (sh.layer_mean && threadIdx.x == 0) {
    std::uint8_t any = 0;
    for (int h = 0; h < sh.H; ++h) any |= need[static_cast<std::int64_t>(b) * sh.H + h];
    for (int h = 0; h < sh.H; ++h) need[static_cast<std::int64_t>(b) * sh.H + h] = any;
  }
  __syncthreads();
  for (int h = threadIdx.x; h < sh.Hkv; h += blockDim.x) {
    std::uint8_t any = 0;
    for (int g = 0; g < sh.Gout; ++g) any |= need[static_cast<std::int64_t>(b) * sh.H + h * sh.Gout + g];
    needkv[b * sh.Hkv + h] = any;
  }
}

/// cw[kvi][j] = c_j of the head's effective window w = min(W, L) (0 for j >= w). last_only:
/// the last row only (last_query). Temporal::weight is the host-device weight of the policy.
template <class Temporal>
__global__ void temporal_weights_kernel(typename Temporal::params tp, const std::int32_t* len_kv, std::int64_t nkv,
                                        std::int64_t W, int last_only, float* cw) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < nkv * W;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t kvi = i / W, j = i % W;
    const std::int64_t L = len_kv[kvi];
    const std::int64_t w = L < W ? L : W;
    float c = 0.0f;
    if (j < w) {
      if (last_only) c = j == w - 1 ? 1.0f : 0.0f;
      else c = static_cast<float>(Temporal::weight(tp, static_cast<int>(j), static_cast<int>(w)));
    }
    cw[i] = c;
  }
}

/// GQA reduction of the Gq query-head rows of each KV head into one row (mode: 0 mean, 1 max),
/// for rows that need scoring. rows: grows [B][Hkv * Gq][S] -> scores [B][Hkv][S].
template <int Unused = 0>
__global__ void gqa_reduce_kernel(const float* grows, float* scores, int B, int Hkv, int Gq, std::int64_t S, int mode,
                                         const std::int32_t* len_kv, const std::uint8_t* need) {
  const std::int64_t total = static_cast<std::int64_t>(B) * Hkv * S;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / S, n = i % S;
    if (!need[r] || n >= len_kv[r]) continue;
    const float* g0 = grows + r * Gq * S + n;
    if (mode == 1) {
      float m = g0[0];
      for (int g = 1; g < Gq; ++g) {
        const float x = g0[g * S];
        m = (m < x) ? x : m;
      }
      scores[i] = m;
    } else {
      double s = 0.0;
      for (int g = 0; g < Gq; ++g) s += g0[g * S];
      scores[i] = static_cast<float>(s * (1.0 / static_cast<double>(Gq)));
    }
  }
}

/// layer_mean: every head of sequence b gets the mean of the H heads' rows (fp32 sum in head
/// order, then / H, as the CPU backend; fp64 where the fp32 sum overflows). Thread per (b, n).
template <int Unused = 0>
__global__ void layer_mean_kernel(float* scores, int B, int H, std::int64_t S, const std::int32_t* len_kv, int Hkv,
                                         const std::uint8_t* need) {
  const std::int64_t total = static_cast<std::int64_t>(B) * S;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t b = i / S, n = i % S;
    if (!need[b * H] || n >= len_kv[b * Hkv]) continue;
    float* o = scores + b * H * S + n;
    float acc = o[0];
    double dacc = o[0];  // fp64 where the fp32 sum overflows (scores near -FLT_MAX), as the CPU backend
    for (int h = 1; h < H; ++h) {
      acc += o[h * S];
      dacc += o[h * S];
    }
    acc /= static_cast<float>(H);
    if (!isfinite(acc)) acc = static_cast<float>(dacc / static_cast<double>(H));
    for (int h = 0; h < H; ++h) o[h * S] = acc;
  }
}

/// Drift per out row from the per-query-head drifts: per_query_head / G == 1 copies, mean /
/// max average over the group, layer_mean then averages over the sequence's heads.
/// One thread per sequence.
template <int Unused = 0>
__global__ void drift_reduce_kernel(const double* qdrift, double* drift, int B, int Hkv, int Gq, int Gout, int layer_mean) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int H = Hkv * Gout;
  for (int h = 0; h < H; ++h) {
    const std::int64_t r = static_cast<std::int64_t>(b) * H + h;
    if (Gout == Gq) {
      drift[r] = qdrift[static_cast<std::int64_t>(b) * Hkv * Gq + h];
    } else {
      double s = 0.0;
      for (int g = 0; g < Gq; ++g) s += qdrift[(static_cast<std::int64_t>(b) * Hkv + h) * Gq + g];
      drift[r] = s / static_cast<double>(Gq);
    }
  }
  if (layer_mean) {
    double s = 0.0;
    for (int h = 0; h < H; ++h) s += drift[static_cast<std::int64_t>(b) * H + h];
    for (int h = 0; h < H; ++h) drift[static_cast<std::int64_t>(b) * H + h] = s / static_cast<double>(H);
  }
}

/// fp64 prefix sums of a row's smoothing region: pre[r][0] = 0, pre[r][i + 1] = sum x[0..i]
/// for i < N = evictable_end. Block per row (CUB BlockScan over 256-element chunks).
template <int Unused = 0>
__global__ void prefix_kernel(const float* x, double* pre, std::int64_t S, const head_plan* plans, const std::uint8_t* need) {
  using scan_t = cub::BlockScan<double, block_threads>;
  __shared__ typename scan_t::TempStorage ts;
  const std::int64_t r = blockIdx.x;
  if (!need[r]) return;
  const std::int64_t N = plans[r].evictable_end();
  const float* xr = x + r * S;
  double* pr = pre + r * (S + 1);
  if (threadIdx.x == 0) pr[0] = 0.0;
  double carry = 0.0;
  for (std::int64_t base = 0; base < N; base += block_threads) {
    const std::int64_t i = base + threadIdx.x;
    const double v = i < N ? static_cast<double>(xr[i]) : 0.0;
    double inc = 0.0, tot = 0.0;
    scan_t(ts).InclusiveSum(v, inc, tot);
    __syncthreads();
    if (i < N) pr[i + 1] = carry + inc;
    carry += tot;
  }
}

/// Box filter y[i] = (1/k) sum_{j = i - k/2 + s}^{i + k/2 + s} x'[j] from the prefix sums, with
/// zero padding (avg_pool: k = kernel, s = 0) or replicate padding (adaptive_window: k, s from
/// adaptive_window::kernel_and_shift(drift)). Tokens in [N, L) are copied. Thread per (r, i).
template <class Spatial>
__global__ void box_kernel(typename Spatial::params p, const float* x, const double* pre, const double* drift, float* y,
                           std::int64_t rows, std::int64_t S, const head_plan* plans, const std::uint8_t* need) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < rows * S;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = t / S, i = t % S;
    if (!need[r] || i >= plans[r].length) continue;
    const std::int64_t N = plans[r].evictable_end();
    if (i >= N) {
      y[t] = x[t];
      continue;
    }
    std::int64_t k, s;
    bool replicate;
    if constexpr (Spatial::needs_attention_drift) {
      spatial::adaptive_window::kernel_and_shift(p, drift[r], &k, &s);
      replicate = true;
    } else {
      k = p.kernel;
      s = 0;
      replicate = false;
    }
    const double* pr = pre + r * (S + 1);
    const float* xr = x + r * S;
    const std::int64_t half = k / 2;
    const std::int64_t lo = i - half + s, hi = i + half + s;
    const std::int64_t a = lo > 0 ? lo : 0, c = hi < N - 1 ? hi : N - 1;
    double sum = a <= c ? pr[c + 1] - pr[a] : 0.0;
    if (replicate) {
      if (lo < 0) sum += static_cast<double>(-lo < k ? -lo : k) * xr[0];
      if (hi > N - 1) sum += static_cast<double>(hi - (N - 1) < k ? hi - (N - 1) : k) * xr[N - 1];
    }
    y[t] = static_cast<float>(sum / static_cast<double>(k));
  }
}

/// Centred sliding max of odd width k, -inf padding (direct O(k) per output). Thread per (r, i).
template <int Unused = 0>
__global__ void max_pool_kernel(int kernel, const float* x, float* y, std::int64_t rows, std::int64_t S,
                                       const head_plan* plans, const std::uint8_t* need) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < rows * S;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = t / S, i = t % S;
    if (!need[r] || i >= plans[r].length) continue;
    const std::int64_t N = plans[r].evictable_end();
    if (i >= N) {
      y[t] = x[t];
      continue;
    }
    const std::int64_t half = kernel / 2;
    const std::int64_t a = i - half > 0 ? i - half : 0, c = i + half < N - 1 ? i + half : N - 1;
    const float* xr = x + r * S;
    float m = xr[a];
    for (std::int64_t j = a + 1; j <= c; ++j) m = xr[j] > m ? xr[j] : m;
    y[t] = m;
  }
}

/// AdaKV budgets, one block per sequence: the global top-T over the candidate scores of all the
/// sequence's heads (ties: lower head, then lower index = the concatenated index order) by
/// block radix select, winners per head, then budgeters::adakv::apportion_budgets (thread 0).
/// Scratch (global): candprefix [B][H + 1], winners/cap/extra [B * H], share [B * H].
template <int Unused = 0>
__global__ void adakv_kernel(budgeters::adakv::params p, const head_plan* plans, const float* scores, int H,
                                    std::int64_t S, long long* candprefix, unsigned long long* winners, double* share,
                                    std::int64_t* cap, std::int64_t* extra, std::int64_t* budgets) {
  __shared__ select_smem sm;
  __shared__ long long total_T;
  const int b = blockIdx.x;
  const head_plan* pl = plans + static_cast<std::int64_t>(b) * H;
  long long* pre = candprefix + static_cast<std::int64_t>(b) * (H + 1);
  unsigned long long* win = winners + static_cast<std::int64_t>(b) * H;
  if (threadIdx.x == 0) {
    long long acc = 0, T = 0;
    pre[0] = 0;
    for (int h = 0; h < H; ++h) {
      if (!pl[h].pass_through) {
        T += pl[h].base_budget - pl[h].protected_count();
        acc += pl[h].candidates();
      }
      pre[h + 1] = acc;
    }
    total_T = T < acc ? T : acc;
  }
  for (int h = threadIdx.x; h < H; h += blockDim.x) win[h] = 0ull;
  __syncthreads();
  const long long n = pre[H], T = total_T;
  auto locate = [pre, H](long long i) {
    int lo = 0, hi = H - 1;  // largest h with pre[h] <= i
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (pre[mid] <= i) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  if (T > 0) {
    auto key = [&](long long i) {
      const int h = locate(i);
      const std::int64_t idx = pl[h].sinks + (i - pre[h]);
      return order_key(scores[(static_cast<std::int64_t>(b) * H + h) * S + idx]);
    };
    const kth_result sel = block_select_kth(key, n, T, sm);
    block_take_ordered(key, n, sel, [&](long long i, long long) { atomicAdd(&win[locate(i)], 1ull); }, sm);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    budgeters::adakv::apportion_budgets(p, pl, win, H, T, share + static_cast<std::int64_t>(b) * H,
                                        cap + static_cast<std::int64_t>(b) * H, extra + static_cast<std::int64_t>(b) * H,
                                        budgets + static_cast<std::int64_t>(b) * H);
  }
}

/// Kept count per row: min(budget, L), int32 (the CSR row lengths).
template <int Unused = 0>
__global__ void counts_kernel(const head_plan* plans, const std::int64_t* budgets, std::int64_t rows, std::int32_t* cnt) {
  const std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  cnt[r] = static_cast<std::int32_t>(kvevict::detail::kept_tokens(plans[r], budgets[r]));
}

/// Report (device status) when the total kept count exceeds the selection capacity.
template <int Unused = 0>
__global__ void capacity_kernel(const std::int32_t* indptr, std::int64_t rows, std::int64_t capacity, device_status* st) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && indptr[rows] > capacity)
    report(st, errc::insufficient_capacity, device_check::capacity, capacity, indptr[rows], 0, 0);
}

/// Top-k selection of one row per block (selectors::topk): sinks [0, c0) and recent [c1, L)
/// kept by rule, the best k = budget - protected candidates of [c0, c1) by block radix select
/// on order_key(score) (NaN lowest, ties to the lower index), written ascending. Rows without
/// scores keep the most recent candidates. Nothing is written when the selection would
/// overflow the capacity (capacity_kernel reports it).
template <int Unused = 0>
__global__ void select_kernel(const head_plan* plans, const std::int64_t* budgets, const std::uint8_t* need, const float* scores,
                                     std::int64_t S, const std::int32_t* indptr, std::int64_t capacity, std::int32_t* indices,
                                     std::int32_t* out_positions, positions_view positions, int H, int Gout) {
  __shared__ select_smem sm;
  const std::int64_t r = blockIdx.x;
  const std::int64_t end = indptr[r + 1];
  if (end > capacity || indptr[gridDim.x] > capacity) return;
  const head_plan pl = plans[r];
  const std::int64_t L = pl.length, budget = budgets[r];
  std::int32_t* dst = indices + indptr[r];
  const std::int64_t b = r / H, hk = (r % H) / Gout;
  auto put = [&](std::int64_t at, std::int64_t slot) {
    dst[at] = static_cast<std::int32_t>(slot);
    if (out_positions)
      out_positions[indptr[r] + at] = positions.data ? positions(b, hk, slot) : static_cast<std::int32_t>(slot);
  };
  if (pl.pass_through || budget >= L) {
    for (std::int64_t i = threadIdx.x; i < L; i += blockDim.x) put(i, i);
    return;
  }
  const std::int64_t c0 = pl.sinks, c1 = L - pl.recent;
  std::int64_t k = budget - pl.protected_count();
  if (k < 0) k = 0;
  if (k > c1 - c0) k = c1 - c0;
  for (std::int64_t i = threadIdx.x; i < c0; i += blockDim.x) put(i, i);
  for (std::int64_t i = c1 + threadIdx.x; i < L; i += blockDim.x) put(c0 + k + (i - c1), i);
  if (k <= 0) return;
  const std::int64_t m = c1 - c0;
  if (!scores || !need[r]) {
    for (std::int64_t i = threadIdx.x; i < k; i += blockDim.x) put(c0 + i, c1 - k + i);
    return;
  }
  if (k == m) {
    for (std::int64_t i = threadIdx.x; i < m; i += blockDim.x) put(c0 + i, c0 + i);
    return;
  }
  const float* row = scores + r * S + c0;
  auto key = [row](long long i) { return order_key(row[i]); };
  const kth_result sel = block_select_kth(key, m, k, sm);
  block_take_ordered(key, m, sel, [&](long long i, long long rank) { put(c0 + rank, c0 + i); }, sm);
}

/// maybe_scores[r][n]: the final score on [sinks, evictable_end) of scored rows, else 0.
template <int Unused = 0>
__global__ void export_scores_kernel(const float* fin, const head_plan* plans, const std::uint8_t* need, std::int64_t rows,
                                            std::int64_t S, float* out) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < rows * S;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = t / S, n = t % S;
    float v = 0.0f;
    if (fin && need[r] && n >= plans[r].sinks && n < plans[r].evictable_end()) v = fin[t];
    out[t] = v;
  }
}

/// Device-side NaN/inf scan of the valid region of a (batch, heads, seq, dim) view; tensor id
/// as in device_check::non_finite. For queries (kv_per_head = G) the valid rows are the last
/// min(W, L) ones. Grid-stride over every element.
template <class T>
__global__ void finite_scan_kernel(strided_view<const T, 4> v, int tensor, const std::int32_t* len_kv, int Hkv, int G,
                                   int queries, device_status* st) {
  const std::int64_t H = v.extent[1], S = v.extent[2], D = v.extent[3];
  const std::int64_t total = v.extent[0] * H * S * D;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % D, s = (i / D) % S, h = (i / (D * S)) % H, b = i / (D * S * H);
    const std::int64_t L = len_kv[b * Hkv + h / G];
    if (queries) {
      const std::int64_t w = L < S ? L : S;
      if (s < S - w) continue;
    } else if (s >= L) {
      continue;
    }
    if (!is_finite_value(v(b, h, s, c))) report(st, errc::non_finite_input, device_check::non_finite, tensor, b, h, s);
  }
}

/// NaN/inf scan of the W_O factors.
template <int Unused = 0>
__global__ void finite_scan_wo_kernel(strided_view<const float, 3> f, device_status* st) {
  const std::int64_t D1 = f.extent[1], D2 = f.extent[2], total = f.extent[0] * D1 * D2;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = i % D2, k = (i / D2) % D1, a = i / (D1 * D2);
    if (!is_finite_value(f(a, k, j))) report(st, errc::non_finite_input, device_check::non_finite, 3, a, k, j);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace kvevict
