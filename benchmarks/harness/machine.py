"""What a result was measured on: the CPU model, CPU count, memory, platform, Python, the
versions of the packages that matter, and the date."""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


_PACKAGES = (
    "zephon",
    "numpy",
    "grain",
    "msgpack",
    "zstandard",
    "multiprocess",
    "tqdm",
    "jax",
    "jaxlib",
    "pyarrow",
    "matplotlib",
)


def package_versions(packages: Iterable[str] = _PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            # Not installed (e.g. zephon run from a source checkout): ask the module itself.
            try:
                out[name] = str(importlib.import_module(name).__version__)
            except Exception:  # noqa: BLE001 - any failure just means "unknown"
                out[name] = None
    return out


def machine_info() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": _cpu_model(),
        "nproc": affinity if affinity is not None else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "packages": package_versions(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
