"""Aligned text tables of result rows, the way every benchmark script prints them."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def format_value(value: Any) -> str:
    """Compact human formatting: ints with thousands separators, floats to ~4 significant
    digits, None/NaN as '-'."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1e5:
            return f"{v:,.0f}"
        if a >= 1:
            return f"{v:,.{max(0, 3 - int(math.floor(math.log10(a))))}f}"
        if a >= 1e-3:
            return f"{v:.4f}"
        return f"{v:.3g}"
    return str(value)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]] | None = None,
    *,
    title: str | None = None,
    file: Any = None,
) -> str:
    """Print ``rows`` (dicts) as an aligned text table and return the text.

    ``columns`` picks and orders the keys; an entry may be ``(key, header)``. Numbers are
    right-aligned, text left-aligned. Missing values print as '-'.
    """
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    keys = [c[0] if isinstance(c, tuple) else c for c in columns]
    headers = [c[1] if isinstance(c, tuple) else c for c in columns]
    cells = [[format_value(row.get(k)) for k in keys] for row in rows]
    numeric = [
        all(
            isinstance(row.get(k), (int, float, np.integer, np.floating)) or row.get(k) is None
            for row in rows
        )
        for k in keys
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def fmt(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(fmt(headers))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in cells)
    text = "\n".join(lines)
    print(text, file=file if file is not None else sys.stdout, flush=True)
    return text
