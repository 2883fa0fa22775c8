#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the libFuzzer target tests/fuzz/fuzz_evictor.cpp with clang (+ ASan + UBSan) and run it
# for a bounded time from the committed seed corpus tests/fuzz/corpus (read-only: new inputs go
# to the build folder). Any crash, sanitizer report or invariant violation fails the run and
# leaves the reproducer in $FUZZ_BUILD_DIR/artifacts/ (re-run: fuzz_evictor <file>).
#
#   scripts/ci_fuzz.sh                                 # 60 s from seed 1 (CI: reproducible)
#   FUZZ_SEED=0 FUZZ_SECONDS=3600 scripts/ci_fuzz.sh   # exploration: a random seed, 1 hour
#
# CI's run is a gate, so it is reproducible: a fixed libFuzzer seed (FUZZ_SEED, default 1) makes
# the sequence of inputs the same for the same binary (same clang and flags); a slower machine
# only stops earlier in it.
# Developers run the same seed for longer, and random seeds (FUZZ_SEED=0) to explore; every
# input found that way becomes a regression seed in tests/fuzz/corpus (make_seeds.py).
# docs/failure-kinds.md, "Fuzzing".
#
# Environment: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_SECONDS (default 60), FUZZ_SEED (default
# 1; 0 = random), FUZZ_CXX (default clang++-14, else clang++), JOBS (default nproc). Needs clang
# and the compiler-rt fuzzer runtime (Debian: clang-14 libclang-rt-14-dev; scripts/setup.sh
# installs both). ccache as in scripts/test.sh (scripts/build_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
SECS=${FUZZ_SECONDS:-60}
SEED=${FUZZ_SEED:-1}
JOBS=${JOBS:-$(nproc)}
if [ -z "${FUZZ_CXX:-}" ]; then
  if command -v clang++-14 >/dev/null 2>&1; then FUZZ_CXX=clang++-14; else FUZZ_CXX=clang++; fi
fi
t0=$(date +%s)
. scripts/build_env.sh "$BUILD_DIR"
cmake -S tests/fuzz -B "$BUILD_DIR" "${KVEVICT_CMAKE_ARGS[@]}" -DCMAKE_CXX_COMPILER="$FUZZ_CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target fuzz_evictor
t1=$(date +%s)
mkdir -p "$BUILD_DIR/corpus" "$BUILD_DIR/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# With a fixed seed, start from the committed corpus alone: inputs kept from an earlier run would
# change what the seed does. A random-seed exploration keeps building on build-fuzz/corpus.
if [ "$SEED" != 0 ]; then rm -rf "$BUILD_DIR/corpus" && mkdir -p "$BUILD_DIR/corpus"; fi
"$BUILD_DIR/fuzz_evictor" -seed="$SEED" -max_total_time="$SECS" -timeout=20 -rss_limit_mb=2048 -max_len=1024 \
  -print_final_stats=1 -artifact_prefix="$BUILD_DIR/artifacts/" "$BUILD_DIR/corpus" tests/fuzz/corpus
t2=$(date +%s)
echo "ci_fuzz: build $((t1 - t0)) s, fuzzing $((t2 - t1)) s (seed $SEED)"
