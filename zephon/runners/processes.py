"""Worker processes: each owns whole lanes and runs their full operator chain.

The parent keeps the work sources, in-flight sets, completion tracking and replay cursors;
workers only ever see feed units (chunk descriptors and flush sentinels) that the parent
hands them on request, over a control pipe carrying msgpack. Finished batches come back
through one shared-memory ring per worker: ``batch`` stacks rows straight into a reserved
ring slot, and the metadata (contributors, tombstones, the replay cursor) travels as
msgpack in the same slot. No pickle on the data path; the pipeline definition itself is
shipped once at start-up with dill, so lambdas and closures work, and datasets travel by
reference (``shipping.py``: memory-mapped files reopened, in-memory arrays shared once).

A worker writes its outputs in exactly the order the parent will consume them (the rank's
round-robin restricted to the worker's lanes, or every lane per step in lockstep), so the
parent reads each ring first-in first-out and zero-copy views need no parking.

Faults: a worker that dies, exits, hangs or raises becomes a :class:`WorkerError` in the
parent's ``next()`` within seconds (a raised builtin exception keeps its type: the parent
raises a class that is both, e.g. ``ValueError`` and ``WorkerError``). Workers die with the
parent: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked a child ends, so the
workers are started from a keeper thread that lives until ``close()``, and control-pipe EOF
stops a worker waiting for work. Workers ignore SIGINT and SIGTERM: Ctrl-C and preemption
are the parent's to handle (its own SIGTERM handler, if any, may still checkpoint), and
its end ends them. Rings and the shared datasets are anonymous memfds handed to each worker
over its control pipe: no kill of any process can leave a segment behind.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import dataclasses
import math
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from weakref import WeakSet

import msgpack
import numpy as np

from zephon.chunks import WorkChunk
from zephon.errors import ShmError, WorkerError
from zephon.records import (
    BatchRecord,
    Contributor,
    FlushSentinel,
    LazyRecord,
    Record,
    SampleCursor,
)
from zephon.replay import ReplayFilter
from zephon.runners.chain import ChainRunner, LaneCounts, LaneOutput
from zephon.runners.lanes import LaneOutputs, schedule

if TYPE_CHECKING:
    from zephon.runners.shipping import Shipment
    from zephon.shm import Segment

LOOKAHEAD_FEEDS = 2  # feed units a worker keeps requested per lane, to hide the round trip
DEFAULT_SLOT_BYTES = 4 << 20
_POLL_S = 0.05
_STOP_GRACE_S = 0.5  # close(): how long workers get to exit on their own before SIGKILL
_REPORT_CHARS = 16_000  # cap on an error's message and traceback sent over the pipe


# --------------------------------------------------------------------------- encoding
def encode_feed(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for it in items:
        if isinstance(it, WorkChunk):
            out.append({"c": it.to_state()})
        else:
            out.append({"s": it.boundary, "f": it.final, "l": it.lane})
    return out


def decode_feed(items: list[Any]) -> list[Any]:
    return [
        WorkChunk.from_state(it["c"]) if "c" in it else FlushSentinel(it["l"], it["s"], it["f"])
        for it in items
    ]


def _flat(contributors: list[Contributor]) -> bytes:
    """Contributors on the wire: little-endian int64 ``(chunk_id, offset, child, is_last)``
    rows, which the parent turns back into rows without a Python call per piece."""
    return np.array(contributors, dtype="<i8").tobytes()


def _unflat(flat: bytes) -> list[Contributor]:
    """Plain ``[chunk_id, offset, child, is_last]`` rows, which is all the parent's tracking
    reads (building Contributor objects would cost a call per piece)."""
    if len(flat) % 32:
        raise WorkerError(f"a worker sent {len(flat)} bytes of contributors, not rows of 4 int64")
    return np.frombuffer(flat, dtype="<i8").reshape(-1, 4).tolist()  # type: ignore[return-value]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(raw: bytes | memoryview) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


# ------------------------------------------------------------------------ worker side
class _Stop(Exception):
    """The parent said stop: the one clean way for a worker to end."""


class _ParentGone(Exception):
    """The control pipe broke: the parent closed it or died."""


def _die_with_parent(parent_pid: int, via_forkserver: bool) -> None:
    """Makes this worker end when the pipeline's process ``parent_pid`` ends.

    ``PR_SET_PDEATHSIG`` sends SIGKILL when the thread that forked us ends: the parent's
    keeper thread with spawn and fork. A forkserver's children are the server's, and the
    server outlives the parent while any of them lives (each holds the server's "alive"
    pipe), so a worker blocked on a full ring would keep it, and itself, alive forever:
    there a thread waits on a pidfd of the parent instead.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the control pipe's EOF still stops us
    if not via_forkserver:
        if os.getppid() != parent_pid:
            os._exit(0)  # the parent died before the prctl took effect
        return
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(0)  # the parent is gone already
    except (AttributeError, OSError):
        return  # no pidfd (Linux < 5.3): the control pipe's EOF still stops a waiting worker
    threading.Thread(
        target=_exit_when_readable, args=(pidfd,), name="zephon-parent-watch", daemon=True
    ).start()


def _exit_when_readable(pidfd: int) -> None:
    select.select([pidfd], [], [])  # a pidfd turns readable when its process exits
    os._exit(0)


def _slot_too_small(what: str, need: int, slot_bytes: int) -> ValueError:
    suggest = 1 << (need + (64 << 10) - 1).bit_length()
    return ValueError(
        f"{what} needs {need} bytes but a shared-memory ring slot holds {slot_bytes} bytes; "
        f"build the pipeline with Pipeline(..., ring_slot_bytes={suggest}) (at least {need}), "
        "or make batches smaller"
    )


class _Worker:
    """A worker's loop: its lanes' outputs, in the rank's order, written into its ring."""

    def __init__(self, worker_id: int, cfg: dict[str, Any], conn: Any, ring: Any) -> None:
        self.id = worker_id
        self.conn = conn
        self.ring = ring
        plan = cfg["plan"]
        pool = None
        cap = max(op.parallelism for op in plan.ops)
        if cap > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op")
        runner = ChainRunner(plan, pool)
        filt = runner.replay_filter
        assert isinstance(filt, ReplayFilter)
        for lane, cursor in cfg["targets"].items():
            filt.set_target(int(lane), SampleCursor(int(lane), *cursor))
        self.lanes: list[int] = cfg["lanes"]
        self.output: str = cfg["output"]
        self.start_lane: int = cfg["start_lane"]
        self.done: list[int] = cfg["done"]
        self.outputs = LaneOutputs(runner, self._pull, len(self.lanes))
        self.feeds: dict[int, deque[list[Any]]] = {lane: deque() for lane in self.lanes}
        self.asked: dict[int, int] = dict.fromkeys(self.lanes, 0)
        self.ended: set[int] = set()
        self._slot: Any = None
        self._slot_arrays: list[np.ndarray] = []

    # feed units, requested ahead
    def _ask(self, lane: int) -> None:
        while lane not in self.ended and self.asked[lane] < LOOKAHEAD_FEEDS:
            try:
                self.conn.send_bytes(_pack({"t": "need", "lane": lane}))
            except OSError as e:
                raise _ParentGone from e
            self.asked[lane] += 1

    def _receive(self) -> None:
        try:
            raw = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise _ParentGone from e
        msg = _unpack(raw)
        if msg["t"] == "stop":
            raise _Stop
        lane = msg["lane"]
        self.asked[lane] -= 1
        if msg["items"]:
            self.feeds[lane].append(decode_feed(msg["items"]))

    def _pull(self, lane: int) -> list[Any]:
        """The lane's next feed unit, from the parent (two are kept asked for)."""
        self._ask(lane)
        while not self.feeds[lane]:
            self._receive()
        feed = self.feeds[lane].popleft()
        if any(isinstance(it, FlushSentinel) and it.final for it in feed):
            self.ended.add(lane)
        self._ask(lane)
        return feed

    # outputs, written straight into ring slots
    def _allocate(
        self, lane: int, spec: dict[str, tuple[tuple[int, ...], np.dtype]]
    ) -> dict[str, np.ndarray]:
        from zephon.shm import plan_layout

        sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values()]
        end = max((o + n for o, n in zip(plan_layout(sizes), sizes, strict=True)), default=0)
        if end > self.ring.slot_bytes:
            shapes = ", ".join(f"{k}: {np.dtype(d).name}{list(s)}" for k, (s, d) in spec.items())
            raise _slot_too_small(f"a batch of lane {lane} ({shapes})", end, self.ring.slot_bytes)
        self._slot = self.ring.reserve(timeout_s=None)
        arrays = {k: self._slot.array(shape, dtype) for k, (shape, dtype) in spec.items()}
        self._slot_arrays = list(arrays.values())
        return arrays

    def _write(self, out: LaneOutput) -> None:
        """Writes one output: the lane's end, a batch (stacked into the slot it is
        committed in) or a record, with its contributors and tombstones."""
        meta: dict[str, Any] = {"lane": out.lane, "tombstones": _flat(out.tombstones)}
        if out.counts is not None:
            meta["counts"] = [
                list(out.counts.ops),
                out.counts.replay_dropped,
                out.counts.io_retries,
            ]
        rec = out.record
        if out.end or rec is None:
            meta["end"] = True
            self._put(_pack(meta), [], f"the end of lane {out.lane}")
            return
        try:
            # A deferred batch stacks now, straight into a reserved slot.
            data = rec.materialize(self._allocate) if isinstance(rec, LazyRecord) else rec.data
        except BaseException:
            if self._slot is not None:
                self._slot.abort()
                self._slot = None
            raise
        meta["contributors"] = _flat(rec.contributors)
        meta["mix"] = [[int(c), int(w)] for c, w in rec.mix.items()]
        if isinstance(rec, BatchRecord):
            meta["last"] = list(rec.last_cursor[1:])
            meta["n"] = rec.num_records
        if isinstance(data, dict) and all(isinstance(v, np.ndarray) for v in data.values()):
            meta["keys"], arrays = list(data), list(data.values())
        elif isinstance(data, np.ndarray):
            meta["single"], arrays = True, [data]
        else:
            meta["value"], arrays = data, []  # msgpack-able plain data
        packed = _pack(meta)
        slot, self._slot = self._slot, None
        what = f"a {'batch' if isinstance(rec, BatchRecord) else 'record'} of lane {out.lane}"
        if slot is None:
            self._put(packed, arrays, what)
            return
        from zephon.shm import message_nbytes

        need = message_nbytes(len(packed), self._slot_arrays)
        if need > slot.capacity:
            slot.abort()
            raise _slot_too_small(
                f"{what} with its metadata ({len(packed)} B)", need, slot.capacity
            )
        slot.commit(packed)

    def _put(self, packed: bytes, arrays: list[np.ndarray], what: str) -> None:
        from zephon.shm import message_nbytes

        need = message_nbytes(len(packed), arrays)
        if need > self.ring.slot_bytes:
            raise _slot_too_small(what, need, self.ring.slot_bytes)
        self.ring.put(packed, arrays)

    def run(self) -> None:
        for lane in self.lanes:
            if lane not in self.done:
                self._ask(lane)
        for item in schedule(
            self.lanes,
            self.output,
            self.outputs.next,
            start_lane=self.start_lane,
            done=self.done,
        ):
            for out in item if isinstance(item, list) else (item,):
                self._write(out)
        # Everything is written; wait for the parent to say stop (it may still read).
        while True:
            self._receive()


def _clip(text: str) -> str:
    if len(text) <= _REPORT_CHARS:
        return text
    half = _REPORT_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - _REPORT_CHARS} characters cut ...]\n{text[-half:]}"


def _exit_code(e: SystemExit) -> int:
    """The status ``sys.exit(e.code)`` gives: None is 0, an int itself, anything else 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    return 1


def _report(conn: Any, e: BaseException, **extra: Any) -> None:
    try:
        conn.send_bytes(
            _pack(
                {
                    "t": "error",
                    "type": type(e).__name__,
                    "module": type(e).__module__,
                    "message": _clip(str(e)),
                    "traceback": _clip(traceback.format_exc()),
                    **extra,
                }
            )
        )
    except (OSError, ValueError):
        pass  # the parent is gone or closed the pipe: nobody to tell


def worker_main(worker_id: int, conn: Any, parent_pid: int, via_forkserver: bool) -> None:
    """Entry point of a worker process.

    Its first three messages on ``conn`` are its configuration: the descriptors of its ring
    and of the shared datasets, the operators, then the rest (see ``ProcessExecutor._keep``).
    The only clean ends are the parent's ``stop`` message, the parent closing the control
    pipe or the ring (both happen in ``close()``), or the parent's death. Anything else,
    including a user function calling ``sys.exit``, is reported to the parent.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is preemption: see the module doc
    _die_with_parent(parent_pid, via_forkserver)
    import dill

    from zephon.runners.shipping import load_operators
    from zephon.shm import RingClosedError, ShmRing, attach_segment, recv_fds

    try:
        fds = recv_fds(conn)
        payload = conn.recv_bytes(), conn.recv_bytes()
    except (EOFError, OSError):
        return  # the parent closed before handing the configuration over
    ring = None
    try:
        ring = ShmRing.attach(fds[0])
        data = attach_segment(fds[1], writable=False) if len(fds) > 1 else None
        cfg = dill.loads(payload[1])
        # The plan travels without its operators, which come by their own route.
        cfg["plan"] = dataclasses.replace(cfg["plan"], ops=load_operators(payload[0], data))
        worker = _Worker(worker_id, cfg, conn, ring)
        conn.send_bytes(_pack({"t": "ready"}))
        worker.run()
    except (_Stop, _ParentGone):
        pass
    except RingClosedError:
        if ring is None or not ring.closed:
            _report(conn, sys.exc_info()[1])  # type: ignore[arg-type]
            os._exit(1)
        # the parent closed the ring (close() wakes a worker blocked on a full ring)
    except SystemExit as e:
        code = _exit_code(e)
        _report(conn, e, exit_code=code, exit_arg=repr(e.code))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if 0 <= code <= 255 else 1)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit 1
        _report(conn, e)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if ring is not None:
            ring.close()


# ------------------------------------------------------------------------ parent side
def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "a signal"


def _how(code: int | None) -> str:
    """How a worker that exited with ``code`` (None: not yet) ended, for an error message."""
    if code is None:
        return "stopped answering and did not exit"
    if code < 0:
        how = f"was killed by {_signal_name(-code)} (signal {-code})"
        if code == -signal.SIGKILL:
            how += " (the kernel's OOM killer sends SIGKILL too: see `dmesg`)"
        return how
    return f"exited with code {code}"


_STATES = {
    "T": "stopped (SIGSTOP or job control)",
    "t": "stopped by a debugger",
    "D": "blocked in uninterruptible I/O",
    "R": "running",
    "S": "sleeping",
    "Z": "a zombie",
}


def _proc_state(pid: int | None) -> str | None:
    """The state letter in ``/proc/<pid>/stat`` (R, S, D, T, t, Z, ...), None if gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def rebuild_error(worker: int, pid: int, msg: dict[str, Any]) -> BaseException:
    """The worker's exception as an instance of its own builtin type *and* WorkerError."""
    if msg["type"] == "SystemExit" and "exit_code" in msg:
        arg = msg.get("exit_arg", repr(msg["message"]))
        return WorkerError(
            f"worker {worker} (pid {pid}) exited with code {msg['exit_code']}: a function it ran "
            f"called sys.exit({arg}). Its traceback:\n{msg['traceback']}"
        )
    text = (
        f"{msg['message']}\n\n[worker {worker} (pid {pid}) raised {msg['type']}; its traceback:]\n"
        f"{msg['traceback']}"
    )
    base = getattr(builtins, msg["type"], None) if msg.get("module") == "builtins" else None
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, WorkerError):
        try:
            cls = type(msg["type"], (WorkerError, base), {"__module__": "zephon.errors"})
            return cls(text)
        except TypeError:
            pass  # layout conflict (e.g. OSError subclasses): fall back to WorkerError
    return WorkerError(f"{msg['type']}: {text}")


class _Handle:
    __slots__ = ("id", "proc", "conn", "ring", "lanes", "last_seen", "lock", "configured", "ready")

    def __init__(self, wid: int, conn: Any, ring: Any, lanes: list[int]) -> None:
        self.id, self.conn, self.ring, self.lanes = wid, conn, ring, lanes
        self.proc: Any = None  # set by the keeper thread once the process started
        self.configured = False  # the keeper has sent the worker its configuration
        self.last_seen = time.monotonic()
        self.ready = False  # the worker said it runs: it got its configuration and ring
        self.lock = threading.Lock()  # conn sends: the feeder thread, and close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def send(self, msg: dict[str, Any], timeout_s: float = -1) -> bool:
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            self.conn.send_bytes(_pack(msg))
            return True
        except (OSError, ValueError):
            return False
        finally:
            self.lock.release()


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
        self,
        plan: Any,
        workers: int,
        *,
        zero_copy: bool = False,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        nslots: int = 4,
        start_method: str = "spawn",
        worker_timeout_s: float = 60.0,
        components: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.plan = plan
        self.components = components  # (name, dataset): to name one that cannot travel
        self.num_workers = workers
        self.zero_copy = zero_copy
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.start_method = start_method
        self.worker_timeout_s = worker_timeout_s
        self.targets: dict[int, Any] = {}
        self.handles: list[_Handle] = []
        self.owner: dict[int, _Handle] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._feeder: threading.Thread | None = None
        self._keeper: threading.Thread | None = None
        self._started = threading.Event()  # the keeper has started every worker process
        self._spawned = threading.Event()  # ... and handed each its configuration (or failed)
        self._release = threading.Event()  # close() is done with the workers: the keeper may end
        self._spawn_error: BaseException | None = None
        self._engine_stop: threading.Event | None = None
        self._closed = False
        self._pull: Callable[[int], list[Any]] | None = None
        self._data: Segment | None = None  # the datasets' shared arrays, once placed

    def set_target(self, lane: int, cursor: Any) -> None:
        if cursor is None:
            self.targets.pop(lane, None)
        else:
            self.targets[lane] = cursor

    def start(self, engine: Any) -> None:
        import dill
        import multiprocess

        from zephon.runners.shipping import pack_operators

        self._pull = engine.pull
        self._engine_stop = engine.stopping  # the pump must not wait on a worker once it is set
        ctx = multiprocess.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server (started once) imports the worker's code, so each worker it forks
            # has it already (takes effect when the server starts).
            ctx.set_forkserver_preload(["zephon.runners.processes"])
        _register_atexit()
        _LIVE.add(self)
        lanes = engine.lanes
        n = min(self.num_workers, len(lanes))
        done = [lane for lane in lanes if engine.trackers[lane].done]
        launches: list[tuple[_Handle, Any, Any, bytes]] = []
        parent = (os.getpid(), self.start_method == "forkserver")  # see _die_with_parent
        try:
            # The operators are pickled once, datasets by reference: each worker unpickles
            # its own fresh copy of them from the same bytes; the plan goes without them.
            shipment = pack_operators([op.fresh() for op in self.plan.ops], self.components)
            plan = dataclasses.replace(self.plan, ops=[])
            for wid in range(n):
                mine = lanes[wid::n]
                cfg = {
                    "plan": plan,
                    "targets": {
                        lane: list(self.targets[lane][1:]) for lane in mine if lane in self.targets
                    },
                    "lanes": mine,
                    "output": engine.output,
                    "start_lane": engine.next_lane,
                    "done": [lane for lane in mine if lane in done],
                }
                ring = self._create_ring(wid, n)
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                h = _Handle(wid, parent_conn, ring, mine)
                self.handles.append(h)
                for lane in mine:
                    self.owner[lane] = h
                proc = ctx.Process(
                    target=worker_main,
                    args=(wid, child_conn, *parent),
                    name=f"zephon-worker-{wid}",
                    daemon=True,
                )
                launches.append((h, proc, child_conn, dill.dumps(cfg, recurse=True)))
            # PR_SET_PDEATHSIG fires when the thread that forked a worker ends, not the
            # process: fork from a thread that lives until close(), never the caller's.
            self._keeper = threading.Thread(
                target=self._keep, args=(launches, shipment), name="zephon-workers", daemon=True
            )
            self._keeper.start()
            while not self._spawned.wait(_POLL_S):
                pass
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

    def _create_ring(self, wid: int, n: int) -> Any:
        from zephon.shm import ShmRing

        try:
            return ShmRing.create(self.nslots, self.slot_bytes, name=f"zephon-ring-{wid}")
        except ShmError as e:
            why = (
                f"{e.strerror or e}. Pipeline(workers={self.num_workers}) makes one ring per worker "
                f"({n} rings) of {self.nslots} slots of ring_slot_bytes={self.slot_bytes} bytes "
                "(Pipeline(ring_slots=...)): lower ring_slot_bytes, ring_slots or workers, or "
                "free memory"
            )
            raise (ShmError(why) if e.errno is None else ShmError(e.errno, why)) from e

    def _keep(self, launches: list[tuple[_Handle, Any, Any, bytes]], shipment: Shipment) -> None:
        """The keeper thread: starts the workers, places the shared datasets while they
        boot, hands each its configuration, then lives until close() is done.

        The configuration (operators, datasets: often megabytes) goes over the control pipe
        once the process runs, never in the process object: the start method writes that
        into a pipe the parent itself holds open, so a worker that dies before reading it
        all (say, re-importing a main module that starts pipelines at import time) would
        block the parent forever. On the control pipe its death is an error.
        """
        try:
            started: list[tuple[_Handle, bytes]] = []
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
                self._hand_over(h, shipment.payload, cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised by start()
            self._spawn_error = e
        finally:
            self._spawned.set()
        self._release.wait()
        if self._data is not None:
            self._data.close()  # the workers are gone: nobody maps the datasets any more

    def _hand_over(self, h: _Handle, ops: bytes, cfg: bytes) -> None:
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

    def _startup_death(self, h: _Handle) -> WorkerError:
        h.proc.join(timeout=5)
        hint = ""
        if self.start_method != "fork":
            hint = (
                f". With worker_start_method={self.start_method!r} a worker first imports your"
                " main module again: a script that builds and iterates pipelines at import"
                " time must do so under `if __name__ == '__main__':`"
            )
        when = (
            "before it began to run the pipeline"
            if h.configured
            else "before it read its configuration"
        )
        return WorkerError(
            f"worker {h.id} (pid {h.proc.pid}, lanes {h.lanes}) {_how(h.proc.exitcode)} while"
            f" starting, {when} (its stderr may say why){hint}"
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
                    msg = _unpack(h.conn.recv_bytes())
                except (EOFError, OSError, ValueError):
                    conns.pop(obj, None)
                    continue
                if msg["t"] == "need":
                    pull = self._pull
                    if pull is None:
                        return  # closed
                    lane = msg["lane"]
                    try:
                        items = encode_feed(pull(lane))
                    except BaseException as e:  # noqa: BLE001 - a work-source failure
                        self._fail(e)
                        return
                    if not h.send({"t": "feed", "lane": lane, "items": items}):
                        conns.pop(obj, None)
                elif msg["t"] == "ready":
                    h.ready = True
                elif msg["t"] == "error":
                    self._fail(rebuild_error(h.id, h.proc.pid, msg))
                    return
            for s in ready:
                h = sentinels.get(s)
                if h is not None:
                    self._fail(self._death(h))
                    return

    def _death(self, h: _Handle, read_pipe: bool = True) -> WorkerError:
        h.proc.join(timeout=1)
        code = h.proc.exitcode
        # An error message may race the process sentinel: prefer the worker's own words.
        if read_pipe:
            try:
                while h.conn.poll(0):
                    msg = _unpack(h.conn.recv_bytes())
                    if msg["t"] == "ready":
                        h.ready = True
                    elif msg["t"] == "error":
                        err = rebuild_error(h.id, h.proc.pid, msg)
                        return err if isinstance(err, WorkerError) else WorkerError(str(err))
            except (EOFError, OSError, ValueError):
                pass
        if not h.ready:
            return self._startup_death(h)
        how = _how(code)
        if code is not None and code >= 0:
            how += " without reporting an error (its stderr may say why)"
        return WorkerError(
            f"worker {h.id} (pid {h.proc.pid}, lanes {h.lanes}) {how}; the pipeline cannot "
            "continue. Restore the last checkpoint into a new pipeline to go on"
        )

    def _hung(self, h: _Handle) -> WorkerError:
        state = _proc_state(h.pid)
        where = f"; its process is {_STATES.get(state, state)}" if state else ""
        t = self.worker_timeout_s
        return WorkerError(
            f"worker {h.id} (pid {h.pid}, lanes {h.lanes}) produced nothing for {t:g} s "
            f"(worker_timeout_s={t:g}): it is hung or stopped{where}. The pipeline cannot "
            "continue: restore the last checkpoint into a new pipeline, and raise "
            "Pipeline(worker_timeout_s=...) if a batch may legitimately take that long"
        )

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def _stopping(self) -> bool:
        return self._closed or (self._engine_stop is not None and self._engine_stop.is_set())

    # reading outputs
    def next_output(self, lane: int) -> LaneOutput:
        from zephon.shm import RingClosedError

        h = self.owner[lane]
        waited_since = time.monotonic()
        dead_since: float | None = None
        while True:
            if self.error is not None:
                raise self.error
            if self._stopping():
                raise WorkerError("the pipeline was closed")
            try:
                msg = h.ring.get(timeout_s=_POLL_S, zero_copy=self.zero_copy)
                break
            except TimeoutError:
                pass
            except RingClosedError:
                if self._stopping():
                    raise WorkerError("the pipeline was closed") from None
                time.sleep(_POLL_S)  # the worker closed its ring on its way out
            now = time.monotonic()
            if not h.proc.is_alive():
                # The feeder reports deaths with the worker's own words; if it has not
                # within a second (it is gone or busy), report from here.
                if dead_since is None:
                    dead_since = now
                elif now - dead_since > 1.0:
                    feeder_alive = self._feeder is not None and self._feeder.is_alive()
                    self._fail(self._death(h, read_pipe=not feeder_alive))
            elif now - waited_since > self.worker_timeout_s:
                self._fail(self._hung(h))
        h.last_seen = time.monotonic()
        meta = _unpack(msg.meta)
        if meta["lane"] != lane:
            raise WorkerError(
                f"worker {h.id} sent lane {meta['lane']} when lane {lane} was due; this is a Zephon bug"
            )
        tombs = _unflat(meta["tombstones"])
        counts = meta.get("counts")
        if counts is not None:
            counts = LaneCounts([tuple(c) for c in counts[0]], int(counts[1]), int(counts[2]))  # type: ignore[misc]
        if meta.get("end"):
            msg.release()
            return LaneOutput(lane, None, tombs, end=True, counts=counts)
        arrays = msg.arrays
        keys = meta.get("keys")
        if keys is not None:
            data: Any = dict(zip(keys, arrays, strict=True))
        elif meta.get("single"):
            data = arrays[0]
        else:
            data = meta["value"]
        if not self.zero_copy:
            msg.release()
        mix = dict(meta["mix"])
        contributors = _unflat(meta["contributors"])
        if "last" in meta:
            rec: Record = BatchRecord(
                data, lane, contributors, mix, SampleCursor(lane, *meta["last"]), meta["n"]
            )
        else:
            rec = Record(data, lane, contributors, mix)
        out = LaneOutput(lane, rec, tombs, counts=counts)
        if self.zero_copy:
            out.lease = msg
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
                h.send({"t": "stop"}, timeout_s=1)
            h.ring.close()  # wakes a worker blocked on a full ring
        if self._feeder is not None and self._feeder is not me:
            self._feeder.join(timeout=2)
        procs = [h.proc for h in self.handles if h.proc is not None]
        for proc in procs:
            if _proc_state(proc.pid) in ("T", "t"):
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
