"""Checks of constructor arguments shared by the operators and the pipeline's options."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def positive_int(what: str, value: Any, unit: str = "") -> int:
    """``value`` as an ``int`` if it is an integer of at least 1 (a Python or numpy
    integer, not a bool), else a ValueError naming ``what`` (e.g.
    ``"batch(batch_size=...)"``) and the value; ``unit`` (e.g. ``"Hz"``) is shown with the
    rule."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        n = operator.index(value)
        if n >= 1:
            return n
    rule = f"a positive int ({unit})" if unit else "a positive int"
    raise ValueError(f"{what} must be {rule}; got {value!r}")
