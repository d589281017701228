"""``batch``: stack records of one lane into numpy arrays.

The replay filter sits right before ``batch``, so batches always start from an empty buffer
at the checkpoint cut; that is why ``batch`` alone may hold records across an epoch
boundary. Rows are stacked when the batch is built (:meth:`~zephon.records.LazyRecord.
materialize`): restoring, or starting, to the first batch stacks one batch, not every batch
the lane's first chunk fills, and a worker builds it straight into a shared-memory ring
slot (the allocator it passes hands out arrays in the slot).

With ``pad_last`` a lane's last partial batch is filled up to ``batch_size`` with padding
rows (each feature's pad value: ``pad_values``, else what the operators before it pad
with, else 0) and every batch carries a boolean ``batch_mask`` marking its real rows; in
``output="lockstep"`` a lane that ended contributes padding rows (:meth:`Batch.padding_like`)
until every lane has ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from zephon.operators.base import (
    LaneStateOperator,
    OpTraits,
    Output,
    PipelineContext,
    check_fits,
    record_text,
)
from zephon.records import Allocator, BatchRecord, Record, Tombstone

#: The most records one batch may stack. ``batch`` holds a lane's records (a few hundred
#: bytes of Python objects each, before their data) until it has ``batch_size`` of them, and
#: a batch passes through one worker ring slot: 2**24 records are gigabytes before any data.
#: A size no lane ever fills (``batch(2**40)``) raises nothing: the lane's buffer grows until
#: memory runs out.
MAX_BATCH_SIZE = 2**24


def _default_allocate(
    lane: int, spec: dict[str, tuple[tuple[int, ...], np.dtype]]
) -> dict[str, np.ndarray]:
    return {k: np.empty(shape, dtype) for k, (shape, dtype) in spec.items()}


class Batch(LaneStateOperator):
    traits = OpTraits(preserves_cursor_order=True, stateful=True)
    name = "batch"
    stalls_at_boundaries = True

    def __init__(
        self,
        batch_size: int,
        drop_last: bool = True,
        pad_last: bool = False,
        pad_values: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch(batch_size=...) must be a positive int; got {batch_size!r}")
        if batch_size > MAX_BATCH_SIZE:
            raise ValueError(
                f"batch(batch_size=...) must be at most {MAX_BATCH_SIZE} (2**24 records: a "
                f"lane's records wait in memory until its batch is full); got {batch_size}: "
                "give the batch of one lane (a step's global batch is that times the lanes "
                "it takes), or stack further in the training loop"
            )
        if not isinstance(pad_last, bool):
            raise TypeError(f"batch(pad_last=...) must be True or False; got {pad_last!r}")
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise TypeError(
                "batch(pad_values=...) must be a dict of feature name to pad value; got "
                f"{type(pad_values).__name__}"
            )
        if pad_values is not None and "batch_mask" in pad_values:
            raise ValueError("batch(pad_values=...): 'batch_mask' is written by batch itself")
        self.batch_size = batch_size
        self.drop_last = drop_last and not pad_last
        self.pad_last = pad_last
        self.pad_values: dict[str, Any] = dict(pad_values or {})
        #: The components' names, for errors that name a record's sample (see bind).
        self.names: tuple[str, ...] = ()
        #: Records dropped with each lane's last partial batch (``drop_last``): a count,
        #: not state (the end-of-data warning reads it; flush resets nothing of it).
        self.dropped_at_end: dict[int, int] = {}

    def fresh(self) -> Batch:
        clone: Batch = super().fresh()  # type: ignore[assignment]
        clone.dropped_at_end = {}
        return clone

    def bind(self, ctx: PipelineContext) -> None:
        self.names = tuple(ctx.names)

    def process(self, record: Record) -> Iterable[Output]:
        return self.process_batch([record])

    def process_batch(self, records: list[Record]) -> list[Output]:
        """Each lane's records into its buffer, a batch stacked whenever it holds
        ``batch_size`` (a lane's run of records fills its batches at once)."""
        out: list[Output] = []
        lanes, size = self._lanes, self.batch_size
        i, n = 0, len(records)
        while i < n:
            lane = records[i].lane
            j = i + 1
            while j < n and records[j].lane == lane:
                j += 1
            buf = lanes.pop(lane, None) or []
            k = i
            while k < j:  # fill the lane's buffer up to a batch, stack it, go on
                take = min(size - len(buf), j - k)
                buf += records[k : k + take]
                k += take
                if len(buf) == size:
                    out.append(self._stack(buf))
                    buf = []
            if buf:
                lanes[lane] = buf
            i = j
        return out

    def _stack(self, records: list[Record], padded: bool = False) -> BatchRecord:
        writer = _row_writer(records)
        if writer is not None:  # the rows' writer makes the batch's parts in one call
            contributors, mix = writer.parts(records)
        else:
            contributors = [c for r in records for c in r.contributors]
            mix = {}
            for r in records:
                for comp, w in r.component_tokens.items():
                    mix[comp] = mix.get(comp, 0) + w
        lane, last, n = records[0].lane, records[-1].cursor, len(records)
        if not self.pad_last:
            return BatchRecord(
                None,
                lane,
                contributors,
                mix,
                last,
                n,
                build=lambda a: self._stack_data(records, a, writer),
            )
        return BatchRecord(
            None, lane, contributors, mix, last, n, build=lambda a: self._stack_padded(records, a)
        )

    def _stack_padded(self, records: list[Record], allocate: Allocator | None) -> Any:
        """``batch_size`` rows: the records', then padding; with ``batch_mask``."""
        first = records[0].data
        if not isinstance(first, dict):
            raise TypeError(
                "batch(pad_last=True) needs records that are dicts of features (it adds a "
                f"'batch_mask' feature); got {type(first).__name__}: map them to a dict first"
            )
        n, size = len(records), self.batch_size
        if "batch_mask" in first:
            raise ValueError(
                "batch(pad_last=True) writes a 'batch_mask' feature, and the records already "
                "have one: rename it before batch"
            )
        rows: list[Any] = list(records)
        if n < size:
            pad = _Padding(self._pad_row(first), records[0].lane)
            rows = [*records, *([pad] * (size - n))]
        spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "batch_mask": ((size,), np.dtype(bool))
        }
        out = self._stack_data(rows, allocate, _row_writer(rows), extra=spec)
        mask = out["batch_mask"]
        mask[:n] = True
        mask[n:] = False
        return out

    def _pad_row(self, data: dict[str, Any]) -> dict[str, np.ndarray]:
        """One padding row shaped like ``data``: every feature its pad value."""
        row = {}
        for k, v in data.items():
            a = np.asarray(v)
            value = self.pad_values.get(k, 0)
            check_fits(f"batch(pad_values={{{k!r}: {value!r}}})", k, value, a.dtype)
            row[k] = np.full(a.shape, value, dtype=a.dtype)
        return row

    def padding_like(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of padding rows shaped like ``batch`` (a lockstep step's stand-in for a
        lane that ended); its ``batch_mask`` is all False."""
        out = {}
        for k, a in batch.items():
            value = False if k == "batch_mask" else self.pad_values.get(k, 0)
            out[k] = np.full(a.shape, value, dtype=a.dtype)
        return out

    def _stack_data(
        self,
        records: list[Any],
        allocate: Allocator | None,
        writer: Any,
        extra: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None,
    ) -> Any:
        """The batch of ``records``, its arrays from ``allocate``; ``writer`` is their
        common row writer (:func:`_row_writer`), or None."""
        n = len(records)
        fields = writer.batch_layout(records) if writer is not None else None
        if fields is not None:  # the records' writer writes them into their rows
            spec = {name: ((n, *shape), dtype) for name, shape, dtype in fields}
            if extra:
                spec.update(extra)
            out = (allocate or _default_allocate)(records[0].lane, spec)
            writer.write_rows(records, out)
            return out
        first = records[0].data
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
                dtype, shape = a.dtype, a.shape
                for i, x in enumerate(rows):  # one dtype and shape, never a silent upcast
                    if (x.dtype != dtype and not _same_text(x.dtype, dtype)) or x.shape != shape:
                        raise self._mismatch(f"feature {k!r}", records, i, a, x)
                if dtype.kind in _TEXT:  # strings (or bytes) of any length: the longest's
                    dtype = np.result_type(*rows)
                spec[k] = ((n, *shape), dtype)
            stacked = list(spec)
            if extra:
                spec.update(extra)
            out = (allocate or _default_allocate)(records[0].lane, spec)
            for k in stacked:
                np.stack([r.data[k] for r in records], out=out[k])
            return out
        arrays = [np.asarray(r.data) for r in records]
        a = arrays[0]
        for i, x in enumerate(arrays):
            if (x.dtype != a.dtype and not _same_text(x.dtype, a.dtype)) or x.shape != a.shape:
                raise self._mismatch("records", records, i, a, x)
        return np.stack(arrays)

    def _mismatch(
        self, what: str, records: list[Any], i: int, first: np.ndarray, got: np.ndarray
    ) -> ValueError:
        """The error for record ``i`` whose ``what`` (a feature, or the record itself) is not
        of the dtype and shape of the batch's first record's: it names both records' samples
        and both dtypes or shapes."""
        differs, fixes = [], []
        if got.dtype != first.dtype and not _same_text(got.dtype, first.dtype):
            differs.append(f"dtype {got.dtype} (the first record's: {first.dtype})")
            fixes.append(
                f"cast it to one dtype in .map() (e.g. np.asarray(x, {str(first.dtype)!r}))"
            )
        if got.shape != first.shape:
            differs.append(f"shape {got.shape} (the first record's: {first.shape})")
            fixes.append("pad or pack records to one shape before batch")
        return ValueError(
            f"batch: {what} cannot be stacked: {record_text(records[i], self.names)} has "
            f"{' and '.join(differs)}, where the batch's first record is "
            f"{record_text(records[0], self.names)}; the records of a batch need one dtype "
            f"and shape (per feature): {', and '.join(fixes)}"
        )

    def flush(self, reset: bool, lane_id: int) -> Iterable[Output]:
        buf = self._lanes.pop(lane_id, None)
        if not buf:
            return ()
        if self.drop_last:
            # The remainder is never delivered; saying so keeps completion tracking honest.
            self.dropped_at_end[lane_id] = self.dropped_at_end.get(lane_id, 0) + len(buf)
            return (Tombstone(lane_id, [c for r in buf for c in r.contributors]),)
        return (self._stack(buf),)

    def pending(self, lane_id: int) -> int:
        return len(self._lanes.get(lane_id, ()))

    def fingerprint(self) -> str:
        return repr(self)

    def __repr__(self) -> str:
        if not self.pad_last:  # today's text: checkpoints made before pad_last match
            return f"Batch(batch_size={self.batch_size}, drop_last={self.drop_last})"
        pads = dict(sorted(self.pad_values.items()))
        return f"Batch(batch_size={self.batch_size}, pad_last=True, pad_values={pads!r})"


#: Dtype kinds of strings and bytes: a feature of them may hold any lengths (the batch's
#: dtype is the longest's); every other feature keeps one dtype.
_TEXT = "SU"


def _same_text(a: np.dtype, b: np.dtype) -> bool:
    """Whether ``a`` and ``b`` are strings (or bytes) of two lengths."""
    return a.kind == b.kind and a.kind in _TEXT


def _row_writer(records: list[Any]) -> Any:
    """The records' common :meth:`~zephon.records.Record.row_writer`, or None."""
    writer = records[0].row_writer()
    if writer is None:
        return None
    for r in records:
        if r.row_writer() is not writer:
            return None
    return writer


class _Padding:
    """A padding row where ``_stack_data`` expects a record."""

    __slots__ = ("data", "lane")

    def row_writer(self) -> None:
        return None

    def __init__(self, data: dict[str, np.ndarray], lane: int) -> None:
        self.data = data
        self.lane = lane
