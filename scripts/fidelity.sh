#!/usr/bin/env bash
# The main job: build kvevict_fidelity and kvevict_decoding (those targets only), run the fidelity report on stories260K and plot it,
# on two texts: Sherlock Holmes (sherlock.txt, from which LKV's training prompts also come) and the King
# James Bible (dumped by scripts/kjv_text.sh from Debian's bible-kjv: a text the model and LKV never saw),
# in <report>/ and <report>/kjv/, then its decoding section (decode-time eviction, Sherlock) in <report>/decoding*.
# A run given --text FILE reports on that file only (no decoding section).
#
#   scripts/fidelity.sh                  # full report: table on stdout, CSV + PNG in build-fidelity/report/
#   scripts/fidelity.sh --smoke          # any kvevict_fidelity flag is passed through; a smoke run's files
#                                        # are fidelity_smoke*.{txt,csv,png}, beside (never over) the full report
#   scripts/fidelity.sh --full           # also the costly rows (Greedy-W-pqh) and decoding at beta 1
#   scripts/fidelity.sh --update-docs    # also copy tables, CSVs and PNGs to docs/ (fidelity.md's figures;
#                                        # the KJV report's as docs/fidelity_kjv*)
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
own_text=0
full=0
args=()
for a in "$@"; do
  if [[ $a == --update-docs ]]; then update_docs=1; else args+=("$a"); fi
  if [[ $a == --smoke ]]; then smoke=1; fi
  if [[ $a == --full ]]; then full=1; fi
  if [[ $a == --text || $a == --prompt-file ]]; then own_text=1; fi
  if [[ $a == --out ]]; then
    echo "error: scripts/fidelity.sh picks the report folder (KVEVICT_FIDELITY_OUT=DIR); no --out" >&2
    exit 2
  fi
done
if [[ $own_text == 1 && $update_docs == 1 ]]; then
  echo "error: --update-docs copies the two-text report into docs/; a run on --text / --prompt-file is not one" >&2
  exit 2
fi
if [[ $smoke == 1 && $update_docs == 1 ]]; then
  echo "error: --update-docs copies a full report into docs/; a --smoke run is not one (run without --smoke)" >&2
  exit 2
fi
# kvevict_fidelity names a smoke run's CSVs fidelity_smoke*.csv; the table and the plot follow.
stem=fidelity
if [[ $smoke == 1 ]]; then stem=fidelity_smoke; fi

"$root/scripts/setup.sh" main
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=OFF -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_BUILD_EXAMPLES=ON -DKVEVICT_BUILD_PYTHON=OFF -DKVEVICT_USE_COMPILED=OFF >/dev/null
# (header-only: its five units instantiate only the presets the report runs, cheaper than the compiled mode's seven)
cmake --build "$build" -j"${JOBS:-2}" --target kvevict_fidelity kvevict_decoding
# report DIR TITLE [extra flags]: run, table, plot into DIR. Returns 10 when kvevict_fidelity skipped (model
# or text missing, it said why); any error exits the script with its status.
report() {
  local dir=$1 title=$2
  shift 2
  mkdir -p "$dir"
  rm -f "$dir/$stem.csv"
  local rc=0
  "$build/examples/fidelity/kvevict_fidelity" --out "$dir" ${args[@]+"${args[@]}"} "$@" | tee "$dir/${stem}_table.txt" || rc=$?
  if [[ $rc != 0 ]]; then
    exit "$rc"  # an error or an incomplete table (kvevict_fidelity said why): the job fails
  fi
  if [[ ! -s $dir/$stem.csv ]]; then
    return 10
  fi
  if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
    /usr/bin/python3 "$root/examples/fidelity/plot.py" "$dir/$stem.csv" "$dir/${stem}_kl.png" "$title" || exit $?
  else
    echo "warning: /usr/bin/python3 with matplotlib not found; no plot" >&2
  fi
}
if [[ $own_text == 1 ]]; then
  report "$out" "the given text" || true  # 10: skipped
  exit 0
fi
report "$out" "Sherlock Holmes" || exit 0  # 10: skipped (errors have exited already)
kjv=0
if "$root/scripts/kjv_text.sh" "$build/kjv.txt"; then
  echo
  rc=0
  report "$out/kjv" "King James Bible" --text "$build/kjv.txt" || rc=$?
  [[ $rc == 0 ]] && kjv=1
else
  echo "warning: no King James Bible text (scripts/kjv_text.sh failed: scripts/setup.sh main installs bible-kjv); Sherlock report only" >&2
fi
# The decoding section (kvevict_decoding, docs/fidelity.md "Decoding"): decode-time eviction on Sherlock excerpts,
# every preset and the LKV decoding modes, caps 10/20/30% of the 512-token context, beta 16/64 (--full: also beta 1,
# an eviction per token, 4x the time of the other two).
dec_args=()
dec_stem=decoding
if [[ $smoke == 1 ]]; then dec_args=(--smoke); dec_stem=decoding_smoke; fi
if [[ $full == 1 && $smoke == 0 ]]; then dec_args=(--intervals 1,16,64); fi
echo
"$build/examples/fidelity/kvevict_decoding" --out "$out" ${dec_args[@]+"${dec_args[@]}"} | tee "$out/${dec_stem}_table.txt"
if [[ $update_docs == 1 ]]; then
  cp "$out/decoding.csv" "$root/docs/decoding.csv"
  cp "$out/decoding_table.txt" "$root/docs/decoding_table.txt"
  cp "$out/fidelity.csv" "$root/docs/fidelity.csv"
  cp "$out/fidelity_per_prompt.csv" "$root/docs/fidelity_per_prompt.csv"
  cp "$out/fidelity_table.txt" "$root/docs/fidelity_table.txt"
  [[ -f $out/fidelity_kl.png ]] && cp "$out/fidelity_kl.png" "$root/docs/fidelity_kl.png"
  if [[ $kjv == 1 ]]; then
    cp "$out/kjv/fidelity.csv" "$root/docs/fidelity_kjv.csv"
    cp "$out/kjv/fidelity_per_prompt.csv" "$root/docs/fidelity_kjv_per_prompt.csv"
    cp "$out/kjv/fidelity_table.txt" "$root/docs/fidelity_kjv_table.txt"
    [[ -f $out/kjv/fidelity_kl.png ]] && cp "$out/kjv/fidelity_kl.png" "$root/docs/fidelity_kjv_kl.png"
  fi
  echo "updated docs/fidelity{,_kjv}.csv, docs/fidelity{,_kjv}_per_prompt.csv, docs/fidelity{,_kjv}_table.txt, docs/fidelity{,_kjv}_kl.png, docs/decoding{.csv,_table.txt}"
fi
