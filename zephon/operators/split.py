"""``split``: one sample into pieces of at most ``max_len`` tokens."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from zephon._args import positive_int
from zephon.errors import ContractViolation
from zephon.operators.base import Operator, OpTraits, Output, data_text
from zephon.records import Contributor, Record


def cut_bounds(n: int, size: int, first: int) -> list[int]:
    """Where a sample of ``n`` tokens is cut: ``[0, first, first + size, ..., n]``, piece
    ``j`` being tokens ``bounds[j]:bounds[j + 1]`` and child ``j`` of the sample. ``split``
    cuts at ``first = size = max_len`` (for ``n > max_len``); ``pack``'s concat-then-split
    at the room left in its row, then ``seq_len`` at a time."""
    return [0, *range(first, n, size), n]


class Split(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "split"

    def __init__(self, max_len: int, feature: str = "tokens") -> None:
        self.max_len = positive_int("split(max_len=...)", max_len)
        self.feature = feature

    def process_batch(self, records: list[Record]) -> list[Output]:
        # Most samples fit: they pass as they are, checked with no call per record.
        out: list[Output] = []
        feature, max_len, ndarray = self.feature, self.max_len, np.ndarray
        for r in records:
            data = r.data
            if type(data) is dict:
                main = data.get(feature)
                if type(main) is ndarray and main.ndim >= 1 and len(main) <= max_len:
                    out.append(r)
                    continue
            out.extend(self.process(r))
        return out

    def process(self, record: Record) -> Iterable[Output]:
        data = record.data
        try:
            main = data[self.feature]
        except (KeyError, TypeError, IndexError):
            raise KeyError(
                f"split: record data has no feature {self.feature!r} ({data_text(data)}); "
                f"tokenize first, or name the per-token feature with split(feature=...)"
            ) from None
        n = len(main)
        if n <= self.max_len:
            return (record,)
        first = record.contributors[0]
        if len(record.contributors) != 1 or first.child != 0 or not first.is_last_child:
            raise ContractViolation(
                f"split got a record that is not a whole sample ({len(record.contributors)} "
                f"contributors, first {tuple(first)}); split whole samples once, before pack"
            )
        chunk_id, offset, _, _ = record.contributors[0]
        ((component, _),) = record.component_tokens.items()
        # Per-token features (as many dimensions as the feature, and its length) are cut
        # along; the rest are copied to each piece: an image whose height happens to be the
        # document's length is not per-token.
        rank = np.ndim(main)
        aligned = [
            k
            for k, v in data.items()
            if isinstance(v, np.ndarray) and v.ndim == rank and v.ndim >= 1 and len(v) == n
        ]
        bounds = cut_bounds(n, self.max_len, self.max_len)
        last = len(bounds) - 2
        out: list[Output] = []
        for child in range(last + 1):
            start, stop = bounds[child], bounds[child + 1]
            piece = dict(data)
            for k in aligned:
                piece[k] = data[k][start:stop]
            out.append(
                Record(
                    piece,
                    record.lane,
                    [Contributor(chunk_id, offset, child, child == last)],
                    {component: stop - start},
                )
            )
        return out

    def fresh(self) -> Operator:
        return self

    def __repr__(self) -> str:
        return f"Split(max_len={self.max_len}, feature={self.feature!r})"
