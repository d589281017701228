"""``batch``: stack records of one lane into numpy arrays.

The replay filter sits right before ``batch``, so batches always start from an empty buffer
at the checkpoint cut; that is why ``batch`` alone may hold records across an epoch
boundary. Rows are stacked when the batch is built (:meth:`~zephon.records.LazyRecord.
materialize`): restoring, or starting, to the first batch stacks one batch, not every batch
the lane's first chunk fills, and a worker builds it straight into a shared-memory ring
slot (the allocator it passes hands out arrays in the slot).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from zephon.operators.base import LaneStateOperator, OpTraits, Output
from zephon.records import Allocator, BatchRecord, Record, Tombstone


def _default_allocate(
    lane: int, spec: dict[str, tuple[tuple[int, ...], np.dtype]]
) -> dict[str, np.ndarray]:
    return {k: np.empty(shape, dtype) for k, (shape, dtype) in spec.items()}


class Batch(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=True, stateful=True)
    name = "batch"
    stalls_at_boundaries = True

    def __init__(self, batch_size: int, drop_last: bool = True) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch(batch_size=...) must be a positive int; got {batch_size!r}")
        self.batch_size = batch_size
        self.drop_last = drop_last

    def process(self, record: Record) -> Iterable[Output]:
        buf = self._lanes.get(record.lane)
        if buf is None:
            buf = self._lanes[record.lane] = []
        buf.append(record)
        if len(buf) < self.batch_size:
            return ()
        del self._lanes[record.lane]
        return (self._stack(buf),)

    def _stack(self, records: list[Record]) -> BatchRecord:
        contributors = [c for r in records for c in r.contributors]
        mix: dict[int, int] = {}
        for r in records:
            for comp, w in r.mix.items():
                mix[comp] = mix.get(comp, 0) + w
        lane, last, n = records[0].lane, records[-1].cursor, len(records)
        return BatchRecord(
            None, lane, contributors, mix, last, n, build=lambda a: self._stack_data(records, a)
        )

    def _stack_data(self, records: list[Record], allocate: Allocator | None) -> Any:
        first = records[0].data
        n = len(records)
        if isinstance(first, dict):
            spec = {}
            for k, v in first.items():
                a = np.asarray(v)
                try:
                    rows = [np.asarray(r.data[k]) for r in records]
                except KeyError:
                    raise KeyError(
                        f"batch: a record lacks feature {k!r} that the first one has"
                    ) from None
                if any(x.shape != a.shape for x in rows):
                    raise ValueError(
                        f"batch: feature {k!r} cannot be stacked (shapes {[x.shape for x in rows]}); "
                        "pad or pack records to one shape before batch"
                    )
                # the widest dtype of the rows: never narrow a later record silently
                spec[k] = ((n, *a.shape), np.result_type(*rows))
            out = (allocate or _default_allocate)(records[0].lane, spec)
            for k in spec:
                np.stack([r.data[k] for r in records], out=out[k])
            return out
        arrays = [np.asarray(r.data) for r in records]
        try:
            return np.stack(arrays)
        except ValueError as e:
            raise ValueError(
                f"batch: records cannot be stacked (shapes {[a.shape for a in arrays]}); "
                "pad or pack records to one shape before batch"
            ) from e

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        buf = self._lanes.pop(lane_id, None)
        if not buf:
            return ()
        if self.drop_last:
            # The remainder is never delivered; saying so keeps completion tracking honest.
            return (Tombstone(lane_id, [c for r in buf for c in r.contributors]),)
        return (self._stack(buf),)

    def pending(self, lane_id: int) -> int:
        return len(self._lanes.get(lane_id, ()))

    def fingerprint(self) -> str:
        return repr(self)

    def __repr__(self) -> str:
        return f"Batch(batch_size={self.batch_size}, drop_last={self.drop_last})"
