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
# Flags: -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer, -O1 with
# line tables only (clang -gline-tables-only, g++ -g1: reports are symbolised with file and line; no
# variable info, which no sanitizer report reads, and a third of the compile time of -g), asserts ON
# (no NDEBUG: Eigen's and kvevict's internal assertions run too).
# The translation units are the main build's: the tests link kvevict::compiled, built here once
# with the same sanitizer flags (docs/compiled-mode.md). ccache as in scripts/test.sh
# (scripts/build_env.sh).
# Suppressions: for LeakSanitizer only (written to $BUILD_DIR/lsan.supp below), two groups:
#   leak:___kmp_allocate
# Reason: LLVM's OpenMP runtime (libomp, clang's -fopenmp) allocates team/thread descriptors with
# its own ___kmp_allocate inside __kmpc_fork_call and keeps them for reuse; when a team size
# changes or a parallel region is entered from a std::thread that later exits, libomp drops the
# old descriptors without freeing them, and LSan reports them at exit (1440 bytes each, stack:
# malloc <- ___kmp_allocate <- __kmp_fork_call <- kvevict::cpu::detail::parallel_for). The
# pattern matches only allocations made BY libomp: a leak in kvevict code, even inside a parallel
# region, has no ___kmp_allocate frame and is still reported.
#   leak:libmpi.so leak:libopen-rte.so leak:libopen-pal.so leak:libevent_core leak:libevent-
#   leak:libhwloc.so leak:libpmix.so leak:mca_
# Reason: Open MPI (the tests/distributed binary) allocates its runtime state in MPI_Init and
# keeps part of it past MPI_Finalize: 3357 allocations, 122 KB with Open MPI 4.1.4, every stack
# through MPI_Init into these libraries or Open MPI's plugins (mca_*). The patterns match only
# allocations with a frame in Open MPI's own libraries; kvevict's exchange code has none.
# ASan and UBSan: no suppressions.
# Any report fails the run (halt_on_error, -fno-sanitize-recover=all).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SAN_BUILD_DIR:-build-sanitizers}
JOBS=${JOBS:-$(nproc)}
if [ -z "${SAN_CXX:-}" ]; then
  if command -v clang++-14 >/dev/null 2>&1; then SAN_CXX=clang++-14; else SAN_CXX=g++; fi
fi
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
case "$SAN_CXX" in *clang*) DBG=-gline-tables-only ;; *) DBG=-g1 ;; esac
t0=$(date +%s)

# Ninja builds the test targets in parallel; with Makefiles CMake's top-level Makefile is
# .NOTPARALLEL across targets, so the fallback below runs one `cmake --build` per target.
. scripts/build_env.sh "$BUILD_DIR"
cmake -S . -B "$BUILD_DIR" "${KVEVICT_CMAKE_ARGS[@]}" \
  -DCMAKE_CXX_COMPILER="$SAN_CXX" \
  -DCMAKE_BUILD_TYPE=Sanitize \
  -DCMAKE_CXX_FLAGS_SANITIZE="-O1 $DBG" \
  -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DKVEVICT_ENABLE_CUDA=OFF \
  -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_BUILD_PYTHON=OFF \
  -DKVEVICT_BLIS_TESTS=OFF >/dev/null

# Test executables = every ctest command that lives in the build folder (a target of ours; its
# basename is the target name). Read from the generated CTestTestfile.cmake files, so a new test
# area is picked up without editing this script; compile-only tests (failtests) and Python tests
# need no build.
targets=$(python3 - "$BUILD_DIR" <<'PY'
import os, re, sys
build = os.path.abspath(sys.argv[1])
seen = []
for root, _, files in os.walk(build):
    if "CTestTestfile.cmake" not in files:
        continue
    for line in open(os.path.join(root, "CTestTestfile.cmake")):
        m = re.match(r'add_test\(\[=\[(.*?)\]=\] "([^"]+)"', line)
        if not m or "cuda" in m.group(1).lower():
            continue
        exe = m.group(2)
        if exe.startswith(build + os.sep):
            name = os.path.basename(exe)
            if name not in seen:
                seen.append(name)
print(" ".join(seen))
PY
)
if [ -z "$targets" ]; then
  echo "ci_sanitizers: no tests configured" >&2
  exit 1
fi
echo "ci_sanitizers: building with $SAN_CXX: $targets"
if [ -f "$BUILD_DIR/build.ninja" ]; then
  cmake --build "$BUILD_DIR" -j "$JOBS" --target $targets
else
  cmake --build "$BUILD_DIR" --target kvevict_test_main  # the shared dependency first, once
  printf '%s\n' $targets | xargs -P "$JOBS" -I{} cmake --build "$BUILD_DIR" --target {}
fi
t1=$(date +%s)

printf 'leak:___kmp_allocate\nleak:libmpi.so\nleak:libopen-rte.so\nleak:libopen-pal.so\nleak:libevent_core\nleak:libevent-\nleak:libhwloc.so\nleak:libpmix.so\nleak:mca_\n' \
  > "$BUILD_DIR/lsan.supp"  # reasons: see the header of this script
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$(cd "$BUILD_DIR" && pwd)/lsan.supp:print_suppressions=0}
# fast_unwind_on_malloc=0: libomp has no frame pointers, so only the slow unwinder sees the
# ___kmp_allocate frame the suppression names (about 2x slower mallocs).
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:fast_unwind_on_malloc=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" -E '[Cc][Uu][Dd][Aa]')
t2=$(date +%s)
echo "ci_sanitizers: build $((t1 - t0)) s, tests $((t2 - t1)) s"
