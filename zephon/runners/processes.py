"""The parent's side of the worker processes: start them, feed them, read their rings.

Each worker owns whole lanes and runs the plan over them (:mod:`zephon.runners.worker`);
the parent keeps the work sources, in-flight sets, completion tracking and replay cursors.
A feeder thread answers the workers' requests for feed units and watches for their deaths;
the consumer's thread reads each worker's ring first-in first-out (a worker writes its
outputs in exactly the order they are taken). The configuration is shipped once at
start-up (:mod:`zephon.runners.shipping`: the operators pickled with dill, datasets by
reference); on the data path nothing is pickled (:mod:`zephon.runners.wire`).

Faults (:mod:`zephon.runners.faults`): a worker that dies, exits, hangs or raises becomes a
:class:`WorkerError` in the parent's ``next()`` within seconds (a raised builtin exception
keeps its type: the parent raises a class that is both, e.g. ``ValueError`` and
``WorkerError``). A worker says when it is past its start method's imports (``booted``) and
when it reached its loop (``ready``): silent for ``worker_timeout_s`` before that, it is
reported as never having reached its loop (with spawn, most often a script whose top level
blocks without a main guard), after it as hung. Workers die with the parent:
``PR_SET_PDEATHSIG`` fires when the *thread* that forked a child ends, so the workers are
started from a keeper thread that lives until ``close()``, and control-pipe EOF stops a
worker waiting for work. Rings and the shared
datasets are anonymous memfds handed to each worker over its control pipe: no kill of any
process can leave a segment behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from weakref import WeakSet

from zephon.errors import ShmError, WorkerError
from zephon.runners import faults, wire
from zephon.runners.base import LaneRun
from zephon.runners.chain import LaneOutput
from zephon.runners.handle import WorkerHandle
from zephon.runners.options import AUTO_MAX_SLOT_BYTES, WorkerOptions
from zephon.runners.worker import WorkerConfig, worker_main

if TYPE_CHECKING:
    from zephon.runners.shipping import Shipment
    from zephon.shm import Segment

_POLL_S = 0.05
_STOP_GRACE_S = 0.5  # close(): how long workers get to exit on their own before SIGKILL


# Executors not closed yet, closed at interpreter exit: before multiprocess's own exit
# handler, which would SIGTERM the workers and then join a SIGSTOPped one forever.
_LIVE: WeakSet[ProcessExecutor] = WeakSet()
_atexit_registered = False


def _close_live_executors() -> None:
    for ex in list(_LIVE):
        try:
            ex.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        import multiprocess.util  # noqa: F401 - its handler must be registered first (runs last)

        atexit.register(_close_live_executors)
        _atexit_registered = True


class ProcessExecutor:
    """Parent side of the worker pool: the feeder thread, the rings, fault detection."""

    place = "workers"

    def __init__(
        self, plan: Any, options: WorkerOptions, components: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self.plan = plan
        self.options = options
        self.components = components  # (name, dataset): to name one that cannot travel
        self.handles: list[WorkerHandle] = []
        self.owner: dict[int, WorkerHandle] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._feeder: threading.Thread | None = None
        self._keeper: threading.Thread | None = None
        self._started = threading.Event()  # the keeper has started every worker process
        self._spawned = threading.Event()  # ... and handed each its configuration (or failed)
        self._release = threading.Event()  # close() is done with the workers: the keeper may end
        self._spawn_error: BaseException | None = None
        #: The worker the keeper is handing its configuration to, and since when.
        self._handing: tuple[WorkerHandle, float] | None = None
        self._engine_stop: threading.Event | None = None
        self._closed = False
        self._pull: Callable[[int], list[Any]] | None = None
        self._data: Segment | None = None  # the datasets' shared arrays, once placed

    def start(self, run: LaneRun) -> None:
        import dill
        import multiprocess

        from zephon.runners.shipping import pack_operators

        self._pull = run.pull
        self._engine_stop = run.stopping  # the pump must not wait on a worker once it is set
        opts = self.options
        ctx = multiprocess.get_context(opts.worker_start_method)
        if opts.worker_start_method == "forkserver":
            # The server (started once) imports the worker's code, so each worker it forks
            # has it already (takes effect when the server starts).
            ctx.set_forkserver_preload(["zephon.runners.worker"])
        _register_atexit()
        _LIVE.add(self)
        lanes = run.lanes
        n = min(opts.workers, len(lanes))
        launches: list[tuple[WorkerHandle, Any, Any, bytes]] = []
        parent = (os.getpid(), opts.worker_start_method == "forkserver")  # see _die_with_parent
        # Sized from the batches: the most a worker may grow its slots to (read now: the
        # tests lower it).
        max_grown_slot_bytes = AUTO_MAX_SLOT_BYTES if opts.ring_slot_bytes is None else None
        try:
            # The operators are pickled once, datasets by reference: each worker unpickles
            # its own fresh copy of them from the same bytes; the plan goes without them.
            shipment = pack_operators([op.fresh() for op in self.plan.ops], self.components)
            plan = dataclasses.replace(self.plan, ops=[])
            for wid in range(n):
                mine = lanes[wid::n]
                cfg = WorkerConfig(
                    options=opts,
                    plan=plan,
                    lanes=mine,
                    targets={
                        lane: list(run.targets[lane][1:]) for lane in mine if lane in run.targets
                    },
                    start_lane=run.start_lane,
                    done=[lane for lane in mine if lane in run.done],
                    pad_ended=run.pad_ended,
                    max_grown_slot_bytes=max_grown_slot_bytes,
                )
                ring = self._create_ring(wid, n)
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                h = WorkerHandle(wid, parent_conn, ring, mine)
                self.handles.append(h)
                for lane in mine:
                    self.owner[lane] = h
                proc = ctx.Process(
                    target=worker_main,
                    args=(child_conn, *parent),
                    name=f"zephon-worker-{wid}",
                    daemon=True,
                )
                launches.append((h, proc, child_conn, dill.dumps(cfg, recurse=True)))
            # PR_SET_PDEATHSIG fires when the thread that forked a worker ends, not the
            # process: fork from a thread that lives until close(), never the caller's.
            self._keeper = threading.Thread(
                target=self._keep_workers,
                args=(launches, shipment),
                name="zephon-workers",
                daemon=True,
            )
            self._keeper.start()
            while not self._spawned.wait(_POLL_S):
                self._check_hand_over()
            if self._spawn_error is not None:
                raise self._spawn_error
        except BaseException:
            if self._keeper is None:  # else the keeper closes them once it stops starting
                for _, _, child_conn, _ in launches:
                    child_conn.close()
            self.close()
            raise
        self._feeder = threading.Thread(target=self._feed_loop, name="zephon-feeder", daemon=True)
        self._feeder.start()

    def _create_ring(self, wid: int, n: int, slot_bytes: int | None = None) -> Any:
        from zephon.shm import ShmRing

        opts = self.options
        first = opts.first_slot_bytes
        slot_bytes = first if slot_bytes is None else slot_bytes
        try:
            return ShmRing.create(opts.ring_slots, slot_bytes, name=f"zephon-ring-{wid}")
        except ShmError as e:
            why = (
                f"{e.strerror or e}. Pipeline(workers={opts.workers}) makes one ring per worker "
                f"({n} rings) of {opts.ring_slots} slots of ring_slot_bytes={first} bytes "
                "(Pipeline(ring_slots=...)): lower ring_slot_bytes, ring_slots or workers, or "
                "free memory"
            )
            raise (ShmError(why) if e.errno is None else ShmError(e.errno, why)) from e

    def _keep_workers(
        self, launches: list[tuple[WorkerHandle, Any, Any, bytes]], shipment: Shipment
    ) -> None:
        """The keeper thread: starts the workers, places the shared datasets while they
        boot, hands each its configuration, then lives until close() is done.

        The configuration (operators, datasets: often megabytes) goes over the control pipe
        once the process runs, never in the process object: the start method writes that
        into a pipe the parent itself holds open, so a worker that dies before reading it
        all (say, re-importing a main module that starts pipelines at import time) would
        block the parent forever. On the control pipe its death is an error.
        """
        try:
            started: list[tuple[WorkerHandle, bytes]] = []
            try:
                for h, proc, _, cfg in launches:
                    if self._closed:
                        break
                    proc.start()
                    h.proc = proc
                    started.append((h, cfg))
            finally:
                for _, _, child_conn, _ in launches:
                    child_conn.close()  # the children hold their own ends
                self._started.set()
            if started and not self._closed:
                self._data = shipment.place()
            for h, cfg in started:
                if self._closed:
                    break
                self._handing = (h, time.monotonic())
                self._hand_over(h, shipment.payload, cfg)
            self._handing = None
        except BaseException as e:  # noqa: BLE001 - re-raised by start()
            self._spawn_error = e
        finally:
            self._spawned.set()
        self._release.wait()
        if self._data is not None:
            self._data.close()  # the workers are gone: nobody maps the datasets any more

    def _hand_over(self, h: WorkerHandle, ops: bytes, cfg: bytes) -> None:
        """Sends worker ``h`` its configuration (the descriptors of its ring and of the
        shared datasets, the operators, then the rest); a worker that died first is an
        error."""
        from zephon.shm import send_fds

        data = [] if self._data is None else [self._data.fileno()]
        with h.lock:  # close() may send "stop" meanwhile
            try:
                send_fds(h.conn, [h.ring.fileno(), *data])
                h.conn.send_bytes(ops)
                h.conn.send_bytes(cfg)
                h.configured = True
                return
            except (OSError, ValueError):
                if self._closed:
                    return
        raise self._startup_death(h)

    def _check_hand_over(self) -> None:
        """The start-up watchdog: a configuration that a worker has not taken within
        ``worker_timeout_s`` means it never began to read it. It reads it all before
        anything else, so it has not reached Zephon's code: it is still importing (with
        spawn, the parent's main module)."""
        handing = self._handing
        if handing is None:
            return
        h, since = handing
        opts = self.options
        if time.monotonic() - since > opts.worker_timeout_s and h.proc.is_alive():
            raise faults.never_reached_loop(
                h.id, h.pid, h.lanes, opts.worker_timeout_s, opts.worker_start_method, booted=False
            )

    def _startup_death(self, h: WorkerHandle) -> WorkerError:
        h.proc.join(timeout=5)
        return faults.died_starting(
            h.id,
            h.proc.pid,
            h.lanes,
            h.proc.exitcode,
            h.configured,
            self.options.worker_start_method,
        )

    # the feeder: answers "need" requests, catches errors and deaths
    def _feed_loop(self) -> None:
        from multiprocess.connection import wait

        conns = {h.conn: h for h in self.handles}
        sentinels = {h.proc.sentinel: h for h in self.handles}
        while not self._stop.is_set() and self.error is None:
            try:
                ready = wait([*conns, *sentinels], timeout=_POLL_S)
            except (OSError, ValueError):
                return  # close() closed a connection under us
            if self._stop.is_set():
                return
            for obj in ready:
                h = conns.get(obj)
                if h is None:
                    continue
                try:
                    msg = wire.unpack(h.conn.recv_bytes())
                except (EOFError, OSError, ValueError):
                    conns.pop(obj, None)
                    continue
                kind = msg[wire.KIND]
                if kind == wire.NEED:
                    pull = self._pull
                    if pull is None:
                        return  # closed
                    lane = msg[wire.LANE]
                    try:
                        answer = wire.feed(lane, pull(lane))
                    except BaseException as e:  # noqa: BLE001 - a work-source failure
                        self._fail(e)
                        return
                    if not h.send(answer):
                        conns.pop(obj, None)
                elif kind == wire.GROW:
                    # On a thread of its own: reserving a ring's memory takes a while, and
                    # the workers, whose first batches most often ask at once, should
                    # neither wait for each other's rings nor hold up the feed units.
                    threading.Thread(
                        target=self._grow,
                        args=(h, int(msg[wire.BYTES])),
                        name=f"zephon-grow-{h.id}",
                        daemon=True,
                    ).start()
                elif kind == wire.READY:
                    h.ready = True
                elif kind == wire.BOOTED:
                    h.booted = True
                elif kind == wire.ERROR:
                    self._fail(faults.rebuild_error(h.id, h.proc.pid, msg))
                    return
            for s in ready:
                h = sentinels.get(s)
                if h is not None:
                    self._fail(self._death(h))
                    return

    def _grow(self, h: WorkerHandle, need: int) -> None:
        """Worker ``h`` has an output of ``need`` bytes: a ring whose slots hold it with a
        quarter to spare, sent over its control pipe; read once the worker moved. Runs on
        a thread of its own; a failure (no memory for the ring) is the pipeline's error."""
        from zephon.shm import send_fds

        size = -(-(need + need // 4) // (64 << 10)) * (64 << 10)
        try:
            ring = self._create_ring(h.id, len(self.handles), size)
        except BaseException as e:  # noqa: BLE001 - raised by next()
            self._fail(e)
            return
        with h.lock:  # close() takes it once it is closed: no ring is added after that
            if self._closed:
                ring.close()
                return
            h.next_rings.append(ring)
            try:
                h.conn.send_bytes(wire.pack({wire.KIND: wire.RING, wire.BYTES: size}))
                send_fds(h.conn, [ring.fileno()])
            except BaseException as e:  # noqa: BLE001 - raised by next()
                self._fail(e)

    def _death(self, h: WorkerHandle, read_pipe: bool = True) -> WorkerError:
        h.proc.join(timeout=1)
        code = h.proc.exitcode
        # An error message may race the process sentinel: prefer the worker's own words.
        if read_pipe:
            try:
                while h.conn.poll(0):
                    msg = wire.unpack(h.conn.recv_bytes())
                    if msg[wire.KIND] == wire.READY:
                        h.ready = True
                    elif msg[wire.KIND] == wire.BOOTED:
                        h.booted = True
                    elif msg[wire.KIND] == wire.ERROR:
                        err = faults.rebuild_error(h.id, h.proc.pid, msg)
                        return err if isinstance(err, WorkerError) else WorkerError(str(err))
            except (EOFError, OSError, ValueError):
                pass
        if not h.ready:
            return self._startup_death(h)
        return faults.died(h.id, h.proc.pid, h.lanes, code)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def _stopping(self) -> bool:
        return self._closed or (self._engine_stop is not None and self._engine_stop.is_set())

    # reading outputs
    def next_output(self, lane: int) -> LaneOutput:
        from zephon.shm import RingClosedError

        h = self.owner[lane]
        opts = self.options
        waited_since = time.monotonic()
        dead_since: float | None = None
        while True:
            if self.error is not None:
                raise self.error
            if self._stopping():
                raise WorkerError("the pipeline was closed")
            msg = None
            try:
                msg = h.ring.get(timeout_s=_POLL_S, zero_copy=opts.zero_copy)
            except TimeoutError:
                pass
            except RingClosedError:
                if self._stopping():
                    raise WorkerError("the pipeline was closed") from None
                time.sleep(_POLL_S)  # the worker closed its ring on its way out
            if msg is not None:
                meta = wire.unpack(msg.meta)
                if not meta.get(wire.MOVED):
                    break
                # The worker's outputs go on in the bigger ring sent to it (see _grow).
                msg.release()
                h.retired.append(h.ring)
                h.ring = h.next_rings.popleft()
                waited_since = time.monotonic()
                continue
            now = time.monotonic()
            if not h.proc.is_alive():
                # The feeder reports deaths with the worker's own words; if it has not
                # within a second (it is gone or busy), report from here.
                if dead_since is None:
                    dead_since = now
                elif now - dead_since > 1.0:
                    feeder_alive = self._feeder is not None and self._feeder.is_alive()
                    self._fail(self._death(h, read_pipe=not feeder_alive))
            elif now - waited_since > opts.worker_timeout_s:
                # A worker that never said it reached its loop is not hung: it is still
                # starting (most often importing a main module whose top level blocks).
                self._fail(
                    faults.hung(h.id, h.pid, h.lanes, opts.worker_timeout_s)
                    if h.ready
                    else faults.never_reached_loop(
                        h.id,
                        h.pid,
                        h.lanes,
                        opts.worker_timeout_s,
                        opts.worker_start_method,
                        h.booted,
                    )
                )
        if meta[wire.LANE] != lane:
            raise WorkerError(
                f"worker {h.id} sent lane {meta[wire.LANE]} when lane {lane} was due; this is a "
                "Zephon bug"
            )
        out = wire.decode_output(meta, msg.arrays)
        if opts.zero_copy and out.record is not None:
            out.lease = msg  # released once the consumer moves on
        else:
            msg.release()
        return out

    def extra_stats(self) -> dict[str, Any]:
        return {
            "workers": [
                {
                    "id": h.id,
                    "pid": h.pid,
                    "lanes": h.lanes,
                    "alive": h.proc is not None and h.proc.is_alive(),
                    "ring": h.ring.name,
                    "ring_fill": h.ring.fill(),  # finished batches waiting for the parent
                    "ring_slots": h.ring.nslots,
                }
                for h in self.handles
            ]
        }

    def close(self) -> None:
        """Stops the workers (SIGKILL after a short grace), closes the rings. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        _LIVE.discard(self)
        me = threading.current_thread()
        if self._keeper is not None and self._keeper is not me:
            self._started.wait(timeout=30)  # no worker starts after this
        for h in self.handles:
            if h.configured:  # else it waits for its configuration: SIGKILL below ends it
                h.send({wire.KIND: wire.STOP}, timeout_s=1)
            h.ring.close()  # wakes a worker blocked on a full ring
            got = h.lock.acquire(timeout=1)  # a ring being sent is in next_rings after it
            try:
                rings = (*h.next_rings, *h.retired)
            finally:
                if got:
                    h.lock.release()
            for ring in rings:
                ring.close()
        if self._feeder is not None and self._feeder is not me:
            self._feeder.join(timeout=2)
        procs = [h.proc for h in self.handles if h.proc is not None]
        for proc in procs:
            if faults.proc_state(proc.pid) in ("T", "t"):
                proc.kill()  # a stopped process cannot act on "stop"; SIGKILL still works
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # busy in user code: nothing of a worker's needs saving
        for proc in procs:
            proc.join(timeout=2)
        for h in self.handles:
            try:
                h.conn.close()
            except OSError:
                pass
        self._release.set()
        if self._keeper is not None and self._keeper is not me:
            self._keeper.join(timeout=1)
        self._pull = None  # the engine's method: a reference cycle, left to the GC
