"""Batch helpers of the benchmark scripts: real and padded tokens of a batch, a batch copied
out of a loader's memory, and whether two batches are equal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def batch_token_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(real tokens, padded positions) of one batch.

    Real tokens: positions with ``tokens_segment_ids > 0`` when the batch has both ``tokens``
    and ``tokens_segment_ids``; otherwise non-pad (``!= 0``) entries of ``tokens``. Padded
    positions: every entry of ``tokens``. A batch without ``tokens`` counts (0, 0).
    """
    if "tokens" not in batch:
        return 0, 0
    tokens = np.asarray(batch["tokens"])
    seg = batch.get("tokens_segment_ids")
    if seg is not None:
        real = int(np.count_nonzero(np.asarray(seg) > 0))
    else:
        real = int(np.count_nonzero(tokens))
    return real, int(tokens.size)


def copy_batch(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A batch as ordinary arrays of its own (not views into a loader's shared memory, which
    can then be released)."""
    return {k: np.array(v, copy=True) for k, v in batch.items()}


def batches_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two batches have the same keys and equal arrays under each."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
