#!/usr/bin/env bash
# Build and install the kvevict Python package (python/) for Debian's python3 and python3-torch,
# offline, from this checkout (docs/python.md).
#   scripts/install_python.sh            # into /usr/local/lib/python3.X/dist-packages (as root)
#   scripts/install_python.sh --user     # into the user's site-packages
#   scripts/install_python.sh --target DIR
# Environment: KVEVICT_PYTHON (default /usr/bin/python3), BUILD_DIR (default build-python), JOBS,
# KVEVICT_ENABLE_CUDA=ON to build the CUDA backend in too (needs nvcc; CUDA tensors then run on it).
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${KVEVICT_PYTHON:-/usr/bin/python3}
BUILD_DIR=${BUILD_DIR:-build-python}
JOBS=${JOBS:-$(nproc)}
usage() { echo "usage: scripts/install_python.sh [--user | --target DIR]  (docs/python.md)"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --user) target=$("$PY" -c 'import site; print(site.getusersitepackages())') ;;
  --target) [ -n "${2:-}" ] || { echo "install_python.sh: --target needs a folder" >&2; usage >&2; exit 2; }
            target=$2
            case "$target" in /*) ;; *) target="$caller/$target" ;; esac ;;  # relative to where it was called
  "") target=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("platlib"))') ;;
  *) usage >&2; exit 2 ;;
esac
scripts/setup.sh python
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_PYTHON=ON -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_ENABLE_CUDA="${KVEVICT_ENABLE_CUDA:-OFF}" -DKVEVICT_PYTHON="$PY" \
  -DKVEVICT_PYTHON_INSTALL_DIR="$target" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target kvevict_python
cmake --install "$BUILD_DIR" --component python
# Import from outside the checkout, so that the installed package is the one found (--target: a
# folder Python does not search by itself, so it is put on PYTHONPATH for the check).
(cd / && PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
  'import kvevict; print("kvevict", kvevict.__version__, "installed at", kvevict.__file__)')
[ "${1:-}" = --target ] && echo "add $target to PYTHONPATH to import kvevict"
exit 0
