# SPDX-License-Identifier: Apache-2.0
"""The stories260K tokenizer lives in the Python package, python/kvevict/models/tokenizer.py (installed as
``kvevict.models.tokenizer``). This shim loads that file by path as the module ``tokenizer``, so that
tools/lkv (training, its tests) runs from the checkout without the compiled binding."""
import importlib.util as _util
import os as _os
import sys as _sys

_path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", "..", "python", "kvevict", "models", "tokenizer.py")
_spec = _util.spec_from_file_location(__name__, _os.path.normpath(_path))
_mod = _util.module_from_spec(_spec)
_sys.modules[__name__] = _mod  # dataclasses look their module up while the file runs
_spec.loader.exec_module(_mod)
