// IWYU pragma: private, include "kvevict/kvevict.hpp"
// Scorer policies: one fp32 score per cached token of a head, higher = keep.
// Each scorer holds only parameters and capability flags; the backends hold the loops
// (kvevict/backends/<backend>/scorers*). No NaN or inf ever leaves a built-in scorer.
//
// Capability flags read by the evictor:
//   needs_queries      reads the observation-window queries (B, Hq, W, D)
//   needs_values       reads V
//   needs_wo_factor    reads the per-query-head W_O factor R (Hq, D, D) when configured so
//   window_attention   computes the window attention A (so it can feed adaptive-window drift)
//   has_scores         false only for `none` (StreamingLLM keeps sinks + recent, no scoring pass)
// Optional flags (absent = false; read through detail::scorer_secondary / scorer_needs_wo_matrix):
//   secondary_scores   also writes a second row per query head (attention_value_norm: the
//                      projected value norms), read by selectors::two_stage
//   needs_wo_matrix    reads the layer's full output projection layer_inputs::wo
//                      (hidden, q_heads * head_dim), not the d x d factor
//   combines_heads     its rows are finished by one pass over the KV heads of a sequence
//                      (defensive_attention); read through detail::scorer_combines_heads
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/core/status.hpp"

namespace kvevict {
namespace scorers {

/// Layer-wise output reconstruction (LOR) score of ReST-KV (An et al., "ReST-KV: Robust KV
/// Cache Eviction with Layer-wise Output Reconstruction and Spatial-Temporal Smoothing", ICLR
/// 2026, Eq. 7): how much the head's contribution to the layer output, z W_O, changes when a
/// token is removed from the attention and the rest renormalised:
///   s[n] = a[n] / (1 - a[n]) * || R_h (z - v_n) ||_2 ^ tau
/// with ||R_h x|| = ||x W_O^h|| (R_h: d x d factor of W_O^h W_O^h^T, see
/// cpu::compute_wo_factors), or R_h = I in value space (`use_wo = false`).
///  - mode::after (default, the published configuration): a = temporal-smoothed window
///    attention; z = sum over past tokens (n < L - w) of a[n] v_n (window tokens' share left
///    out unless include_window_in_output).
///  - mode::before (the paper's equation): per window row j, S[j,n] = A[j,n]/(1-A[j,n]) *
///    ||R (z_j - v_n)|| with z_j = A[j,:] V, then temporal smoothing over j.
/// Tokens that take almost all the attention are scored by the finite limit
/// a * ||R (z_{-n} - v_n)|| computed without cancellation (spec: restkv.md "Numerics").
struct output_reconstruction {
  enum class mode : int { after = 0, before = 1 };
  struct params {
    mode aggregation = mode::after;
    bool use_wo = true;                     ///< true: needs the W_O factor; false: value space
    float tau = 1.0f;                       ///< exponent on the distance, in (0, 16]
    bool include_window_in_output = false;  ///< "after": include window tokens in z
  };
  static constexpr const char* name = "output_reconstruction";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = true;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params& p) { return p.use_wo; }
  static status check(const params& p) {
    if (!(p.tau > 0.0f && p.tau <= 16.0f))
      return status::error(errc::invalid_argument, "scorer.tau = %g must be in (0, 16]", static_cast<double>(p.tau));
    if (p.aggregation != mode::after && p.aggregation != mode::before)
      return status::error(errc::invalid_argument, "scorer.aggregation = %d is not a mode", static_cast<int>(p.aggregation));
    return {};
  }
};

/// Attention-weight score (SnapKV, Li et al. 2024, arXiv 2404.14469): the temporal-smoothed
/// window attention a[n] = sum_j c_j A[j, n] (SnapKV: c_j = 1 ("sum") or 1/w ("mean")).
/// A[j, :] = softmax(q_j K^T / sqrt(d)) in fp32 with the causal mask inside the window.
struct attention_weight {
  struct params {};
  static constexpr const char* name = "attention_weight";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

/// Accumulated attention (H2O, Zhang et al. 2023, arXiv 2306.14048): column sums of the
/// attention of ALL prompt queries under the full causal mask (query i sees keys 0..i). Pass
/// the whole prompt's queries as the "window" (W = L). Memory is O(seq_len): rows are
/// processed in blocks, the L x L matrix never exists.
/// `normalize_by_visible`: divide column n by the number of queries that see it (the
/// normalisation that removes H2O's bias toward early tokens).
struct accumulated_attention {
  struct params {
    bool normalize_by_visible = false;
  };
  static constexpr const char* name = "accumulated_attention";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

/// Attention of the last query only (TOVA, Oren et al. 2024, arXiv 2401.06104). Only the last
/// row of the window is computed. TOVA averages over all heads of the layer: use it with
/// gqa_reduction::layer_mean (the `presets::tova` default) for one token set per layer.
struct last_query {
  struct params {};
  static constexpr const char* name = "last_query";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

/// Key-norm score (Devoto et al. 2024, arXiv 2406.11430): keep the keys of LOW L2 norm,
/// s[n] = -||k_n||. Query-free.
struct key_norm {
  struct params {};
  static constexpr const char* name = "key_norm";
  static constexpr bool needs_queries = false;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = false;
  static constexpr bool has_scores = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

/// CriticalKV's scorer (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an
/// Output Perturbation Perspective", arXiv 2502.03805). Two rows per query head h:
///  - primary   a[n] = sum_j c_j A[j, n], the window attention exactly as attention_weight
///              (SnapKV); the policy's GQA reduction and spatial smoother apply to it, and it is
///              what budgeters (AdaKV) and stage 1 of selectors::two_stage rank;
///  - secondary u_h[n] = || v_n W_O^h ||_1 = sum_{c < C} | sum_{i < d} W_O[c, h d + i] v_n[i] |,
///              the L1 norm of the value projected by query head h's slice of the output
///              projection to the hidden size C (layer_inputs::wo). Reduced over the GQA group
///              by the same rule as the primary row (mean by default, as the CriticalKV
///              reference code averages the G norms), never smoothed.
/// selectors::two_stage then keeps floor(first_stage_ratio * k) candidates by a and the rest by
/// (a + eps) * u (docs/criticalkv.md). The L1 norm is not invariant under the d x d QR factor
/// used by output_reconstruction, so this scorer needs the real W_O slice: cost O(L d C) per
/// query head (one fp32 GEMM per block of tokens), fp64 accumulation of |y_c|.
/// Values of extreme magnitude are rescaled by powers of two before the projection, and the norm
/// saturates at FLT_MAX (never inf or NaN).
struct attention_value_norm {
  struct params {};
  static constexpr const char* name = "attention_value_norm";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = true;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static constexpr bool secondary_scores = true;
  static constexpr bool needs_wo_matrix = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

/// DefensiveKV's scorer (Feng et al., "Taming the Fragility of KV Cache Eviction in LLM Inference",
/// ICLR 2026, arXiv 2510.13334; the authors' code: FFY0/DefensiveKV,
/// kvpress/presses/efficient_defensivekv_press.py). Over the candidates n < Lc = L - w (the window's
/// own columns are never scored: the selector keeps the window), per KV head h with query heads g
/// of its GQA group, window rows j and A[g, j, :] = softmax(q_j K^T / sqrt(d)) (fp32, causal inside
/// the window):
///  1. pooled rows: P[g, j, :] = avgpool_k(A[g, j, :Lc]) * (sum_n A[g, j, n]) / (sum_n avgpool_k(...)),
///     avgpool_k the zero-padded average of width `kernel` (odd; divided by k at the edges too, as
///     torch's avg_pool1d), each row rescaled back to its own mass on the candidates;
///  2. defensive aggregation (`clamp_at_mean`): M[n] = max_{g, j} P[g, j, n] and
///     S[n] = max(M[n], mean_{n' < Lc} M[n']) (clamp_at_mean = false: plain max aggregation, S = M);
///  3. value weighting: u_h[n] = mean_g ||v_n W_O^{hg}||_1 (CriticalKV's projected value norm) and
///     F_h[n] = S_h[n] * u_h[n] / sum_{h'} u_{h'}[n], normalised over the KV heads of the sequence at
///     each position (the authors' code: WoV_norm / WoV_norm.sum(dim = heads)), so the heads' scores are
///     comparable for a head-wise (flattened) budgeter;
///  4. mass stage (`mass_threshold` t > 0): per head, the mass row m_h[n] = sum_j c_j mean_g A[g, j, n]
///     (c_j: the policy's temporal weights; the preset's temporal::mean gives the authors' mean),
///     normalised over the candidates, ranked high to low (ties to the lower index); the first k_h
///     tokens, k_h = the first rank whose cumulative mass reaches t - share (0 when none does or
///     t - share <= 0), capped at the head's base budget minus the window, are forced in: their
///     F (and the window's) is set to the next float above the largest F of the sequence's heads
///     (the authors' code sets it to that maximum, where the best unforced candidate ties with the
///     forced ones and torch.topk breaks the tie either way). `share` is the layer's window share
///     (`share_rule`), averaged over every query head and window row of the sequence.
/// F_h is the scorer's one row per KV head (what budgeters and the selector rank; maybe_scores).
/// Steps 3 and 4 read every KV head of a sequence: the scorer declares combines_heads, so a
/// backend runs them once per sequence after the heads are scored. GQA: the aggregation spans the
/// group by definition; the policy's gqa must be gqa_reduction::mean (other values are refused).
/// Needs queries, values and layer_inputs::wo (hidden, q_heads * head_dim). Cost over SnapKV: the
/// pooling of every window row (G w Lc k) and the value norms (O(L d C) per query head).
/// Errors: kernel not odd or outside [1, 255]; mass_threshold outside [0, 1] or NaN; share_rule
/// not a rule.
struct defensive_attention {
  /// Which attention mass stage 4 subtracts from the threshold.
  ///  - preceding_keys (default): the mass of the w candidates just before the window, columns
  ///    [max(0, Lc - w), Lc), as the authors' code computes it (it slices the window's columns off
  ///    before summing the last w columns);
  ///  - window: the mass of the window's own columns [Lc, L) (the paper's wording, "0.9 minus the
  ///    window's share");
  ///  - none: the threshold is mass_threshold itself.
  enum class share_rule : int { preceding_keys = 0, window = 1, none = 2 };
  struct params {
    std::int32_t kernel = 5;          ///< avg-pool width of step 1, odd
    bool clamp_at_mean = true;        ///< step 2: defensive (true) or plain max (false)
    float mass_threshold = 0.9f;      ///< step 4: cumulative mass of the forced tokens; 0 = no stage 1
    share_rule share = share_rule::preceding_keys;
  };
  static constexpr const char* name = "defensive_attention";
  static constexpr bool needs_queries = true;
  static constexpr bool needs_values = true;
  static constexpr bool window_attention = true;
  static constexpr bool has_scores = true;
  static constexpr bool needs_wo_matrix = true;
  /// Steps 3 and 4 combine the KV heads of a sequence (scorer_impl::combine_heads).
  static constexpr bool combines_heads = true;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params& p) {
    if (p.kernel < 1 || p.kernel > 255 || p.kernel % 2 == 0)
      return status::error(errc::invalid_argument, "scorer.kernel = %d must be odd and in [1, 255]", p.kernel);
    if (!(p.mass_threshold >= 0.0f && p.mass_threshold <= 1.0f))
      return status::error(errc::invalid_argument, "scorer.mass_threshold = %g must be in [0, 1]", static_cast<double>(p.mass_threshold));
    const int r = static_cast<int>(p.share);
    if (r < 0 || r > 2) return status::error(errc::invalid_argument, "scorer.share = %d is not a share_rule", r);
    return {};
  }
};

/// No scores: the selector keeps sink and recent tokens only (StreamingLLM, Xiao et al. 2023,
/// arXiv 2309.17453). No scoring pass runs.
struct none {
  struct params {};
  static constexpr const char* name = "none";
  static constexpr bool needs_queries = false;
  static constexpr bool needs_values = false;
  static constexpr bool window_attention = false;
  static constexpr bool has_scores = false;
  static bool needs_wo_factor(const params&) { return false; }
  static status check(const params&) { return {}; }
};

}  // namespace scorers

namespace detail {

/// True when scorer S declares `static constexpr bool secondary_scores = true`.
template <class S, class = void>
struct scorer_secondary : std::false_type {};
template <class S>
struct scorer_secondary<S, std::void_t<decltype(S::secondary_scores)>> : std::integral_constant<bool, S::secondary_scores> {};

/// True when scorer S declares `static constexpr bool needs_wo_matrix = true` (reads layer_inputs::wo).
template <class S, class = void>
struct scorer_needs_wo_matrix : std::false_type {};
template <class S>
struct scorer_needs_wo_matrix<S, std::void_t<decltype(S::needs_wo_matrix)>>
    : std::integral_constant<bool, S::needs_wo_matrix> {};


/// True when scorer S declares `static constexpr bool combines_heads = true`: its rows are final only
/// after a pass over every KV head of a sequence (scorer_impl::combine_heads; defensive_attention).
template <class S, class = void>
struct scorer_combines_heads : std::false_type {};
template <class S>
struct scorer_combines_heads<S, std::void_t<decltype(S::combines_heads)>> : std::integral_constant<bool, S::combines_heads> {};

}  // namespace detail
}  // namespace kvevict
