"""Runs a compiled operator chain over feed units of the lanes this process owns.

The same object runs in the parent (``workers=0``) and inside each worker process. A feed
unit is what :meth:`LaneTracker.pull` returns: a chunk, possibly followed by a flush
sentinel, or the final sentinel. Items move through the chain one operator at a time (a
whole layer per operator), which gives exactly the order a record-at-a-time push would,
and lets stateless operators work on a chunk at once, on threads if they ask for it.

Tombstones skip the rest of the chain; they travel with the lane's next output. Outputs are
:class:`LaneOutput`: one record or batch (or none, at the end of a lane) plus the
contributors that were tombstoned since the lane's previous output.

Operators' counters are kept per lane. The first output of every run of the chain carries
a :class:`LaneCounts` snapshot of its lane's counters, so what ``stats()`` reports can be
counted at delivery: the same whichever process ran the lane and however far ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from zephon.chunks import SamplePointer, WorkChunk
from zephon.errors import ContractViolation
from zephon.operators.base import Operator, OpStats
from zephon.operators.fetch import Fetch
from zephon.operators.fused import TokenizeSplitPack, fusable
from zephon.operators.pack import Pack
from zephon.records import Contributor, FlushSentinel, Record, Tombstone
from zephon.replay import ReplayFilter


class LaneCounts(NamedTuple):
    """One lane's operator counters at one moment: ``(records_in, records_out, seconds)``
    per operator of the chain, and how many records the replay filter dropped."""

    ops: list[tuple[int, int, float]]
    replay_dropped: int


class LaneOutput:
    """What a lane hands to the consumer: ``record`` (None at the end) + tombstoned pieces,
    and, on the first output of a run of the chain, the lane's counters after that run."""

    __slots__ = ("lane", "record", "tombstones", "end", "lease", "counts")

    def __init__(
        self,
        lane: int,
        record: Record | None,
        tombstones: list[Contributor],
        end: bool = False,
        counts: LaneCounts | None = None,
    ) -> None:
        self.lane = lane
        self.record = record
        self.tombstones = tombstones
        self.end = end
        self.lease: Any = None  # a zero-copy ring slot to release once the consumer moves on
        self.counts = counts

    def __repr__(self) -> str:
        return f"LaneOutput(lane={self.lane}, record={self.record!r}, tombstones={len(self.tombstones)}, end={self.end})"


def expand(chunk: WorkChunk) -> list[Record]:
    """One record per pointer; its data is the pointer until ``fetch`` resolves it."""
    lane, cid = chunk.lane, chunk.chunk_id
    comps = chunk.components.tolist()
    idx = chunk.indices.tolist()
    return [
        Record(SamplePointer(c, i), lane, [Contributor(cid, off, 0, True)], {c: 1})
        for off, (c, i) in enumerate(zip(comps, idx, strict=True))
    ]


_T = TypeVar("_T")


class _Fetched:
    """The records of a read chunk from offset ``first`` on, made when they are pushed: a
    lane that runs its unit in steps keeps its samples, not a record per sample."""

    __slots__ = ("chunk", "comps", "samples", "first")

    def __init__(self, chunk: WorkChunk, comps: list[int], samples: list[Any], first: int) -> None:
        self.chunk, self.comps, self.samples, self.first = chunk, comps, samples, first

    def __len__(self) -> int:
        return len(self.samples) - self.first

    def take(self, n: int) -> tuple[list[Record], _Fetched | None]:
        """The records of the next ``n`` offsets, and what is left (None: nothing)."""
        stop = self.first + n
        records = Fetch.records(self.chunk, self.comps, self.samples, self.first, stop)
        if stop >= len(self.samples):
            return records, None
        return records, _Fetched(self.chunk, self.comps, self.samples, stop)


#: How many samples :meth:`ChainRunner.feed` runs first while a lane's first output is
#: awaited (about the pieces of a few packed rows); each further step runs twice as many.
FIRST_STEP = 8
_UNREAD = -1  # a feed segment that is a chunk still to read

#: Run ``tokenize -> split -> pack`` as one stage where the chain has it (see
#: :mod:`zephon.operators.fused`); tests turn it off to compare the two paths.
FUSE = True


class ChainRunner:
    def __init__(self, ops: Sequence[Operator], pool: ThreadPoolExecutor | None = None) -> None:
        self.ops = list(ops)
        self.pool = pool
        #: The counters of the lane being run (see :meth:`_select`), one per operator.
        self.stats: list[OpStats] = [OpStats() for _ in self.ops]
        self._lane_stats: dict[int, list[OpStats]] = {}
        self._tombs: dict[int, list[Contributor]] = {}
        self._rest: dict[int, list[tuple[int, list[Any]]]] = {}  # see feed(first=True)
        filt = [op for op in self.ops if isinstance(op, ReplayFilter)]
        self._filter = filt[0] if filt else None
        # What _push runs: the operators, with fusable runs replaced by their fused stage
        # (which keeps the three operators' own counters: its step has none, ``None``).
        self._steps: list[tuple[Operator, int | None]] = []
        self._fused: list[tuple[TokenizeSplitPack, int]] = []
        self._unused = OpStats()
        i = 0
        while i < len(self.ops):
            fused = fusable(self.ops, i, threaded=pool is not None) if FUSE else None
            if fused is not None:
                tok, split, pack = fused
                stage = TokenizeSplitPack(tok, split, pack, (OpStats(), OpStats(), OpStats()))
                self._steps.append((stage, None))
                self._fused.append((stage, i))
                i += 3
            else:
                self._steps.append((self.ops[i], i))
                i += 1
        # A pack right before the replay filter drops, after a restore, the bins the filter
        # would drop, as it emits them: they are never turned into records.
        for before, op in zip(self.ops, self.ops[1:], strict=False):
            if isinstance(op, ReplayFilter) and type(before) is Pack:
                before.screen = op
        # A leading built-in fetch on this thread reads each chunk's samples as it expands
        # it (it is stateless: sentinels pass it untouched); the chain proper starts after it.
        head = self.ops[0] if self.ops else None
        self._fetch = head if type(head) is Fetch and head.parallelism <= 1 else None
        # After it a fused stage takes the samples of a replaying lane's chunk straight from
        # fetch (see TokenizeSplitPack.forward): no record per sample.
        second = self._steps[1][0] if self._fetch is not None and len(self._steps) > 1 else None
        self._forward = second if isinstance(second, TokenizeSplitPack) else None

    def _select(self, lane: int) -> None:
        """Points the counters (``stats``, the fused stages') at ``lane``'s."""
        stats = self._lane_stats.get(lane)
        if stats is None:
            stats = self._lane_stats[lane] = [OpStats() for _ in self.ops]
        self.stats = stats
        for stage, i in self._fused:
            stage.stats = (stats[i], stats[i + 1], stats[i + 2])

    def counts(self, lane: int) -> LaneCounts:
        """``lane``'s counters now."""
        stats = self._lane_stats.get(lane) or [OpStats() for _ in self.ops]
        dropped = self._filter.dropped.get(lane, 0) if self._filter is not None else 0
        return LaneCounts([(s.records_in, s.records_out, s.seconds) for s in stats], dropped)

    def feed(
        self, items: Sequence[WorkChunk | FlushSentinel], first: bool = False
    ) -> list[LaneOutput]:
        """Runs a feed unit of one lane through the chain; the lane's outputs.

        With ``first`` (the lane has not produced an output since a start or restore), the
        unit's samples go through in growing steps (see :data:`FIRST_STEP`) and the call
        returns as soon as an output is ready: the first batch waits for the samples it
        needs, not for the whole chunk. The rest waits in the runner; :meth:`resume` runs it
        (before the lane's next unit). Operators see the same records in the same order
        either way.
        """
        start = 0 if self._fetch is None else 1
        lane = items[0].lane
        segments: list[tuple[int, list[Any]]] = []
        layer: list[Any] = []
        for it in items:
            if not isinstance(it, WorkChunk):
                layer.append(it)
            elif self._fetch is None:
                layer.extend(expand(it))
            else:  # read when the segments before it have run (see _read)
                if layer:
                    segments.append((start, layer))
                    layer = []
                segments.append((_UNREAD, [it]))
        if layer:
            segments.append((start, layer))
        return self._drive(lane, segments, first)

    def suspended(self, lane: int) -> bool:
        """Whether a :meth:`feed` with ``first`` left part of ``lane``'s unit to run."""
        return lane in self._rest

    def resume(self, lane: int, first: bool = False) -> list[LaneOutput]:
        """Runs what a :meth:`feed` with ``first`` left of ``lane``'s unit: all of it, or
        with ``first`` again until an output is ready."""
        return self._drive(lane, self._rest.pop(lane), first)

    def _drive(
        self, lane: int, segments: list[tuple[int, list[Any]]], first: bool
    ) -> list[LaneOutput]:
        """Pushes ``segments`` (``(stage, items)``, in order, all of ``lane``) through the
        chain; with ``first``, stops once a record has come out and keeps the rest in
        ``_rest``."""
        self._select(lane)
        start = 0 if self._fetch is None else 1
        produced: list[Any] = []
        final_lanes: list[int] = []
        step = FIRST_STEP
        while segments:
            stage, items = segments.pop(0)
            if stage == _UNREAD:
                got = self._read(items[0], first, produced)
                if got and segments and type(got[-1][1]) is list and segments[0][0] == got[-1][0]:
                    got[-1] = (got[-1][0], got[-1][1] + segments.pop(0)[1])  # one push, not two
                segments[:0] = got
                continue
            if type(items) is _Fetched:
                items, rest = items.take(step if first else len(items))
                if rest is not None:
                    segments.insert(0, (stage, rest))  # type: ignore[arg-type]
                    step *= 2  # few calls, should the first output need the whole chunk
            elif first and stage == start and len(items) > step:
                segments.insert(0, (stage, items[step:]))
                items = items[:step]
                step *= 2
            final_lanes.extend(it.lane for it in items if type(it) is FlushSentinel and it.final)
            produced.extend(self._push(items, stage))
            if first and segments and any(type(it) is not Tombstone for it in produced):
                self._rest[lane] = segments
                break
        out: list[LaneOutput] = []
        for it in produced:
            if type(it) is Tombstone:
                self._tombs.setdefault(lane, []).extend(it.contributors)
            else:
                out.append(LaneOutput(lane, it, self._tombs.pop(lane, [])))
        if final_lanes:
            out.append(LaneOutput(lane, None, self._tombs.pop(lane, []), end=True))
        if out:
            out[0].counts = self.counts(lane)
        return out

    def _read(
        self, chunk: WorkChunk, first: bool, produced: list[Any]
    ) -> list[tuple[int, list[Any]]]:
        """Reads ``chunk`` with the leading fetch: the segment of its records. A replaying
        lane's samples go to the fused stage's :meth:`~TokenizeSplitPack.forward` instead,
        whose outputs join ``produced``; with ``first`` it returns once the replay target is
        found, leaving the samples after it as records."""
        fetch, forward = self._fetch, self._forward
        assert fetch is not None
        start = 1
        if forward is None or not forward.forwards(chunk.lane):
            if not first:
                return [(start, self._timed_fetch(fetch, chunk, fetch.expand_chunk))]
            comps, samples = self._timed_fetch(fetch, chunk, fetch.read_chunk)
            return [(start, _Fetched(chunk, comps, samples, 0))]  # type: ignore[list-item]
        comps, samples = self._timed_fetch(fetch, chunk, fetch.read_chunk)
        keys = [(chunk.chunk_id, off) for off in range(len(comps))]
        pieces, done = forward.forward(chunk.lane, keys, comps, samples, to_target=first)
        produced.extend(self._push(pieces, start + 1))
        if done == len(samples):
            return []
        if first:
            return [(start, _Fetched(chunk, comps, samples, done))]  # type: ignore[list-item]
        return [(start, fetch.records(chunk, comps, samples, done))]

    def _timed_fetch(self, fetch: Fetch, chunk: WorkChunk, read: Callable[[WorkChunk], _T]) -> _T:
        """``read(chunk)``, counted in fetch's stats."""
        t0 = time.perf_counter()
        got = read(chunk)
        st = self.stats[0]
        st.records_in += len(chunk)
        st.records_out += len(chunk)
        st.seconds += time.perf_counter() - t0
        return got

    def _push(self, items: list[Any], start: int = 0) -> list[Any]:
        if not items:
            return []
        out: list[Any] = []
        made: OpStats | None = None  # the counters of the operator that made ``items``
        stats = self.stats
        for op, index in self._steps[start:]:
            st = self._unused if index is None else stats[index]
            if not items:
                break  # all tombstones: they skip the rest of the chain
            t0 = time.perf_counter()
            n_in = n_sentinels = n_tombs = 0
            nxt: list[Any] = []
            run: list[Record] = []
            for it in items:
                kind = type(it)
                if kind is Tombstone:
                    out.append(it)
                    n_tombs += 1
                elif kind is FlushSentinel:
                    if run:
                        nxt.extend(self._run(op, run))
                        run = []
                    nxt.extend(self._sentinel(op, it))
                    nxt.append(it)
                    n_sentinels += 1
                else:
                    n_in += 1
                    run.append(it)
            if run:
                nxt.extend(self._run(op, run))
            st.records_in += n_in
            st.seconds += time.perf_counter() - t0
            if made is not None:
                made.records_out -= n_tombs  # what it dropped is no output
            items, made = nxt, st
            st.records_out += len(items) - n_sentinels
        for it in items:
            kind = type(it)
            if kind is Tombstone:
                out.append(it)
                if made is not None:
                    made.records_out -= 1
            elif kind is not FlushSentinel:
                out.append(it)
        return out

    def _run(self, op: Operator, records: list[Record]) -> list[Any]:
        """A run of records through ``op``, in order; a stateless operator that asks for
        threads gets slices of it on the pool."""
        p = op.parallelism
        if op.traits.stateful or p <= 1 or self.pool is None or len(records) < 2:
            return op.process_batch(records)
        step = -(-len(records) // p)
        slices = [records[i : i + step] for i in range(0, len(records), step)]
        return [r for part in self.pool.map(op.process_batch, slices) for r in part]

    def _sentinel(self, op: Operator, sentinel: FlushSentinel) -> list[Any]:
        op.on_sentinel(sentinel)
        if op.stalls_at_boundaries and not sentinel.final:
            return []
        flushed = list(op.flush(True, sentinel.lane))
        left = op.pending(sentinel.lane)
        if left:
            raise ContractViolation(
                f"operator {op.name!r} ({type(op).__name__}) still holds {left} pending item(s) "
                f"for lane {sentinel.lane} after flush(reset=True); flush must emit everything "
                "and reset the lane's state"
            )
        return flushed
