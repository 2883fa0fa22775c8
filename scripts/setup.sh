#!/usr/bin/env bash
# Install what kvevict's build, tests and main job need, from Debian's archive (idempotent).
# Needs root (or sudo). Skips apt-get when everything is already installed.
#   scripts/setup.sh        everything: build (Ninja, ccache), tests (doctest, Open MPI for the distributed tests, PyTorch for the LKV smoke training,
#                           clang for the fuzzer), benchmarks
#   scripts/setup.sh main   only what the main job (scripts/fidelity.sh) needs (bible-kjv: its second text)
#   scripts/setup.sh python only what the Python package needs (pip install --no-build-isolation ., scripts/install_python.sh)
set -euo pipefail
if [ "${1:-all}" = main ]; then
  pkgs=(cmake make g++ libeigen3-dev python3 python3-matplotlib bible-kjv bible-kjv-text)
elif [ "${1:-all}" = python ]; then
  pkgs=(cmake make g++ libeigen3-dev python3 python3-dev python3-torch python3-numpy pybind11-dev python3-pybind11 libdlpack-dev
        python3-venv python3-pip python3-setuptools python3-wheel python3-build libblis-dev)
else
  pkgs=(cmake make g++ libeigen3-dev doctest-dev libbenchmark-dev python3 python3-torch python3-matplotlib python3-numpy
        clang libclang-rt-14-dev python3-dev pybind11-dev python3-pybind11 libdlpack-dev python3-pytest
        bible-kjv bible-kjv-text openmpi-bin libopenmpi-dev ccache ninja-build python3-venv python3-pip python3-setuptools python3-wheel
        libblis-dev)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: dependencies present"
