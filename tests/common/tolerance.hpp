// Tolerances and comparison helpers shared by kvevict's tests.
//
// Scores: |lib - ref| <= rtol * |ref| + atol * scale, scale = largest |ref| of the row (so tiny
// scores next to large ones are compared in absolute terms). Selections: compared as sets only
// where the reference's k-th and (k+1)-th candidate scores are separated by more than the score
// tolerance (otherwise a fp32-vs-fp64 rounding can legitimately swap them); at a near-tie the sum
// of the reference scores over the kept candidates is compared instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace kvtest {

/// Relative tolerance for fp32 scores against an fp64 reference.
inline constexpr double score_rtol = 1e-4;
/// Absolute tolerance, as a fraction of the largest reference score of the row.
inline constexpr double score_atol = 2e-6;

inline bool close(double lib, double ref, double rtol, double atol) {
  return std::fabs(lib - ref) <= rtol * std::fabs(ref) + atol;
}

/// Index of the first mismatch of lib vs ref over [lo, hi), -1 if none. worst receives the
/// largest |lib - ref| / (rtol |ref| + atol scale).
inline std::int64_t first_mismatch(const float* lib, const std::vector<double>& ref, std::int64_t lo, std::int64_t hi,
                                   double rtol, double atol_rel, double* worst = nullptr, double scale = 0.0) {
  for (std::int64_t i = lo; i < hi; ++i) scale = std::max(scale, std::fabs(ref[static_cast<std::size_t>(i)]));
  const double atol = atol_rel * scale + 1e-30;
  std::int64_t bad = -1;
  double w = 0.0;
  for (std::int64_t i = lo; i < hi; ++i) {
    const double r = ref[static_cast<std::size_t>(i)], l = lib[i];
    const double e = std::fabs(l - r) / (rtol * std::fabs(r) + atol);
    if (!(e <= 1.0) && bad < 0) bad = i;
    if (!(e <= w)) w = e;  // NaN propagates as "bad"
  }
  if (worst) *worst = w;
  return bad;
}

/// Result of comparing a library selection of candidates against reference scores.
struct selection_check {
  bool ok = true;
  bool compared_as_sets = true;
  std::string why;
};

/// `lib_kept` and `ref_kept`: kept candidate slots (any order) out of candidates [c0, c1) with
/// reference scores `ref` (indexed by slot). k = number of candidates kept. `scale` (optional)
/// raises the scale of the absolute tolerance (e.g. to the largest score of the whole row).
inline selection_check compare_kept_candidates(std::vector<std::int32_t> lib_kept, std::vector<std::int32_t> ref_kept,
                                               const std::vector<double>& ref, std::int64_t c0, std::int64_t c1,
                                               double rtol, double atol_rel, double scale = 0.0) {
  selection_check out;
  std::sort(lib_kept.begin(), lib_kept.end());
  std::sort(ref_kept.begin(), ref_kept.end());
  if (lib_kept.size() != ref_kept.size()) {
    out.ok = false;
    out.why = "kept counts differ: lib " + std::to_string(lib_kept.size()) + " ref " + std::to_string(ref_kept.size());
    return out;
  }
  const std::size_t k = ref_kept.size();
  std::vector<double> s;
  for (std::int64_t i = c0; i < c1; ++i) {
    s.push_back(ref[static_cast<std::size_t>(i)]);
    scale = std::max(scale, std::fabs(ref[static_cast<std::size_t>(i)]));
  }
  std::sort(s.begin(), s.end(), [](double a, double b) { return a > b; });
  const double atol = atol_rel * scale;
  bool separated = true;
  if (k > 0 && k < s.size()) {
    const double gap = s[k - 1] - s[k];
    separated = gap > 2.0 * (rtol * std::fabs(s[k - 1]) + atol);
  }
  if (separated) {
    if (lib_kept != ref_kept) {
      out.ok = false;
      out.why = "kept sets differ although the k-th and (k+1)-th reference scores are separated";
    }
    return out;
  }
  out.compared_as_sets = false;
  double sl = 0.0, sr = 0.0;
  for (auto i : lib_kept) sl += ref[static_cast<std::size_t>(i)];
  for (auto i : ref_kept) sr += ref[static_cast<std::size_t>(i)];
  if (!(std::fabs(sl - sr) <= static_cast<double>(k) * 2.0 * (rtol * std::fabs(s[k - 1]) + atol) + 1e-300)) {
    out.ok = false;
    out.why = "near-tie: kept reference-score sums differ: lib " + std::to_string(sl) + " ref " + std::to_string(sr);
  }
  return out;
}

}  // namespace kvtest
