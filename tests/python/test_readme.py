"""The README's Python example and docs/python.md's press example run as printed (the blocks
after a test_readme marker)."""
import os
import re
import subprocess
import sys

from conftest import REPO


def test_readme_python_block_runs():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    m = re.search(r"<!-- tests/python/test_readme.py runs this block -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its tested Python block"
    out = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "torch.Size([1, 8, 1024])" in out.stdout and "temporal.alpha" in out.stdout


def test_docs_press_block_runs():
    if not os.path.isfile(os.path.join(REPO, "..", "shared", "models", "stories260K", "stories260K.bin")) and \
            not os.environ.get("KVEVICT_MODEL_DIR"):
        import pytest
        pytest.skip("stories260K model folder not found: docs/python.md's press example needs it")
    text = open(os.path.join(REPO, "docs", "python.md"), encoding="utf-8").read()
    m = re.search(r"<!-- tests/python/test_readme.py runs this block \(from the repository root\) -->\n```python\n(.*?)```",
                  text, re.S)
    assert m, "docs/python.md lost its tested press block"
    out = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "tensor([[40, 40, 40, 40]]" in out.stdout, out.stdout  # 20% of 200 tokens per KV head
