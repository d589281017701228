"""One version: pyproject.toml's is the one ``zephon.__version__`` says (the installed
distribution's is checked against it by scripts/smoke_installed.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import zephon

ROOT = Path(__file__).resolve().parents[2]


def test_zephon_version_is_pyprojects():
    with open(ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert zephon.__version__ == version, (
        f"zephon.__version__ is {zephon.__version__!r} but pyproject.toml says {version!r}: "
        "change both"
    )
    assert "__version__" in zephon.__all__
