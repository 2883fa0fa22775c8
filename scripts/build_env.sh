# Sourced by scripts/test.sh and the CI scripts: the generator and the compiler cache they share.
#   KVEVICT_CMAKE_ARGS  the cmake arguments that pick them (an array)
# Ninja when installed (it runs the targets' compiles in parallel; CMake's Makefiles serialise the
# top level), unless the build folder $1 was configured with Makefiles before.
# ccache when installed (scripts/setup.sh installs it) and KVEVICT_CCACHE is not 0: base_dir is
# the checkout, so the compile lines, rewritten relative to the build folder, are the same in any
# checkout and a fresh clone hits the cache that an earlier clone on this machine filled; no hash of
# the working directory (debug info then names the first checkout's folder). A fresh machine has an
# empty cache and builds everything; the results do not depend on the cache.
KVEVICT_CMAKE_ARGS=()
if command -v ninja >/dev/null 2>&1 && [ ! -f "${1:-build}/Makefile" ]; then KVEVICT_CMAKE_ARGS+=(-G Ninja); fi
if [ "${KVEVICT_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)}
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-8G}
  KVEVICT_CMAKE_ARGS+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
