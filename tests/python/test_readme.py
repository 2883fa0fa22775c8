"""The README's Python example and docs/python.md's press example run as printed (the blocks
after a test_readme marker), from a directory outside the checkout."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


def run_block(code, tmp_path):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})


def test_readme_python_block_runs(tmp_path):
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    m = re.search(r"<!-- tests/python/test_readme.py runs this block -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its tested Python block"
    out = run_block(m.group(1), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([1, 8, 1024])" in out.stdout and "temporal.alpha" in out.stdout


def test_docs_press_block_runs(tmp_path, monkeypatch):
    mdir = os.environ.get("KVEVICT_MODEL_DIR") or os.path.join(REPO, "..", "shared", "models", "stories260K")
    if not os.path.isfile(os.path.join(mdir, "stories260K.bin")):
        pytest.skip("stories260K model folder not found (../shared/models/stories260K or KVEVICT_MODEL_DIR): "
                    "docs/python.md's press example needs it")
    monkeypatch.setenv("KVEVICT_MODEL_DIR", os.path.abspath(mdir))
    text = open(os.path.join(REPO, "docs", "python.md"), encoding="utf-8").read()
    m = re.search(r"<!-- tests/python/test_readme.py and scripts/ci_python_package.sh run this block[^\n]*-->\n```python\n(.*?)```",
                  text, re.S)
    assert m, "docs/python.md lost its tested press block"
    out = run_block(m.group(1), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tensor([[40, 40, 40, 40]]" in out.stdout, out.stdout  # 20% of 200 tokens per KV head
    assert "204 3" in out.stdout, out.stdout  # decode-time: 4 heads x cap 51 after the third eviction
