"""The parent's side of Ray workers (``Pipeline(workers=zp.RayWorkers(n))``).

One :class:`~zephon.runners.base.Executor` more, not a second pipeline: this process keeps
the engine, the work sources, in-flight chunks, completion tracking and replay cursors; each
actor (:class:`~zephon.runners.ray_actor.LaneActor`) runs the same plan and chain code as a
local worker process over the lanes it owns. Actors cannot ask this process for feed units,
so it pushes them: each lane keeps :data:`LOOKAHEAD_FEEDS` calls in flight, one feed unit
each; a call returns every output the lane could make (in the wire format of the worker
rings), through Ray's object store. A lane's outputs depend only on its feed units, so the
batches are those of ``workers=0``, bit for bit.

Lanes move. When an actor dies (``ray.kill``, its node lost), each of its lanes that had not
ended goes to a live actor (a fresh one if none is left) and takes the restore path there:
a fresh chain replays the lane's pulled in-flight chunks (:attr:`LaneRun.inflight`) with the
last record this process received from the lane as its replay target. What the replay drops
was received already: the tombstones it makes for it are left out of the lane's next
output (each piece of a sample appears once in a lane's stream), so tracking counts every
piece once. No batch changes, none is lost or repeated.

Errors: an exception raised on an actor arrives in ``next()`` as its own type and
:class:`~zephon.errors.WorkerError`, naming the actor and the lane; an actor that cannot
start or be placed within ``worker_timeout_s``, or does not answer for that long, is a
WorkerError; an unreachable ``address`` a ConnectionError after ``connect_timeout_s``.
Ray is imported here only, when the pipeline first runs.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.errors import TransferError, WorkerError
from zephon.records import FlushSentinel, SampleCursor
from zephon.runners import wire
from zephon.runners.base import LaneRun
from zephon.runners.chain import LaneOutput
from zephon.runners.faults import _original_type, _rebuilt
from zephon.runners.options import WorkerOptions
from zephon.runners.ray_actor import ERROR, LaneActor
from zephon.runners.ray_options import (
    LOOPBACK_ENV,
    RayWorkers,
    check_reachable,
    start_local_ray,
)

#: Calls (one feed unit each) kept in flight per lane, to hide the round trips.
LOOKAHEAD_FEEDS = 4
_POLL_S = 0.05
#: Received outputs between two prunings of a lane's received-pieces window.
_PRUNE_EVERY = 32


def connect(spec: RayWorkers) -> Any:
    """The ``ray`` module, connected as ``spec`` says (see :class:`RayWorkers`)."""
    if spec.address is None:
        if "ray" not in sys.modules:
            os.environ.update(LOOPBACK_ENV)  # before Ray reads them at import
        import ray

        if not ray.is_initialized():
            # CPUs for the actors asked for, no more (Ray's default takes every core)
            cpus = spec.num_workers * spec.actor_options()["num_cpus"]
            start_local_ray(num_cpus=max(1, math.ceil(cpus)))
        return ray
    import ray

    check_reachable(spec.address, spec.connect_timeout_s)
    if ray.is_initialized():
        return ray  # one Ray connection per process: the one made first
    try:
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=False)
    except Exception as e:
        raise ConnectionError(
            f"RayWorkers(address={spec.address!r}): could not join the Ray cluster: {e}"
        ) from e
    return ray


@dataclass
class _Actor:
    index: int
    handle: Any
    lanes: list[int] = field(default_factory=list)
    pid: int | None = None
    host: str = "?"
    alive: bool = True

    def name(self) -> str:
        return f"Ray actor {self.index} (pid {self.pid} on {self.host})"


@dataclass
class _Lane:
    actor: _Actor
    outs: deque[LaneOutput] = field(default_factory=deque)
    calls: deque[Any] = field(default_factory=deque)  # ObjectRefs, in the lane's order
    fed_end: bool = False  # no feed unit left to send
    final: FlushSentinel | None = None  # the final sentinel, once sent
    last: SampleCursor | None = None  # the last record received (or the restore target)
    ended: bool = False  # its end output was received
    #: ``(highest chunk id, contributors, tombstones)`` of received outputs that may still
    #: be replayed (see _move); pruned as the lane's in-flight chunks are evicted.
    window: deque[tuple[int, bytes, bytes]] = field(default_factory=deque)
    received: int = 0
    #: After a move: the pieces received before, left out of the next output's tombstones.
    seen: set[tuple[int, int, int]] | None = None


class RayExecutor:
    """Runs a rank's lanes on Ray actors; see the module's docstring."""

    place = "ray"

    def __init__(self, plan: Any, spec: RayWorkers, options: WorkerOptions) -> None:
        self.plan = plan
        self.spec = spec
        self.options = options
        self.ray: Any = None
        self.actors: list[_Actor] = []
        self.lanes: dict[int, _Lane] = {}
        self.moves = 0
        self._run: LaneRun | None = None
        self._payload: Any = None
        self._remote_cls: Any = None
        self._closed = False

    # ------------------------------------------------------------------ start
    def start(self, run: LaneRun) -> None:
        import dill

        self._run = run
        ray = self.ray = connect(self.spec)
        try:
            payload = dill.dumps(self.plan, recurse=True)
        except Exception as e:
            raise TransferError(
                f"the pipeline's operators or datasets do not pickle for Ray actors ({e!r}); "
                "make them picklable with dill (or give a dataset __zephon_reopen__)"
            ) from e
        self._payload = ray.put(payload)
        self._remote_cls = ray.remote(max_restarts=0, max_task_retries=0)(LaneActor)
        n = min(self.spec.num_workers, len(run.lanes))
        try:
            self.actors = self._start_actors(range(n))
            for wid, actor in enumerate(self.actors):
                actor.lanes = list(run.lanes[wid::n])
                for lane in actor.lanes:
                    target = run.targets.get(lane)
                    st = self.lanes[lane] = _Lane(actor, last=target)
                    st.ended = st.fed_end = lane in run.done
                    actor.handle.take.remote(lane, None if target is None else list(target[1:]))
            for lane in run.lanes:
                self._top_up(lane)
        except BaseException:
            self.close()
            raise

    def _start_actors(self, indexes: Any) -> list[_Actor]:
        """Actors built and answering, or a WorkerError saying why not, within
        ``worker_timeout_s``."""
        ray = self.ray
        opts = self.spec.actor_options()
        actors = [
            _Actor(i, self._remote_cls.options(**opts).remote(i, self._payload)) for i in indexes
        ]
        refs = [a.handle.ready.remote() for a in actors]
        timeout_s = self.options.worker_timeout_s
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for a in actors:
                ray.kill(a.handle)
            raise WorkerError(
                f"{len(pending)} of {len(actors)} Ray actors did not start within "
                f"worker_timeout_s={timeout_s} s: each asks for {opts}, the cluster has "
                f"{ray.available_resources()} available of {ray.cluster_resources()}. Lower "
                "RayWorkers(num_workers=..., resources=...) or add nodes"
            )
        for a, ref in zip(actors, refs, strict=True):
            try:
                a.pid, a.host = ray.get(ref)
            except Exception as e:
                for b in actors:
                    ray.kill(b.handle)
                why = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours its messages
                raise WorkerError(
                    f"Ray actor {a.index} could not start (a missing package on the cluster, "
                    f"or an operator or dataset that does not unpickle there): {why}"
                ) from e
        return actors

    # ------------------------------------------------------------- feeding
    def _top_up(self, lane: int) -> None:
        """Keeps :data:`LOOKAHEAD_FEEDS` calls of ``lane`` in flight."""
        st = self.lanes[lane]
        assert self._run is not None
        while not st.fed_end and len(st.calls) < LOOKAHEAD_FEEDS:
            feed = self._run.pull(lane)
            if not feed:
                st.fed_end = True
                return
            for it in feed:
                if isinstance(it, FlushSentinel) and it.final:
                    st.fed_end, st.final = True, it
            self._send(st, lane, feed)

    def _send(self, st: _Lane, lane: int, feed: list[Any]) -> None:
        st.calls.append(st.actor.handle.run.remote(lane, wire.pack(wire.feed(lane, feed))))

    # ------------------------------------------------------------- outputs
    def next_output(self, lane: int) -> LaneOutput:
        st = self.lanes[lane]
        while not st.outs:
            self._top_up(lane)
            if not st.calls:
                raise WorkerError(
                    f"lane {lane} has nothing more to run on {st.actor.name()} but has not "
                    "ended; this is a Zephon bug"
                )
            result = self._wait(lane, st)
            if result is None:
                continue  # the lane moved: its calls start again
            self._accept(lane, st, result)
        out = st.outs.popleft()
        self._top_up(lane)
        return out

    def _wait(self, lane: int, st: _Lane) -> Any:
        """The result of the lane's oldest call; None if its actor died and the lane moved."""
        ray = self.ray
        ref = st.calls[0]
        run = self._run
        assert run is not None
        since = time.monotonic()
        while True:
            if self._closed or run.stopping.is_set():
                raise WorkerError("the pipeline was closed")
            try:
                status, payload = ray.get(ref, timeout=_POLL_S)
                break
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError as e:
                self._move(st.actor, e)
                return None
            if time.monotonic() - since > self.options.worker_timeout_s:
                raise WorkerError(
                    f"{st.actor.name()} has not answered for lane {lane} in "
                    f"worker_timeout_s={self.options.worker_timeout_s} s"
                )
        st.calls.popleft()
        if status == ERROR:
            raise _actor_error(st.actor, lane, payload)
        return payload

    def _accept(self, lane: int, st: _Lane, made: list[tuple[bytes, list[Any]]]) -> None:
        for raw, arrays in made:
            meta = wire.unpack(raw)
            # Ray's arrays are read-only views of its object store: copies, as the rings give.
            out = wire.decode_output(meta, [np.array(a) for a in arrays])
            if st.seen is not None:
                seen = st.seen
                out.tombstones = [c for c in out.tombstones if (c[0], c[1], c[2]) not in seen]
                if out.record is not None or out.end:
                    st.seen = None  # everything the replay dropped came before this output
            pieces = meta.get(wire.CONTRIBUTORS, b"")
            tombs = wire.flat(out.tombstones) if out.tombstones else b""
            st.window.append((max(_top_chunk(pieces), _top_chunk(tombs)), pieces, tombs))
            rec = out.record
            if rec is not None:
                st.last = getattr(rec, "last_cursor", None) or rec.cursor
            if out.end:
                st.ended = True
            st.outs.append(out)
            st.received += 1
            if st.received % _PRUNE_EVERY == 0:
                self._prune(lane, st)

    def _prune(self, lane: int, st: _Lane) -> None:
        run = self._run
        if run is None or run.inflight is None:
            return
        units = run.inflight(lane)
        floor = units[0][0].chunk_id if units else 1 << 62
        while st.window and st.window[0][0] < floor:
            st.window.popleft()

    # --------------------------------------------------------------- moves
    def _move(self, dead: _Actor, error: BaseException) -> None:
        """Gives the lanes of ``dead`` to live actors (a fresh one if none is left); each
        replays its pulled in-flight chunks there, up to the last record received."""
        run = self._run
        assert run is not None
        if not dead.alive:
            return
        dead.alive = False
        if run.inflight is None:
            raise WorkerError(f"{dead.name()} died ({error}); its lanes cannot move") from error
        live = [a for a in self.actors if a.alive]
        if not live:
            try:
                live = self._start_actors([len(self.actors)])
            except WorkerError as e:
                raise WorkerError(
                    f"{dead.name()} died ({error}) and no actor could take its lanes "
                    f"{dead.lanes}: {e}"
                ) from e
            self.actors.extend(live)
        self.moves += 1
        for lane in dead.lanes:
            st = self.lanes[lane]
            to = min(live, key=lambda a: (len(a.lanes), a.index))
            to.lanes.append(lane)
            st.actor = to
            st.calls.clear()  # they failed with the actor
            if st.ended:
                continue
            seen: set[tuple[int, int, int]] = set()
            for _, contributors, tombs in st.window:
                for raw in (contributors, tombs):
                    rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 4)[:, :3]
                    seen.update(map(tuple, rows.tolist()))
            st.seen = seen
            last = st.last
            to.handle.take.remote(lane, None if last is None else list(last[1:]))
            for unit in run.inflight(lane):
                self._send(st, lane, unit)
            if st.final is not None:
                self._send(st, lane, [st.final])
        dead.lanes = []

    # ------------------------------------------------------------ the rest
    def extra_stats(self) -> dict[str, Any]:
        return {
            "ray": {
                "actors": [
                    {
                        "id": a.index,
                        "pid": a.pid,
                        "host": a.host,
                        "lanes": a.lanes,
                        "alive": a.alive,
                    }
                    for a in self.actors
                ],
                "lane_moves": self.moves,
                "speculate": self.spec.speculate,
            }
        }

    def close(self) -> None:
        """Kills the actors (nothing of theirs needs saving). Idempotent; Ray itself stays
        up (it may serve other pipelines; ``ray.shutdown()`` is the caller's)."""
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        for a in self.actors:
            if a.alive and ray is not None:
                try:
                    ray.kill(a.handle)
                except Exception:  # noqa: BLE001 - gone already
                    pass
            a.alive = False
        for st in self.lanes.values():
            st.calls.clear()
            st.outs.clear()
        self._run = None  # holds the engine's methods: a reference cycle, left to the GC


def _top_chunk(raw: bytes) -> int:
    """The highest chunk id among flat contributor rows (-1 for none)."""
    if not raw:
        return -1
    return int(np.frombuffer(raw, dtype="<i8")[0::4].max())


def _actor_error(actor: _Actor, lane: int, msg: dict[str, Any]) -> BaseException:
    """An actor's exception as its own type and WorkerError, naming the actor and lane."""
    where = msg.get("where")
    at = f" in {where}" if where else f" running lane {lane}"
    text = (
        f"{msg['message']}\n\n[{actor.name()}, lane {lane}: raised {msg['type']}{at}; its "
        f"traceback:]\n{msg['traceback'].rstrip()}"
    )
    base = _original_type(msg)
    err = None if base is None else _rebuilt(base, text)
    return err if err is not None else WorkerError(f"{msg['type']}: {text}")
