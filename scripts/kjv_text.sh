#!/usr/bin/env bash
# Dump the King James Bible (Debian's bible-kjv + bible-kjv-text: the `bible` tool and its data) as plain
# prose for the fidelity report's second text: verse references stripped, one paragraph per chapter
# (chapters separated by a blank line, which is where kvevict_fidelity starts its excerpts).
#
#   scripts/kjv_text.sh OUT.txt      # exit 0 and OUT.txt written; exit 3 (nothing written) when `bible`
#                                    # is not installed (scripts/setup.sh main|test installs it)
set -euo pipefail
out=${1:?usage: kjv_text.sh OUT.txt}
if ! command -v bible >/dev/null 2>&1; then
  echo "kjv_text.sh: the 'bible' tool (Debian packages bible-kjv, bible-kjv-text) is not installed" >&2
  exit 3
fi
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# "Ge1:1 In the beginning ..." -> chapter key "Ge1", text "In the beginning ..."
bible -f "Gen1:1-Rev22:21" | awk '
  match($0, /^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ /) {
    ref = substr($0, 1, RLENGTH - 1); text = substr($0, RLENGTH + 1)
    sub(/:[0-9]+$/, "", ref)
    if (ref != chap) { if (chap != "") printf "\n\n"; chap = ref; sep = "" }
    printf "%s%s", sep, text; sep = " "; next
  }
  { if (length($0) > 0) printf " %s", $0 }
  END { printf "\n" }' > "$tmp"
if [[ $(wc -c < "$tmp") -lt 1000000 ]]; then
  echo "kjv_text.sh: the dump is too short ($(wc -c < "$tmp") bytes); is bible-kjv-text installed?" >&2
  exit 1
fi
mv "$tmp" "$out"
trap - EXIT
