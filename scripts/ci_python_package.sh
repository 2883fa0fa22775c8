#!/usr/bin/env bash
# The Python package as a user installs it (docs/python.md, "Install"), offline: a fresh venv over
# Debian's python3 and python3-torch, `pip install --no-build-isolation --no-index .`, `pip show`,
# `import kvevict` from another directory, the README's and docs/python.md's examples run there as
# written, a wheel built, `pip uninstall` (the import must fail after it). CI's consumers phase.
# Environment: JOBS; KVEVICT_MODEL_DIR (default ../shared/models/stories260K beside the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
scripts/setup.sh python >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_ROOT_USER_ACTION=ignore
/usr/bin/python3 -m venv --system-site-packages "$tmp/v"
"$tmp/v/bin/pip" install -q --no-build-isolation "$root"
"$tmp/v/bin/pip" show kvevict | grep -E '^(Name|Version|Location):'
cd "$tmp"
"$tmp/v/bin/python" -c 'import kvevict, kvevict.models.llama2c, kvevict.press, os, sys
assert not kvevict.__file__.startswith(sys.argv[1]), kvevict.__file__
print("import kvevict", kvevict.__version__, "from", os.path.dirname(kvevict.__file__))' "$root/python"
# the documented examples, as written, from this directory
export KVEVICT_MODEL_DIR=${KVEVICT_MODEL_DIR:-$root/../shared/models/stories260K}
"$tmp/v/bin/python" - "$root" <<'PY'
import os, re, subprocess, sys
root = sys.argv[1]
blocks = [("README.md", r"<!-- tests/python/test_readme.py runs this block -->\n```python\n(.*?)```")]
if os.path.isfile(os.path.join(os.environ["KVEVICT_MODEL_DIR"], "stories260K.bin")):
    blocks.append(("docs/python.md", r"<!-- tests/python/test_readme.py and scripts/ci_python_package.sh run this block[^\n]*-->\n```python\n(.*?)```"))
else:
    print("ci_python_package: stories260K not found (KVEVICT_MODEL_DIR): docs/python.md's press example skipped")
for doc, pat in blocks:
    m = re.search(pat, open(os.path.join(root, doc), encoding="utf-8").read(), re.S)
    assert m, f"{doc} lost its tested Python block"
    r = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True)
    assert r.returncode == 0, f"{doc}'s example failed from {os.getcwd()}:\n{r.stderr}"
    print(f"{doc} example ran from {os.getcwd()}")
PY
# a wheel from the same build (offline: no isolation), with the compiled module and the models
(cd "$root" && "$tmp/v/bin/python" -m build --wheel --no-isolation --outdir "$tmp/dist" >/dev/null)
whl=$(ls "$tmp"/dist/kvevict-*.whl)
/usr/bin/python3 -m zipfile -l "$whl" | grep -E 'kvevict/(_C\.|models/llama2c\.py|press\.py)' | awk '{print "wheel:", $1}'
"$tmp/v/bin/pip" uninstall -q -y kvevict
if "$tmp/v/bin/python" -c 'import kvevict' 2>/dev/null; then
  echo "ci_python_package: kvevict is still importable after pip uninstall" >&2
  exit 1
fi
rm -rf "$root/python/kvevict.egg-info"
echo "python package: pip install (offline, Debian's torch), import from outside the checkout, documented examples, wheel, uninstall: pass"
