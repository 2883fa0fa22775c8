#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the libFuzzer targets of tests/fuzz with clang (+ ASan + UBSan) and run each for a bounded
# time from its committed seed corpus (read-only: new inputs go to the build folder):
#   fuzz_evictor   tests/fuzz/corpus            every preset x storage type over the CPU API
#   fuzz_schedule  tests/fuzz/corpus_schedule   the decode-time eviction schedule
#   fuzz_paged     tests/fuzz/corpus_paged      compact_paged and union_selections over random page tables
#   fuzz_views     tests/fuzz/corpus_views      the evictor over paged / token-pool / cell views, corrupted tables, dense compact
#   fuzz_sharded   tests/fuzz/corpus_sharded    run_sharded over 1-4 in-process ranks, faults on one rank
# Any crash, sanitizer report or invariant violation fails the run and leaves the reproducer in
# $FUZZ_BUILD_DIR/artifacts/ (re-run: build-fuzz/<target> <file>).
#
#   scripts/ci_fuzz.sh                                          # CI: 25 + 5 + 5 + 12 + 12 s from seed 1
#   FUZZ_SEED=0 FUZZ_SECONDS=3600 scripts/ci_fuzz.sh fuzz_schedule  # one target, a random seed, 1 hour
#
# CI's run is a gate, so it is reproducible: a fixed libFuzzer seed (FUZZ_SEED, default 1) makes
# the sequence of inputs the same for the same binary (same clang and flags); a slower machine
# only stops earlier in it.
# Developers run the same seed for longer, and random seeds (FUZZ_SEED=0) to explore; every
# input found that way becomes a regression seed in the target's corpus (make_seeds*.py).
# docs/failure-kinds.md, "Fuzzing".
#
# Arguments: the targets to run (default: all). Environment: FUZZ_BUILD_DIR (default build-fuzz),
# FUZZ_SECONDS (every target's time; default 25 for fuzz_evictor, 5 each for fuzz_schedule and
# fuzz_paged, whose inputs run in microseconds (50,000-100,000 executions), 12 each for fuzz_views
# and fuzz_sharded: 59 s in all, as the 60 s of the three targets before), FUZZ_SEED (default 1; 0 = random), FUZZ_CXX (default clang++-14, else
# clang++), JOBS (default nproc). Needs clang and the compiler-rt fuzzer runtime (Debian: clang-14
# libclang-rt-14-dev; scripts/setup.sh installs both). ccache as in scripts/test.sh
# (scripts/build_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
SEED=${FUZZ_SEED:-1}
JOBS=${JOBS:-$(nproc)}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_evictor fuzz_schedule fuzz_paged fuzz_views fuzz_sharded)
if [ -z "${FUZZ_CXX:-}" ]; then
  if command -v clang++-14 >/dev/null 2>&1; then FUZZ_CXX=clang++-14; else FUZZ_CXX=clang++; fi
fi
t0=$(date +%s)
. scripts/build_env.sh "$BUILD_DIR"
cmake -S tests/fuzz -B "$BUILD_DIR" "${KVEVICT_CMAKE_ARGS[@]}" -DCMAKE_CXX_COMPILER="$FUZZ_CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"
t1=$(date +%s)
mkdir -p "$BUILD_DIR/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
report=""
for t in "${targets[@]}"; do
  case $t in
    fuzz_evictor) seeds=tests/fuzz/corpus; secs=${FUZZ_SECONDS:-25}; max_len=1024 ;;
    fuzz_schedule) seeds=tests/fuzz/corpus_schedule; secs=${FUZZ_SECONDS:-5}; max_len=1100 ;;
    fuzz_paged) seeds=tests/fuzz/corpus_paged; secs=${FUZZ_SECONDS:-5}; max_len=512 ;;
    fuzz_views) seeds=tests/fuzz/corpus_views; secs=${FUZZ_SECONDS:-12}; max_len=512 ;;
    fuzz_sharded) seeds=tests/fuzz/corpus_sharded; secs=${FUZZ_SECONDS:-12}; max_len=512 ;;
    *) echo "ci_fuzz: unknown target $t" >&2; exit 2 ;;
  esac
  work="$BUILD_DIR/corpus_$t"
  # With a fixed seed, start from the committed corpus alone: inputs kept from an earlier run would
  # change what the seed does. A random-seed exploration keeps building on build-fuzz/corpus_<target>.
  if [ "$SEED" != 0 ]; then rm -rf "$work"; fi
  mkdir -p "$work"
  ts=$(date +%s)
  "$BUILD_DIR/$t" -seed="$SEED" -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -max_len="$max_len" \
    -print_final_stats=1 -artifact_prefix="$BUILD_DIR/artifacts/" "$work" "$seeds"
  report="$report, $t $(( $(date +%s) - ts )) s"
done
echo "ci_fuzz: build $((t1 - t0)) s$report (seed $SEED)"
