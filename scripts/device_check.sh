#!/usr/bin/env bash
# One-command GPU check of the kvevict CUDA backend (H200 / sm_90), meant to finish in about
# 5-7 minutes on a 16-core machine:
#   1. configure with -DCMAKE_CUDA_ARCHITECTURES=90, build only test_cuda, bench_cuda and the
#      user-scorer example (examples/custom_policy_cuda.cu)
#   2. run the CUDA tests (full grid: every stage vs the CPU backend)
#   3. compute-sanitizer memcheck (KVEVICT_CUDA_TEST_GRID=small) and racecheck (=tiny)
#   4. run the CUDA benchmarks and print a table: per-stage time, achieved GB/s and the
#      fraction of the device-to-device copy bandwidth measured in the same run, at seq 4k,
#      32k, 128k (q_heads 32, kv_heads 8, head_dim 128, window 32, bf16)
#   5. the same ReST-KV scoring in plain PyTorch (bench/cuda/torch_restkv.py) as baseline:
#      time and peak-memory ratio (skipped when torch with CUDA is not importable)
#   6. decode benefit: one decoding step's attention (torch SDPA) over the full 32k cache vs
#      caches compacted to 2048 / 1024 / 512 tokens (bench/cuda/torch_decode.py)
# Every step has its own timeout; the script goes on after a failed step and exits non-zero
# at the end if any step failed. Outputs land in $OUT (or ./device_check_out).
# Usage: scripts/device_deps.sh (here, once), then through the device tool:
#   run(command="scripts/device_check.sh", carry=[".device-deps"], timeout_s=540)
# Usage: scripts/device_check.sh [build-dir]
set -u
cd "$(dirname "$0")/.."
BUILD=${1:-build-device}
OUTDIR=${OUT:-$PWD/device_check_out}
mkdir -p "$OUTDIR"
JOBS=$(nproc 2>/dev/null || echo 4)
FAILED=()
step() {  # step <name> <timeout_s> <command...>
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUTDIR/$name.log"
  echo "=== $name: rc=$rc, $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || FAILED+=("$name(rc=$rc)")
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1 | tee "$OUTDIR/gpu.txt"
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH

# A device machine starts bare: no Eigen, doctest or Google Benchmark, and ../shared does not
# travel. scripts/device_deps.sh (run on the dev machine) puts the Debian packages and the model
# into .device-deps/, which the device tool carries (carry: [".device-deps"]). Unpack them into
# .device-deps/root (never into /) and point CMake and the tests there.
CMAKE_DEPS=()
DEPS=$PWD/.device-deps
if ls "$DEPS"/debs/*.deb >/dev/null 2>&1; then
  mkdir -p "$DEPS/root"
  for f in "$DEPS"/debs/*.deb; do dpkg -x "$f" "$DEPS/root" || FAILED+=("unpack($f)"); done
  R=$DEPS/root/usr
  # Debian's doctest config hard-codes /usr/include: skip it; tests/CMakeLists.txt falls back to
  # find_path(doctest/doctest.h) on CMAKE_INCLUDE_PATH.
  CMAKE_DEPS=(-DCMAKE_PREFIX_PATH="$R;$R/lib/x86_64-linux-gnu/cmake;$R/share/eigen3/cmake"
              -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON -DCMAKE_INCLUDE_PATH="$R/include")
  export LD_LIBRARY_PATH="$R/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "using carried dependencies in $DEPS/root"
fi
[ -d "$DEPS/shared/models/stories260K" ] && export KVEVICT_MODEL_DIR="$DEPS/shared/models/stories260K"
[ -d "$DEPS/shared/data/text" ] && export KVEVICT_DATA_DIR="$DEPS/shared/data/text"

step configure 120 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_BENCH=ON -DKVEVICT_BUILD_PYTHON=OFF "${CMAKE_DEPS[@]}" || true
step build 300 cmake --build "$BUILD" -j"$JOBS" --target test_cuda bench_cuda kvevict_custom_policy_cuda || true

TEST=$BUILD/tests/backends/cuda/test_cuda
BENCH=$BUILD/bench/cuda/bench_cuda
if [ -x "$TEST" ]; then
  step test 200 "$TEST" || true
  if command -v compute-sanitizer >/dev/null; then
    step memcheck 150 env KVEVICT_CUDA_TEST_GRID=small compute-sanitizer --tool memcheck --error-exitcode 3 "$TEST" || true
    step racecheck 150 env KVEVICT_CUDA_TEST_GRID=tiny compute-sanitizer --tool racecheck --error-exitcode 3 "$TEST" || true
  else
    echo "compute-sanitizer not found"; FAILED+=("sanitizer(missing)")
  fi
fi
EXAMPLE=$BUILD/examples/kvevict_custom_policy_cuda
if [ -x "$EXAMPLE" ]; then
  step user_scorer_example 60 "$EXAMPLE" || true  # a user's scorer through cuda::scorer_impl
fi
if [ -x "$BENCH" ]; then
  step bench 150 "$BENCH" --benchmark_out="$OUTDIR/bench.json" --benchmark_out_format=json || true
fi
step torch 120 python3 bench/cuda/torch_restkv.py 4096 32768 131072 || true
step decode 60 python3 bench/cuda/torch_decode.py 32768 2048 1024 512 || true

python3 - "$OUTDIR" <<'EOF'
import json, os, sys
out = sys.argv[1]
try:
    data = json.load(open(os.path.join(out, "bench.json")))["benchmarks"]
except Exception as e:
    print("no benchmark results:", e); data = []
bw = None
rows = []
for b in data:
    if b.get("error_occurred"):
        print("benchmark error:", b["name"], b.get("error_message")); continue
    if b["name"].startswith("BM_d2d_copy"):
        bw = b["bytes"] / (b["real_time"] / 1e3) / 1e9  # real_time in ms (manual time)
    else:
        rows.append(b)
print(f"\nmeasured device-to-device copy bandwidth: {bw:.0f} GB/s (read + write)" if bw else "\nno D2D measurement")
hdr = f"{'benchmark':28s} {'total ms':>9s} {'plan':>7s} {'score':>8s} {'gqa+smooth':>10s} {'budget':>7s} {'select':>7s} {'GB/s':>8s} {'% of D2D':>8s} {'score GB/s':>10s} {'ws MB':>8s}"
print(hdr); print("-" * len(hdr))
print("(stage columns in ms; GB/s = K + V + Q bytes read once / time; '% of D2D' = GB/s / measured copy bandwidth)")
restkv_ms = {}
for b in rows:
    ms = b["real_time"]
    gbps = b["bytes"] / (ms / 1e3) / 1e9
    frac = f"{100 * gbps / bw:7.1f}%" if bw else "    n/a"
    st = [b.get(k, float("nan")) for k in ("plan_ms", "score_ms", "reduce_smooth_ms", "budget_ms", "select_ms")]
    name = b["name"].split("/iterations")[0].replace("/manual_time", "")
    sgb = b["bytes"] / (st[1] / 1e3) / 1e9 if st[1] == st[1] and st[1] > 0 else float("nan")
    print(f"{name:28s} {ms:9.3f} {st[0]:7.3f} {st[1]:8.3f} {st[2]:10.3f} {st[3]:7.3f} {st[4]:7.3f} {gbps:8.0f} {frac} {sgb:10.0f} {b.get('ws_MB', 0):8.1f}")
    if name.startswith("BM_run/restkv/"):
        restkv_ms[int(name.split("/")[-1])] = (ms, b.get("ws_MB", 0.0))
tl = os.path.join(out, "torch.log")
if os.path.exists(tl):
    print(f"\n{'ReST-KV scoring':28s} {'seq':>7s} {'kvevict ms':>10s} {'torch ms':>9s} {'speed-up':>8s} {'kvevict MB':>10s} {'torch MB':>9s} {'mem ratio':>9s}")
    for line in open(tl):
        line = line.strip()
        if not line.startswith("{"): continue
        r = json.loads(line)
        if "skip" in r: print("torch baseline skipped:", r["skip"]); break
        k = restkv_ms.get(r["seq"])
        if not k: continue
        print(f"{'':28s} {r['seq']:7d} {k[0]:10.3f} {r['ms']:9.3f} {r['ms'] / k[0]:8.1f} {k[1]:10.1f} {r['peak_MB']:9.1f} {r['peak_MB'] / max(k[1], 1e-9):9.1f}")
dl = os.path.join(out, "decode.log")
if os.path.exists(dl):
    print(f"\n{'decode step (torch SDPA)':28s} {'cache':>7s} {'ms':>9s} {'GB/s':>8s} {'speed-up':>8s}")
    for line in open(dl):
        line = line.strip()
        if not line.startswith("{"): continue
        r = json.loads(line)
        if "skip" in r: print("decode benchmark skipped:", r["skip"]); break
        print(f"{'':28s} {r['tokens']:7d} {r['ms']:9.4f} {r['GBps']:8.0f} {r['speedup']:8.1f}")
EOF

if [ ${#FAILED[@]} -ne 0 ]; then
  echo "device_check: FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "device_check: all steps passed"
