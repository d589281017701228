"""What flows between operators: records, tombstones and flush sentinels.

A record's identity is its :class:`SampleCursor` ``(lane, chunk_id, offset, child)``, the
cursor of its first fragment; it is never an ordinal position. ``contributors`` lists every
piece of every sample that went into the record, which is how the parent closes per-offset
completion when the record is delivered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from zephon._native import load

_NATIVE = load("_track")  # whole_samples in C

#: Where a deferred record's arrays go when it is built: ``allocate(lane, {name: (shape,
#: dtype)})`` returns an empty array per name (a worker hands out views of a ring slot).
Allocator = Callable[[int, dict[str, tuple[tuple[int, ...], np.dtype]]], dict[str, np.ndarray]]


class SampleCursor(NamedTuple):
    """The unique identity of a record: ``(lane, chunk_id, offset, child)``."""

    lane: int
    chunk_id: int
    offset: int
    child: int


class Contributor(NamedTuple):
    """One piece of one sample that went into a record."""

    chunk_id: int
    offset: int
    child: int
    is_last_child: bool


def whole_samples(chunk_id: int, first: int, stop: int) -> list[tuple[Contributor]]:
    """The contributors of the whole samples at offsets ``first:stop`` of chunk
    ``chunk_id``, one 1-tuple per sample. In C they are made untracked by CPython's cyclic
    collector (a contributor holds ints only); a process of thousands of lanes holds
    hundreds of thousands of them in waiting pieces and rows, each of which every full
    collection would otherwise scan."""
    if _NATIVE is not None:
        return _NATIVE.whole_samples(Contributor, chunk_id, first, stop)  # type: ignore[no-any-return]
    new = tuple.__new__
    return [(new(Contributor, (chunk_id, off, 0, True)),) for off in range(first, stop)]


class Record:
    """Data plus identity plus contributor metadata.

    Attributes:
        data: the payload (raw sample after ``fetch``, a dict of arrays after ``tokenize``).
        lane: the lane the record belongs to.
        contributors: the sample pieces in the record, first fragment first.
        component_tokens: per-component weight carried by the record (token counts once tokenized,
            1 per sample before that); ``ensure_mixture`` balances on it.
    """

    __slots__ = ("data", "lane", "contributors", "component_tokens")

    def __init__(
        self,
        data: Any,
        lane: int,
        contributors: list[Contributor],
        component_tokens: dict[int, int],
    ) -> None:
        self.data = data
        self.lane = lane
        self.contributors = contributors
        self.component_tokens = component_tokens

    @property
    def cursor(self) -> SampleCursor:
        first = self.contributors[0]
        return SampleCursor(self.lane, first[0], first[1], first[2])

    def row_writer(self) -> Any:
        """What can write this record straight into one row of a batch's arrays instead of
        it being built and copied there, or None (this default) where nothing can. Records
        of one writer go into a batch at once where ``writer.batch_layout(records)`` gives
        ``[(name, shape, dtype), ...]`` (not None): ``writer.write_rows(records, arrays)``
        then fills an empty array of ``(len(records), *shape)`` per name; and
        ``writer.parts(records)`` gives their contributors one after another and their
        component tokens summed (the batch's)."""
        return None

    def replace(self, data: Any) -> Record:
        """The same identity carrying new data."""
        return Record(data, self.lane, self.contributors, self.component_tokens)

    def __repr__(self) -> str:
        return f"Record(cursor={tuple(self.cursor)}, contributors={len(self.contributors)})"


_DATA = Record.__dict__["data"]  # the slot itself, under LazyRecord's property


class LazyRecord(Record):
    """A record whose data is built on first access to ``data`` (or :meth:`materialize`).

    ``pack`` emits these: after a restore, the replay filter drops every packed record up
    to the lane's target without reading its data, so replayed bins are placed (which needs
    only lengths) but never assembled. ``batch`` emits these, so that a batch is stacked
    where it is wanted, when it is wanted. Anything that reads ``data`` gets the real thing.
    """

    __slots__ = ("_build",)

    def __init__(
        self,
        build: Callable[[Allocator | None], Any] | None,
        lane: int,
        contributors: list[Contributor],
        component_tokens: dict[int, int],
    ) -> None:
        _DATA.__set__(self, None)
        self._build: Callable[[Allocator | None], Any] | None = build
        self.lane = lane
        self.contributors = contributors
        self.component_tokens = component_tokens

    @property  # type: ignore[override]
    def data(self) -> Any:
        return self.materialize(None)

    @data.setter
    def data(self, value: Any) -> None:
        _DATA.__set__(self, value)
        self._build = None

    def materialize(self, allocate: Allocator | None) -> Any:
        """The data, built now if it was not, its arrays from ``allocate`` (None: new ones)
        where the builder stacks arrays: a worker builds a batch straight into a ring slot."""
        build = self._build
        if build is not None:
            _DATA.__set__(self, build(allocate))
            self._build = None
        return _DATA.__get__(self)

    @property
    def built(self) -> bool:
        return self._build is None


class BatchRecord(LazyRecord):
    """The output of ``batch``: stacked data of several records of one lane.

    ``last_cursor`` is the cursor of the last record stacked into it; once the batch is
    delivered it becomes the lane's replay cursor. Given ``build`` instead of ``data``, the
    rows are stacked on first access (see :meth:`LazyRecord.materialize`).
    """

    __slots__ = ("last_cursor", "num_records")

    def __init__(
        self,
        data: Any,
        lane: int,
        contributors: list[Contributor],
        component_tokens: dict[int, int],
        last_cursor: SampleCursor,
        num_records: int,
        build: Callable[[Allocator | None], Any] | None = None,
    ) -> None:
        super().__init__(build, lane, contributors, component_tokens)
        if build is None:
            _DATA.__set__(self, data)
        self.last_cursor = last_cursor
        self.num_records = num_records

    def __repr__(self) -> str:
        return f"BatchRecord(lane={self.lane}, records={self.num_records}, last={tuple(self.last_cursor)})"


class Tombstone:
    """A record-less message: these contributors were dropped and will never be delivered."""

    __slots__ = ("lane", "contributors")

    def __init__(self, lane: int, contributors: list[Contributor]) -> None:
        self.lane = lane
        self.contributors = contributors

    def __repr__(self) -> str:
        return f"Tombstone(lane={self.lane}, contributors={self.contributors})"


class FlushSentinel:
    """Marks an epoch boundary of one lane: history-dependent operators flush and reset.

    ``boundary`` is the id of the first chunk after the sentinel. ``final`` marks the end of
    the lane's stream: then even ``batch`` emits (or drops) what it holds.
    """

    __slots__ = ("lane", "boundary", "final")

    def __init__(self, lane: int, boundary: int, final: bool = False) -> None:
        self.lane = lane
        self.boundary = boundary
        self.final = final

    def __repr__(self) -> str:
        return f"FlushSentinel(lane={self.lane}, boundary={self.boundary}, final={self.final})"
