"""The package tests build wheels in subprocesses that ignore ``ZEPHON_PURE_PYTHON`` (a build
without a compiler gives the twins whatever the variable says), so the suite's second,
pure-Python pass would only repeat them: they are deselected there, like the ``native`` tests.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ZEPHON_PURE_PYTHON") != "1":
        return
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if item not in ours]
