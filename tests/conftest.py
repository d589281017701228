"""Suite-wide rules.

Under ``CI=true`` a skipped test is a failed test: every piece a test needs (etcd, JAX, the
native ring, optional extras) is installed by the test command, so a skip there means
something is missing, and CI must say so instead of passing quietly.

Tests marked ``native`` compare the C extensions with their pure-Python twins, so they need
the extensions. Under ``ZEPHON_PURE_PYTHON=1`` (the second pass of ``scripts/test``, which
runs everything else on the Python twins) the extensions are off on purpose, and these tests
are deselected rather than skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parents[1]
# The tests are the package ``tests`` (pytest puts the checkout on sys.path); the processes
# they start (rank scripts, fault parents, benchmark children) import the same helpers.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
PURE_PYTHON = os.environ.get("ZEPHON_PURE_PYTHON") == "1"


def pytest_collection_modifyitems(config, items):
    if not PURE_PYTHON:
        return
    native = [item for item in items if item.get_closest_marker("native")]
    if native:
        config.hook.pytest_deselected(items=native)
        items[:] = [item for item in items if not item.get_closest_marker("native")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (a required piece is missing): {reason}"
