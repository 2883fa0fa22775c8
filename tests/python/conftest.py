"""pytest set-up for the Python binding's tests: kvevict must be importable (ctest sets
PYTHONPATH to <build>/python; after scripts/install_python.sh it is installed)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

try:
    import kvevict  # noqa: F401
except ImportError as e:  # a clear failure, not a skip: the binding is part of the test suite
    raise ImportError(f"kvevict is not importable ({e}): build it (cmake --build <build> --target kvevict_python) and set "
                      "PYTHONPATH=<build>/python, or run scripts/install_python.sh") from e

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def model_dir():
    """The stories260K folder ($KVEVICT_MODEL_DIR, else <repo>/../shared/models/stories260K), or None."""
    d = os.environ.get("KVEVICT_MODEL_DIR") or os.path.join(REPO, "..", "shared", "models", "stories260K")
    return d if os.path.isfile(os.path.join(d, "stories260K.bin")) else None


@pytest.fixture
def repo():
    return REPO


@pytest.fixture
def gen():
    return torch_gen(1234)


def torch_gen(seed):
    import torch
    g = torch.Generator()
    g.manual_seed(seed)
    return g
