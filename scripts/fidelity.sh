#!/usr/bin/env bash
# The main job: build kvevict_fidelity (that target only), run the fidelity report on stories260K and plot it.
#
#   scripts/fidelity.sh                  # full report: table on stdout, CSV + PNG in build-fidelity/report/
#   scripts/fidelity.sh --smoke          # any kvevict_fidelity flag is passed through; a smoke run's files
#                                        # are fidelity_smoke*.{txt,csv,png}, beside (never over) the full report
#   scripts/fidelity.sh --update-docs    # also copy table, CSV and PNG to docs/ (fidelity.md's figures)
#
# Environment: KVEVICT_FIDELITY_BUILD (build folder, default <repo>/build-fidelity), KVEVICT_FIDELITY_OUT
# (report folder, default <build>/report), JOBS (parallel compile jobs, default 2), KVEVICT_MODEL_DIR,
# KVEVICT_DATA_DIR (see docs/fidelity.md). Needs cmake, a C++17 compiler, Eigen 3.4; the plot needs
# /usr/bin/python3 with matplotlib (skipped with a warning otherwise).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVEVICT_FIDELITY_BUILD:-$root/build-fidelity}
out=${KVEVICT_FIDELITY_OUT:-$build/report}
update_docs=0
smoke=0
args=()
for a in "$@"; do
  if [[ $a == --update-docs ]]; then update_docs=1; else args+=("$a"); fi
  if [[ $a == --smoke ]]; then smoke=1; fi
done
if [[ $smoke == 1 && $update_docs == 1 ]]; then
  echo "error: --update-docs copies a full report into docs/; a --smoke run is not one (run without --smoke)" >&2
  exit 2
fi
# kvevict_fidelity names a smoke run's CSVs fidelity_smoke*.csv; the table and the plot follow.
stem=fidelity
if [[ $smoke == 1 ]]; then stem=fidelity_smoke; fi

"$root/scripts/setup.sh" main
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=OFF -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_BUILD_EXAMPLES=ON -DKVEVICT_BUILD_PYTHON=OFF >/dev/null
cmake --build "$build" -j"${JOBS:-2}" --target kvevict_fidelity
mkdir -p "$out"
rm -f "$out/$stem.csv"
"$build/examples/fidelity/kvevict_fidelity" --out "$out" ${args[@]+"${args[@]}"} | tee "$out/${stem}_table.txt"
if [[ ! -s $out/$stem.csv ]]; then
  exit 0  # skipped (model or text missing): kvevict_fidelity said why
fi
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 "$root/examples/fidelity/plot.py" "$out/$stem.csv" "$out/${stem}_kl.png"
else
  echo "warning: /usr/bin/python3 with matplotlib not found; no plot" >&2
fi
if [[ $update_docs == 1 ]]; then
  cp "$out/fidelity.csv" "$root/docs/fidelity.csv"
  cp "$out/fidelity_table.txt" "$root/docs/fidelity_table.txt"
  [[ -f $out/fidelity_kl.png ]] && cp "$out/fidelity_kl.png" "$root/docs/fidelity_kl.png"
  echo "updated docs/fidelity.csv, docs/fidelity_table.txt, docs/fidelity_kl.png"
fi
