"""Loading the optional C extensions built from ``native/``."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Set to 1 to run every pure-Python twin instead of the C extensions.
PURE_PYTHON_ENV = "ZEPHON_PURE_PYTHON"


def load(name: str) -> ModuleType | None:
    """``zephon.<name>`` (a C extension), or None when it is not built or
    ``ZEPHON_PURE_PYTHON=1`` asks for pure Python."""
    if os.environ.get(PURE_PYTHON_ENV) == "1":
        return None
    try:
        return importlib.import_module(f"zephon.{name}")
    except ImportError:
        return None
