"""The parent's side of Ray workers (``Pipeline(workers=zp.RayWorkers(n))``).

One :class:`~zephon.runners.base.Executor` more, not a second pipeline: this process keeps
the engine, the work sources, in-flight chunks, completion tracking and replay cursors; each
actor (:class:`~zephon.runners.ray_actor.LaneActor`) runs the same plan and chain code as a
local worker process over the lanes it owns. Actors cannot ask this process for feed units,
so it pushes them: each lane keeps :data:`LOOKAHEAD_CALLS` calls in flight, a few feed
units each; a call returns every output the lane could make (in the wire format of the worker
rings), through Ray's object store. A lane's outputs depend only on its feed units, so the
batches are those of ``workers=0``, bit for bit.

Lanes move. When an actor dies (``ray.kill``, its node lost), each of its lanes that had not
ended goes to a live actor (a fresh one if none is left) and takes the restore path there:
a fresh chain replays the lane's pulled in-flight chunks (:attr:`LaneRun.inflight`) with the
last record this process received from the lane as its replay target. What the replay drops
was received already: the tombstones it makes for it are left out of the lane's next
output (each piece of a sample appears once in a lane's stream), so tracking counts every
piece once. No batch changes, none is lost or repeated. The same path starts a straggling
lane on a second actor (``RayWorkers(speculate=True)``: the first of the two runs to make
the lane's next output keeps it, the other is dropped) and moves lanes when
``resize_workers`` adds or removes actors. Moved and speculative lanes run in the actor's
second concurrency group (:data:`MOVED`), so their replay does not queue behind the calls
already sent for the actor's own lanes; each run of a lane on an actor has an id, and a
call of a run that was dropped or replaced does nothing.

Errors: an exception raised on an actor arrives in ``next()`` as its own type and
:class:`~zephon.errors.WorkerError`, naming the actor and the lane; an actor that cannot
start or be placed within ``worker_timeout_s``, or does not answer for that long, is a
WorkerError; an unreachable ``address`` a ConnectionError after ``connect_timeout_s``.
Ray is imported here only, when the pipeline first runs.
"""

from __future__ import annotations

import itertools
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

#: Calls kept in flight per lane, to hide the round trips.
LOOKAHEAD_CALLS = 2
#: Feed units a call brings at most: fewer calls, each worth more. A Ray call costs the
#: parent, the raylet and the actor about a millisecond of CPU together, whatever it
#: carries; on the LM workload (benchmarks.remote) 4 calls of 1 unit a lane ran at
#: 0.4-0.5x of local workers, 2 of 8 at 0.6-0.75x. The replay of a moved lane sends one
#: unit a call instead (its first output then comes back as soon as it is made).
FEEDS_PER_CALL = 8
_POLL_S = 0.05
#: The actors' second concurrency group (one thread): where moved and speculative lanes
#: run, so that their replay does not wait behind the calls already queued for the
#: actor's own lanes. A lane's calls all go to one group, which runs them in order.
MOVED = "moved"
#: Waits for a lane's outputs kept to judge stragglers by.
_WAITS_KEPT = 8
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
class _Copy:
    """A lane's speculative run on a second actor (see :meth:`RayExecutor._speculate`)."""

    actor: _Actor
    run_id: int
    seen: set[tuple[int, int, int]]
    calls: deque[Any] = field(default_factory=deque)
    group: str | None = MOVED


@dataclass
class _Lane:
    actor: _Actor
    run_id: int = 0  # the lane's run on its actor (see LaneActor.take)
    group: str | None = None  # the actor's concurrency group running it (see MOVED)
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
    copy: _Copy | None = None  # a speculative run, racing this one
    #: This process's recent waits for the lane's outputs, in seconds (for stragglers).
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=_WAITS_KEPT))


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
        self.speculations = 0
        self.speculation_wins = 0
        self.resizes = 0
        self._run_ids = itertools.count(1)
        self._resize_to: int | None = None
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
        self._remote_cls = ray.remote(
            max_restarts=0, max_task_retries=0, concurrency_groups={MOVED: 1}
        )(LaneActor)
        wanted = self.spec.num_workers if self._resize_to is None else self._resize_to
        self._resize_to = None
        n = min(wanted, len(run.lanes))
        try:
            self.actors = self._start_actors(range(n))
            for wid, actor in enumerate(self.actors):
                actor.lanes = list(run.lanes[wid::n])
                for lane in actor.lanes:
                    target = run.targets.get(lane)
                    st = self.lanes[lane] = _Lane(actor, next(self._run_ids), last=target)
                    st.ended = st.fed_end = lane in run.done
                    self._take(actor, lane, target, st.run_id, None)
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
        """Keeps :data:`LOOKAHEAD_CALLS` calls of ``lane`` in flight, each with up to
        :data:`FEEDS_PER_CALL` feed units."""
        st = self.lanes[lane]
        assert self._run is not None
        while not st.fed_end and len(st.calls) < LOOKAHEAD_CALLS:
            units: list[list[Any]] = []
            while not st.fed_end and len(units) < FEEDS_PER_CALL:
                feed = self._run.pull(lane)
                if not feed:
                    st.fed_end = True
                    break
                for it in feed:
                    if isinstance(it, FlushSentinel) and it.final:
                        st.fed_end, st.final = True, it
                units.append(feed)
            if units:
                self._send(st, lane, units)

    def _send(self, st: _Lane, lane: int, units: list[list[Any]]) -> None:
        """One call of ``lane`` on its actor, bringing ``units`` (feed units, in order)."""
        feeds = [wire.pack(wire.feed(lane, feed)) for feed in units]
        st.calls.append(_call(st.actor, "run", st.group, lane, feeds, st.run_id))
        if st.copy is not None:  # racing: the copy gets every unit too
            copy = st.copy
            copy.calls.append(_call(copy.actor, "run", copy.group, lane, feeds, copy.run_id))

    @staticmethod
    def _take(
        actor: _Actor, lane: int, target: SampleCursor | None, run_id: int, group: str | None
    ) -> None:
        where = None if target is None else list(target[1:])
        _call(actor, "take", group, lane, where, run_id)

    # ------------------------------------------------------------- outputs
    def next_output(self, lane: int) -> LaneOutput:
        if self._resize_to is not None:
            self._resize(self._resize_to)
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
        """The outputs of the lane's oldest call (or of its copy's, which then takes the
        lane: see :meth:`_speculate`); None if its actor died and the lane moved."""
        ray = self.ray
        run = self._run
        assert run is not None
        since = time.monotonic()
        while True:
            if self._closed or run.stopping.is_set():
                raise WorkerError("the pipeline was closed")
            copy = st.copy
            refs = [st.calls[0]]
            if copy is not None and copy.calls:
                refs.append(copy.calls[0])
            ready, _ = ray.wait(refs, num_returns=1, timeout=_POLL_S)
            if ready:
                from_copy = len(refs) == 2 and ready[0].hex() == refs[1].hex()
                owner = copy.actor if from_copy and copy is not None else st.actor
                try:
                    status, payload = ray.get(ready[0])
                except ray.exceptions.RayActorError as e:
                    self._move(owner, e, lane)
                    if from_copy:
                        continue  # the copy is gone; the lane itself runs on
                    return None
                if status == ERROR:
                    raise _actor_error(owner, lane, payload)
                if from_copy and copy is not None:
                    copy.calls.popleft()
                    if not payload:
                        continue  # still replaying: no output yet
                    self._adopt(lane, st)
                    self.speculation_wins += 1
                else:
                    st.calls.popleft()
                    if payload and copy is not None:
                        self._drop_copy(lane, st)  # the lane's own run was first
                st.waits.append(time.monotonic() - since)
                return payload
            waited = time.monotonic() - since
            if self.spec.speculate and copy is None and waited > self._straggler_s():
                self._speculate(lane, st)
            if waited > self.options.worker_timeout_s:
                raise WorkerError(
                    f"{st.actor.name()} has not answered for lane {lane} in "
                    f"worker_timeout_s={self.options.worker_timeout_s} s"
                )

    def _straggler_s(self) -> float:
        """How long a wait makes a lane a straggler: ``straggler_factor`` times the median
        lane's mean recent wait, at least ``straggler_min_s``; never before half the lanes
        have had an output (the first outputs wait for the actors' first calls)."""
        means = sorted(sum(st.waits) / len(st.waits) for st in self.lanes.values() if st.waits)
        if len(means) < max(2, len(self.lanes) // 2):
            return math.inf
        median = means[len(means) // 2]
        return max(self.spec.straggler_min_s, self.spec.straggler_factor * median)

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
    def _replay_on(
        self,
        lane: int,
        st: _Lane,
        to: _Actor,
        later: list[tuple[_Copy, int, list[Any]]] | None = None,
    ) -> _Copy:
        """A fresh run of ``lane`` on ``to``: its pulled in-flight chunks replayed up to
        the last record received (the restore path), the pieces received before noted
        so that their tombstones are not counted twice. With ``later``, the replay's
        calls are left there for :meth:`_send_replays`."""
        run = self._run
        assert run is not None and run.inflight is not None
        seen: set[tuple[int, int, int]] = set()
        for _, contributors, tombs in st.window:
            for raw in (contributors, tombs):
                rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 4)[:, :3]
                seen.update(map(tuple, rows.tolist()))
        copy = _Copy(to, next(self._run_ids), seen)
        self._take(to, lane, st.last, copy.run_id, copy.group)
        units = run.inflight(lane)
        if st.final is not None:
            units.append([st.final])
        feeds = [wire.pack(wire.feed(lane, unit)) for unit in units]
        if later is None:
            self._send_replays([(copy, lane, feeds)])
        else:
            later.append((copy, lane, feeds))
        return copy

    @staticmethod
    def _send_replays(replays: list[tuple[_Copy, int, list[Any]]]) -> None:
        """Replays' calls, one feed unit each (a lane's first output comes back as soon as
        it is made) and taking turns between lanes (an actor runs its calls in order: a
        lane waits for the others' first units, not for all of their replays)."""
        for i in range(max((len(feeds) for _, _, feeds in replays), default=0)):
            for copy, lane, feeds in replays:
                if i < len(feeds):
                    call = _call(copy.actor, "run", copy.group, lane, [feeds[i]], copy.run_id)
                    copy.calls.append(call)

    def _relocate(
        self,
        lane: int,
        st: _Lane,
        to: _Actor,
        later: list[tuple[_Copy, int, list[Any]]] | None = None,
    ) -> None:
        """``lane`` runs on ``to`` from now on, replaying there (a lane move)."""
        old = st.actor
        if old.alive:
            _call(old, "drop", st.group, lane, st.run_id)
        if lane in old.lanes:
            old.lanes.remove(lane)
        to.lanes.append(lane)
        st.actor = to
        if st.copy is not None:
            self._drop_copy(lane, st)
        st.calls.clear()  # their outputs come again from the replay
        if st.ended:
            return
        fresh = self._replay_on(lane, st, to, later)
        st.run_id, st.calls, st.seen, st.group = fresh.run_id, fresh.calls, fresh.seen, fresh.group

    def _speculate(self, lane: int, st: _Lane) -> None:
        """Starts ``lane`` again on the least loaded other live actor, racing its run."""
        others = [a for a in self.actors if a.alive and a is not st.actor]
        if not others or self._run is None or self._run.inflight is None:
            return
        to = min(others, key=lambda a: (len(a.lanes), a.index))
        st.copy = self._replay_on(lane, st, to)
        self.speculations += 1

    def _adopt(self, lane: int, st: _Lane) -> None:
        """The lane's copy made its next output first: it is the lane's run now."""
        copy = st.copy
        assert copy is not None
        old = st.actor
        if old.alive:
            _call(old, "drop", st.group, lane, st.run_id)
        if lane in old.lanes:
            old.lanes.remove(lane)
        copy.actor.lanes.append(lane)
        st.actor, st.run_id, st.calls, st.seen = copy.actor, copy.run_id, copy.calls, copy.seen
        st.group = copy.group
        st.copy = None

    def _drop_copy(self, lane: int, st: _Lane) -> None:
        copy = st.copy
        st.copy = None
        if copy is not None and copy.actor.alive:
            _call(copy.actor, "drop", copy.group, lane, copy.run_id)

    def _move(self, dead: _Actor, error: BaseException, first: int = 0) -> None:
        """Gives the lanes of ``dead`` to live actors (a fresh one if none is left); each
        replays its pulled in-flight chunks there, up to the last record received (or is
        taken by its speculative copy, if it has one). The lanes replay in the order the
        consumer asks for them, from ``first`` (the lane it waits for)."""
        run = self._run
        assert run is not None
        if not dead.alive:
            return
        dead.alive = False
        for st in self.lanes.values():
            if st.copy is not None and st.copy.actor is dead:
                st.copy = None
        if not dead.lanes:
            return
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
        replays: list[tuple[_Copy, int, list[Any]]] = []
        for lane in sorted(dead.lanes, key=lambda x: (x < first, x)):
            st = self.lanes[lane]
            if st.copy is not None:
                self._adopt(lane, st)
            else:
                to = min(live, key=lambda a: (len(a.lanes), a.index))
                self._relocate(lane, st, to, replays)
        self._send_replays(replays)
        dead.lanes = []

    # -------------------------------------------------------------- resize
    def resize_workers(self, num_workers: int) -> None:
        """Asks for ``num_workers`` actors: added ones take lanes, removed ones give
        theirs, as lane moves, when the consumer next asks for a batch (before the
        pipeline starts: it starts with that many)."""
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(
                f"resize_workers(num_workers) must be an int >= 1; got {num_workers!r}"
            )
        self._resize_to = num_workers

    def _resize(self, wanted: int) -> None:
        self._resize_to = None
        if self._run is None or self._run.inflight is None:
            raise WorkerError("this pipeline's lanes cannot move: resize_workers() needs them to")
        live = [a for a in self.actors if a.alive]
        n = min(wanted, len(self.lanes))
        if n > len(live):
            added = self._start_actors(range(len(self.actors), len(self.actors) + n - len(live)))
            self.actors.extend(added)
            live += added
            for a in added:  # each takes lanes from the most loaded, until even
                while True:
                    donor = max(live, key=lambda b: (len(b.lanes), -b.index))
                    if len(donor.lanes) - len(a.lanes) <= 1:
                        break
                    lane = donor.lanes[-1]
                    self._relocate(lane, self.lanes[lane], a)
        elif n < len(live):
            keep, gone = live[:n], live[n:]
            for a in gone:
                a.alive = False  # takes no lane or copy from here on
                for st in self.lanes.values():
                    if st.copy is not None and st.copy.actor is a:
                        st.copy = None
                for lane in list(a.lanes):
                    to = min(keep, key=lambda b: (len(b.lanes), b.index))
                    self._relocate(lane, self.lanes[lane], to)
                self.ray.kill(a.handle)
        else:
            return
        self.resizes += 1

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
                "resizes": self.resizes,
                "speculate": self.spec.speculate,
                "speculations": self.speculations,
                "speculation_wins": self.speculation_wins,
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
            st.copy = None
        self._run = None  # holds the engine's methods: a reference cycle, left to the GC


def _call(actor: _Actor, method: str, group: str | None, *args: Any) -> Any:
    """``actor.method.remote(*args)`` in concurrency group ``group`` (None: the default)."""
    bound = getattr(actor.handle, method)
    if group is not None:
        bound = bound.options(concurrency_group=group)
    return bound.remote(*args)


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
