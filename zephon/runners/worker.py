"""A worker process: it runs the plan over its lanes and writes their outputs to its ring.

The parent keeps the work sources, in-flight sets, completion tracking and replay cursors;
a worker only ever sees feed units (chunk descriptors and flush sentinels), which it asks
the parent for, two ahead per lane, over the control pipe. It produces its lanes' outputs
with the same :class:`~zephon.runners.lanes.LaneOutputs` and
:func:`~zephon.runners.lanes.schedule` as the parent would in process, so it writes them in
exactly the order the parent reads them: each ring is read first-in first-out, and a batch
is stacked straight into the ring slot it is committed in.
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import signal
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.chunks import WorkChunk
from zephon.operators.replay import ReplayFilter
from zephon.records import FlushSentinel, LazyRecord, SampleCursor
from zephon.runners import wire
from zephon.runners.chain import ChainRunner, LaneOutput
from zephon.runners.faults import error_message, exit_code
from zephon.runners.lanes import LaneOutputs, schedule

if TYPE_CHECKING:
    from zephon.plan.compile import Plan
    from zephon.runners.options import WorkerOptions

LOOKAHEAD_FEEDS = 2  # feed units a worker keeps requested per lane, to hide the round trip


class _Stop(Exception):
    """The parent said stop: the one clean way for a worker to end."""


class _ParentGone(Exception):
    """The control pipe broke: the parent closed it or died."""


def slot_too_small(what: str, need: int, slot_bytes: int) -> ValueError:
    suggest = 1 << (need + (64 << 10) - 1).bit_length()
    return ValueError(
        f"{what} needs {need} bytes but a shared-memory ring slot holds {slot_bytes} bytes; "
        f"build the pipeline with Pipeline(..., ring_slot_bytes={suggest}) (at least {need}), "
        "or make batches smaller"
    )


@dataclass(frozen=True)
class WorkerConfig:
    """What the parent sends a worker at start-up (besides its ring, the shared datasets
    and the operators, which travel on their own: see ``ProcessExecutor._keep_workers``).

    Attributes:
        options: the pipeline's options that workers run by.
        plan: the compiled plan (its operators come apart and are put back in).
        lanes: the lanes this worker owns, ascending.
        targets: each replaying lane's replay target, ``[chunk_id, offset, child]``.
        start_lane: whose turn the consumer's next output is.
        done: this worker's lanes whose end was delivered already.
        pad_ended: in lockstep, go on until every lane ended (see
            :func:`~zephon.runners.lanes.schedule`).
        max_grown_slot_bytes: derived from ``options.ring_slot_bytes``: None where it
            fixes the slots' size (an output that does not fit is an error), else the most
            bytes this worker may ask its slots to grow to.
    """

    options: WorkerOptions
    plan: Plan
    lanes: list[int]
    targets: dict[int, list[int]]
    start_lane: int
    done: list[int]
    pad_ended: bool
    max_grown_slot_bytes: int | None


class Worker:
    """A worker's loop: its lanes' outputs, in the rank's order, written into its ring."""

    def __init__(self, cfg: WorkerConfig, conn: Any, ring: Any) -> None:
        self.conn = conn
        # Whether a message waits on the control pipe, asked before every feed unit: one
        # poll of its descriptor (a connection reads whole messages, so nothing is left
        # buffered in it) rather than ``conn.poll(0)``, which builds a selector a call.
        self._pipe = select.poll()
        self._pipe.register(conn.fileno(), select.POLLIN)
        self.ring = ring
        self.cfg = cfg
        plan = cfg.plan
        pool = None
        cap = max(op.parallelism for op in plan.ops)
        if cap > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op")
        runner = self.runner = ChainRunner(plan, pool)
        filt = runner.replay_filter
        assert isinstance(filt, ReplayFilter)
        for lane, cursor in cfg.targets.items():
            filt.set_target(int(lane), SampleCursor(int(lane), *cursor))
        self.lanes = cfg.lanes
        self._new_ring: Any = None
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
                self.conn.send_bytes(wire.pack(wire.need(lane)))
            except OSError as e:
                raise _ParentGone from e
            self.asked[lane] += 1

    def _receive(self) -> None:
        try:
            raw = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise _ParentGone from e
        msg = wire.unpack(raw)
        if msg[wire.KIND] == wire.STOP:
            raise _Stop
        if msg[wire.KIND] == wire.RING:
            from zephon.shm import ShmRing, recv_fds

            try:
                (fd,) = recv_fds(self.conn)
            except (EOFError, OSError) as e:
                raise _ParentGone from e
            self._new_ring = ShmRing.attach(fd)
            return
        lane = msg[wire.LANE]
        self.asked[lane] -= 1
        items = wire.feed_items(msg)
        if items:
            self.feeds[lane].append(items)
            for it in items:
                if type(it) is WorkChunk:
                    self.runner.head.read_ahead(it)

    def _pull(self, lane: int) -> list[Any]:
        """The lane's next feed unit, from the parent (two are kept asked for). Every feed
        unit that has arrived is taken off the pipe first, whichever lane it is for, so
        that the chunks of object storage start their reads ahead as soon as they come,
        not when their lane next runs out."""
        self._ask(lane)
        pipe = self._pipe
        try:
            while pipe.poll(0):
                self._receive()
        except (EOFError, OSError) as e:
            raise _ParentGone from e
        while not self.feeds[lane]:
            self._receive()
        feed = self.feeds[lane].popleft()
        if any(isinstance(it, FlushSentinel) and it.final for it in feed):
            self.ended.add(lane)
        self._ask(lane)
        return feed

    # outputs, written straight into ring slots
    def _fits(self, what: str, need: int) -> None:
        """Makes the ring's slots hold ``need`` bytes: with sizes from the batches, by
        moving to a bigger ring (asked of the parent; the old ring's last message says
        so); else, or past the most it may grow to, the error quoting both sizes."""
        if need <= self.ring.slot_bytes:
            return
        cap = self.cfg.max_grown_slot_bytes
        if cap is None or need > cap:
            raise slot_too_small(what, need, self.ring.slot_bytes if cap is None else cap)
        try:
            self.conn.send_bytes(wire.pack({wire.KIND: wire.GROW, wire.BYTES: need}))
        except OSError as e:
            raise _ParentGone from e
        while self._new_ring is None:
            self._receive()
        old, self.ring, self._new_ring = self.ring, self._new_ring, None
        old.put(wire.pack({wire.LANE: -1, wire.MOVED: True}), [])
        old.detach()  # not close(): the parent still reads what it holds

    def _allocate(
        self, lane: int, spec: dict[str, tuple[tuple[int, ...], np.dtype]]
    ) -> dict[str, np.ndarray]:
        from zephon.shm import plan_layout

        sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values()]
        end = max((o + n for o, n in zip(plan_layout(sizes), sizes, strict=True)), default=0)
        if end > self.ring.slot_bytes:
            shapes = ", ".join(f"{k}: {np.dtype(d).name}{list(s)}" for k, (s, d) in spec.items())
            # growing: room for the metadata too (contributors: 32 bytes a piece)
            margin = 0 if self.cfg.max_grown_slot_bytes is None else 64 << 10
            self._fits(f"a batch of lane {lane} ({shapes})", end + margin)
        self._slot = self.ring.reserve(timeout_s=None)
        arrays = {k: self._slot.array(shape, dtype) for k, (shape, dtype) in spec.items()}
        self._slot_arrays = list(arrays.values())
        return arrays

    def _write(self, out: LaneOutput) -> None:
        """Writes one output: the lane's end, a batch (stacked into the slot it is
        committed in) or a record, with its contributors and tombstones."""
        rec = out.record
        data = None
        if rec is not None:
            try:
                # A deferred batch stacks now, straight into a reserved slot.
                data = rec.materialize(self._allocate) if isinstance(rec, LazyRecord) else rec.data
            except BaseException:
                if self._slot is not None:
                    self._slot.abort()
                    self._slot = None
                raise
        meta, arrays = wire.output_meta(out, data)
        packed = wire.pack(meta)
        kind = "batch" if wire.LAST_CURSOR in meta else "record" if rec is not None else "end"
        what = f"the {kind} of lane {out.lane}" if kind == "end" else f"a {kind} of lane {out.lane}"
        slot, self._slot = self._slot, None
        from zephon.shm import message_nbytes

        if slot is None:
            self._fits(what, message_nbytes(len(packed), arrays))
            self.ring.put(packed, arrays)
            return
        need = message_nbytes(len(packed), self._slot_arrays)
        if need > slot.capacity:
            if self.cfg.max_grown_slot_bytes is None:
                slot.abort()
                raise slot_too_small(
                    f"{what} with its metadata ({len(packed)} B)", need, slot.capacity
                )
            # Sized from the batches: the arrays fit but not with their metadata. Copy them
            # out of the slot, move to a bigger ring, and put them there.
            copies = [a.copy() for a in self._slot_arrays]
            slot.abort()
            self._fits(f"{what} with its metadata ({len(packed)} B)", need)
            self.ring.put(packed, copies)
            return
        slot.commit(packed)

    def run(self) -> None:
        cfg = self.cfg
        for lane in self.lanes:
            if lane not in cfg.done:
                self._ask(lane)
        for item in schedule(
            self.lanes,
            cfg.options.output,
            self.outputs.next,
            start_lane=cfg.start_lane,
            done=cfg.done,
            pad_ended=cfg.pad_ended,
        ):
            for out in item if isinstance(item, list) else (item,):
                if not out.padding:  # the parent's schedule makes its own
                    self._write(out)
        # Everything is written; wait for the parent to say stop (it may still read).
        while True:
            self._receive()


def _die_with_parent(parent_pid: int, via_forkserver: bool) -> None:
    """Makes this worker end when the pipeline's process ``parent_pid`` ends.

    ``PR_SET_PDEATHSIG`` sends SIGKILL when the thread that forked us ends: the parent's
    keeper thread with spawn and fork. A forkserver's children are the server's, and the
    server outlives the parent while any of them lives (each holds the server's "alive"
    pipe), so a worker blocked on a full ring would keep it, and itself, alive forever:
    there a thread waits on a pidfd of the parent instead.
    """
    import ctypes

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


def _report(conn: Any, e: BaseException, **extra: Any) -> None:
    try:
        conn.send_bytes(wire.pack(error_message(e, **extra)))
    except (OSError, ValueError):
        pass  # the parent is gone or closed the pipe: nobody to tell


def worker_main(conn: Any, parent_pid: int, via_forkserver: bool) -> None:
    """Entry point of a worker process.

    It says ``booted`` first, then reads its configuration, the first three messages on
    ``conn``: the descriptors of its ring and of the shared datasets, the operators, then the
    rest (see ``ProcessExecutor._keep_workers``); it says ``ready`` once it has built its loop.
    The only clean ends are the parent's ``stop`` message, the parent closing the control
    pipe or the ring (both happen in ``close()``), or the parent's death. Anything else,
    including a user function calling ``sys.exit``, is reported to the parent. Workers
    ignore SIGINT and SIGTERM: Ctrl-C and preemption are the parent's to handle (its own
    SIGTERM handler, if any, may still checkpoint), and its end ends them.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid, via_forkserver)
    try:
        # Past the start method's imports (with spawn, the parent's main module): from here a
        # worker the watchdog finds silent is loading its configuration, not importing.
        conn.send_bytes(wire.pack({wire.KIND: wire.BOOTED}))
    except OSError:
        return  # the parent is gone
    import dill

    from zephon.runners.shipping import load_operators
    from zephon.shm import RingClosedError, ShmRing, attach_segment, recv_fds

    try:
        fds = recv_fds(conn)
        payload = conn.recv_bytes(), conn.recv_bytes()
    except (EOFError, OSError):
        return  # the parent closed before handing the configuration over
    ring = None
    worker: Worker | None = None
    try:
        ring = ShmRing.attach(fds[0])
        data = attach_segment(fds[1], writable=False) if len(fds) > 1 else None
        cfg = dill.loads(payload[1])
        # The plan travels without its operators, which come by their own route.
        plan = dataclasses.replace(cfg.plan, ops=load_operators(payload[0], data))
        worker = Worker(dataclasses.replace(cfg, plan=plan), conn, ring)
        conn.send_bytes(wire.pack({wire.KIND: wire.READY}))
        worker.run()
    except (_Stop, _ParentGone):
        pass
    except RingClosedError:
        if worker is not None:
            ring = worker.ring  # it may have moved to a bigger one
        if ring is None or not ring.closed:
            _report(conn, sys.exc_info()[1])  # type: ignore[arg-type]
            os._exit(1)
        # the parent closed the ring (close() wakes a worker blocked on a full ring)
    except SystemExit as e:
        code = exit_code(e)
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
        if worker is not None:
            ring = worker.ring
        if ring is not None:
            ring.close()
