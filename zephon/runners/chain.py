"""Runs a compiled plan over feed units of the lanes this process owns.

The same object runs in the parent (``workers=0``) and inside each worker process. A feed
unit is what :meth:`LaneTracker.pull` returns: a chunk, possibly followed by a flush
sentinel, or the final sentinel. The plan's head turns a chunk into records; they move
through the plan's steps one step at a time (a whole layer per step), which gives exactly
the order a record-at-a-time push would, and lets stateless operators work on a chunk at
once, on threads if they ask for it. The runner does not know what a step is: an operator,
or a stage standing for several (:mod:`zephon.plan`).

Tombstones skip the rest of the chain; they travel with the lane's next output. Outputs are
:class:`LaneOutput`: one record or batch (or none, at the end of a lane) plus the
contributors that were tombstoned since the lane's previous output.

Operators' counters are kept per lane. The first output of every run of the chain carries
a :class:`LaneCounts` snapshot of its lane's counters, so what ``stats()`` reports can be
counted at delivery: the same whichever process ran the lane and however far ahead.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from zephon.chunks import SamplePointer, WorkChunk
from zephon.errors import ContractViolation
from zephon.operators.base import Operator, OpStats
from zephon.operators.replay import ReplayView
from zephon.plan.compile import Plan
from zephon.plan.read import ChunkRecords
from zephon.records import Contributor, FlushSentinel, Record, Tombstone

if TYPE_CHECKING:
    from zephon.operators.fetch import Fetch


class LaneCounts(NamedTuple):
    """One lane's operator counters at one moment: ``(records_in, records_out, seconds)``
    per operator of the chain, how many records the replay filter dropped, how many
    reads the fetch operator retried after transient I/O failures, how many records
    ``batch`` dropped at the lane's end, and the bytes, requests and retries of the
    fetch operator's reads per source."""

    ops: list[tuple[int, int, float]]
    replay_dropped: int
    io_retries: int = 0
    #: records ``batch(drop_last=True)`` dropped at the lane's end (its last partial batch)
    dropped_at_end: int = 0
    #: ``(component, bytes, requests, retries)`` per source the lane's fetch read from
    #: (:meth:`~zephon.operators.fetch.Fetch.lane_reads`)
    reads: tuple[tuple[int, int, int, int], ...] = ()


class LaneOutput:
    """What a lane hands to the consumer: ``record`` (None at the end) + tombstoned pieces,
    and, on the first output of a run of the chain, the lane's counters after that run."""

    __slots__ = ("lane", "record", "tombstones", "end", "lease", "counts", "padding")

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
        #: A lockstep step's stand-in for a lane that ended earlier (see lanes.schedule):
        #: made where the schedule runs, never written to a ring nor delivered.
        self.padding = False

    def __repr__(self) -> str:
        return f"LaneOutput(lane={self.lane}, record={self.record!r}, tombstones={len(self.tombstones)}, end={self.end})"


#: The attribute :meth:`ChainRunner` sets on an exception an operator raised: where in the
#: stream it happened, in words (also added as a note: Python prints it under the error).
WHERE = "_zephon_where"

#: Chunks a runner remembers (by lane and id) to name the sample behind a failing record.
#: A record may come out of a shuffle or pack buffer many chunks after its own was read;
#: an older one is named by its cursor only.
REMEMBERED_CHUNKS = 4096

#: How many samples :meth:`ChainRunner.feed` runs first while a lane's output is awaited
#: (about the pieces of a few packed rows); each further step runs twice as many.
FIRST_STEP = 8

#: A segment of a feed unit still to run: ``(step index, items)``, where items are a
#: chunk not read yet, a chunk's records still to take, or flush sentinels.
_Segment = tuple[int, Any]


class ChainRunner:
    """Runs ``plan``'s head and steps over fresh copies of its operators.

    Args:
        plan: the compiled plan (:func:`~zephon.plan.compile.compile_plan`).
        pool: threads for the stateless operators that ask for them.
    """

    def __init__(self, plan: Plan, pool: ThreadPoolExecutor | None = None) -> None:
        self.ops: list[Operator] = [op.fresh() for op in plan.ops]
        self.pool = pool
        self.head, self.steps = plan.build(self.ops)
        self.replay_filter = self.ops[plan.filter_index]
        self._replay = ReplayView(self.replay_filter.targets)  # type: ignore[attr-defined]
        #: The counters of the lane being run (see :meth:`_select`), one per operator.
        self.stats: list[OpStats] = [OpStats() for _ in self.ops]
        self._lane_stats: dict[int, list[OpStats]] = {}
        self._self_counting = [step for step in self.steps if step.counts_itself]
        self._fetches: list[Fetch] = [self.ops[i] for i in plan.readers]  # type: ignore[misc]
        # A first step that takes a chunk's read samples as they are, without records.
        first = self.steps[0].run if self.steps and self.head.fetch is not None else None
        self._takes_samples = first if hasattr(first, "process_samples") else None
        self._unused = OpStats()  # what a self-counting step's place in the chain counts
        self._tombs: dict[int, list[Contributor]] = {}
        self._rest: dict[int, list[_Segment]] = {}  # see feed(first=True)
        #: Recent chunks by (lane, chunk id), to name the sample of a record that fails.
        self._chunks: OrderedDict[tuple[int, int], WorkChunk] = OrderedDict()
        #: ``batch``'s records dropped at a lane's end (``drop_last``), for the end warning.
        self._droppers: list[Any] = [op for op in self.ops if hasattr(op, "dropped_at_end")]

    def _select(self, lane: int) -> None:
        """Points the counters (``stats``, the self-counting stages') at ``lane``'s."""
        stats = self._lane_stats.get(lane)
        if stats is None:
            stats = self._lane_stats[lane] = [OpStats() for _ in self.ops]
        self.stats = stats
        for step in self._self_counting:
            step.run.counters = [stats[i] for i in step.ops]

    def counts(self, lane: int) -> LaneCounts:
        """``lane``'s counters now."""
        stats = self._lane_stats.get(lane) or [OpStats() for _ in self.ops]
        dropped = self.replay_filter.dropped.get(lane, 0)  # type: ignore[attr-defined]
        retried = sum(op.io_retries.get(lane, 0) for op in self._fetches)
        ops = [(s.records_in, s.records_out, s.seconds) for s in stats]
        at_end = sum(op.dropped_at_end.get(lane, 0) for op in self._droppers)
        fetches = self._fetches
        if len(fetches) == 1:  # its tuple as it is: the same one until the lane reads again
            reads = fetches[0].lane_reads(lane)
        else:
            reads = tuple(row for op in fetches for row in op.lane_reads(lane))
        return LaneCounts(ops, dropped, retried, at_end, reads)

    def feed(
        self, items: Sequence[WorkChunk | FlushSentinel], first: bool = False
    ) -> list[LaneOutput]:
        """Runs a feed unit of one lane through the chain; the lane's outputs.

        With ``first``, the unit's samples go through in growing steps (see
        :data:`FIRST_STEP`) and the call returns as soon as an output is ready: a batch
        waits for the samples it needs, not for the whole chunk (a lane that replays after
        a restore, whose outputs are all dropped until its target, takes whole chunks until
        then). The rest waits in the runner; :meth:`resume` runs it (before the lane's next
        unit). Operators see the same records in the same order either way.
        """
        start = self.head.start
        segments: list[_Segment] = []
        for it in items:
            if isinstance(it, WorkChunk):
                segments.append((start, it))
            elif segments and type(segments[-1][1]) is list:
                segments[-1][1].append(it)
            else:
                segments.append((start, [it]))
        return self._drive(items[0].lane, segments, first)

    def suspended(self, lane: int) -> bool:
        """Whether a :meth:`feed` with ``first`` left part of ``lane``'s unit to run."""
        return lane in self._rest

    def resume(self, lane: int, first: bool = False) -> list[LaneOutput]:
        """Runs what a :meth:`feed` with ``first`` left of ``lane``'s unit: all of it, or
        with ``first`` again until an output is ready."""
        return self._drive(lane, self._rest.pop(lane), first)

    def _drive(self, lane: int, segments: list[_Segment], first: bool) -> list[LaneOutput]:
        """Pushes ``segments`` (in order, all of ``lane``) through the chain; with
        ``first``, stops once a record has come out and keeps the rest in ``_rest``."""
        self._select(lane)
        produced: list[Any] = []
        final = False
        step = FIRST_STEP
        while segments:
            start, items = segments.pop(0)
            if isinstance(items, WorkChunk):
                items = self._read(items)
            if type(items) is ChunkRecords:
                # While the lane replays everything it makes is dropped: whole chunks then.
                whole = not first or self._replay.replaying(lane)
                n = len(items) if whole else step
                if self._takes_samples is not None:
                    lo, hi, rest = items.split(n)
                    if rest is not None:
                        segments.insert(0, (start, rest))
                        step *= 2
                    try:
                        made = self._takes_samples.process_samples(
                            items.chunk, items.comps, items.samples, lo, hi
                        )
                    except Exception as e:
                        what = self.steps[start - self.head.start].name
                        c = items.chunk
                        _annotate(
                            e,
                            f"{what} on lane {c.lane}, at one of the samples at offsets "
                            f"{lo}..{hi - 1} of chunk {c.chunk_id}",
                        )
                        raise
                    produced.extend(self._push(made, start + 1))
                    if first and segments and any(type(it) is not Tombstone for it in produced):
                        self._rest[lane] = segments
                        break
                    continue
                records, rest = items.take(n)
                if rest is not None:
                    segments.insert(0, (start, rest))
                    step *= 2  # few calls, should the output need the whole chunk
                elif segments and type(segments[0][1]) is list:
                    records += segments.pop(0)[1]  # its sentinels: one push, not two
                items = records
            final = final or any(type(it) is FlushSentinel and it.final for it in items)
            produced.extend(self._push(items, start))
            if first and segments and any(type(it) is not Tombstone for it in produced):
                self._rest[lane] = segments
                break
        out: list[LaneOutput] = []
        for it in produced:
            if type(it) is Tombstone:
                self._tombs.setdefault(lane, []).extend(it.contributors)
            else:
                out.append(LaneOutput(lane, it, self._tombs.pop(lane, [])))
        if final:
            out.append(LaneOutput(lane, None, self._tombs.pop(lane, []), end=True))
        if out:
            out[0].counts = self.counts(lane)
        return out

    def _read(self, chunk: WorkChunk) -> ChunkRecords:
        """The head's records of ``chunk``; what the head read counts as its fetch's."""
        t0 = time.perf_counter()
        chunks = self._chunks
        chunks[(chunk.lane, chunk.chunk_id)] = chunk
        if len(chunks) > REMEMBERED_CHUNKS:
            chunks.popitem(last=False)
        try:
            records = self.head.read(chunk)
        except Exception as e:
            name = "fetch" if self.head.fetch is not None else "the head"
            _annotate(e, f"{name}, reading chunk {chunk.chunk_id} of lane {chunk.lane}")
            raise
        if self.head.fetch is not None:
            st = self.stats[0]
            st.records_in += len(chunk)
            st.records_out += len(chunk)
            st.seconds += time.perf_counter() - t0
        return records

    def _push(self, items: list[Any], start: int = 0) -> list[Any]:
        if not items:
            return []
        out: list[Any] = []
        made: OpStats | None = None  # the counters of the step that made ``items``
        stats = self.stats
        for step in self.steps[start - self.head.start :]:
            op = step.run
            st = self._unused if step.counts_itself else stats[step.ops[0]]
            if not items:
                break  # all tombstones: they skip the rest of the chain
            t0 = time.perf_counter()
            n_in = n_sentinels = n_tombs = 0
            nxt: list[Any] = []
            run: list[Record] = []
            sentinel: FlushSentinel | None = None
            try:
                for it in items:
                    kind = type(it)
                    if kind is Tombstone:
                        out.append(it)
                        n_tombs += 1
                    elif kind is FlushSentinel:
                        if run:
                            nxt.extend(self._run(op, run))
                            run = []
                        sentinel = it
                        nxt.extend(self._sentinel(op, it))
                        sentinel = None
                        nxt.append(it)
                        n_sentinels += 1
                    else:
                        n_in += 1
                        run.append(it)
                if run:
                    nxt.extend(self._run(op, run))
            except Exception as e:
                if not isinstance(e, ContractViolation):  # that one says where already
                    _annotate(e, self._where(step, e, run, sentinel))
                raise
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

    def _where(
        self, step: Any, e: BaseException, run: list[Record], sentinel: FlushSentinel | None
    ) -> str:
        """Where ``step`` raised ``e``: its operator, the lane and the sample of the record
        it was working on (found among the locals of the traceback's frames: the runner
        gives an operator a run of records at once), or the flush it was doing."""
        what = repr(step.run) if len(step.ops) == 1 else step.name
        if sentinel is not None:
            at = "the end of the lane" if sentinel.final else f"chunk {sentinel.boundary}"
            return f"{what} on lane {sentinel.lane}, flushing at the boundary before {at}"
        rec = _failing_record(e, run)
        if rec is None:
            if not run:
                return what
            first, last = run[0].cursor, run[-1].cursor
            return (
                f"{what} on lane {first.lane}, at one of the records from cursor "
                f"{tuple(first)} to {tuple(last)}"
            )
        cur = rec.cursor
        chunk = self._chunks.get((cur.lane, cur.chunk_id))
        sample = "a sample"
        if chunk is not None and 0 <= cur.offset < len(chunk):
            comp, index = chunk.components[cur.offset], chunk.indices[cur.offset]
            sample = f"sample {SamplePointer(int(comp), int(index))}"
        return (
            f"{what} on lane {cur.lane}, at {sample} (record cursor: chunk "
            f"{cur.chunk_id}, offset {cur.offset}, child {cur.child})"
        )

    def _run(self, op: Any, records: list[Record]) -> list[Any]:
        """A run of records through ``op``, in order; a stateless operator that asks for
        threads gets slices of it on the pool."""
        p = op.parallelism
        if op.traits.stateful or p <= 1 or self.pool is None or len(records) < 2:
            return op.process_batch(records)  # type: ignore[no-any-return]
        step = -(-len(records) // p)
        slices = [records[i : i + step] for i in range(0, len(records), step)]
        return [r for part in self.pool.map(op.process_batch, slices) for r in part]

    def _sentinel(self, op: Any, sentinel: FlushSentinel) -> list[Any]:
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


def _failing_record(e: BaseException, records: list[Record]) -> Record | None:
    """The record of ``records`` that the innermost frame of ``e``'s traceback holding one
    of them was working on (an operator's ``for r in records`` loop, its ``process(record)``),
    or None. Only read on the way out of a failure."""
    if not records:
        return None
    if len(records) == 1:
        return records[0]
    ids = {id(r) for r in records}
    found = None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:  # the runner's own loops hold them all
            for value in tb.tb_frame.f_locals.values():
                if id(value) in ids:
                    found = value
        tb = tb.tb_next
    return found


def _annotate(e: BaseException, where: str) -> None:
    """Says on ``e`` where in the stream it was raised (once: the innermost place wins)."""
    if getattr(e, WHERE, None) is not None:
        return
    try:
        setattr(e, WHERE, where)
    except AttributeError:
        return  # an exception that refuses attributes (a frozen dataclass): as it is
    e.add_note(f"[zephon] raised in {where}")
