"""Statistics of repeated measurements: median / min / max, and the two table columns
(median, range) the scripts print them as."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def summarize(values: Sequence[float]) -> dict[str, float]:
    """median / min / max / n of a list of numbers (NaNs ignored)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def median_and_range(
    label: str, values: Sequence[float], *, scale: float = 1.0, digits: int = 1
) -> dict[str, Any]:
    """Two table columns from repeated measurements: ``label``, the median, and ``label +
    " range"``, ``"min–max"``; both scaled by ``scale`` and given to ``digits`` decimals. Without
    a measurement both are None."""
    s = summarize(values)
    if s["n"] == 0:
        return {label: None, f"{label} range": None}
    lo, hi = s["min"] * scale, s["max"] * scale
    return {
        label: round(s["median"] * scale, digits),
        f"{label} range": f"{lo:.{digits}f}–{hi:.{digits}f}",
    }
