"""The core chosen at import matches ZEPHON_PURE_PYTHON, so the pure run really tests it."""

from __future__ import annotations

import importlib.util
import os

import zephon.shm
from zephon.shm import ring


def test_implementation_matches_environment() -> None:
    if os.environ.get("ZEPHON_PURE_PYTHON") == "1":
        expected = "python"
    else:
        expected = "native" if importlib.util.find_spec("zephon._ring") else "python"
    assert zephon.shm.IMPLEMENTATION == expected
    assert (
        ring._core.__name__ == {"native": "zephon._ring", "python": "zephon.shm.pyring"}[expected]
    )


def test_ring_reports_its_implementation(rings) -> None:
    producer, consumer = rings
    assert producer.implementation == consumer.implementation == zephon.shm.IMPLEMENTATION
    assert zephon.shm.IMPLEMENTATION in repr(producer)
