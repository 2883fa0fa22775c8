#!/usr/bin/env bash
# Build and install the kvevict Python package for Debian's python3 and python3-torch, offline, from
# this checkout: the same build as `pip install .` (pyproject.toml, setup.py), run by Debian's pip
# without build isolation or an index (docs/python.md, "Install").
#   scripts/install_python.sh            # into /usr/local/lib/python3.X/dist-packages (as root)
#   scripts/install_python.sh --user     # into the user's site-packages
#   scripts/install_python.sh --target DIR
# Uninstall: python3 -m pip uninstall --break-system-packages kvevict (--target: delete DIR/kvevict*).
# Environment: KVEVICT_PYTHON (default /usr/bin/python3), JOBS (parallel compile jobs, default all
# cores), KVEVICT_ENABLE_CUDA=ON to build the CUDA backend in too (needs nvcc; CUDA tensors then run on it).
# Debian marks its python3 as externally managed (PEP 668): pip installs into it only with
# --break-system-packages, which is what this script passes; kvevict's dependencies (torch, numpy)
# are Debian's own packages (--no-deps), so nothing of Debian's is replaced.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${KVEVICT_PYTHON:-/usr/bin/python3}
export JOBS=${JOBS:-$(nproc)}
usage() { echo "usage: scripts/install_python.sh [--user | --target DIR]  (docs/python.md)"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --user) where=(--user --break-system-packages) ;;
  --target) [ -n "${2:-}" ] || { echo "install_python.sh: --target needs a folder" >&2; usage >&2; exit 2; }
            target=$2
            case "$target" in /*) ;; *) target="$caller/$target" ;; esac  # relative to where it was called
            where=(--target "$target" --upgrade) ;;
  "") where=(--break-system-packages) ;;
  *) usage >&2; exit 2 ;;
esac
scripts/setup.sh python
"$PY" -m pip install --no-build-isolation --no-index --no-deps --disable-pip-version-check --root-user-action=ignore "${where[@]}" .
# Import from outside the checkout, so that the installed package is the one found (--target: a
# folder Python does not search by itself, so it is put on PYTHONPATH for the check).
(cd / && PYTHONPATH="${target:+$target}${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
  'import kvevict; print("kvevict", kvevict.__version__, "installed at", kvevict.__file__)')
[ "${1:-}" = --target ] && echo "add $target to PYTHONPATH to import kvevict"
exit 0
