"""The README's Python example runs as printed (the block after the test_readme marker)."""
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
