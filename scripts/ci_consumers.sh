#!/usr/bin/env bash
# Install kvevict to a temporary prefix and build three outside projects against it: one with
# find_package(kvevict CONFIG COMPONENTS cpu), one with add_subdirectory(), one with FetchContent
# (cloned from this checkout's git repository at HEAD: no network; commit first to test changes).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake -S . -B "$tmp/build" -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF \
      -DKVEVICT_ENABLE_CUDA=OFF -DKVEVICT_BUILD_PYTHON=OFF -DCMAKE_INSTALL_PREFIX="$tmp/prefix" >/dev/null
cmake --install "$tmp/build" >/dev/null
cmake -S tests/consumers/find_package -B "$tmp/c1" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/c1" -j 2 >/dev/null
"$tmp/c1/consumer"
"$tmp/c1/consumer_core_only"
cmake -S tests/consumers/add_subdirectory -B "$tmp/c2" -DKVEVICT_SOURCE="$root" >/dev/null
cmake --build "$tmp/c2" -j 2 --target consumer >/dev/null
"$tmp/c2/consumer"
cmake -S tests/consumers/fetchcontent -B "$tmp/c3" -DKVEVICT_GIT_REPOSITORY="$root" \
      -DKVEVICT_GIT_TAG="$(git -C "$root" rev-parse HEAD)" -DFETCHCONTENT_BASE_DIR="$tmp/c3-deps" >/dev/null
cmake --build "$tmp/c3" -j 2 --target consumer >/dev/null
"$tmp/c3/consumer"
echo "consumers: find_package, add_subdirectory and FetchContent builds pass"
