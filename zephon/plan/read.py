"""The head of a plan: a work chunk into the records the first step takes.

With a leading built-in ``fetch`` that reads on this thread, the chunk's samples are read
as it is expanded (one batched read per dataset) and the steps start after fetch, which is
counted as having run; otherwise the records carry sample pointers and the steps start at
the first operator. The records are made when they are taken (:class:`ChunkRecords`), so a
lane that runs its chunk in steps keeps the samples, not a record per sample.

With ``spans`` (the plan's choice: :attr:`~zephon.plan.compile.Plan.spans`) a dataset that
offers token spans gives them instead of samples: a token file's documents as spans of the
mapped file, for the fused split-pack stage that takes them.

Over object storage a worker reads ahead: when a chunk arrives (a worker asks for two feed
units per lane ahead), :meth:`ReadChunks.read_ahead` starts its read on a thread, and
:meth:`ReadChunks.read` takes the result when the lane gets to the chunk. The samples are
the same; only when they are read changes.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from zephon.chunks import SamplePointer, WorkChunk
from zephon.operators.fetch import Fetch
from zephon.records import Contributor, Record

#: Threads reading chunks ahead over object storage, per process.
READ_AHEAD_THREADS = 8


class ChunkRecords:
    """The records of a chunk from offset ``first`` on, made as they are taken."""

    __slots__ = ("chunk", "comps", "samples", "first")

    def __init__(
        self, chunk: WorkChunk, comps: list[int], samples: list[Any] | None, first: int = 0
    ) -> None:
        self.chunk, self.comps, self.samples, self.first = chunk, comps, samples, first

    def __len__(self) -> int:
        return len(self.comps) - self.first

    def split(self, n: int) -> tuple[int, int, ChunkRecords | None]:
        """The next ``n`` offsets as ``(first, stop)``, and what is left (None: nothing)."""
        first, size = self.first, len(self.comps)
        stop = min(first + n, size)
        rest = None if stop >= size else ChunkRecords(self.chunk, self.comps, self.samples, stop)
        return first, stop, rest

    def take(self, n: int) -> tuple[list[Record], ChunkRecords | None]:
        """The records of the next ``n`` offsets, and what is left (None: nothing)."""
        first, stop, rest = self.split(n)
        chunk, comps = self.chunk, self.comps
        lane, cid = chunk.lane, chunk.chunk_id
        new = tuple.__new__
        if self.samples is None:
            indices = chunk.indices[first:stop].tolist()
            data: list[Any] = [
                SamplePointer(c, i) for c, i in zip(comps[first:stop], indices, strict=True)
            ]
        else:
            data = self.samples[first:stop]
        records = [
            Record(data[k], lane, [new(Contributor, (cid, off, 0, True))], {comps[off]: 1})
            for k, off in enumerate(range(first, stop))
        ]
        return records, rest


class ReadChunks:
    """Turns chunks into :class:`ChunkRecords` for the step at index ``start``.

    Args:
        fetch: the leading built-in fetch to read with, or None (the records carry
            pointers and the steps start at the first operator).
        spans: read token spans where a dataset offers them (see the module docstring).
    """

    def __init__(self, fetch: Fetch | None, spans: bool = False) -> None:
        self.fetch = fetch
        self.spans = spans
        self.start = 0 if fetch is None else 1
        self._ahead: dict[tuple[int, int], Future[list[Any]]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def read_ahead(self, chunk: WorkChunk) -> None:
        """Starts reading ``chunk``'s samples on a thread, where reads wait on object
        storage (nothing otherwise: local reads are cheaper in line)."""
        fetch = self.fetch
        if fetch is None or not fetch.remote:
            return
        key = (chunk.lane, chunk.chunk_id)
        if key in self._ahead:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="zephon-read")
        comps, indices = chunk.components.tolist(), chunk.indices.tolist()
        self._ahead[key] = self._pool.submit(fetch.read, comps, indices, chunk.lane, self.spans)

    def read(self, chunk: WorkChunk) -> ChunkRecords:
        comps = chunk.components.tolist()
        if self.fetch is None:
            return ChunkRecords(chunk, comps, None)
        ahead = self._ahead.pop((chunk.lane, chunk.chunk_id), None) if self._ahead else None
        if ahead is not None:
            return ChunkRecords(chunk, comps, ahead.result())
        samples = self.fetch.read(comps, chunk.indices.tolist(), chunk.lane, self.spans)
        return ChunkRecords(chunk, comps, samples)
