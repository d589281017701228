"""The house rules a reviewer would otherwise check by hand: ruff's lint and format rules
(pyproject.toml's ``[tool.ruff]``) over everything the repository runs, and mypy over the
package (``[tool.mypy]``). A failure prints the tool's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["zephon", "tests", "benchmarks", "examples", "scripts", "setup.py"]


def _run(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module", autouse=True)
def _tools():
    for module in ("ruff", "mypy"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"{module} is not installed: pip install -e '.[test]' installs it")


def test_ruff_lint():
    _run("ruff", "check", *CHECKED)


def test_ruff_format():
    _run("ruff", "format", "--check", *CHECKED)


def test_mypy():
    _run("mypy", "zephon")
