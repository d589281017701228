"""The result file of a benchmark script: ``{name, machine, rows, ...}`` as JSON (numpy
scalars and arrays converted, NaN/inf as null), written atomically."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.machine import machine_info


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return repr(obj)


def _finite(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_results(
    name: str,
    rows: Any,
    results_dir: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``{name, machine, rows, ...extra}`` to ``results_dir/name.json``; returns the path.

    The write is atomic (temp file + rename) so an interrupted run leaves no half file.
    """
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "machine": machine_info(), "rows": rows, **(extra or {})}
    text = json.dumps(
        _finite(json.loads(json.dumps(payload, default=_json_default))), indent=2, allow_nan=False
    )
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path
