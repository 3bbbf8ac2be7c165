"""Loads a file of ``scripts/`` as a module, so tests can call a benchmark's own functions (scripts/ is no package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# As `python scripts/x.py` would: the scripts import their shared harness (scripts/harness.py) by its bare name.
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py``, executed afresh (module-level patches of one test stay in its copy)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
