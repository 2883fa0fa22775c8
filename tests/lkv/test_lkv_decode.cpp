// Tests of LKV decoding "mode B" (kvevict/backends/cpu/learned.hpp: lkv::decode_budgets,
// select_drops, decode_step) and of the engine's lkv_session (examples/engine/lkv_decode.hpp),
// against an independent naive simulation (plain loops, fp64 budgets, token identities tracked by
// hand) and, on the real stories260K model, against a shadow cache: a copy of the session's cache
// before each token, run through plain forward() and evicted by the naive rule.
#include <doctest/doctest.h>

#include <kvevict/backends/cpu/learned.hpp>

#include "lkv_decode.hpp"
#include "model_path.hpp"
#include "lkv_prng.hpp"
#include "tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct prng : lkv_test::prng {  // salt 11: this file's sequences
  explicit prng(std::uint64_t seed) : lkv_test::prng(seed, 11) {}
};

// Naive LKV-H budgets (fp64, plain loops): softmax, clip-and-redistribute until nothing exceeds t,
// floor, then one unit at a time to the largest remaining fractional part (ties: lower head).
std::vector<std::int64_t> naive_budgets(const std::vector<float>& z, double temp, double R, std::int64_t t) {
  const std::size_t n = z.size();
  const std::int64_t total = static_cast<std::int64_t>(std::floor(R * static_cast<double>(static_cast<std::int64_t>(n) * t)));
  double mx = -1e300;
  for (float v : z) mx = std::max(mx, static_cast<double>(v) / temp);
  std::vector<double> r(n), share(n, 0.0);
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += (r[i] = std::exp(static_cast<double>(z[i]) / temp - mx));
  for (std::size_t i = 0; i < n; ++i) r[i] /= s;
  std::vector<bool> clipped(n, false);
  for (;;) {
    double rs = 0, rest = static_cast<double>(total);
    for (std::size_t i = 0; i < n; ++i) {
      if (clipped[i]) rest -= static_cast<double>(t);
      else rs += r[i];
    }
    bool any = false;
    for (std::size_t i = 0; i < n; ++i)
      if (!clipped[i]) {
        share[i] = rs > 0 ? r[i] / rs * rest : 0.0;
        if (share[i] > static_cast<double>(t)) any = true;
      }
    if (!any) break;
    for (std::size_t i = 0; i < n; ++i)
      if (!clipped[i] && share[i] > static_cast<double>(t)) clipped[i] = true, share[i] = static_cast<double>(t);
  }
  std::vector<std::int64_t> out(n);
  std::int64_t left = total;
  for (std::size_t i = 0; i < n; ++i) left -= (out[i] = static_cast<std::int64_t>(std::floor(share[i])));
  std::vector<bool> got(n, false);
  while (left > 0) {
    std::size_t best = n;
    double bf = -1;
    for (std::size_t i = 0; i < n; ++i) {
      if (got[i] || out[i] >= t) continue;
      const double f = share[i] - std::floor(share[i]);
      if (f > bf) bf = f, best = i;
    }
    if (best == n) break;
    got[best] = true;
    ++out[best];
    --left;
  }
  return out;
}

// A naive head: the tokens it holds, in order, as (utility, token id).
struct naive_tok {
  float u;
  std::int64_t id;
};
// Drops the lowest-ranked tokens one at a time (lowest utility; equal utilities: the later token).
void naive_drop(std::vector<naive_tok>& head, std::int64_t budget) {
  while (static_cast<std::int64_t>(head.size()) > budget) {
    std::size_t worst = 0;
    for (std::size_t i = 1; i < head.size(); ++i)
      if (head[i].u < head[worst].u || (head[i].u == head[worst].u && head[i].id > head[worst].id)) worst = i;
    head.erase(head.begin() + static_cast<std::ptrdiff_t>(worst));
  }
}

kvevict::budgeters::headwise_learned::params budgeter_of(const std::vector<float>& z, int L, int H, float temp = 1.0f) {
  kvevict::budgeters::headwise_learned::params p;
  p.logits = z.data();
  p.num_layers = L;
  p.kv_heads = H;
  p.temperature = temp;
  return p;
}

// The library side of the simulation: slot-aligned utilities + token ids, compacted by the drops.
struct lib_cache {
  std::int64_t N, cap;
  std::vector<float> u;
  std::vector<std::int64_t> id;
  std::vector<std::int32_t> len;
  lib_cache(std::int64_t n, std::int64_t c) : N(n), cap(c), u(static_cast<std::size_t>(n * c)), id(static_cast<std::size_t>(n * c)), len(static_cast<std::size_t>(n), 0) {}
  void append(std::int64_t n, float v, std::int64_t tok) {
    const std::size_t at = static_cast<std::size_t>(n * cap + len[static_cast<std::size_t>(n)]++);
    u[at] = v;
    id[at] = tok;
  }
  void apply(const std::vector<std::int32_t>& ip, const std::vector<std::int32_t>& idx) {
    for (std::int64_t n = 0; n < N; ++n) {
      std::int64_t w = 0, d = ip[static_cast<std::size_t>(n)];
      for (std::int64_t s = 0; s < len[static_cast<std::size_t>(n)]; ++s) {
        if (d < ip[static_cast<std::size_t>(n + 1)] && idx[static_cast<std::size_t>(d)] == s) {
          ++d;
          continue;
        }
        u[static_cast<std::size_t>(n * cap + w)] = u[static_cast<std::size_t>(n * cap + s)];
        id[static_cast<std::size_t>(n * cap + w)] = id[static_cast<std::size_t>(n * cap + s)];
        ++w;
      }
      len[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(w);
    }
  }
};

struct step_out {
  std::vector<std::int64_t> budgets;
  std::vector<std::int32_t> ip, idx, scratch;
};

// Budget scratch (decode_budget_scratch) for N heads, prepared for bp.
struct budget_scratch {
  std::vector<double> r, share;
  std::vector<std::int64_t> capv;
  std::vector<unsigned char> clipped;
  kvevict::lkv::decode_budget_scratch s;
  budget_scratch(const kvevict::budgeters::headwise_learned::params& bp)
      : r(static_cast<std::size_t>(bp.num_layers * bp.kv_heads)), share(r.size()), capv(r.size()), clipped(r.size()) {
    s.ratios = r.data();
    s.share = share.data();
    s.capv = capv.data();
    s.clipped = clipped.data();
    REQUIRE(kvevict::lkv::prepare_decode_scratch(bp, s).ok());
  }
};

kvevict::status run_step(const kvevict::budgeters::headwise_learned::params& bp, double R, std::int64_t t, const lib_cache& c, step_out& o,
                         const kvevict::lkv::decode_budget_scratch* bs = nullptr) {
  o.budgets.assign(static_cast<std::size_t>(c.N), -1);
  o.ip.assign(static_cast<std::size_t>(c.N + 1), -1);
  o.idx.assign(static_cast<std::size_t>(c.N * c.cap), -1);
  o.scratch.assign(static_cast<std::size_t>(c.cap), -1);
  kvevict::lkv::decode_cache_view cv;
  cv.utilities = c.u.data();
  cv.utility_stride = c.cap;
  cv.lengths = c.len.data();
  kvevict::lkv::decode_step_buffers b;
  b.budgets = o.budgets.data();
  b.drop_indptr = o.ip.data();
  b.drop_indices = o.idx.data();
  b.drop_capacity = static_cast<std::int64_t>(o.idx.size());
  b.scratch = o.scratch.data();
  b.scratch_size = static_cast<std::int64_t>(o.scratch.size());
  b.budget_scratch = bs;
  return kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(R), t, cv, b);
}

}  // namespace

TEST_CASE("mode B on random utilities: invariants after every step and equality with a naive fp64 simulation") {
  std::int64_t total_drops = 0, ragged_steps = 0, tie_steps = 0;
  for (std::uint64_t seed = 1; seed <= 24; ++seed) {
    prng g(seed);
    const int L = 1 + static_cast<int>(g.next() % 4), H = 1 + static_cast<int>(g.next() % 4);
    const std::int64_t N = L * H;
    const std::int64_t T0 = 1 + static_cast<std::int64_t>(g.next() % 40), steps = 20 + static_cast<std::int64_t>(g.next() % 60);
    const int interval = seed % 3 == 0 ? 3 : (seed % 5 == 0 ? 7 : 1);
    const double R = 0.05 + 0.5 * g.uniform();
    const bool ties = seed % 2 == 0;  // utilities from a few values: many exact ties
    const float temp = seed % 4 == 0 ? 0.5f : 1.0f;
    std::vector<float> z(static_cast<std::size_t>(N));
    for (auto& v : z) v = g.sym(seed % 7 == 0 ? 5.0 : 1.5);  // large spread: some heads clip at t
    CAPTURE(seed);
    CAPTURE(L);
    CAPTURE(H);
    CAPTURE(T0);
    CAPTURE(steps);
    CAPTURE(interval);
    CAPTURE(R);
    CAPTURE(ties);
    const auto bp = budgeter_of(z, L, H, temp);
    budget_scratch bscr(bp);  // the `again` run goes through the allocation-free budget path
    const auto draw = [&]() { return ties ? static_cast<float>(g.next() % 4) : g.sym(3.0); };

    lib_cache lib(N, T0 + steps + 1), again(N, T0 + steps + 1);
    std::vector<std::vector<naive_tok>> naive(static_cast<std::size_t>(N));
    std::int64_t t = 0;
    auto check_step = [&](bool evict_now) {
      if (!evict_now) return;
      std::vector<std::int32_t> before(lib.len);
      step_out o, o2;
      const kvevict::status s = run_step(bp, R, t, lib, o);
      INFO(std::string(s.message()));
      REQUIRE(s.ok());
      REQUIRE(run_step(bp, R, t, again, o2, &bscr.s).ok());
      CHECK(o.budgets == o2.budgets);  // deterministic, and the same with the caller's budget scratch
      CHECK(o.ip == o2.ip);
      CHECK(std::equal(o.idx.begin(), o.idx.begin() + o.ip.back(), o2.idx.begin()));
      // budgets: exact total, range, naive reference (temperature folded into the logits)
      std::int64_t sum = 0;
      for (std::int64_t b : o.budgets) {
        CHECK(b >= 0);
        CHECK(b <= t);
        sum += b;
      }
      CHECK(sum == static_cast<std::int64_t>(std::floor(R * static_cast<double>(N * t))));
      CHECK(o.budgets == naive_budgets(z, static_cast<double>(temp), R, t));
      lib.apply(o.ip, o.idx);
      again.apply(o2.ip, o2.idx);
      bool ragged = false;
      for (std::int64_t n = 0; n < N; ++n) {
        const std::size_t k = static_cast<std::size_t>(n);
        CAPTURE(n);
        CHECK(lib.len[k] == std::min<std::int64_t>(o.budgets[k], before[k]));
        naive_drop(naive[k], o.budgets[k]);
        REQUIRE(naive[k].size() == static_cast<std::size_t>(lib.len[k]));
        for (std::int64_t slot = 0; slot < lib.len[k]; ++slot) {
          const std::int64_t id = lib.id[static_cast<std::size_t>(n * lib.cap + slot)];
          CHECK(id == naive[k][static_cast<std::size_t>(slot)].id);  // same tokens, same (ascending) order
          if (slot > 0) CHECK(id > lib.id[static_cast<std::size_t>(n * lib.cap + slot - 1)]);
        }
        for (std::int64_t d = o.ip[k]; d < o.ip[k + 1]; ++d)
          if (d > o.ip[k]) CHECK(o.idx[static_cast<std::size_t>(d)] > o.idx[static_cast<std::size_t>(d - 1)]);
        if (lib.len[k] != lib.len[0]) ragged = true;
      }
      total_drops += o.ip.back();
      ragged_steps += ragged ? 1 : 0;
      tie_steps += ties ? 1 : 0;
    };
    // prefill: every head holds T0 tokens, then the first step
    for (std::int64_t i = 0; i < T0; ++i, ++t)
      for (std::int64_t n = 0; n < N; ++n) {
        const float v = draw();
        lib.append(n, v, t);
        again.append(n, v, t);
        naive[static_cast<std::size_t>(n)].push_back({v, t});
      }
    check_step(true);
    for (std::int64_t k = 1; k <= steps; ++k) {
      for (std::int64_t n = 0; n < N; ++n) {
        const float v = draw();
        lib.append(n, v, t);
        again.append(n, v, t);
        naive[static_cast<std::size_t>(n)].push_back({v, t});
      }
      ++t;  // tokens seen, the new one included
      check_step(k % interval == 0);
    }
  }
  MESSAGE("drops " << total_drops << ", steps with ragged heads " << ragged_steps << ", steps with tied utilities " << tie_steps);
  CHECK(total_drops > 1000);  // non-vacuous
  CHECK(ragged_steps > 10);
  CHECK(tie_steps > 10);
}

TEST_CASE("a mode-B step on an uncompressed cache keeps what evictor<lkv::full> keeps") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    prng g(seed);
    const int L = 3, H = 2, d = 4, hid = 8, T = 37 + static_cast<int>(seed);
    std::vector<float> z, w, K, V;
    for (int i = 0; i < L * H; ++i) z.push_back(g.sym(1.5));
    for (int i = 0; i < L * H * (hid * 2 * d + 2 * hid + 1); ++i) w.push_back(g.sym(0.6));
    for (int i = 0; i < L * H * T * d; ++i) K.push_back(g.sym(2.0)), V.push_back(g.sym(1.0));
    kvevict::lkv::full::params p = kvevict::lkv::full::defaults();
    p.scorer.weights = w.data();
    p.scorer.num_layers = L;
    p.scorer.kv_heads = H;
    p.scorer.head_dim = d;
    p.scorer.hidden = hid;
    p.budgeter = budgeter_of(z, L, H);
    kvevict::evictor<kvevict::lkv::full, kvevict::cpu::backend> ev(p);
    for (double R : {0.1, 0.3}) {
      CAPTURE(seed);
      CAPTURE(R);
      lib_cache c(L * H, T);
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          const std::size_t base = (static_cast<std::size_t>(l * H + h)) * static_cast<std::size_t>(T * d);
          std::vector<float> u(static_cast<std::size_t>(T));
          REQUIRE(kvevict::lkv::score_tokens(p.scorer, l, h, K.data() + base, V.data() + base, T, d, u.data()).ok());
          for (int s = 0; s < T; ++s) c.append(l * H + h, u[static_cast<std::size_t>(s)], s);
        }
      step_out o;
      REQUIRE(run_step(p.budgeter, R, T, c, o).ok());
      c.apply(o.ip, o.idx);
      std::int64_t evicted = 0;
      for (int l = 0; l < L; ++l) {
        kvevict::layer_inputs<float> in;
        in.keys = kvevict::make_kv_view<const float>(K.data() + static_cast<std::size_t>(l * H * T * d), 1, H, T, d, kvevict::kv_layout::hnd);
        in.values = kvevict::make_kv_view<const float>(V.data() + static_cast<std::size_t>(l * H * T * d), 1, H, T, d, kvevict::kv_layout::hnd);
        in.layer_idx = l;
        in.num_layers = L;
        const auto b = kvevict::budget_request::fraction(R);
        const std::int64_t n = ev.max_selected(in, b);
        REQUIRE(n >= 0);
        std::vector<std::int32_t> ip(static_cast<std::size_t>(H + 1)), idx(static_cast<std::size_t>(n + 1));
        kvevict::selection_view sel;
        sel.indptr = ip.data();
        sel.indices = idx.data();
        sel.capacity = n;
        REQUIRE(ev.run(in, b, sel).ok());
        for (int h = 0; h < H; ++h) {
          const std::size_t k = static_cast<std::size_t>(l * H + h);
          REQUIRE(ip[static_cast<std::size_t>(h + 1)] - ip[static_cast<std::size_t>(h)] == c.len[k]);
          for (int s = 0; s < c.len[k]; ++s)
            CHECK(c.id[k * static_cast<std::size_t>(T) + static_cast<std::size_t>(s)] == idx[static_cast<std::size_t>(ip[static_cast<std::size_t>(h)] + s)]);
          evicted += T - c.len[k];
        }
      }
      CHECK(evicted > 0);
    }
  }
}

TEST_CASE("mode B: errors name the parameter and its value") {
  std::vector<float> z{0.1f, 0.2f, -0.3f, 0.4f};
  const auto bp = budgeter_of(z, 2, 2);
  lib_cache c(4, 10);
  for (int n = 0; n < 4; ++n)
    for (int s = 0; s < 8; ++s) c.append(n, static_cast<float>(s % 3), s);
  step_out o;
  auto msg = [](const kvevict::status& s) { return std::string(s.message()); };
  CHECK(run_step(bp, 0.25, 8, c, o).ok());
  // score_tokens reads host weights only: device tables are refused, not dereferenced
  {
    std::vector<float> w(static_cast<std::size_t>(kvevict::scorers::learned_mlp::block_floats(2, 3)), 0.5f);
    kvevict::scorers::learned_mlp::params sp;
    sp.weights = w.data();
    sp.num_layers = 1;
    sp.kv_heads = 1;
    sp.head_dim = 2;
    sp.hidden = 3;
    const float kv[2] = {1.0f, 2.0f};
    float u = 0.0f;
    CHECK(kvevict::lkv::score_tokens(sp, 0, 0, kv, kv, 1, 2, &u).ok());
    CHECK(u != 0.0f);
    sp.on_device = true;
    const kvevict::status s = kvevict::lkv::score_tokens(sp, 0, 0, kv, kv, 1, 2, &u);
    CHECK(s.code() == kvevict::errc::invalid_argument);
    CHECK(msg(s).find("on_device = true") != std::string::npos);
  }
  // t smaller than a head's length
  {
    const kvevict::status s = run_step(bp, 0.25, 7, c, o);
    CHECK(s.code() == kvevict::errc::invalid_argument);
    CHECK(msg(s).find("cache.lengths[0] = 8") != std::string::npos);
    CHECK(msg(s).find("t = 7") != std::string::npos);
  }
  CHECK(run_step(bp, 0.25, -1, c, o).code() == kvevict::errc::invalid_argument);
  // bad fraction
  {
    const kvevict::status s = run_step(bp, 1.5, 8, c, o);
    CHECK(msg(s).find("keep_fraction = 1.5") != std::string::npos);
  }
  // bad budgeter
  {
    auto b2 = bp;
    b2.temperature = 0.0f;
    CHECK(msg(run_step(b2, 0.25, 8, c, o)).find("temperature") != std::string::npos);
    b2 = bp;
    b2.logits = nullptr;
    CHECK(run_step(b2, 0.25, 8, c, o).code() == kvevict::errc::null_pointer);
  }
  kvevict::lkv::decode_cache_view cv;
  cv.utilities = c.u.data();
  cv.utility_stride = c.cap;
  cv.lengths = c.len.data();
  std::vector<std::int64_t> budgets(4);
  std::vector<std::int32_t> ip(5), idx(64), scratch(16);
  kvevict::lkv::decode_step_buffers b;
  b.budgets = budgets.data();
  b.drop_indptr = ip.data();
  b.drop_indices = idx.data();
  b.drop_capacity = 3;  // 4 heads * 8 tokens, 25% kept: 24 drops
  b.scratch = scratch.data();
  b.scratch_size = 16;
  {
    const kvevict::status s = kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(0.25), 8, cv, b);
    CHECK(s.code() == kvevict::errc::insufficient_capacity);
    CHECK(msg(s).find("drop_capacity = 3 < 24") != std::string::npos);
  }
  b.drop_capacity = 64;
  b.scratch_size = 5;
  {
    const kvevict::status s = kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(0.25), 8, cv, b);
    CHECK(s.code() == kvevict::errc::insufficient_workspace);
    CHECK(msg(s).find("scratch_size = 5 < 8") != std::string::npos);
  }
  b.scratch_size = 16;
  cv.utility_stride = 6;
  CHECK(msg(kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(0.25), 8, cv, b)).find("utility_stride = 6") != std::string::npos);
  cv.utility_stride = c.cap;
  cv.lengths = nullptr;
  CHECK(kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(0.25), 8, cv, b).code() == kvevict::errc::null_pointer);
  cv.lengths = c.len.data();
  c.u[static_cast<std::size_t>(1 * c.cap + 5)] = std::nanf("");
  {
    const kvevict::status s = kvevict::lkv::decode_step(bp, kvevict::budget_request::fraction(0.25), 8, cv, b);
    CHECK(s.code() == kvevict::errc::non_finite_input);
    CHECK(msg(s).find("layer 0, kv_head 1: utilities[5]") != std::string::npos);
  }
  // both budget forms / none
  kvevict::budget_request both;
  both.keep_tokens = 2;
  both.keep_fraction = 0.5;
  CHECK(msg(kvevict::lkv::decode_budgets(bp, both, 8, budgets.data())).find("exactly one") != std::string::npos);
  CHECK(msg(kvevict::lkv::decode_budgets(bp, kvevict::budget_request{}, 8, budgets.data())).find("exactly one") != std::string::npos);
  // a budget scratch with a missing buffer
  kvevict::lkv::decode_budget_scratch bad;
  CHECK(kvevict::lkv::decode_budgets(bp, kvevict::budget_request::fraction(0.25), 8, budgets.data(), &bad).code() == kvevict::errc::null_pointer);
  CHECK(kvevict::lkv::prepare_decode_scratch(bp, bad).code() == kvevict::errc::null_pointer);
  // select_drops on its own
  std::int64_t k = -1;
  CHECK(kvevict::lkv::select_drops(c.u.data(), -2, 1, scratch.data(), idx.data(), &k).code() == kvevict::errc::invalid_argument);
  CHECK(kvevict::lkv::select_drops(c.u.data(), 4, 1, nullptr, idx.data(), &k).code() == kvevict::errc::null_pointer);
  CHECK(kvevict::lkv::select_drops(nullptr, 4, 4, nullptr, nullptr, &k).ok());  // nothing to drop: no buffers needed
  CHECK(k == 0);
}

TEST_CASE("engine: LKV mode B on stories260K keeps the invariants on the real cache (and mode A appends)") {
  using namespace kvevict_engine;
  const std::string dir = resolve_model_dir();
  if (!model_dir_exists(dir)) {
    MESSAGE("skipping: model folder " << dir << " missing (set KVEVICT_MODEL_DIR or provide ../shared/models/stories260K)");
    return;
  }
  const std::string art_path = std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
  kvevict::io::lkv_artifact art;
  if (const kvevict::status s = kvevict::io::read_lkv_artifact(art_path.c_str(), &art); !s.ok()) {
    MESSAGE("skipping: LKV artifact " << art_path << " unreadable: " << s.message());
    return;
  }
  model m;
  REQUIRE(load_model(model_file(dir), m));
  tokenizer tok;
  REQUIRE(tok.load(tokenizer_file(dir), m.cfg.vocab_size));
  const config& c = m.cfg;
  const std::vector<int> prompt = tok.encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
      "One day, she saw a big red ball under a tree. She ran to get it, but a dog took it first and ran away.");
  REQUIRE(prompt.size() > 40);
  const int steps = 64, N = c.n_layers * c.n_kv_heads, hd = c.head_dim();
  const auto sp = kvevict::io::scorer_params(art);
  const auto bp = kvevict::io::budgeter_params(art);
  for (int interval : {1, 5}) {
    for (double R : {0.1, 0.2}) {
      CAPTURE(interval);
      CAPTURE(R);
      lkv_decode_options o;
      o.mode = lkv_decode_mode::b;
      o.budget = kvevict::budget_request::fraction(R);
      o.interval = interval;
      lkv_session s(m, sp, bp, o, int(prompt.size()) + steps);
      // shadow: plain prefill() of the prompt; before every decoded token, a copy of the session's cache
      // run through plain forward(). The naive heads hold (utility, position); positions identify tokens.
      kv_cache shadow(c, int(prompt.size()) + steps);
      std::vector<std::vector<naive_tok>> naive(static_cast<std::size_t>(N));  // id = logical position
      std::vector<float> logits, lsh;
      {
        const result r = s.prefill(prompt, logits);
        INFO(r.error);
        REQUIRE(r);
      }
      REQUIRE(prefill(m, shadow, prompt, lsh));
      CHECK(logits == lsh);
      auto shadow_score = [&](int l, int h, int slot) {
        return kvevict::scorers::learned_mlp::utility(sp, l, h, shadow.key(l, h, slot), shadow.value(l, h, slot));
      };
      auto shadow_slot = [&](int l, int h, int position) {  // slots hold ascending positions
        const std::int32_t* p = shadow.positions(l) + std::int64_t(h) * shadow.position_head_stride();
        const std::int32_t* e = p + shadow.length(l, h);
        const std::int32_t* f = std::lower_bound(p, e, position);
        return f != e && *f == position ? int(f - p) : -1;
      };
      for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h)
          for (int p = 0; p < int(prompt.size()); ++p) naive[static_cast<std::size_t>(l * c.n_kv_heads + h)].push_back({shadow_score(l, h, p), p});
      std::int64_t drops = 0;
      bool ragged = false;
      auto verify = [&](bool evicted_now) {
        const std::int64_t t = s.tokens_seen();
        CHECK(t == shadow.next_position);
        CHECK(t == s.cache().next_position);
        if (evicted_now) {
          const std::vector<std::int64_t> nb = naive_budgets(art.logits, static_cast<double>(art.temperature), R, t);
          CHECK(s.budgets() == nb);
          std::int64_t sum = 0;
          for (std::int64_t b : s.budgets()) sum += b;
          CHECK(sum == static_cast<std::int64_t>(std::floor(R * double(N * t))));
          for (int n = 0; n < N; ++n) {
            const std::size_t before = naive[size_t(n)].size();
            naive_drop(naive[size_t(n)], s.budgets()[size_t(n)]);
            CHECK(std::int64_t(naive[size_t(n)].size()) == std::min<std::int64_t>(s.budgets()[size_t(n)], std::int64_t(before)));
          }
        }
        const kv_cache& kc = s.cache();
        for (int l = 0; l < c.n_layers; ++l)
          for (int h = 0; h < c.n_kv_heads; ++h) {
            const auto& nh = naive[size_t(l * c.n_kv_heads + h)];
            CAPTURE(l);
            CAPTURE(h);
            REQUIRE(kc.length(l, h) == int(nh.size()));
            if (kc.length(l, h) != kc.length(0, 0)) ragged = true;
            for (int slot = 0; slot < kc.length(l, h); ++slot) {
              CHECK(kc.position(l, h, slot) == nh[size_t(slot)].id);  // kept positions ascending and equal to the naive ones
              if (slot > 0) CHECK(kc.position(l, h, slot) > kc.position(l, h, slot - 1));
              const int q = shadow_slot(l, h, kc.position(l, h, slot));
              REQUIRE(q >= 0);
              CHECK(std::memcmp(kc.key(l, h, slot), shadow.key(l, h, q), sizeof(float) * size_t(hd)) == 0);
              CHECK(std::memcmp(kc.value(l, h, slot), shadow.value(l, h, q), sizeof(float) * size_t(hd)) == 0);
              CHECK(s.utility(l, h, slot) == nh[size_t(slot)].u);  // stored utility moved with its slot
            }
          }
      };
      verify(true);
      // the layer-wise prefill keeps what a plain prefill + eviction keeps
      {
        lkv_decode_options o2 = o;
        o2.layerwise = false;
        lkv_session s2(m, sp, bp, o2, int(prompt.size()) + steps);
        std::vector<float> l2;
        REQUIRE(s2.prefill(prompt, l2));
        CHECK(l2 == logits);
        for (int l = 0; l < c.n_layers; ++l)
          for (int h = 0; h < c.n_kv_heads; ++h) {
            REQUIRE(s2.cache().length(l, h) == s.cache().length(l, h));
            for (int slot = 0; slot < s.cache().length(l, h); ++slot) CHECK(s2.cache().position(l, h, slot) == s.cache().position(l, h, slot));
          }
        CHECK(s.peak_kv_tokens() < s2.peak_kv_tokens());
      }
      int next = argmax(logits);
      for (int k = 1; k <= steps; ++k) {
        shadow = s.cache();  // the state the naive rule left (verified above)
        const result r = s.decode(next, logits);
        INFO(r.error);
        REQUIRE(r);
        REQUIRE(forward(m, shadow, next, lsh));
        CHECK(lsh == logits);  // the session's forward saw exactly this cache
        for (int l = 0; l < c.n_layers; ++l)
          for (int h = 0; h < c.n_kv_heads; ++h) {
            const int q = shadow.length(l, h) - 1;  // the new token
            naive[size_t(l * c.n_kv_heads + h)].push_back({shadow_score(l, h, q), shadow.position(l, h, q)});
          }
        const bool now = k % interval == 0;
        if (now) drops += s.last_drops();
        verify(now);
        next = argmax(logits);
      }
      CHECK(drops > 0);  // non-vacuous: decoding evicted
      CHECK(ragged);
      MESSAGE("mode B, R = " << R << ", interval " << interval << ": " << drops << " slots dropped while decoding " << steps
                             << " tokens; KV tokens now " << s.kv_tokens() << ", peak " << s.peak_kv_tokens());
    }
  }
  // mode A: budgets fixed at prefill, every generated token appended to every head
  lkv_decode_options o;
  o.mode = lkv_decode_mode::a;
  o.budget = kvevict::budget_request::fraction(0.1);
  lkv_session s(m, sp, bp, o, int(prompt.size()) + steps);
  std::vector<float> logits;
  REQUIRE(s.prefill(prompt, logits));
  std::vector<int> after(static_cast<std::size_t>(N));
  for (int n = 0; n < N; ++n) after[size_t(n)] = s.cache().length(n / c.n_kv_heads, n % c.n_kv_heads);
  const std::int64_t kept0 = s.kv_tokens();
  CHECK(kept0 == static_cast<std::int64_t>(std::floor(0.1 * double(N) * double(prompt.size()))));
  for (int k = 1; k <= 16; ++k) {
    REQUIRE(s.decode(argmax(logits), logits));
    for (int n = 0; n < N; ++n) CHECK(s.cache().length(n / c.n_kv_heads, n % c.n_kv_heads) == after[size_t(n)] + k);
  }
  CHECK(s.kv_tokens() == kept0 + 16 * N);
  // mode B with a protected prefix and recent window (kvevict::decode_schedule's protection): every head
  // keeps the first 3 and the last 4 tokens, and holds at least 7 (min_budget); the budgets still sum to
  // max(floor(R N t), 7 N)
  for (int interval : {1, 3}) {
    CAPTURE(interval);
    lkv_decode_options po;
    po.mode = lkv_decode_mode::b;
    po.budget = kvevict::budget_request::fraction(0.1);
    po.interval = interval;
    po.protect_prefix = 3;
    po.protect_recent = 4;
    lkv_session ps(m, sp, bp, po, int(prompt.size()) + steps);
    std::vector<float> pl;
    REQUIRE(ps.prefill(prompt, pl));
    std::int64_t t = std::int64_t(prompt.size());
    int checked = 0;
    for (int k = 0; k <= 24; ++k) {
      const bool stepped = k == 0 || k % interval == 0;
      for (int n = 0; n < N; ++n) {
        const int l = n / c.n_kv_heads, h = n % c.n_kv_heads, len = ps.cache().length(l, h);
        REQUIRE(len >= 7);
        for (int j = 0; j < 3; ++j) CHECK(ps.cache().position(l, h, j) == j);
        for (int j = 0; j < 4; ++j) CHECK(ps.cache().position(l, h, len - 1 - j) == t - 1 - j);
        if (stepped) CHECK(ps.budgets()[size_t(n)] >= 7);
        ++checked;
      }
      if (stepped)
        CHECK(ps.kv_tokens() == std::max<std::int64_t>(static_cast<std::int64_t>(std::floor(0.1 * double(N) * double(t))), 7 * N));
      if (k == 24) break;
      REQUIRE(ps.decode(argmax(pl), pl));
      ++t;
    }
    CHECK(checked == 25 * N);
  }
  lkv_decode_options pbad = o;
  pbad.protect_recent = -1;
  lkv_session psb(m, sp, bp, pbad, 8);
  CHECK(psb.prefill(prompt, logits).error.find("protect_recent = -1") != std::string::npos);
  // errors
  lkv_decode_options bad = o;
  bad.mode = lkv_decode_mode::b;
  bad.interval = 0;
  lkv_session sb(m, sp, bp, bad, 8);
  CHECK(sb.prefill(prompt, logits).error.find("interval = 0") != std::string::npos);
  CHECK(s.prefill(prompt, logits).error.find("already holds") != std::string::npos);
}
