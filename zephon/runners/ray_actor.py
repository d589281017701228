"""What a Ray actor runs: the plan over the lanes it owns, fed by the pipeline's process.

The actor is the Ray twin of a local worker process (:mod:`zephon.runners.worker`): the
same :class:`~zephon.runners.chain.ChainRunner` and
:class:`~zephon.runners.lanes.LaneOutputs`, the same wire format for outputs
(:func:`~zephon.runners.wire.output_meta`). It cannot ask the parent for feed units, so
the parent pushes them: each :meth:`LaneActor.run` call brings one of a lane's feed units
and returns every output the lane can make with what it has been given. A lane's outputs
are a pure function of its feed units, so which actor runs it, and how the units are cut
into calls, never changes them.

This module does not import Ray; :mod:`zephon.runners.ray` makes the class an actor.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any

from zephon.records import SampleCursor
from zephon.runners import wire
from zephon.runners.faults import error_message
from zephon.runners.lanes import LaneOutputs

OK = "ok"
ERROR = "error"


class _Starved(Exception):
    """A lane needs a feed unit the parent has not sent yet: it stops there."""


class LaneActor:
    """A Ray actor's loop: a lane's outputs from the feed units the parent sends."""

    def __init__(self, index: int, payload: bytes) -> None:
        import dill

        from zephon.runners.chain import ChainRunner

        self.index = index
        plan = dill.loads(payload)
        pool = None
        cap = max(op.parallelism for op in plan.ops)
        if cap > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op")
        self.runner = ChainRunner(plan, pool)
        self.outputs = LaneOutputs(self.runner, self._pull, 1)
        self.feeds: dict[int, deque[list[Any]]] = {}

    def ready(self) -> tuple[int, str]:
        """This actor's process id and host, once it is built."""
        return os.getpid(), socket.gethostname()

    def take(self, lane: int, target: list[int] | None) -> None:
        """``lane`` runs here from now on, from its first feed unit or its in-flight
        chunks; with ``target`` (``[chunk_id, offset, child]``) it replays up to and
        including that record, dropped (the restore path)."""
        self.feeds[lane] = deque()
        if target is not None:
            self.runner.replay_filter.set_target(lane, SampleCursor(lane, *target))  # type: ignore[attr-defined]

    def _pull(self, lane: int) -> list[Any]:
        feeds = self.feeds[lane]
        if not feeds:
            raise _Starved
        return feeds.popleft()

    def run(self, lane: int, feed: bytes) -> tuple[str, Any]:
        """Adds one feed unit of ``lane`` and makes every output it can: ``("ok",
        [(meta, arrays), ...])``, or ``("error", message)`` for an exception (the actor
        goes on living; the parent raises it)."""
        try:
            items = wire.feed_items(wire.unpack(feed))
            if items:
                self.feeds[lane].append(items)
            made: list[tuple[bytes, list[Any]]] = []
            while True:
                try:
                    out = self.outputs.next(lane)
                except _Starved:
                    break
                rec = out.record
                data = None if rec is None else rec.data  # a deferred batch stacks here
                meta, arrays = wire.output_meta(out, data)
                made.append((wire.pack(meta), arrays))
                if out.end:
                    break
            return OK, made
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            return ERROR, error_message(e)
