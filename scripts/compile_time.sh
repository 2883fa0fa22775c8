#!/usr/bin/env bash
# Compile time of a header-only library is part of its interface: time one translation unit that
# uses one preset for one storage type (examples/quickstart.cpp), the include alone, and the CUDA
# umbrella's include alone (when nvcc exists), with g++ -O2 as a user would build them; the quick
# start once header-only and once as a unit that links kvevict::compiled sees it (KVEVICT_COMPILED=1:
# the instantiations are extern, docs/compiled-mode.md).
#   scripts/compile_time.sh [REPS]     # prints the median wall seconds of REPS runs (default 3)
# Environment: CXX (default g++), KVEVICT_ROOT (default: this checkout; point it at another
# checkout to measure before/after in the same run).
set -euo pipefail
root=${KVEVICT_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
reps=${1:-3}
cxx=${CXX:-g++}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c++17 -O2 -fopenmp -I"$root/include" -I/usr/include/eigen3)
printf '#include <kvevict/cpu.hpp>\nint main() { return 0; }\n' >"$tmp/include_only.cpp"
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
time_cmd() {  # time_cmd LABEL CMD...: median wall seconds over $reps runs
  local label=$1; shift
  local ts=()
  for _ in $(seq "$reps"); do
    local t0 t1
    t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N)
    ts+=("$(echo "$t1 - $t0" | bc)")
  done
  printf '%-40s %6.2f s (median of %d)\n' "$label" "$(printf '%s\n' "${ts[@]}" | median)" "$reps"
}
time_cmd "quickstart.cpp (restkv, fp32) g++ -O2" "$cxx" "${flags[@]}" -c "$root/examples/quickstart.cpp" -o "$tmp/q.o"
time_cmd "quickstart.cpp, compiled mode g++ -O2" "$cxx" "${flags[@]}" -DKVEVICT_COMPILED=1 -c "$root/examples/quickstart.cpp" -o "$tmp/qc.o"
time_cmd "#include <kvevict/cpu.hpp> alone" "$cxx" "${flags[@]}" -c "$tmp/include_only.cpp" -o "$tmp/i.o"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  printf '#include <kvevict/cuda.cuh>\nint main() { return 0; }\n' >"$tmp/cuda_only.cu"
  time_cmd "#include <kvevict/cuda.cuh> alone (nvcc)" "$nvcc" -std=c++17 -O2 -arch=sm_90 -I"$root/include" \
    -I/usr/local/cuda/include/cccl -c "$tmp/cuda_only.cu" -o "$tmp/c.o"
fi
