#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Per-function coverage of the library's code by the fuzz targets' corpora (libFuzzer's
# -print_coverage=1 over a corpus, no mutation): for each library header a target reaches, the
# functions it covers and the ones it does not, by name. Run after scripts/ci_fuzz.sh has built
# the targets (build-fuzz/), e.g. over the committed corpora or over a long run's corpus:
#
#   scripts/fuzz_coverage.sh                                    # every target over its committed corpus
#   scripts/fuzz_coverage.sh fuzz_views build-fuzz/corpus_fuzz_views   # one target, another corpus
#
# Output: "target  covered/all  header" lines (functions as instantiated in that target), then
# each function of the headers named in FUZZ_COVERAGE_FILES (default: the paged, schedule, sharded
# and compaction code) that no target reaches, by source line (all instantiations of a template
# count as one).
# docs/failure-kinds.md ("Fuzzing") reports the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
FILES=${FUZZ_COVERAGE_FILES:-"core/paged.hpp core/inputs.hpp backends/cpu/backend.hpp backends/cpu/evictor.hpp schedule/decode.hpp distributed/exchange.hpp distributed/fingerprint.hpp distributed/lkv.hpp backends/cpu/compact_paged.hpp backends/cpu/compact.hpp"}
declare -A corpus=([fuzz_evictor]=tests/fuzz/corpus [fuzz_schedule]=tests/fuzz/corpus_schedule [fuzz_paged]=tests/fuzz/corpus_paged
                   [fuzz_views]=tests/fuzz/corpus_views [fuzz_sharded]=tests/fuzz/corpus_sharded)
if [ $# -ge 1 ]; then
  targets=("$1")
  if [ $# -ge 2 ]; then corpus[$1]=$2; fi
else targets=(fuzz_evictor fuzz_schedule fuzz_paged fuzz_views fuzz_sharded); fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in "${targets[@]}"; do
  [ -x "$BUILD_DIR/$t" ] || { echo "fuzz_coverage: $BUILD_DIR/$t is not built (scripts/ci_fuzz.sh builds it)" >&2; exit 2; }
  "$BUILD_DIR/$t" -runs=0 -print_coverage=1 "${corpus[$t]}" 2>&1 | grep -E '^(UN)?COVERED_FUNC' | sed "s|^|$t |" >> "$tmp/all" || true
done
for f in $FILES; do
  for t in "${targets[@]}"; do
    c=$(grep -cE "^$t COVERED_FUNC.*include/kvevict/$f:" "$tmp/all" || true)
    u=$(grep -cE "^$t UNCOVERED_FUNC.*include/kvevict/$f:" "$tmp/all" || true)
    if [ $((c + u)) -gt 0 ]; then printf '%-14s %4d/%-4d %s\n' "$t" "$c" "$((c + u))" "$f"; fi
  done
done
# A template counts once (by its source line): its instantiations are the same code over other
# types, and the compiled library holds instantiations no target calls (every preset x type).
echo "-- functions (by source line) of these headers that no target covers:"
for f in $FILES; do
  { grep -E "COVERED_FUNC.*include/kvevict/$f:" "$tmp/all" || true; } |
    sed -E 's/^[a-z_]+ (UN)?COVERED_FUNC: hits: ([0-9]+) edges: [0-9]+\/[0-9]+ (.*) [^ ]*include\/kvevict\/([^ ]*)$/\2\t\4\t\3/' |
    awk -F'\t' '{ if (!($2 in hit)) { hit[$2] = 0; name[$2] = $3 } if ($1 > 0) hit[$2] = 1 } END { for (k in hit) if (!hit[k]) print "   " k "  " substr(name[k], 1, 160) }' | sort
done
