"""The per-rank engine: lanes' trackers, the producer, the prefetch pump and delivery.

One engine per rank owns the work sources, the in-flight sets, completion tracking,
eviction and the replay cursors (all in :class:`~zephon.tracking.tracker.LaneTracker`). It sees
chunks going out and outputs coming back; the operators run in an executor (here, in this
process; with ``workers`` > 0, in worker processes).

The producer walks the rank's lanes in output order (round-robin for ``interleave``, all
lanes per step for ``lockstep``) and a pump thread runs it ``prefetch`` outputs ahead.
Nothing counts as delivered until ``next()`` returns it: only then are offsets closed,
chunks evicted and the replay cursor moved.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from weakref import WeakSet

import numpy as np

from zephon.errors import CheckpointError, DataStallWarning, PipelineClosedError
from zephon.metrics.observe import STALL_FRACTION, STALL_MIN_BUSY_S, WAIT_BUCKETS_S, stall_cause
from zephon.plan.compile import Plan
from zephon.runners.base import Executor, LaneRun, pulled_inflight
from zephon.runners.chain import LaneCounts, LaneOutput
from zephon.runners.lanes import LOCKSTEP, schedule
from zephon.tracking.tracker import LaneTracker

if TYPE_CHECKING:
    from zephon.pipeline.options import Options

_DONE = object()
_POLL_S = 0.1

# Engines whose prefetch pump runs, stopped at interpreter exit: a daemon thread still inside
# a tokenizer's C++ when the interpreter finalizes can abort the process ("terminate called
# without an active exception"). Closing stops the pump between two outputs.
_PUMPING: WeakSet[Engine] = WeakSet()


@atexit.register
def _stop_pumps() -> None:
    for engine in list(_PUMPING):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _materialize(item: Any) -> None:
    """Builds the deferred data of an output (or of each output of a lockstep step)."""
    for out in item if isinstance(item, list) else (item,):
        if type(out) is LaneOutput and out.record is not None:
            out.record.data  # noqa: B018 - the read builds it


def closed_error() -> PipelineClosedError:
    return PipelineClosedError(
        "the pipeline is closed: next() after close(). Build a new pipeline (and restore a "
        "checkpoint into it) to go on"
    )


def concat_lockstep(outputs: list[LaneOutput], pad: Any = None) -> Any:
    """One lockstep step's batch: every lane's rows in lane order. A lane that has no
    batch in the step (it ended; only with ``batch(pad_last=True)``) gets the rows of
    ``pad.padding_like(batch)``, a batch of padding shaped like the others."""
    datas: list[Any] = [o.record.data if o.record is not None else None for o in outputs]
    if any(d is None for d in datas):
        template = next(d for d in datas if d is not None)
        filler = pad.padding_like(template)
        datas = [filler if d is None else d for d in datas]
    if isinstance(datas[0], dict):
        return {k: np.concatenate([d[k] for d in datas]) for k in datas[0]}
    return np.concatenate(datas)


class Engine:
    """Runs ``plan`` for the lanes of ``trackers`` with the pipeline's ``options``
    (``output``, ``prefetch``), the operators in ``executor``."""

    def __init__(
        self,
        plan: Plan,
        trackers: dict[int, LaneTracker],
        options: Options,
        executor: Executor,
    ) -> None:
        self.plan = plan
        self.trackers = trackers
        self.lanes = sorted(trackers)
        self.options = options
        self.executor = executor
        #: ``batch(pad_last=True)``: in lockstep, lanes that ended get padded rows until
        #: every lane has ended (the Batch operator makes them).
        self.pad_op = None if plan.padding is None else plan.ops[plan.padding]
        self.pad_ended = options.output == LOCKSTEP and self.pad_op is not None
        self._ends: list[LaneOutput] = []
        self.lock = threading.RLock()
        self.next_lane = self.lanes[0]  # consumer side: whose turn after the last delivery
        #: Batches delivered since the start of the data (restored with the lanes): the
        #: step a checkpoint names, the same on every rank at a training step.
        self.step = 0
        self.first_step = 0  # the step this engine started at (a restore's)
        self.replayed_chunks = 0
        self.started = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(options.prefetch, 1))
        self._thread: threading.Thread | None = None
        self._pump_wanted = False
        self._pump_go = threading.Event()
        self._gen: Iterator[Any] | None = None
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        self._finished = False
        self._handed: list[Any] = []
        self.last_lanes: tuple[int, ...] = ()
        self.closed = False
        #: Each lane's operator counters as of its last delivered output (see stats()).
        self.lane_counts: dict[int, LaneCounts] = {}
        self._calls = 0
        self._wait_s = 0.0  # inside next(), the first call (start-up) left out
        self._busy_s = 0.0  # between a next() returning and the next call
        self._first_s: float | None = None
        self._returned_at: float | None = None
        self._stall_warned = False
        self.first_at: float | None = None  # when the first next() returned
        self.wait_buckets = [0] * (len(WAIT_BUCKETS_S) + 1)  # see WAIT_BUCKETS_S
        #: Per component, the ``component_tokens`` of the delivered batches (tokens once
        #: tokenized, samples before).
        self.component_tokens: dict[int, int] = {}
        #: Per component, the documents of the delivered batches: a document counts once,
        #: with the batch that holds its last piece (counted by the trackers, in C).
        self.component_docs: dict[int, int] = {}
        #: ``(component, bytes, requests, retries)`` rows of lanes' earlier counters: a
        #: lane whose counters went down runs in a new process (a Ray actor replaced), and
        #: what its old one read stays counted (see :func:`~zephon.metrics.observe.reads`).
        self.moved_reads: list[tuple[int, int, int, int]] = []

    # ------------------------------------------------------------ production
    def pull(self, lane: int) -> list[Any]:
        """The lane's next feed unit, under the lock that checkpoint() also takes."""
        with self.lock:
            return self.trackers[lane].pull()

    def inflight_feeds(self, lane: int) -> list[list[Any]]:
        """The lane's pulled in-flight chunks as feed units (see
        :func:`~zephon.runners.base.pulled_inflight`), under the lock."""
        with self.lock:
            return pulled_inflight(self.trackers[lane])

    def _produce(self) -> Iterator[Any]:
        done = [lane for lane in self.lanes if self.trackers[lane].done]
        for item in schedule(
            self.lanes,
            self.options.output,
            self.executor.next_output,
            start_lane=self.next_lane,
            done=done,
            pad_ended=self.pad_ended,
        ):
            if type(item) is list and (
                all(out.end for out in item) if self.pad_ended else any(out.end for out in item)
            ):
                # lockstep: a lane ended, and the stream with it (padding: every lane did;
                # the ends of this step are delivered, so a checkpoint shows the lanes done)
                if self.pad_ended:
                    self._ends.extend(out for out in item if not out.padding)
                break
            yield item
        yield _DONE

    def _pump(self) -> None:
        assert self._gen is not None
        # Thread.start() returns only once this thread runs, and this thread would then keep
        # the GIL for a whole switch interval (5 ms) of producing: wait, so the caller gets
        # its first batch now and the pump starts beside whatever the caller does next.
        self._pump_go.wait()
        try:
            for item in self._gen:
                _materialize(item)  # deferred stacking runs here, off the consumer's thread
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            self._put(_Failure(e))

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _take(self) -> Any:
        if self._thread is None:
            assert self._gen is not None
            try:
                item = next(self._gen)
            except StopIteration:
                return _DONE
            _materialize(item)
            if self._pump_wanted and item is not _DONE:
                # The first output is made on the caller's thread (a pump running beside it
                # would take the GIL from it); from here on the pump runs ahead.
                self._thread = threading.Thread(target=self._pump, name="zephon-pump", daemon=True)
                _PUMPING.add(self)
                self._thread.start()
                self._pump_go.set()
            return item
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.closed:
                    raise closed_error() from None
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch pump stopped without a result") from None

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        done = [lane for lane in self.lanes if self.trackers[lane].done]
        # At the start a lane has a cursor only if it was restored: it replays to it.
        targets = {lane: t.cursor for lane, t in self.trackers.items() if t.cursor is not None}
        self.executor.start(
            LaneRun(
                self.lanes,
                self.pull,
                targets,
                self.next_lane,
                done,
                self.stopping,
                self.pad_ended,
                self.inflight_feeds,
            )
        )
        self._gen = self._produce()
        self._pump_wanted = self.options.prefetch > 0

    # -------------------------------------------------------------- delivery
    def next(self) -> Any:
        """The next batch; times how long the consumer waits in here (see stats())."""
        entered = time.perf_counter()
        if self._returned_at is not None:
            self._busy_s += entered - self._returned_at
        try:
            return self._next()
        finally:
            left = time.perf_counter()
            if self._calls:
                self._wait_s += left - entered
                self.wait_buckets[bisect_left(WAIT_BUCKETS_S, left - entered)] += 1
            else:
                self._first_s = left - entered
                self.first_at = left
            self._calls += 1
            self._returned_at = left
            if not self._stall_warned and self._calls % 16 == 0:
                self._check_stall()

    def wait_fraction(self) -> float:
        """The share of the consumer's time since its first batch spent waiting in next()."""
        total = self._wait_s + self._busy_s
        return self._wait_s / total if total > 0 else 0.0

    def _check_stall(self) -> None:
        # Only a consumer that works between batches (a training loop busy for a second or
        # more) is starved by waiting; a loop that only drains the pipeline always waits.
        if self._busy_s < STALL_MIN_BUSY_S or self.wait_fraction() <= STALL_FRACTION:
            return
        self._stall_warned = True
        warnings.warn(
            f"zephon: the training loop spent {self.wait_fraction():.0%} of its time waiting "
            f"in next() for data over {self._calls} batches (more than "
            f"{STALL_FRACTION:.0%}); the loader is the bottleneck: raise Pipeline(workers=...) "
            "or prefetch=, or fetch(parallelism=) for slow storage (now "
            f"workers={self.options.workers}, prefetch={self.options.prefetch}). "
            f"{stall_cause(self)}"
            "stats()['next_wait_fraction'] and stats()['bottleneck'] follow it. Warned once "
            "per run",
            DataStallWarning,
            stacklevel=3,
        )

    def _next(self) -> Any:
        if self.closed:
            raise closed_error()
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopIteration
        try:
            self.start()
        except BaseException as e:
            self._error = e
            raise
        self._release_handed()  # zero-copy views of the previous batch expire now
        while True:
            try:
                item = self._take()
            except KeyboardInterrupt as e:
                # With a pump thread nothing was lost: the caller may go on iterating. Without
                # one, the interrupt broke the producer generator mid-item: that is final.
                if self._thread is None:
                    self._error = e
                raise
            except BaseException as e:
                if self.closed:  # close() from another thread stopped what we waited on
                    raise closed_error() from e
                self._error = e
                raise
            if item is _DONE:
                self._finished = True
                if self._ends:  # the lanes' ends in the step that ended a padded lockstep
                    with self.lock:
                        for out in self._ends:
                            self._deliver(out)
                    self._ends = []
                raise StopIteration
            if isinstance(item, _Failure):
                self._error = item.error
                raise item.error
            if isinstance(item, list):
                with self.lock:
                    for out in item:
                        if not out.padding:
                            self._deliver(out)
                    self.step += 1
                data = concat_lockstep(item, self.pad_op)
                for out in item:
                    self._hand_out(out)
                self.last_lanes = tuple(out.lane for out in item)
                return data
            self._hand_out(item)
            with self.lock:
                self._deliver(item)
                if item.record is not None:
                    i = self.lanes.index(item.lane)
                    self.next_lane = self.lanes[(i + 1) % len(self.lanes)]
                    self.step += 1
            if item.record is not None:
                self.last_lanes = (item.lane,)
                return item.record.data

    def _hand_out(self, out: LaneOutput) -> None:
        if out.lease is not None:
            self._handed.append(out.lease)

    def _release_handed(self) -> None:
        handed, self._handed = self._handed, []
        for lease in handed:
            lease.release()

    def _deliver(self, out: LaneOutput) -> None:
        if out.counts is not None:
            self._merge_counts(out.lane, out.counts)
        tracker = self.trackers[out.lane]
        rec = out.record
        if rec is None:
            tracker.deliver(out.tombstones, None)
            if out.end:
                tracker.done = True
            return
        tokens = self.component_tokens
        for comp, n in rec.component_tokens.items():
            tokens[comp] = tokens.get(comp, 0) + n
        tracker.deliver(
            rec.contributors,
            getattr(rec, "last_cursor", None) or rec.cursor,
            self.component_docs,
            out.tombstones,
        )

    def _merge_counts(self, lane: int, counts: LaneCounts) -> None:
        """Keeps ``counts`` as the lane's; reads that a restarted lane had counted before
        (its counters went down) are kept in :attr:`moved_reads`."""
        prev = self.lane_counts.get(lane)
        self.lane_counts[lane] = counts
        if prev is None:
            return
        old = prev.reads  # (the same tuple again: the lane has read nothing more)
        if (
            old
            and counts.reads is not old
            and (
                sum(r[2] for r in counts.reads) < sum(r[2] for r in old)
                or (counts.ops and counts.ops[0][0] < prev.ops[0][0])
            )
        ):
            self.moved_reads.extend(old)

    # ------------------------------------------------------------ state/stats
    def restore(
        self,
        lane_states: Mapping[int, dict[str, Any]],
        holds: Mapping[int, list[list[Any]]],
        next_lane: int | None,
        step: int = 0,
    ) -> None:
        """Loads every lane's state (checked: a malformed one is a CheckpointError, and
        nothing of it is kept); the consumer's turn then goes to ``next_lane``, or with
        None to the least advanced lane that has not ended (ties: the lowest), where a
        rank's round-robin would be."""
        if self.started:
            raise CheckpointError("restore() after iteration began; this is a Zephon bug")
        replayed = 0
        for lane in self.lanes:
            tracker = self.trackers[lane]
            replayed += tracker.load(lane_states[lane])
            tracker.held = holds.get(lane, [])
        self.replayed_chunks = replayed
        self.step = self.first_step = step
        if next_lane is None:
            live = [lane for lane in self.lanes if not self.trackers[lane].done] or self.lanes
            next_lane = min(live, key=lambda lane: (self.trackers[lane].batches, lane))
        self.next_lane = next_lane

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {
                "lanes": [self.trackers[lane].state() for lane in self.lanes],
                "next_lane": self.next_lane,
                "step": self.step,
            }

    def stats(self) -> dict[str, Any]:
        with self.lock:
            lanes = {
                lane: {
                    "inflight_chunks": len(t.inflight),
                    "boundaries": len(t.boundaries),
                    "batches": t.batches,
                    "evicted_chunks": t.evicted,
                    "next_chunk_id": t.next_chunk_id,
                    "done": t.done,
                }
                for lane, t in self.trackers.items()
            }
        return {
            "lanes": lanes,
            "operators": self._operator_stats(),
            "queue_fill": self._queue.qsize(),
            "final_prefetch": self.options.prefetch,
            "replayed_chunks": self.replayed_chunks,
            "replay_dropped_records": sum(c.replay_dropped for c in self.lane_counts.values()),
            "io_retries": sum(c.io_retries for c in self.lane_counts.values()),
            "next_wait_fraction": round(self.wait_fraction(), 4),
            "next_wait_s": round(self._wait_s, 6),
            "first_batch_s": None if self._first_s is None else round(self._first_s, 6),
            **self.executor.extra_stats(),
        }

    def _operator_stats(self) -> list[dict[str, Any]]:
        """Each operator's counters summed over the lanes, each lane's as of its last
        delivered output: what the operators did for everything delivered so far (and for
        the rest of the chain runs that produced it), the same with or without workers."""
        totals = [[0, 0, 0.0] for _ in self.plan.ops]
        with self.lock:
            counts = list(self.lane_counts.values())
        for c in counts:
            for t, (n_in, n_out, seconds) in zip(totals, c.ops, strict=True):
                t[0] += n_in
                t[1] += n_out
                t[2] += seconds
        place = self.executor.place
        return [
            {
                "name": op.name,
                "records_in": int(t[0]),
                "records_out": int(t[1]),
                "seconds": round(t[2], 6),
                "place": place,
            }
            for op, t in zip(self.plan.ops, totals, strict=True)
        ]

    def close(self) -> None:
        self.closed = True
        self.stopping.set()
        self._release_handed()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.executor.close()
        # The producer's frame holds this engine: dropping it leaves no reference cycle, so
        # a closed pipeline is freed at once instead of by a later (costly) GC pass.
        self._gen = None
