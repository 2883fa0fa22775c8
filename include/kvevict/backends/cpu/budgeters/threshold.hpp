// IWYU pragma: private, include "kvevict/cpu.hpp"
// CPU implementation of budgeters::threshold: per head, the candidates passing the score or mass
// threshold, floored and capped at the head's budget; then the sequence's max_tokens cap by one
// flattened ranking of the passing candidates (policies/budgeters.hpp states the rule).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvevict/backends/cpu/impl.hpp"
#include "kvevict/policies/budgeters.hpp"

namespace kvevict {
namespace cpu {

template <>
struct budgeter_impl<budgeters::threshold> {
  static void score_budgets(const budgeters::threshold::params& p, const kvevict::detail::head_plan* plans, const float* const* rows,
                            std::int64_t H, std::int64_t* budgets) {
    using rule = budgeters::threshold::rule;
    // higher first, NaN below every number, ties to the lower index (the selectors' order)
    auto before = [](float a, std::int32_t ia, float b, std::int32_t ib) {
      const bool na = !(a == a), nb = !(b == b);
      if (na != nb) return nb;
      if (!na && a != b) return a > b;
      return ia < ib;
    };
    std::vector<std::int64_t> count(static_cast<std::size_t>(H), 0), floor_of(static_cast<std::size_t>(H), 0);
    std::vector<std::vector<std::int32_t>> order(static_cast<std::size_t>(H));  // each head's candidates, best first
    std::int64_t sum = 0, floors = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& pl = plans[h];
      budgets[h] = pl.pass_through ? pl.length : pl.base_budget;
      if (pl.pass_through) continue;
      const float* s = rows[h];
      const std::int64_t C = pl.candidates(), cap = std::max<std::int64_t>(0, std::min(C, pl.base_budget - pl.protected_count()));
      auto& ord = order[static_cast<std::size_t>(h)];
      ord.resize(static_cast<std::size_t>(C));
      std::iota(ord.begin(), ord.end(), static_cast<std::int32_t>(pl.sinks));
      std::sort(ord.begin(), ord.end(), [&](std::int32_t a, std::int32_t b) { return before(s[a], a, s[b], b); });
      std::int64_t c = 0;
      if (p.mode == rule::score) {
        while (c < C && s[ord[static_cast<std::size_t>(c)]] >= p.threshold) ++c;  // NaN fails the comparison
      } else {
        double total = 0.0;
        for (std::int64_t i = 0; i < C; ++i) total += std::max(0.0, static_cast<double>(s[ord[static_cast<std::size_t>(i)]]));
        const double goal = static_cast<double>(p.threshold) * total;
        double cum = 0.0;
        if (total > 0.0 && goal > 0.0) {
          while (c < C && cum < goal) cum += std::max(0.0, static_cast<double>(s[ord[static_cast<std::size_t>(c++)]]));
        }
      }
      const std::int64_t f = std::min<std::int64_t>(p.min_candidates, cap);
      c = std::min(std::max(c, f), cap);
      count[static_cast<std::size_t>(h)] = c;
      floor_of[static_cast<std::size_t>(h)] = std::min(f, c);
      sum += c;
      floors += floor_of[static_cast<std::size_t>(h)];
    }
    if (p.max_tokens > 0 && sum > p.max_tokens) {
      // the floors first, then the best passing candidates beyond them over every head
      struct cand {
        float s;
        std::int32_t h, i;
      };
      std::vector<cand> rest;
      for (std::int64_t h = 0; h < H; ++h) {
        const auto& ord = order[static_cast<std::size_t>(h)];
        for (std::int64_t k = floor_of[static_cast<std::size_t>(h)]; k < count[static_cast<std::size_t>(h)]; ++k)
          rest.push_back(cand{rows[h][ord[static_cast<std::size_t>(k)]], static_cast<std::int32_t>(h), ord[static_cast<std::size_t>(k)]});
        count[static_cast<std::size_t>(h)] = floor_of[static_cast<std::size_t>(h)];
      }
      const std::int64_t R = std::max<std::int64_t>(0, p.max_tokens - floors);
      std::sort(rest.begin(), rest.end(), [&](const cand& a, const cand& b) {
        const bool na = !(a.s == a.s), nb = !(b.s == b.s);
        if (na != nb) return nb;
        if (!na && a.s != b.s) return a.s > b.s;
        if (a.h != b.h) return a.h < b.h;
        return a.i < b.i;
      });
      for (std::int64_t k = 0; k < std::min<std::int64_t>(R, static_cast<std::int64_t>(rest.size())); ++k)
        ++count[static_cast<std::size_t>(rest[static_cast<std::size_t>(k)].h)];
    }
    for (std::int64_t h = 0; h < H; ++h)
      if (!plans[h].pass_through) budgets[h] = plans[h].protected_count() + count[static_cast<std::size_t>(h)];
  }
};

}  // namespace cpu
}  // namespace kvevict
