#!/usr/bin/env bash
# Build and run kvevict's CPU benchmarks, then write the results section of
# docs/performance.md (between the "BEGIN/END GENERATED" markers; the rest of the file is
# hand-written and kept).
#
#   scripts/run_bench.sh                 # full suite (~5-10 min on 2 cores)
#   KVEVICT_BENCH_FILTER='L:1024' scripts/run_bench.sh   # a subset (regex on benchmark names)
#
# Environment:
#   KVEVICT_BENCH_BUILD     build folder            (default: build-bench-release)
#   KVEVICT_BENCH_MIN_TIME  --benchmark_min_time s  (default: 0.3; the 32k runs and the
#                           straightforward reference use fixed small iteration counts)
#   KVEVICT_BENCH_FILTER    --benchmark_filter      (default: all)
#   KVEVICT_BENCH_DOC       markdown file to update (default: docs/performance.md)
#   KVEVICT_BENCH_JSON      reuse this JSON instead of building and running (report only); the
#                           target check is read from the same name with .json -> _target.json
#   KVEVICT_BENCH_REPS      repetitions of the target check (default 7; 0 skips it): the ReST-KV
#                           scorer at L >= 8k and its limit GEMM, randomly interleaved so that
#                           both sample the same stretch of time (a shared machine's load moves
#                           the rates of a single pass by +-30 %), compared by their medians
#   OMP_NUM_THREADS         threads of kvevict's CPU backend (default: all cores)
#   OMP_WAIT_POLICY         default passive: idle OpenMP threads sleep instead of spinning, so
#                           the process CPU time (cpu_time) counts work, not waiting
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${KVEVICT_BENCH_BUILD:-$ROOT/build-bench-release}"
MIN_TIME="${KVEVICT_BENCH_MIN_TIME:-0.3}"
FILTER="${KVEVICT_BENCH_FILTER:-.}"
DOC="${KVEVICT_BENCH_DOC:-$ROOT/docs/performance.md}"
JSON="${KVEVICT_BENCH_JSON:-}"
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a)"

if [[ -z "$JSON" ]]; then
  JSON="$BUILD/bench_cpu.json"
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-march=native" \
        -DKVEVICT_BUILD_BENCH=ON -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF \
        -DKVEVICT_ENABLE_CUDA=OFF -DKVEVICT_BUILD_PYTHON=OFF >/dev/null
  cmake --build "$BUILD" --target kvevict_bench_cpu -j "$(nproc)"
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
  T0=$(date +%s)
  "$BUILD/bench/cpu/kvevict_bench_cpu" --benchmark_min_time="$MIN_TIME" --benchmark_filter="$FILTER" \
      --benchmark_out="$JSON" --benchmark_out_format=json --benchmark_counters_tabular=false
  echo "benchmarks took $(( $(date +%s) - T0 )) s"
  REPS="${KVEVICT_BENCH_REPS:-7}"
  if [[ "$REPS" -gt 0 ]]; then
    T0=$(date +%s)
    "$BUILD/bench/cpu/kvevict_bench_cpu" --benchmark_min_time="$MIN_TIME" \
        --benchmark_filter='^(score_reconstruction/.*/L:(8192|16384|32768)|limit_gemm_heads)/' \
        --benchmark_repetitions="$REPS" --benchmark_enable_random_interleaving=true \
        --benchmark_out="${JSON%.json}_target.json" --benchmark_out_format=json --benchmark_counters_tabular=false
    echo "target check took $(( $(date +%s) - T0 )) s"
  else
    rm -f "${JSON%.json}_target.json"
  fi
fi
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a)"
if [[ -n "${KVEVICT_BENCH_JSON:-}" ]]; then  # report re-rendered from a saved run
  LOAD_BEFORE="n/a (re-rendered from a saved JSON)"; LOAD_AFTER="n/a"
fi

export KB_JSON="$JSON" KB_JSON_TARGET="${JSON%.json}_target.json" KB_DOC="$DOC" KB_LOAD_BEFORE="$LOAD_BEFORE" KB_LOAD_AFTER="$LOAD_AFTER"
export KB_CPU="$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
export KB_CORES="$(nproc)"
export KB_COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
export KB_CXX="$(grep -m1 '^CMAKE_CXX_COMPILER:' "$BUILD/CMakeCache.txt" 2>/dev/null | cut -d= -f2) $( ("$(grep -m1 '^CMAKE_CXX_COMPILER:' "$BUILD/CMakeCache.txt" 2>/dev/null | cut -d= -f2)" --version 2>/dev/null || true) | head -1)"

python3 - <<'PY'
import json, os, re, datetime

data = json.load(open(os.environ["KB_JSON"]))
ctx = data.get("context", {})
runs = {}
for b in data["benchmarks"]:
    if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
        continue
    name = b["name"]
    unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
    b["sec"] = b["real_time"] * unit  # wall clock per iteration
    b["cpu"] = b["cpu_time"] * unit   # CPU time of the whole process per iteration
    parts = name.split("/")
    key = parts[0] if not parts[0].startswith("gemm_") else parts[0] + "/" + parts[1]  # gemm_qk/<library>
    dtype = parts[1] if len(parts) > 1 and parts[1] in ("f32", "bf16") else ""
    m = re.search(r"/(?:L|cache):(\d+)", name)
    arg = int(m.group(1)) if m else 0
    runs[(key, dtype, arg)] = b

def get(key, dtype="", arg=0):
    return runs.get((key, dtype, arg))

def rate(b, field, t="sec"):
    return b[field] / b[t] if b and b.get(field) and b.get(t) else 0.0

LIM = {}
for t in ("sec", "cpu"):  # limits per wall second and per CPU second
    LIM[t] = {"bw": max([rate(get(k), "bytes", t) for k in ("limit_stream_copy", "limit_stream_triad")] + [0.0]),
              "gemm": max([rate(get(k), "flops", t) for k in ("limit_gemm_square", "limit_gemm_heads", "limit_gemm_qk")] + [0.0]),
              "heads": rate(get("limit_gemm_heads"), "flops", t), "qk": rate(get("limit_gemm_qk"), "flops", t)}
bw, gemm = LIM["sec"]["bw"], LIM["sec"]["gemm"]

# The Eigen GEMM whose shape matches a benchmark's dominant product (brief: "Eigen GEMM at a
# comparable shape"); benchmarks without one use the peak GEMM.
shape_of = {"score_reconstruction": "heads", "score_reconstruction_drift": "heads", "preset_restkv": "heads",
            "restkv_scoring_kvevict": "heads", "window_attention": "qk", "score_attention_weight": "qk",
            "preset_snapkv": "qk", "preset_adakv": "qk", "preset_h2o": "qk"}

def bound(b, key=None, t="sec"):
    """(fraction of the roofline limit, which limit) for a run with bytes/flops counters.
    key given: the compute limit is the comparable-shape GEMM of that benchmark; else the peak.
    t = "sec": wall-clock times; t = "cpu": process CPU times (runs and limits alike)."""
    lim = LIM[t]
    g = lim.get(shape_of.get(key, ""), 0.0) if key else 0.0
    g = g or lim["gemm"]
    tb = b.get("bytes", 0) / lim["bw"] if lim["bw"] else 0.0
    tf = b.get("flops", 0) / g if g else 0.0
    tm = max(tb, tf)
    return (tm / b[t] if b[t] > 0 else 0.0), ("compute" if tf >= tb else "memory")

def ms(s): return f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:,.0f}"
def si(x, unit=""):
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f: return f"{x / f:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"
def mib(x): return f"{x / 2**20:,.1f} MiB"

out = []
now = ctx.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
out.append(f"Measured {now} on **{os.environ.get('KB_CPU') or 'unknown CPU'}**, "
           f"{os.environ['KB_CORES']} cores, kvevict threads = {ctx.get('kvevict_threads', '?')}, "
           f"Eigen SIMD: {ctx.get('eigen_simd', '?')}; compiler: {os.environ.get('KB_CXX', '').strip() or 'n/a'} "
           f"(Release, -march=native); commit {os.environ['KB_COMMIT']}. Load average before/after the run: "
           f"{os.environ['KB_LOAD_BEFORE']} / {os.environ['KB_LOAD_AFTER']} (a loaded machine inflates every "
           f"wall-clock time below). Heap counter: {ctx.get('alloc_counter', '?')}.")
out.append("")
out.append("### Limits (same run)")
out.append("")
out.append("| limit | measured |")
out.append("|---|---|")
for k, lab, f, u in (("limit_stream_copy", "stream copy (128 MiB arrays)", "bytes", "B/s"),
                     ("limit_stream_triad", "stream triad (128 MiB arrays)", "bytes", "B/s"),
                     ("limit_gemm_square", "Eigen GEMM 2048^3 fp32", "flops", "FLOP/s"),
                     ("limit_gemm_heads", "Eigen GEMM 32 x (4096x128)(128x128), LOR shape", "flops", "FLOP/s"),
                     ("limit_gemm_qk", "Eigen GEMM 32 x (32x128)(128x4096), window-attention shape", "flops", "FLOP/s")):
    b = get(k)
    if b: out.append(f"| {lab} | {si(rate(b, f), u)} |")
out.append(f"| **bandwidth limit** (max of the streams) | **{si(bw, 'B/s')}** |")
out.append(f"| **GEMM limit** (max of the GEMMs) | **{si(gemm, 'FLOP/s')}** |")
out.append("")

# --- the scorers' GEMMs against the machine's BLAS libraries (bench/cpu/bench_blas.cpp) ------
glibs = sorted({k.split("/", 1)[1] for (k, _, _) in runs if k.startswith("gemm_qk/")})
mine = [g for g in glibs if g.startswith("kvevict_")]
if mine:
    others = [g for g in glibs if not g.startswith("kvevict_")]
    out.append("### The scorers' GEMMs against the machine's BLAS (same run)")
    out.append("")
    out.append("GFLOP/s of the two products at the exact shapes and tiles the scorers use, the 8 KV heads over the "
               "plan's threads, one single-threaded product per head (bench/cpu/bench_blas.cpp): *qk* the window "
               "logits (128 x 128) x (128 x L) in tiles of 1024 keys, *vr* ReST-KV's value projections (L x 128) x "
               f"(128 x 512) in tiles of 256 tokens. {mine[0]} is the call the scorers make; the others are "
               "cblas_sgemm of each installed library (dlopen, one thread). Fraction = kvevict / the fastest library.")
    out.append("")
    out.append("| product | L | " + " | ".join(mine + others) + " | kvevict / fastest |")
    out.append("|---|---|" + "---|" * (len(mine) + len(others) + 1))
    for prod in ("gemm_qk", "gemm_vr"):
        for L in sorted({a for (k, _, a) in runs if k.startswith(prod + "/")}):
            r = {g: rate(get(prod + "/" + g, "", L), "flops") for g in mine + others}
            best = max([r[g] for g in others] + [0.0])
            frac = f"{r[mine[0]] / best:.2f}" if best > 0 else "-"
            out.append(f"| {prod[5:]} | {L} | " + " | ".join(f"{r[g] / 1e9:.1f}" if r[g] else "-" for g in mine + others)
                       + f" | {frac} |")
    out.append("")

# --- stage table -------------------------------------------------------------------------
out.append("### Stages and presets")
out.append("")
out.append("Fraction = max(bytes / bandwidth limit, flops / GEMM rate) / measured time: the share of the roofline "
           "bound reached (1.0 = at the limit). Bound = which term of the max applies. *Fraction (shape)* uses the "
           "Eigen GEMM of the benchmark's dominant product shape (LOR: 32 x (4096x128)(128x128); window attention: "
           "32 x (32x128)(128x4096)); *fraction (peak)* uses the largest GEMM rate measured (2048^3 included), "
           "the stricter of the two. *CPU*: the same shape fraction from process CPU time (all threads) for the "
           "run and for the limits: how efficiently the CPU time that the run got was used, much less sensitive "
           "to the machine's load than wall time.")
out.append("")
out.append("| benchmark | dtype | L | time ms | CPU ms | tokens/s | GB/s | GFLOP/s | bound | fraction (shape) | fraction (peak) | fraction (shape, CPU) |")
out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
order = ["window_attention", "score_attention_weight", "score_reconstruction", "score_reconstruction_drift",
         "smooth_avg_pool", "smooth_adaptive_window", "budget_adakv", "select_topk", "compact",
         "preset_restkv", "preset_snapkv", "preset_adakv", "preset_lkv", "preset_h2o"]
for k in order:
    for dt in ("f32", "bf16"):
        for (kk, dd, L), b in sorted(runs.items(), key=lambda x: x[0][2]):
            if kk != k or dd != dt: continue
            fr, bd = bound(b, k)
            fp, _ = bound(b)
            fc, _ = bound(b, k, "cpu")
            out.append(f"| {k} | {dt} | {L} | {ms(b['sec'])} | {ms(b['cpu'])} | {si(b['tokens'] / b['sec'])} | "
                       f"{b['bytes'] / b['sec'] / 1e9:.3g} | {b['flops'] / b['sec'] / 1e9:.3g} | {bd} | {fr:.2f} | {fp:.2f} | {fc:.2f} |")
out.append("")

# --- reference -----------------------------------------------------------------------------
out.append("### ReST-KV scoring: kvevict vs the straightforward implementation (fp32, same run)")
out.append("")
out.append("| L | kvevict ms | straightforward ms | speedup (wall) | speedup (CPU time) | kvevict extra memory | straightforward extra memory | memory ratio | extra bytes / token (kvevict, straightforward) | max rel. diff |")
out.append("|---|---|---|---|---|---|---|---|---|---|")
ref_rows = {}
for (k, dt, L), b in sorted(runs.items(), key=lambda x: x[0][2]):
    if k != "restkv_scoring_reference": continue
    kv = get("restkv_scoring_kvevict", "f32", L)
    if not kv: continue
    sp = b["sec"] / kv["sec"]
    mr = b["extra_bytes"] / kv["extra_bytes"] if kv["extra_bytes"] else 0
    spc = b["cpu"] / kv["cpu"] if kv["cpu"] else 0
    ref_rows[L] = (sp, kv, b, spc)
    out.append(f"| {L} | {ms(kv['sec'])} | {ms(b['sec'])} | {sp:.1f}x | {spc:.1f}x | {mib(kv['extra_bytes'])} | {mib(b['extra_bytes'])} | "
               f"{mr:.1f}x | {kv['extra_bytes'] / L:,.0f}, {b['extra_bytes'] / L:,.0f} | {b.get('max_rel_diff', 0):.1e} |")
out.append("")

# --- decode ------------------------------------------------------------------------------------
out.append("### Decode step over the compacted vs the full cache (fp32, one query per q head)")
out.append("")
out.append("| cache tokens | threads: time ms | GB/s | speedup vs full 32k | 1 thread: time ms | GB/s | speedup vs full 32k |")
out.append("|---|---|---|---|---|---|---|")
full = get("decode_attention", "f32", 32768)
full1 = get("decode_attention_1thread", "f32", 32768)
def dec(b, f):
    if not b: return "n/a | n/a | n/a"
    sp = f"{f['sec'] / b['sec']:.1f}x" if f else "n/a"
    return f"{ms(b['sec'])} | {b['bytes'] / b['sec'] / 1e9:.3g} | {sp}"
for n in (32768, 2048, 1024, 512):
    b, b1 = get("decode_attention", "f32", n), get("decode_attention_1thread", "f32", n)
    if not b and not b1: continue
    out.append(f"| {n} | {dec(b, full)} | {dec(b1, full1)} |")
out.append("")

# --- eviction vs prefill ---------------------------------------------------------------------
out.append("### Whole-preset eviction of one layer vs that layer's prefill attention")
out.append("")
out.append("Prefill attention of a layer = (wall time of `threads` query heads' causal attention, one per thread) "
           "x (32 / threads).")
out.append("")
out.append("| L | prefill attention, layer (est.) ms | preset | dtype | eviction ms | eviction / prefill |")
out.append("|---|---|---|---|---|---|")
ratios = {}
for (k, dt, L), pb in sorted(runs.items(), key=lambda x: x[0][2]):
    if k != "prefill_attention": continue
    layer = pb["sec"] * pb.get("layer_scale", 1.0)
    for pk in ("preset_restkv", "preset_snapkv", "preset_adakv", "preset_lkv"):
        for pdt in ("f32", "bf16"):
            e = get(pk, pdt, L)
            if not e: continue
            ratios[(pk, pdt, L)] = e["sec"] / layer
            out.append(f"| {L} | {ms(layer)} | {pk[7:]} | {pdt} | {ms(e['sec'])} | {100 * e['sec'] / layer:.2f}% |")
out.append("")

# --- targets -------------------------------------------------------------------------------
out.append("### Targets")
out.append("")
def verdict(ok): return "**met**" if ok else "**missed**"
lines = []
fr = [(L, dt, bound(b, k)[0], bound(b)[0], bound(b, k, "cpu")[0]) for (k, dt, L), b in runs.items()
      if k == "score_reconstruction" and L >= 8192]
if fr:
    worst = min(fr, key=lambda x: x[2])
    worst_p = min(fr, key=lambda x: x[3])
    lines.append(f"- ReST-KV scoring (LOR scorer) at L >= 8k reaches >= 70% of the applicable limit (compute-bound: the "
                 f"Eigen GEMM of its dominant shape): {verdict(worst[2] >= 0.7)}; lowest {100 * worst[2]:.0f}% "
                 f"({worst[1]}, L = {worst[0]}); all: " + ", ".join(f"{dt} {L}: {100 * f:.0f}%" for L, dt, f, _, _ in sorted(fr))
                 + f". Against the peak GEMM rate (stricter): lowest {100 * worst_p[3]:.0f}%, all: "
                 + ", ".join(f"{dt} {L}: {100 * p:.0f}%" for L, dt, _, p, _ in sorted(fr))
                 + ". From process CPU time (load-insensitive), against the same-shape GEMM: "
                 + ", ".join(f"{dt} {L}: {100 * c:.0f}%" for L, dt, _, _, c in sorted(fr)) + ".")
if 8192 in ref_rows:
    sp, kv, b, spc = ref_rows[8192]
    lines.append(f"- >= 20x faster than the straightforward scoring at 8k: {verdict(sp >= 20)} by wall time ({sp:.1f}x); "
                 f"by process CPU time {spc:.1f}x ({'met' if spc >= 20 else 'missed'}).")
if len(ref_rows) >= 2:
    Ls = sorted(ref_rows)
    nt = float(ctx.get("kvevict_threads", 1) or 1)
    kpt = [ref_rows[L][1]["extra_bytes"] / L for L in Ls]
    rpt = [ref_rows[L][2]["extra_bytes"] / L for L in Ls]
    kf = [x / nt / 4 for x in kpt]  # fp32 words per token per thread
    rf = [x / nt / 4 for x in rpt]
    # Marginal cost per added token between the smallest and the largest L (a fixed scratch,
    # e.g. one 256-token projection tile, is not "growth with seq_len").
    L0, L1 = Ls[0], Ls[-1]
    km = (ref_rows[L1][1]["extra_bytes"] - ref_rows[L0][1]["extra_bytes"]) / (L1 - L0) / nt / 4
    rm = (ref_rows[L1][2]["extra_bytes"] - ref_rows[L0][2]["extra_bytes"]) / (L1 - L0) / nt / 4
    ok = km < 8 * 128 and rm > 4096 * 0.9
    lines.append("- Extra memory grows with seq_len, not seq_len x hidden: " + verdict(ok) + ". Bytes per token at L = "
                 + ", ".join(str(L) for L in Ls) + ": kvevict " + ", ".join(f"{x:,.0f}" for x in kpt)
                 + "; straightforward " + ", ".join(f"{x:,.0f}" for x in rpt) + f". Per token and thread that is "
                 f"{min(kf):,.0f}-{max(kf):,.0f} floats for kvevict (K and V staging, logits and weights of G x 32 window rows, score rows; V R^T "
                 f"only for one 256-token tile) "
                 f"vs {min(rf):,.0f}-{max(rf):,.0f} floats for the straightforward scorer (C = 4096: the L x C "
                 f"projection); per ADDED token (L = {L0:,} -> {L1:,}) {km:,.0f} vs {rm:,.0f} floats per thread, so "
                 f"kvevict's memory grows with seq_len x a few head_dim, the straightforward one with seq_len x hidden "
                 f"(criterion: < 8 x 128 vs > 0.9 x 4096); the PyTorch reference would hold 32 heads' projections at once "
                 f"(32 x 4096 floats = 512 KiB per token).")
r32 = [(k, dt, v) for (k, dt, L), v in ratios.items() if L == 32768 and k == "preset_restkv"]
if r32:
    worst = max(r32, key=lambda x: x[2])
    lines.append(f"- Whole-preset (ReST-KV) eviction at 32k < 5% of one layer's prefill attention: {verdict(worst[2] < 0.05)} "
                 f"(" + ", ".join(f"{dt} {100 * v:.2f}%" for _, dt, v in sorted(r32)) + ").")
out.extend(lines or ["- (no target benchmarks in this run)"])
out.append("")

# --- target check: interleaved repetitions -----------------------------------------------------
tj = os.environ.get("KB_JSON_TARGET", "")
if tj and os.path.exists(tj):
    reps = {}
    for b in json.load(open(tj))["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
        reps.setdefault(b["run_name"], []).append((b["real_time"] * unit, b["cpu_time"] * unit, b.get("flops", 0.0)))
    def med(xs):
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    lim = [v for k, v in reps.items() if k.startswith("limit_gemm_heads")]
    if lim:
        lim = lim[0]
        lrate = med([f / t for t, _, f in lim])
        lrate_c = med([f / c for _, c, f in lim])
        out.append("### Target check: ReST-KV scoring vs its limit GEMM, interleaved repetitions")
        out.append("")
        out.append(f"A second pass over only these benchmarks, {len(lim)} repetitions each in random order "
                   "(`--benchmark_enable_random_interleaving`), so that the scorer and the GEMM it is compared with "
                   "sample the same stretch of time; rates are medians over the repetitions. Limit (same-shape Eigen "
                   f"GEMM): median {lrate / 1e9:.0f} GFLOP/s (range {min(f / t for t, _, f in lim) / 1e9:.0f}-"
                   f"{max(f / t for t, _, f in lim) / 1e9:.0f}); per CPU second {lrate_c / 1e9:.0f}.")
        out.append("")
        out.append("| benchmark | dtype | L | median ms | median GFLOP/s | fraction of the limit (medians) | range over repetitions | fraction (CPU time) |")
        out.append("|---|---|---|---|---|---|---|---|")
        worst = None
        rows_t = sorted((k.split("/")[1], int(re.search(r"L:(\d+)", k).group(1)), v) for k, v in reps.items()
                        if k.startswith("score_reconstruction/"))
        for dt, L, v in rows_t:
            r = med([f / t for t, _, f in v])
            rc = med([f / c for _, c, f in v])
            fr, frc = r / lrate, rc / lrate_c
            lo, hi = min(f / t for t, _, f in v) / lrate, max(f / t for t, _, f in v) / lrate
            worst = min(worst or (fr, dt, L), (fr, dt, L))
            out.append(f"| score_reconstruction | {dt} | {L} | {ms(med([t for t, _, _ in v]))} | {r / 1e9:.0f} | "
                       f"**{100 * fr:.0f}%** | {100 * lo:.0f}-{100 * hi:.0f}% | {100 * frc:.0f}% |")
        out.append("")
        if worst:
            out.append(f"- Target (ReST-KV scoring at L >= 8k >= 70% of the same-shape GEMM), from the medians: "
                       f"{verdict(worst[0] >= 0.7)}; lowest {100 * worst[0]:.0f}% ({worst[1]}, L = {worst[2]}).")
            out.append("")

body = "\n".join(out)
doc = os.environ["KB_DOC"]
begin, end = "<!-- BEGIN GENERATED (scripts/run_bench.sh) -->", "<!-- END GENERATED -->"
text = open(doc).read() if os.path.exists(doc) else f"# kvevict performance\n\n{begin}\n{end}\n"
if begin not in text or end not in text:
    text = text.rstrip() + f"\n\n## Results\n\n{begin}\n{end}\n"
pre, rest = text.split(begin, 1)
_, post = rest.split(end, 1)
open(doc, "w").write(pre + begin + "\n" + body + "\n" + end + post)
print(body)
print(f"\nwrote {doc}")
PY
