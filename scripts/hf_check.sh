#!/usr/bin/env bash
# kvevict in Hugging Face transformers beside NVIDIA kvpress (docs/kvpress.md): makes a venv with a
# current torch, transformers and kvpress from PyPI (about 3 GB: PyPI's torch brings its CUDA libraries),
# installs kvevict into it from this checkout, runs tests/python/test_hf.py and, with --compare, the
# side-by-side table (tools/hf/compare_kvpress.py, about 5 minutes on 2 cores).
#   scripts/hf_check.sh [--compare]      # VENV (default .venv-hf), KVEVICT_MODEL_DIR as for the tests
# Not part of .ci/run: Debian's python3-torch 1.13 is too old for current transformers, and the download
# does not fit CI's budget (tests/python/test_hf.py skips there with a message).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-hf}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
scripts/setup.sh python >/dev/null
[ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
# kvpress 0.5.2 reads the attention module's past_key_values keyword, which transformers 5 renamed;
# datasets < 4 keeps the huggingface-hub that transformers 4.x needs
"$VENV/bin/pip" install -q torch "transformers>=4.56,<5" "kvpress==0.5.2" "datasets<4" pytest
"$VENV/bin/pip" install -q .
"$VENV/bin/python" -c 'import torch, transformers, kvpress, kvevict; print("torch", torch.__version__, "transformers", transformers.__version__, "kvevict", kvevict.__version__)'
(cd tests/python && "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_hf.py)
if [ "${1:-}" = --compare ]; then
  kjv=$(mktemp); trap 'rm -f "$kjv"' EXIT
  extra=()
  scripts/kjv_text.sh "$kjv" && extra=(--kjv "$kjv")
  "$VENV/bin/python" tools/hf/compare_kvpress.py --excerpts 8 "${extra[@]}" --csv docs/kvpress.csv
fi
