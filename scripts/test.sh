#!/usr/bin/env bash
# Build kvevict and run its whole test suite (the README's test command).
#   scripts/test.sh            # set-up (apt-get), configure, build, ctest
# Environment: BUILD_DIR (default build), JOBS (default nproc), KVEVICT_ENABLE_CUDA (default ON:
# CUDA code is compiled when nvcc exists; its tests skip at run time without a GPU), KVEVICT_CCACHE
# (default 1: use ccache when installed; scripts/build_env.sh).
# The tests, examples, benchmarks and the binding link kvevict::compiled (every preset instantiated
# once; docs/compiled-mode.md); -DKVEVICT_USE_COMPILED=OFF in KVEVICT_CMAKE_EXTRA builds them header-only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
. scripts/build_env.sh "$BUILD_DIR"
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" "${KVEVICT_CMAKE_ARGS[@]}" ${KVEVICT_CMAKE_EXTRA:-} -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA="${KVEVICT_ENABLE_CUDA:-ON}" -DKVEVICT_REQUIRE_MPI=ON
cmake --build "$BUILD_DIR" -j "$JOBS"
cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS"
