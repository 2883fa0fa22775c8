#!/usr/bin/env bash
# Install kvevict to a temporary prefix and build three outside projects against it: one with
# find_package(kvevict CONFIG COMPONENTS cpu compiled), one with add_subdirectory(), one with
# FetchContent (cloned from this checkout's git repository at HEAD: no network; commit first to test
# changes). Each builds the same program header-only (kvevict::cpu) and in the compiled mode
# (kvevict::compiled), runs both, and checks that the compiled-mode object instantiated no evictor.
#
# Environment: BUILD_DIR (default build): when it holds a built kvevict::compiled (scripts/test.sh
# ran), the install is taken from it; otherwise a CPU-only build of the library is made first.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
BUILD_DIR=${BUILD_DIR:-build}
. scripts/build_env.sh "$tmp/build"
launcher=()
for a in "${KVEVICT_CMAKE_ARGS[@]}"; do case $a in -DCMAKE_CXX_COMPILER_LAUNCHER=*) launcher+=("$a") ;; esac; done
if [ -f "$BUILD_DIR/CMakeCache.txt" ] && [ -f "$BUILD_DIR/libkvevict_compiled.a" ]; then
  cmake --install "$BUILD_DIR" --prefix "$tmp/prefix" >/dev/null
else
  cmake -S . -B "$tmp/build" "${KVEVICT_CMAKE_ARGS[@]}" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF \
        -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_ENABLE_CUDA=OFF -DKVEVICT_BUILD_PYTHON=OFF -DCMAKE_INSTALL_PREFIX="$tmp/prefix" >/dev/null
  cmake --build "$tmp/build" -j "${JOBS:-2}" --target kvevict_compiled >/dev/null
  cmake --install "$tmp/build" >/dev/null
fi

# run_pair DIR: both programs of one consumer; the compiled-mode object defines no evictor member
# (the instantiations are the library's: extern in the user's unit).
run_pair() {
  "$1/consumer"
  "$1/consumer_compiled"
  local obj
  obj=$(find "$1" -path '*consumer_compiled.dir*' -name '*.o' | head -n 1)
  if nm -C "$obj" | grep -E ' [TW] .*kvevict::evictor<.*::(run_impl|plan|workspace_bytes)<' >/dev/null; then
    echo "consumers: $obj instantiates an evictor itself (the compiled mode's extern declarations did not apply)" >&2
    exit 1
  fi
}

cmake -S tests/consumers/find_package -B "$tmp/c1" "${launcher[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/c1" -j "${JOBS:-2}" >/dev/null
run_pair "$tmp/c1"
"$tmp/c1/consumer_core_only"
cmake -S tests/consumers/add_subdirectory -B "$tmp/c2" "${launcher[@]}" -DKVEVICT_SOURCE="$root" >/dev/null
cmake --build "$tmp/c2" -j "${JOBS:-2}" --target consumer consumer_compiled >/dev/null
run_pair "$tmp/c2"
cmake -S tests/consumers/fetchcontent -B "$tmp/c3" "${launcher[@]}" -DKVEVICT_GIT_REPOSITORY="$root" \
      -DKVEVICT_GIT_TAG="$(git -C "$root" rev-parse HEAD)" -DFETCHCONTENT_BASE_DIR="$tmp/c3-deps" >/dev/null
cmake --build "$tmp/c3" -j "${JOBS:-2}" --target consumer consumer_compiled >/dev/null
run_pair "$tmp/c3"
echo "consumers: find_package, add_subdirectory and FetchContent builds pass, header-only and compiled mode"
