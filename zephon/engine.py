"""The per-rank engine: lanes' trackers, the producer, the prefetch pump and delivery.

One engine per rank owns the work sources, the in-flight sets, completion tracking,
eviction and the replay cursors (all in :class:`~zephon.tracking.LaneTracker`). It sees
chunks going out and outputs coming back; the operators run in an executor (here, in this
process; with ``workers`` > 0, in worker processes).

The producer walks the rank's lanes in output order (round-robin for ``interleave``, all
lanes per step for ``lockstep``) and a pump thread runs it ``prefetch`` outputs ahead.
Nothing counts as delivered until ``next()`` returns it: only then are offsets closed,
chunks evicted and the replay cursor moved.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from zephon.compile import Plan
from zephon.operators.batch import Batch
from zephon.replay import ReplayFilter
from zephon.runners.chain import ChainRunner, LaneOutput
from zephon.tracking import LaneTracker

INTERLEAVE = "interleave"
LOCKSTEP = "lockstep"
_DONE = object()
_POLL_S = 0.1


def _nothing(lane: int) -> list[Any]:
    return []


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class LocalExecutor:
    """Runs the chain in this process (``workers=0``); pulls feed units on demand."""

    prefetches = False  # the engine's pump thread runs it ahead

    def __init__(self, plan: Plan) -> None:
        cap = max(op.parallelism for op in plan.ops)
        self.pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op") if cap > 1 else None
        self.runner = ChainRunner([op.fresh() for op in plan.ops], self.pool)
        for op in self.runner.ops:
            if isinstance(op, Batch):
                op.defer = True  # the first batch after a start or restore stacks alone
        filt = self.runner.ops[plan.filter_index]
        assert isinstance(filt, ReplayFilter)
        self.replay_filter = filt
        self.ready: dict[int, deque[LaneOutput]] = {}
        self.producing: set[int] = set()  # lanes that have had an output
        self.pull: Callable[[int], list[Any]] = _nothing

    def start(self, engine: Engine) -> None:
        self.pull = engine.pull

    def set_target(self, lane: int, cursor: Any) -> None:
        self.replay_filter.set_target(lane, cursor)

    def next_output(self, lane: int) -> LaneOutput:
        ready = self.ready.setdefault(lane, deque())
        runner = self.runner
        while not ready:
            if runner.suspended(lane):
                outs = runner.resume(lane)
            else:
                feed = self.pull(lane)
                if not feed:
                    raise RuntimeError(
                        f"lane {lane} was pulled after its end; this is a Zephon bug"
                    )
                # Until the lane's first output, the runner stops as soon as it has one.
                outs = runner.feed(feed, first=lane not in self.producing)
            for out in outs:
                self.ready.setdefault(out.lane, deque()).append(out)
                if out.record is not None:
                    self.producing.add(out.lane)
        return ready.popleft()

    def op_stats(self) -> list[dict[str, Any]]:
        return [
            {
                "name": op.name,
                "records_in": s.records_in,
                "records_out": s.records_out,
                "seconds": round(s.seconds, 6),
            }
            for op, s in zip(self.runner.ops, self.runner.stats, strict=True)
        ]

    def extra_stats(self) -> dict[str, Any]:
        return {"replay_dropped_records": self.replay_filter.dropped}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pull = _nothing  # the engine's method: a reference cycle, left to the GC


def _materialize(item: Any) -> None:
    """Builds the deferred data of an output (or of each output of a lockstep step)."""
    for out in item if isinstance(item, list) else (item,):
        if type(out) is LaneOutput and out.record is not None:
            out.record.data  # noqa: B018 - the read builds it


def concat_lockstep(outputs: list[LaneOutput]) -> Any:
    datas = [o.record.data for o in outputs]  # type: ignore[union-attr]
    if isinstance(datas[0], dict):
        return {k: np.concatenate([d[k] for d in datas]) for k in datas[0]}
    return np.concatenate(datas)


class Engine:
    def __init__(
        self,
        plan: Plan,
        trackers: dict[int, LaneTracker],
        output: str,
        prefetch: int,
        executor: Any,
    ) -> None:
        self.plan = plan
        self.trackers = trackers
        self.lanes = sorted(trackers)
        self.output = output
        self.prefetch = prefetch
        self.executor = executor
        self.lock = threading.RLock()
        self.next_lane = self.lanes[0]  # consumer side: whose turn after the last delivery
        self.replayed_chunks = 0
        self.started = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(prefetch, 1))
        self._thread: threading.Thread | None = None
        self._pump_wanted = False
        self._pump_go = threading.Event()
        self._gen: Iterator[Any] | None = None
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        self._finished = False
        self._handed: list[Any] = []
        self.last_lanes: tuple[int, ...] = ()

    # ------------------------------------------------------------ production
    def pull(self, lane: int) -> list[Any]:
        """The lane's next feed unit, under the lock that checkpoint() also takes."""
        with self.lock:
            return self.trackers[lane].pull()

    def _produce(self) -> Iterator[Any]:
        if self.output == LOCKSTEP:
            lanes = self.lanes
            while True:
                step = [self.executor.next_output(lane) for lane in lanes]
                if any(o.end for o in step):
                    break
                yield step
        else:
            rot = [lane for lane in self.lanes if not self.trackers[lane].done]
            pos = next((i for i, lane in enumerate(rot) if lane >= self.next_lane), 0)
            while rot:
                pos %= len(rot)
                out = self.executor.next_output(rot[pos])
                yield out
                if out.end:
                    del rot[pos]
                else:
                    pos += 1
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
                self._thread.start()
                self._pump_go.set()
            return item
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch pump stopped without a result") from None

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.executor.start(self)
        self._gen = self._produce()
        # Worker processes already run ahead into their rings, which hold the prefetched
        # batches; a pump thread on top would only add a queue handoff per batch.
        self._pump_wanted = self.prefetch > 0 and not self.executor.prefetches

    # -------------------------------------------------------------- delivery
    def next(self) -> Any:
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
                self._error = e
                raise
            if item is _DONE:
                self._finished = True
                raise StopIteration
            if isinstance(item, _Failure):
                self._error = item.error
                raise item.error
            if isinstance(item, list):
                with self.lock:
                    for out in item:
                        self._deliver(out)
                data = concat_lockstep(item)
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
        tracker = self.trackers[out.lane]
        rec = out.record
        if rec is None:
            tracker.deliver(out.tombstones, None)
            if out.end:
                tracker.done = True
            return
        contributors = rec.contributors + out.tombstones if out.tombstones else rec.contributors
        tracker.deliver(contributors, getattr(rec, "last_cursor", None) or rec.cursor)

    # ------------------------------------------------------------ state/stats
    def state(self) -> dict[str, Any]:
        with self.lock:
            return {
                "lanes": [self.trackers[lane].state() for lane in self.lanes],
                "next_lane": self.next_lane,
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
            "operators": self.executor.op_stats(),
            "queue_fill": self._queue.qsize(),
            "final_prefetch": self.prefetch,
            "replayed_chunks": self.replayed_chunks,
            **self.executor.extra_stats(),
        }

    def close(self) -> None:
        self.stopping.set()
        self._release_handed()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.executor.close()
        # The producer's frame holds this engine: dropping it leaves no reference cycle, so
        # a closed pipeline is freed at once instead of by a later (costly) GC pass.
        self._gen = None
