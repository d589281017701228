"""What a Ray actor runs: the plan over the lanes it owns, fed by the pipeline's process.

The actor is the Ray twin of a local worker process (:mod:`zephon.runners.worker`): the
same :class:`~zephon.runners.chain.ChainRunner` and
:class:`~zephon.runners.lanes.LaneOutputs`, the same wire format for outputs
(:func:`~zephon.runners.wire.output_meta`). It cannot ask the parent for feed units, so
the parent pushes them: each :meth:`LaneActor.run` call brings a few of a lane's feed
units and returns every output the lane can make with what it has been given. A lane's outputs
are a pure function of its feed units, so which actor runs it, and how the units are cut
into calls, never changes them.

This module does not import Ray; :mod:`zephon.runners.ray` makes the class an actor.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import deque
from typing import Any

from zephon.records import SampleCursor
from zephon.runners import wire
from zephon.runners.faults import error_message
from zephon.runners.lanes import LaneOutputs

OK = "ok"
#: Set in each actor's process to the actor's index (0, 1, ...).
ACTOR_ENV = "ZEPHON_RAY_ACTOR"
ERROR = "error"
#: The longest a call waits for urgent calls before each output it makes.
_YIELD_S = 1.0


class _Starved(Exception):
    """A lane needs a feed unit the parent has not sent yet: it stops there."""


class LaneActor:
    """A Ray actor's loop: a lane's outputs from the feed units the parent sends."""

    def __init__(self, index: int, payload: bytes) -> None:
        import dill

        self.index = index
        # Which actor this is, for what runs here (logs; a benchmark's slowed actor).
        os.environ[ACTOR_ENV] = str(index)
        self.plan = dill.loads(payload)
        self.pool = None
        cap = max(op.parallelism for op in self.plan.ops)
        if cap > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op")
        #: Each lane's own chain (fresh operators): a lane that comes back (a move, a
        #: speculative copy) starts clean, and one dropped leaves nothing behind.
        self.lanes: dict[int, tuple[LaneOutputs, deque[list[Any]]]] = {}
        #: Each lane's current run (see :meth:`take`): calls of an older one are no-ops.
        self.runs: dict[int, int] = {}
        #: Urgent calls running (see :meth:`run`), and where the others wait for them.
        self.urgent = 0
        self.calm = threading.Condition()

    def ready(self) -> tuple[int, str, str]:
        """This actor's process id, host and Ray node id, once it is built."""
        import ray

        return os.getpid(), socket.gethostname(), ray.get_runtime_context().get_node_id()

    def watch(self) -> None:
        """Returns when the actor ends: never, in practice (it is killed). The parent
        keeps one call of it in flight per actor: its result fails when the actor dies,
        which is how the parent learns of a death before it waits for the actor's lanes
        (see :meth:`~zephon.runners.ray.RayExecutor.next_output`)."""
        threading.Event().wait()

    def take(self, lane: int, target: list[int] | None, run_id: int = 0) -> None:
        """``lane`` runs here from now on (as run ``run_id``), from its first feed unit
        or its in-flight chunks, on a fresh chain; with ``target`` (``[chunk_id, offset,
        child]``) it replays up to and including that record, dropped (the restore path)."""
        from zephon.runners.chain import ChainRunner

        runner = ChainRunner(self.plan, self.pool)
        if target is not None:
            runner.replay_filter.set_target(lane, SampleCursor(lane, *target))  # type: ignore[attr-defined]
        feeds: deque[list[Any]] = deque()

        def pull(_lane: int) -> list[Any]:
            if not feeds:
                raise _Starved
            return feeds.popleft()

        # A run's own feed units: a call of an older run still going (in another
        # concurrency group) cannot take the new run's.
        self.lanes[lane] = (LaneOutputs(runner, pull, 1), feeds)
        self.runs[lane] = run_id

    def replay(
        self,
        lane: int,
        target: list[int] | None,
        run_id: int,
        feeds: list[bytes],
        until_record: bool = True,
    ) -> tuple[str, Any]:
        """:meth:`take` and an urgent :meth:`run` in one call, the first of a lane that
        moved here or runs here speculatively; with ``until_record`` it returns once the
        lane has made its next record (the first after ``target``), its other units left
        queued for the lane's next call."""
        self.take(lane, target, run_id)
        return self.run(lane, feeds, run_id, urgent=True, until_record=until_record)

    def drop(self, lane: int, run_id: int) -> None:
        """Forgets run ``run_id`` of ``lane`` (it runs elsewhere now): its calls still
        queued do nothing. A newer run of the lane here (taken since) stays."""
        if self.runs.get(lane) == run_id:
            del self.lanes[lane], self.runs[lane]

    def run(
        self,
        lane: int,
        feeds: list[bytes],
        run_id: int = 0,
        urgent: bool = False,
        until_record: bool = False,
    ) -> tuple[str, Any]:
        """Adds feed units of ``lane`` and makes every output it can: ``("ok",
        [(meta, arrays), ...])``, or ``("error", message)`` for an exception (the actor
        goes on living; the parent raises it). A call of a run this actor no longer has
        (dropped, or taken again since) does nothing: ``("ok", [])``.

        An ``urgent`` call (a moved or speculative lane's replay, which the consumer waits
        for) goes first: while one runs, the others (in the other concurrency group) wait
        before each output they make, instead of sharing the interpreter with it. With
        ``until_record`` the call returns at its first record, the rest of its units left
        queued."""
        held = self.lanes.get(lane)
        if held is None or self.runs.get(lane) != run_id:
            return OK, []
        if urgent:
            with self.calm:
                self.urgent += 1
            try:
                return self._run(lane, held, feeds, urgent, until_record)
            finally:
                with self.calm:
                    self.urgent -= 1
                    self.calm.notify_all()
        return self._run(lane, held, feeds, urgent, until_record)

    def _run(
        self,
        lane: int,
        held: tuple[LaneOutputs, deque[list[Any]]],
        feeds: list[bytes],
        urgent: bool,
        until_record: bool,
    ) -> tuple[str, Any]:
        outputs, queue = held
        try:
            for feed in feeds:
                items = wire.feed_items(wire.unpack(feed))
                if items:
                    queue.append(items)
            made: list[tuple[bytes, list[Any]]] = []
            while True:
                if self.urgent and not urgent:
                    with self.calm:
                        self.calm.wait_for(lambda: not self.urgent, timeout=_YIELD_S)
                try:
                    out = outputs.next(lane)
                except _Starved:
                    break
                rec = out.record
                data = None if rec is None else rec.data  # a deferred batch stacks here
                meta, arrays = wire.output_meta(out, data)
                made.append((wire.pack(meta), arrays))
                if out.end or (until_record and rec is not None):
                    break
            return OK, made
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            return ERROR, error_message(e)
