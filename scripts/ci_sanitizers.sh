#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the whole CPU test suite a second time under AddressSanitizer + UndefinedBehaviorSanitizer
# and run it with ctest (failure kinds: docs/failure-kinds.md). CUDA is excluded.
#
#   scripts/ci_sanitizers.sh
#
# Environment: SAN_BUILD_DIR (default build-sanitizers), JOBS (default nproc), SAN_CXX (default
# clang++-14 when installed, else g++: clang's -fsanitize=undefined also checks float->int
# overflow, which GCC's does not).
# Only the test executables are built (not the examples or benchmarks): the list comes from
# ctest itself, so a new test area is picked up without editing this script.
# Flags: -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer, -O1 -g,
# asserts ON (no NDEBUG: Eigen's and kvevict's internal assertions run too).
# Suppressions: none. Any report fails the run (halt_on_error, -fno-sanitize-recover=all).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SAN_BUILD_DIR:-build-sanitizers}
JOBS=${JOBS:-$(nproc)}
if [ -z "${SAN_CXX:-}" ]; then
  if command -v clang++-14 >/dev/null 2>&1; then SAN_CXX=clang++-14; else SAN_CXX=g++; fi
fi
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
t0=$(date +%s)

cmake -S . -B "$BUILD_DIR" \
  -DCMAKE_CXX_COMPILER="$SAN_CXX" \
  -DCMAKE_BUILD_TYPE=Sanitize \
  -DCMAKE_CXX_FLAGS_SANITIZE="-O1 -g" \
  -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DKVEVICT_ENABLE_CUDA=OFF \
  -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF >/dev/null

# Test executables = the first word of every ctest command (target names by convention).
targets=$(cd "$BUILD_DIR" && ctest --show-only=json-v1 | python3 -c '
import json, os, sys
seen = []
for t in json.load(sys.stdin).get("tests", []):
    cmd = t.get("command") or []
    if not cmd or "cuda" in t["name"].lower():
        continue
    name = os.path.basename(cmd[0])
    if name not in seen:
        seen.append(name)
print(" ".join(seen))')
if [ -z "$targets" ]; then
  echo "ci_sanitizers: no tests configured" >&2
  exit 1
fi
echo "ci_sanitizers: building with $SAN_CXX: $targets"
cmake --build "$BUILD_DIR" -j "$JOBS" --target $targets
t1=$(date +%s)

export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" -E '[Cc][Uu][Dd][Aa]')
t2=$(date +%s)
echo "ci_sanitizers: build $((t1 - t0)) s, tests $((t2 - t1)) s"
