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
call of a run that was dropped or replaced does nothing. A replay is one call
(:meth:`~zephon.runners.ray_actor.LaneActor.replay`): the lane's in-flight units, run
before the actor's other calls until the lane's next record, which it returns at once.
This process learns of a death from the actor's one call of
:meth:`~zephon.runners.ray_actor.LaneActor.watch`, whose result fails then (looked at
while waiting for any lane's output, and every :data:`_WATCH_S` in ``next()``), or from a
wait for one of its lanes. The first way, the moved lanes replay while the consumer still
takes the batches the actor had made, or waits for another actor's. The moved lanes start
their replay one at each of the consumer's calls, in its order (a lane it asks for at
once; all of them while it waits for another actor's lane): a lane the consumer waits
for replays alone, and the Ray calls of a move are spread over its calls.
A lane whose actors keep dying before it gets past its chunks (a sample that kills the
process running it) is a WorkerError after ``RayWorkers.max_lane_restarts`` moves in a row.

Actors join. ``RayWorkers(n)`` asks Ray for ``n`` actors and starts with those up: it
waits ``worker_timeout_s`` for the first (none up by then is a WorkerError naming the
resources asked and available), then :data:`JOIN_GRACE_S` for the others. Those still
waiting for resources stay asked for (``stats()["ray"]["pending_actors"]``); when Ray
places one (a node added, by hand or by its autoscaler) it takes lanes from the most
loaded actors, as lane moves (``stats()["ray"]["joins"]``). An actor that dies is replaced
by a new one, asked for at once and joining the same way (``replacements``): the count
asked for stays ``n``.

Errors: an exception raised on an actor arrives in ``next()`` as its own type and
:class:`~zephon.errors.WorkerError`, naming the actor and the lane; an actor that cannot
start (its error), or none placed within ``worker_timeout_s``, or one that does not answer
for that long, is a WorkerError; an unreachable ``address`` a ConnectionError after
``connect_timeout_s``. Ray is imported here only, when the pipeline first runs.
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
from zephon.runners.faults import raised_as
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
#: The actors' third concurrency group (one thread), where each actor's one
#: :meth:`~zephon.runners.ray_actor.LaneActor.watch` call waits: its result fails when
#: the actor dies.
WATCH = "watch"
#: How often a running pipeline looks at those results, besides while it waits for a
#: lane's output: an actor's death is noticed within this (and Ray's own notice) while the
#: consumer still takes the batches made before it, and the dead actor's lanes replay
#: elsewhere in the meantime. Infinite: no watch (a benchmark's comparison).
_WATCH_S = 0.02
#: Waits for a lane's outputs kept to judge stragglers by.
_WAITS_KEPT = 8
#: How long the start waits for the other actors once one is up (see RayExecutor.start).
JOIN_GRACE_S = 1.0
#: Feed units past the one holding its replay target that a replay's first call brings.
_REPLAY_AHEAD = 2
#: How often a running pipeline looks for pending actors that Ray has placed since.
_JOIN_CHECK_S = 0.2
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
    node: str = "?"  # Ray's node id
    alive: bool = True
    ready: Any = None  # the ObjectRef of its ready() call, while it is pending
    watch: Any = None  # the ObjectRef of its watch() call, once up

    def name(self) -> str:
        return f"Ray actor {self.index} (pid {self.pid} on {self.host})"


@dataclass
class _Copy:
    """A lane's speculative run on a second actor (see :meth:`RayExecutor._speculate`)."""

    actor: _Actor
    run_id: int
    seen: np.ndarray  # see _Lane.seen
    calls: deque[Any] = field(default_factory=deque)
    group: str | None = MOVED
    backlog: list[bytes] = field(default_factory=list)  # see _Lane.backlog


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
    #: ``(chunk_id, offset, child)`` rows, int64: a set only where an output needs it (a
    #: set of every row, built at once, costs a move milliseconds and a GC pass).
    seen: np.ndarray | None = None
    copy: _Copy | None = None  # a speculative run, racing this one
    #: A replay's feed units (packed) not sent yet, sent before any unit pulled now,
    #: ``step`` units in the next call.
    backlog: list[bytes] = field(default_factory=list)
    step: int = 2
    #: Deaths in a row of the actor running the lane (see _count_death), and the highest
    #: chunk id pulled for the lane: at the last of them, and now.
    deaths: int = 0
    death_top: int = -1
    pulled_top: int = -1
    #: This process's recent waits for the lane's outputs, in seconds (for stragglers).
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=_WAITS_KEPT))


class RayExecutor:
    """Runs a rank's lanes on Ray actors; see the module's docstring."""

    place = "ray"
    #: Tests: every wait for a lane's output starts a speculative run of the lane at once
    #: (as if every lane straggled), so that races and their ends are exercised.
    force_speculation = False

    def __init__(self, plan: Any, spec: RayWorkers, options: WorkerOptions) -> None:
        self.plan = plan
        self.spec = spec
        self.options = options
        self.ray: Any = None
        self.actors: list[_Actor] = []  # up (alive or not), by index
        #: Actors asked of Ray and not up yet (waiting for resources: a node to be added).
        self.pending: list[_Actor] = []
        self.joins = 0  # pending actors that were placed while running and took lanes
        self.replacements = 0  # actors asked for in place of dead ones
        self._wanted = 0  # actors asked for: live and pending (see _move)
        self._replace_at = math.inf  # when to ask for the replacements of dead actors
        self._indexes = itertools.count()
        self._join_at = math.inf
        self._watch_at = 0.0
        self.lanes: dict[int, _Lane] = {}
        self.moves = 0
        self.speculations = 0
        self.speculation_wins = 0
        self.resizes = 0
        self._run_ids = itertools.count(1)
        #: Calls of moved lanes' old runs, let go at the consumer's next call (see _relocate).
        self._spent: list[deque[Any]] = []
        #: Lanes that moved and have not started their replay yet (see _move).
        self._due: list[int] = []
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
            max_restarts=0, max_task_retries=0, concurrency_groups={MOVED: 1, WATCH: 1}
        )(LaneActor)
        wanted = self.spec.num_workers if self._resize_to is None else self._resize_to
        self._resize_to = None
        try:
            self._wanted = min(wanted, len(run.lanes))
            self._launch(self._wanted)
            up = self._admit(1, self.options.worker_timeout_s, must=True)
            up += self._admit(len(self.pending), JOIN_GRACE_S)  # the others, if they are up
            for wid, actor in enumerate(up):
                actor.lanes = list(run.lanes[wid :: len(up)])
                for lane in actor.lanes:
                    target = run.targets.get(lane)
                    st = self.lanes[lane] = _Lane(actor, next(self._run_ids), last=target)
                    st.ended = st.fed_end = lane in run.done
                    self._take(actor, lane, target, st.run_id, None)
            for lane in run.lanes:
                self._top_up(lane)
            self._join_at = time.monotonic() + _JOIN_CHECK_S
        except BaseException:
            self.close()
            raise

    def _launch(self, count: int) -> None:
        """Asks Ray for ``count`` more actors: pending until they are up (see _admit)."""
        opts = self.spec.actor_options()
        for _ in range(count):
            i = next(self._indexes)
            handle = self._remote_cls.options(**opts).remote(i, self._payload)
            self.pending.append(_Actor(i, handle, ready=handle.ready.remote()))

    def _admit(self, count: int, timeout_s: float, must: bool = False) -> list[_Actor]:
        """The pending actors that are up within ``timeout_s`` (waiting for ``count`` of
        them at most), now live, without lanes yet. An actor that could not start is a
        WorkerError naming its error; with ``must``, so is finding none up in time,
        naming the resources asked and available."""
        ray = self.ray
        if not self.pending:
            return []
        refs = [a.ready for a in self.pending]
        done, _ = ray.wait(refs, num_returns=max(1, min(count, len(refs))), timeout=timeout_s)
        if not done and must:
            opts = self.spec.actor_options()
            waiting = len(self.pending)
            self._kill_pending()
            raise WorkerError(
                f"none of {waiting} Ray actors started within worker_timeout_s={timeout_s} s: "
                f"each asks for {opts}, the cluster has {ray.available_resources()} available "
                f"of {ray.cluster_resources()}. Lower RayWorkers(num_workers=..., "
                "resources=...) or add nodes"
            )
        ready = {ref.hex() for ref in done}
        up = [a for a in self.pending if a.ready.hex() in ready]
        for a in up:
            try:
                a.pid, a.host, a.node = ray.get(a.ready)
            except Exception as e:
                self._kill_pending()
                why = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours its messages
                raise WorkerError(
                    f"Ray actor {a.index} could not start (a missing package on the cluster, "
                    f"or an operator or dataset that does not unpickle there): {why}"
                ) from e
        self.pending = [a for a in self.pending if a.ready.hex() not in ready]
        for a in up:
            # a call that does nothing, run in the group moved lanes replay in: Ray sets
            # the group's thread up on its first call, which a death then need not wait for
            _call(a, "drop", MOVED, -1, 0)
            a.watch = _call(a, "watch", WATCH)
        self.actors = sorted(self.actors + up, key=lambda a: a.index)
        return up

    def _kill_pending(self, keep: int = 0) -> None:
        """Kills the pending actors but the first ``keep``."""
        for a in self.pending[keep:]:
            self.ray.kill(a.handle)
        self.pending = self.pending[:keep]

    def _join_pending(self) -> None:
        """Pending actors that are up now (placed since: a node added, by hand or by Ray's
        autoscaler) take lanes from the most loaded actors, as lane moves."""
        self._join_at = time.monotonic() + _JOIN_CHECK_S
        up = self._admit(len(self.pending), 0)
        if up:
            self._spread(up)
            self.joins += len(up)

    def _spread(self, added: list[_Actor]) -> None:
        """Each of ``added`` takes lanes from the most loaded live actors, until even."""
        live = [a for a in self.actors if a.alive]
        for a in added:
            while True:
                donor = max(live, key=lambda b: (len(b.lanes), -b.index))
                if len(donor.lanes) - len(a.lanes) <= 1:
                    break
                lane = donor.lanes[-1]
                self._relocate(lane, self.lanes[lane], a)

    # ------------------------------------------------------------- feeding
    def _top_up(self, lane: int) -> None:
        """Keeps :data:`LOOKAHEAD_CALLS` calls of ``lane`` in flight, each with up to
        :data:`FEEDS_PER_CALL` feed units: the rest of a replay first (its backlog, in
        calls of 2, 4, ... units: the lane's next outputs come back soon), then units
        pulled now."""
        st = self.lanes[lane]
        assert self._run is not None
        if lane in self._due:
            return  # its run starts with its replay
        while (st.backlog or not st.fed_end) and len(st.calls) < LOOKAHEAD_CALLS:
            if st.backlog:
                feeds = st.backlog[: st.step]
                del st.backlog[: st.step]
                st.step = min(2 * st.step, FEEDS_PER_CALL)
                self._send(st, lane, feeds, [])
                continue
            fresh: list[bytes] = []
            while not st.fed_end and len(fresh) < FEEDS_PER_CALL:
                feed = self._run.pull(lane)
                if not feed:
                    st.fed_end = True
                    break
                for it in feed:
                    if not isinstance(it, FlushSentinel):
                        st.pulled_top = it.chunk_id
                    elif it.final:
                        st.fed_end, st.final = True, it
                fresh.append(wire.pack(wire.feed(lane, feed)))
            if fresh:
                self._send(st, lane, fresh, fresh)

    def _send(self, st: _Lane, lane: int, feeds: list[bytes], fresh: list[bytes]) -> None:
        """One call of ``lane`` on its actor, bringing ``feeds`` (packed feed units, in
        order), of which ``fresh`` were pulled now."""
        st.calls.append(_call(st.actor, "run", st.group, lane, feeds, st.run_id))
        if st.copy is not None and fresh:
            # racing: the copy gets every unit pulled from now on too (its replay brought
            # it those pulled before: the lane's backlog too)
            copy = st.copy
            copy.calls.append(_call(copy.actor, "run", copy.group, lane, fresh, copy.run_id))

    @staticmethod
    def _take(
        actor: _Actor, lane: int, target: SampleCursor | None, run_id: int, group: str | None
    ) -> None:
        where = None if target is None else list(target[1:])
        _call(actor, "take", group, lane, where, run_id)

    # ------------------------------------------------------------- outputs
    def next_output(self, lane: int) -> LaneOutput:
        if self._spent:
            self._spent.clear()
        self._start_due(lane)
        if time.monotonic() >= self._watch_at:
            self._watch(lane)
        if self._resize_to is not None:
            self._resize(self._resize_to)
        if self.pending and time.monotonic() >= self._join_at:
            self._join_pending()
        if time.monotonic() >= self._replace_at:
            # a death's replacement, asked for a little later: its start (a process, the
            # plan unpickled) does not slow the moved lanes' replays on a shared machine
            self._replace_at = math.inf
            self._replace()
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

    def _watch(self, lane: int, every: bool = False) -> None:
        """Moves the lanes of actors found dead by their watch() calls (see
        :data:`WATCH`), the consumer's ``lane`` and those after it first. Unless ``lane``
        is one of them (it then replays alone), one starts its replay now, or with
        ``every`` (the consumer waits for another lane) all of them."""
        self._watch_at = time.monotonic() + _WATCH_S
        watched = {a.watch.hex(): a for a in self.actors if a.alive and a.watch is not None}
        if not watched:
            return
        refs = [a.watch for a in watched.values()]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        waits = False  # the consumer waits for a lane that moved: it replays alone
        for ref in done:
            actor = watched[ref.hex()]
            actor.watch = None
            waits = waits or lane in actor.lanes
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError as e:
                self._move(actor, e, lane)
        if not waits:
            self._start_due(lane, every)

    def _start_due(self, lane: int, every: bool = False) -> None:
        """Starts the replay of one moved lane that waits for it (see :meth:`_move`): the
        consumer's ``lane`` if it is one, else the next in the consumer's order; with
        ``every``, of all of them. One a call spreads their cost (a Ray call each) over
        the consumer's calls, and the lanes still replay before it reaches them."""
        while self._due:
            moved = lane if lane in self._due else self._due[0]
            self._due.remove(moved)
            self._start_replay(moved, self.lanes[moved])
            if not every:
                return

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
            if copy is None and self.force_speculation and self.spec.speculate:
                self._speculate(lane, st)
                copy = st.copy
            refs = [st.calls[0]]
            if copy is not None and copy.calls:
                refs.append(copy.calls[0])
            # the actors' watch calls too: another actor's death moves its lanes now, and
            # they replay while this lane's output is made
            watches = []
            if _WATCH_S < math.inf:
                watches = [a.watch for a in self.actors if a.alive and a.watch is not None]
            ready, _ = ray.wait(refs + watches, num_returns=1, timeout=_POLL_S)
            if ready and all(ready[0].hex() != ref.hex() for ref in refs):
                self._watch(lane, every=True)
                if st.actor.alive:
                    continue
                return None  # this lane's actor died: it moved
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
        zero_copy = self.options.zero_copy
        for raw, arrays in made:
            meta = wire.unpack(raw)
            # Ray's arrays are read-only views of its object store: copies, as the rings
            # give, but with zero_copy=True (views then, valid for as long as they are kept)
            out = wire.decode_output(meta, arrays if zero_copy else [np.array(a) for a in arrays])
            if st.seen is not None:
                if out.tombstones:
                    dropped = out.tombstones
                    rows = st.seen[np.isin(st.seen[:, 0], [c[0] for c in dropped])]
                    seen = set(map(tuple, rows.tolist()))
                    out.tombstones = [c for c in dropped if (c[0], c[1], c[2]) not in seen]
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
    def _replay_on(self, lane: int, st: _Lane, to: _Actor, move: bool = False) -> _Copy:
        """A fresh run of ``lane`` on ``to``: its pulled in-flight chunks replayed up to
        the last record received (the restore path), the pieces received before noted
        so that their tombstones are not counted twice. Its first call goes at once (one
        :meth:`LaneActor.replay`: the actor runs it before its other calls, until the
        lane's next record where later calls make the rest's outputs). The rest: for a
        ``move``, the lane's next calls (its backlog, see :meth:`_top_up`); for a copy,
        calls now (it gets every unit pulled from now on)."""
        run = self._run
        assert run is not None and run.inflight is not None
        raws = [raw for _, pieces, tombs in st.window for raw in (pieces, tombs) if raw]
        rows = np.frombuffer(b"".join(raws), dtype="<i8").reshape(-1, 4)[:, :3]
        copy = _Copy(to, next(self._run_ids), rows)
        units = run.inflight(lane)
        if st.final is not None:
            units.append([st.final])
        feeds = [wire.pack(wire.feed(lane, unit)) for unit in units]
        # the first call: the units up to the target's chunk and two more (the replay
        # makes no output before the target; the next one most likely needs no more)
        target = st.last
        upto = 0 if target is None else sum(_chunk_id(u) <= target.chunk_id for u in units)
        head = min(upto + _REPLAY_AHEAD, len(feeds))
        where = None if target is None else list(target[1:])
        # it returns at the lane's next record if later calls make the rest's outputs
        early = not st.fed_end or head < len(feeds)
        args = (lane, where, copy.run_id, feeds[:head], early)
        copy.calls.append(_call(to, "replay", copy.group, *args))
        if move:
            copy.backlog = feeds[head:]
        else:
            for i in range(head, len(feeds), FEEDS_PER_CALL):
                units_i = feeds[i : i + FEEDS_PER_CALL]
                copy.calls.append(_call(to, "run", copy.group, lane, units_i, copy.run_id))
        return copy

    def _relocate(self, lane: int, st: _Lane, to: _Actor, now: bool = True) -> None:
        """``lane`` runs on ``to`` from now on, replaying there (a lane move): at once, or
        if not ``now`` when :meth:`_start_due` gets to it."""
        old = st.actor
        if old.alive:
            _call(old, "drop", st.group, lane, st.run_id)
        if lane in old.lanes:
            old.lanes.remove(lane)
        to.lanes.append(lane)
        st.actor = to
        if st.copy is not None:
            self._drop_copy(lane, st)
        # their outputs come again from the replay; the references are let go once the
        # consumer has its next output (Ray frees each one's object then: that can wait)
        self._spent.append(st.calls)
        st.calls = deque()
        st.backlog = []
        if now or st.ended:
            if lane in self._due:
                self._due.remove(lane)
            if not st.ended:
                self._start_replay(lane, st)
        elif lane not in self._due:
            self._due.append(lane)

    def _start_replay(self, lane: int, st: _Lane) -> None:
        """The replay of a lane that moved (see :meth:`_relocate`), on its new actor."""
        fresh = self._replay_on(lane, st, st.actor, move=True)
        st.run_id, st.calls, st.seen, st.group = fresh.run_id, fresh.calls, fresh.seen, fresh.group
        st.backlog, st.step = fresh.backlog, 2

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
        st.group, st.backlog = copy.group, []  # the copy got every unit
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
        self._replace_at = time.monotonic() + _JOIN_CHECK_S  # see next_output
        if not dead.lanes:
            return
        if run.inflight is None:
            raise WorkerError(f"{dead.name()} died ({error}); its lanes cannot move") from error
        self._count_death(dead, error, first)
        live = [a for a in self.actors if a.alive]
        if not live:
            if not self.pending:
                self._launch(1)
            try:
                live = self._admit(1, self.options.worker_timeout_s, must=True)
            except WorkerError as e:
                raise WorkerError(
                    f"{dead.name()} died ({error}) and no actor could take its lanes "
                    f"{dead.lanes}: {e}"
                ) from e
        for lane in sorted(dead.lanes, key=lambda x: (x < first, x)):
            st = self.lanes[lane]
            if st.copy is not None:
                self._adopt(lane, st)
            else:
                to = min(live, key=lambda a: (len(a.lanes), a.index))
                self._relocate(lane, st, to, now=False)
        dead.lanes = []
        # the lane the consumer waits for replays alone (the machine's CPUs and Ray's
        # calls all its own); the others start one a call from its next (see _start_due)
        if first in self._due:
            self._due.remove(first)
            self._start_replay(first, self.lanes[first])
        self.moves += 1  # counted once done (stats() reads it from another thread)

    def _count_death(self, dead: _Actor, error: BaseException, first: int) -> None:
        """Counts the death of ``dead`` against each of its lanes; a lane over
        ``RayWorkers.max_lane_restarts`` deaths in a row is a WorkerError (see there).

        Deaths are in a row while the lane has not got past the chunks it had then: one
        counts after another while a chunk pulled before the other is still in flight (a
        sample that kills every actor keeps its chunk in flight; a lane that moves on
        evicts them)."""
        run = self._run
        assert run is not None and run.inflight is not None
        cap = self.spec.max_lane_restarts
        over = []
        for lane in dead.lanes:
            st = self.lanes[lane]
            if st.ended:
                continue
            held = False
            if st.deaths:
                ids = [unit[0].chunk_id for unit in run.inflight(lane)]
                held = bool(ids) and min(ids) <= st.death_top
            st.deaths = st.deaths + 1 if held else 1
            st.death_top = st.pulled_top
            if cap is not None and st.deaths > cap:
                over.append(lane)
        if not over:
            return
        over.sort(key=lambda x: (x != first, x))  # the lane the consumer waits for first
        n = self.lanes[over[0]].deaths
        if len(over) == 1:
            which, it, culprit = f"lane {over[0]}", "it", "The lane may have"
        else:
            which, it = f"lanes {over}", "them"
            culprit = "One of these lanes (lanes that share an actor die together) may have"
        raise WorkerError(
            f"{dead.name()} died running {which}: {n} deaths in a row of the actors running "
            f"{it} (each before the lane got past the chunks it had at the death before), "
            f"more than RayWorkers(max_lane_restarts={cap}) allows. The last death, as Ray "
            f"reports it: {_death_cause(error).rstrip('.')}. {culprit} a sample that kills "
            "the process running it (a crash in a native function, os._exit, memory "
            "exhausted on one sample): fix that; if the deaths are the cluster's (nodes "
            "lost), raise RayWorkers(max_lane_restarts=...) (None: no limit)"
        ) from error

    def _replace(self) -> None:
        """Keeps the count asked for after a death: new actors, placed when Ray can (the
        lost node back, or one its autoscaler adds: their resource requests ask for it),
        then joining as pending actors do."""
        missing = self._wanted - sum(a.alive for a in self.actors) - len(self.pending)
        if missing > 0:
            self._launch(missing)
            self.replacements += missing

    # -------------------------------------------------------------- resize
    def resize_workers(self, num_workers: int) -> None:
        """Asks for ``num_workers`` actors from the consumer's next batch on: added ones
        take lanes once up (those up within :data:`JOIN_GRACE_S` at once, the others when
        Ray places them), removed ones (pending ones first) give theirs; each lane moves as
        when an actor dies. Before the pipeline starts: it starts with that many."""
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
        n = self._wanted = min(wanted, len(self.lanes))
        if n == len(live) + len(self.pending):
            return
        if n > len(live) + len(self.pending):
            self._launch(n - len(live) - len(self.pending))
            added = self._admit(len(self.pending), JOIN_GRACE_S)
            if added:  # the others join when they are up (see _join_pending)
                self._spread(added)
        elif n <= len(live):
            self._kill_pending()
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
            self._kill_pending(keep=n - len(live))
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
                        "node": a.node,
                        "lanes": list(a.lanes),
                        "alive": a.alive,
                    }
                    for a in self.actors
                ],
                "pending_actors": len(self.pending),
                "joins": self.joins,
                "replacements": self.replacements,
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
        if ray is not None:
            for a in self.pending:
                try:
                    ray.kill(a.handle)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        self.pending = []
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


def _chunk_id(unit: list[Any]) -> float:
    """A feed unit's chunk id (infinity for a unit without a chunk: a final sentinel)."""
    return getattr(unit[0], "chunk_id", math.inf)


def _top_chunk(raw: bytes) -> int:
    """The highest chunk id among flat contributor rows (-1 for none)."""
    if not raw:
        return -1
    return int(np.frombuffer(raw, dtype="<i8")[0::4].max())


def _death_cause(error: BaseException) -> str:
    """What Ray says of an actor's death, on one line: from "The actor is dead because"
    where it says so (the rest is the actor's ids), colours removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    at = text.find("The actor is dead because")
    return " ".join((text[at:] if at >= 0 else text).split())


def _actor_error(actor: _Actor, lane: int, msg: dict[str, Any]) -> BaseException:
    """An actor's exception as its own type and WorkerError, naming the actor and lane."""
    return raised_as(msg, f"{actor.name()}, lane {lane}:", f" running lane {lane}")
