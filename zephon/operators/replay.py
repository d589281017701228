"""The replay filter: after a restore, drop each lane's already-delivered prefix.

The compiler inserts it right before ``batch`` (or at the tail). On a fresh run it passes
everything. After a restore it drops records of a lane until one whose cursor *equals* the
lane's target (the last record delivered before the checkpoint), drops that one too, then
forwards everything. Equality, not ``<=``: with shuffling, records do not leave in cursor
order, and a cursor is an identity, not a position. Every dropped record becomes a
tombstone so its offsets close and its chunk can be evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zephon.errors import CheckpointError
from zephon.operators.base import Operator, OpTraits, Output
from zephon.records import Contributor, FlushSentinel, Record, SampleCursor, Tombstone


class ReplayFilter(Operator):
    traits = OpTraits(preserves_cursor_order=True, stateful=True)

    def __init__(self, name: str, monotone: bool) -> None:
        self.name = name
        self.monotone = monotone
        self.targets: dict[int, SampleCursor] = {}  # lane -> its target; read by pack
        self.dropped: dict[int, int] = {}  # lane -> records dropped (see count_dropped)

    def set_target(self, lane: int, cursor: SampleCursor | None) -> None:
        if cursor is None:
            self.targets.pop(lane, None)
        else:
            self.targets[lane] = cursor

    def active(self, lane: int) -> bool:
        return lane in self.targets

    def process(self, record: Record) -> Iterable[Output]:
        if record.lane not in self.targets:
            return (record,)
        self.drop(record.lane, record.contributors[0])
        return (Tombstone(record.lane, record.contributors),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        """:meth:`process` on each; the records a run drops in a row become one tombstone."""
        targets = self.targets
        out: list[Output] = []
        last: Tombstone | None = None  # the tombstone the run of drops goes into
        for r in records:
            if r.lane not in targets:
                out.append(r)
                last = None
                continue
            self.drop(r.lane, r.contributors[0])
            if last is not None and last.lane == r.lane:
                last.contributors.extend(r.contributors)
            else:
                last = Tombstone(r.lane, list(r.contributors))
                out.append(last)
        return out

    def drop(self, lane: int, first: Contributor) -> None:
        """Drops a record of ``lane``, which must have a target; ``first`` is the record's
        first contributor (its cursor). Also called by a ``pack`` right before this filter,
        which turns the bins that would be dropped into tombstones without building them."""
        target = self.targets[lane]
        self.count_dropped(lane, 1)
        if first[0] == target[1] and first[1] == target[2] and first[2] == target[3]:
            del self.targets[lane]
        elif self.monotone:
            cursor = SampleCursor(lane, first[0], first[1], first[2])
            if cursor > target:
                self._lost(target, f"a later record {tuple(cursor)} arrived first")

    def count_dropped(self, lane: int, n: int) -> None:
        """Counts ``n`` records of ``lane`` dropped (by this filter, or for it by a stage
        that drops bins before they become records)."""
        self.dropped[lane] = self.dropped.get(lane, 0) + n

    def on_sentinel(self, sentinel: FlushSentinel) -> None:
        target = self.targets.get(sentinel.lane)
        if target is not None and (sentinel.final or sentinel.boundary > target.chunk_id):
            why = (
                "the lane ended"
                if sentinel.final
                else f"its epoch closed at chunk {sentinel.boundary}"
            )
            self._lost(target, why)

    def _lost(self, target: SampleCursor, why: str) -> None:
        raise CheckpointError(
            f"replay target {tuple(target)} of lane {target.lane} never reappeared ({why}): the "
            "pipeline does not reproduce the checkpointed run. Restore into the same pipeline "
            "definition and datasets, and make map/filter functions deterministic"
        )

    def fresh(self) -> Operator:
        return ReplayFilter(self.name, self.monotone)

    def fingerprint(self) -> str:
        return "ReplayFilter()"

    def __repr__(self) -> str:
        return f"ReplayFilter(name={self.name!r})"


class ReplayView:
    """Which lanes are replaying towards a restore's target: read-only, for a stage that
    can replay more cheaply (by length); only the replay filter drops records."""

    __slots__ = ("_targets",)

    def __init__(self, targets: Mapping[int, Any]) -> None:
        self._targets = targets

    def replaying(self, lane: int) -> bool:
        return lane in self._targets
