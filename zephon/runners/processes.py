"""Worker processes: each owns whole lanes and runs their full operator chain.

The parent keeps the work sources, in-flight sets, completion tracking and replay cursors;
workers only ever see feed units (chunk descriptors and flush sentinels) that the parent
hands them on request, over a control pipe carrying msgpack. Finished batches come back
through one shared-memory ring per worker: ``batch`` stacks rows straight into a reserved
ring slot, and the metadata (contributors, tombstones, the replay cursor) travels as
msgpack in the same slot. No pickle on the data path; the pipeline definition itself is
shipped once at start-up with dill, so lambdas and closures work.

A worker writes its outputs in exactly the order the parent will consume them (the rank's
round-robin restricted to the worker's lanes, or every lane per step in lockstep), so the
parent reads each ring first-in first-out and zero-copy views need no parking.

Faults: a worker that dies, exits, hangs or raises becomes a :class:`WorkerError` in the
parent's ``next()`` within seconds; workers die with the parent (``PR_SET_PDEATHSIG`` plus
control-pipe EOF), ignore SIGINT (the parent handles Ctrl-C), and the parent unlinks every
ring on ``close()``; a sweeper removes rings of dead parents.
"""

from __future__ import annotations

import builtins
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from zephon.chunks import WorkChunk
from zephon.errors import WorkerError
from zephon.operators.batch import Batch
from zephon.records import BatchRecord, Contributor, FlushSentinel, Record, SampleCursor
from zephon.replay import ReplayFilter
from zephon.runners.chain import ChainRunner, LaneOutput

LOOKAHEAD_FEEDS = 2  # feed units a worker keeps requested per lane, to hide the round trip
DEFAULT_SLOT_BYTES = 4 << 20
_POLL_S = 0.05


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
    return [WorkChunk.from_state(it["c"]) if "c" in it else FlushSentinel(it["l"], it["s"], it["f"]) for it in items]


def _flat(contributors: list[Contributor]) -> list[int]:
    return [int(x) for c in contributors for x in c]


def _unflat(flat: list[int]) -> list[Contributor]:
    return [Contributor(flat[i], flat[i + 1], flat[i + 2], bool(flat[i + 3])) for i in range(0, len(flat), 4)]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(raw: bytes | memoryview) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


# ------------------------------------------------------------------------ worker side
def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the control pipe's EOF still stops us


class _Worker:
    def __init__(self, worker_id: int, cfg: dict[str, Any], conn: Any, ring: Any) -> None:
        self.id = worker_id
        self.conn = conn
        self.ring = ring
        ops = cfg["ops"]
        self.batch_op: Batch | None = ops[-1] if isinstance(ops[-1], Batch) else None
        chain = ops[:-1] if self.batch_op is not None else ops
        pool = None
        cap = max(op.parallelism for op in chain)
        if cap > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(cap, thread_name_prefix="zephon-op")
        self.runner = ChainRunner(chain, pool)
        filt = self.runner.ops[cfg["filter_index"]]
        assert isinstance(filt, ReplayFilter)
        for lane, cursor in cfg["targets"].items():
            filt.set_target(int(lane), SampleCursor(int(lane), *cursor))
        self.lanes: list[int] = cfg["lanes"]
        self.output: str = cfg["output"]
        self.start_lane: int = cfg["start_lane"]
        self.done: set[int] = set(cfg["done"])
        self.feeds: dict[int, deque[list[Any]]] = {lane: deque() for lane in self.lanes}
        self.asked: dict[int, int] = dict.fromkeys(self.lanes, 0)
        self.ended: set[int] = set()
        self.outputs: dict[int, deque[LaneOutput]] = {lane: deque() for lane in self.lanes}
        self.messages = 0
        if self.batch_op is not None:
            self.batch_op.allocate = self._allocate
        self._slot: Any = None

    # feed units, requested ahead
    def _ask(self, lane: int) -> None:
        while lane not in self.ended and self.asked[lane] < LOOKAHEAD_FEEDS:
            self.conn.send_bytes(_pack({"t": "need", "lane": lane}))
            self.asked[lane] += 1

    def _receive(self) -> None:
        msg = _unpack(self.conn.recv_bytes())
        if msg["t"] == "stop":
            raise SystemExit(0)
        lane = msg["lane"]
        self.asked[lane] -= 1
        if msg["items"]:
            self.feeds[lane].append(decode_feed(msg["items"]))

    def _next_lane_output(self, lane: int) -> LaneOutput:
        outs = self.outputs[lane]
        while not outs:
            self._ask(lane)
            while not self.feeds[lane]:
                self._receive()
            feed = self.feeds[lane].popleft()
            if any(isinstance(it, FlushSentinel) and it.final for it in feed):
                self.ended.add(lane)
            for out in self.runner.feed(feed):
                self.outputs[out.lane].append(out)
            self._ask(lane)
        return outs.popleft()

    # outputs, written straight into ring slots
    def _allocate(self, lane: int, spec: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        self._slot = self.ring.reserve(timeout_s=None)
        return {k: self._slot.array(shape, dtype) for k, (shape, dtype) in spec.items()}

    def _commit(self, meta: dict[str, Any]) -> None:
        if self.messages % 64 == 0:
            meta["stats"] = [[s.records_in, s.records_out, s.seconds] for s in self.runner.stats]
        self.messages += 1
        slot, self._slot = self._slot, None
        if slot is None:
            self.ring.put(_pack(meta), ())
        else:
            slot.commit(_pack(meta))

    def _emit_batch(self, lane: int) -> bool:
        """Writes the lane's next output; False once the lane has ended."""
        assert self.batch_op is not None
        tombs: list[Contributor] = []
        while True:
            out = self._next_lane_output(lane)
            tombs.extend(out.tombstones)
            if out.end:
                produced = list(self.batch_op.flush(True, lane))
                for item in produced:
                    if isinstance(item, BatchRecord):
                        self._commit(self._batch_meta(item, tombs))
                        tombs = []
                    else:
                        tombs.extend(item.contributors)
                self._commit({"lane": lane, "end": True, "tombstones": _flat(tombs)})
                return False
            assert out.record is not None
            try:
                produced = list(self.batch_op.process(out.record))
            except BaseException:
                if self._slot is not None:
                    self._slot.abort()
                    self._slot = None
                raise
            if produced:
                (batch,) = produced
                assert isinstance(batch, BatchRecord)
                self._commit(self._batch_meta(batch, tombs))
                return True

    def _batch_meta(self, batch: BatchRecord, tombs: list[Contributor]) -> dict[str, Any]:
        return {
            "lane": batch.lane,
            "keys": list(batch.data) if isinstance(batch.data, dict) else None,
            "contributors": _flat(batch.contributors),
            "tombstones": _flat(tombs),
            "last": list(batch.last_cursor[1:]),
            "n": batch.num_records,
            "mix": [[int(c), int(w)] for c, w in batch.mix.items()],
        }

    def _emit_record(self, lane: int) -> bool:
        """Pipelines without ``batch``: one record per message."""
        out = self._next_lane_output(lane)
        tombs = _flat(out.tombstones)
        if out.end:
            self._commit({"lane": lane, "end": True, "tombstones": tombs})
            return False
        rec = out.record
        assert rec is not None
        data = rec.data
        if isinstance(data, dict) and all(isinstance(v, np.ndarray) for v in data.values()):
            keys, arrays, value = list(data), [data[k] for k in data], None
        elif isinstance(data, np.ndarray):
            keys, arrays, value = None, [data], None
        else:
            keys, arrays, value = None, [], data  # msgpack-able plain data
        meta = {
            "lane": lane,
            "keys": keys,
            "value": value,
            "single": isinstance(data, np.ndarray),
            "contributors": _flat(rec.contributors),
            "tombstones": tombs,
            "mix": [[int(c), int(w)] for c, w in rec.mix.items()],
        }
        self.messages += 1
        self.ring.put(_pack(meta), arrays)
        return True

    def run(self) -> None:
        emit = self._emit_batch if self.batch_op is not None else self._emit_record
        lanes = [lane for lane in self.lanes if lane not in self.done]
        for lane in lanes:
            self._ask(lane)
        if self.output == "lockstep":
            while all(emit(lane) for lane in lanes):
                pass
        else:
            pos = next((i for i, lane in enumerate(lanes) if lane >= self.start_lane), 0)
            while lanes:
                pos %= len(lanes)
                if emit(lanes[pos]):
                    pos += 1
                else:
                    del lanes[pos]
        # Everything is written; wait for the parent to say stop (it may still read).
        while True:
            self._receive()


def worker_main(worker_id: int, payload: bytes, conn: Any, ring_name: str) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    import dill

    from zephon.shm import ShmRing

    ring = None
    try:
        cfg = dill.loads(payload)
        ring = ShmRing.attach(ring_name)
        _Worker(worker_id, cfg, conn, ring).run()
    except (SystemExit, EOFError, BrokenPipeError):
        pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit 1
        try:
            conn.send_bytes(
                _pack(
                    {
                        "t": "error",
                        "type": type(e).__name__,
                        "module": type(e).__module__,
                        "message": str(e),
                        "traceback": traceback.format_exc(),
                    }
                )
            )
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    finally:
        if ring is not None:
            ring.close()


# ------------------------------------------------------------------------ parent side
def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def rebuild_error(worker: int, pid: int, msg: dict[str, Any]) -> BaseException:
    """The worker's exception as an instance of its own builtin type *and* WorkerError."""
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
    __slots__ = ("id", "proc", "conn", "ring", "lanes", "last_seen", "stats", "lock")

    def __init__(self, wid: int, proc: Any, conn: Any, ring: Any, lanes: list[int]) -> None:
        self.id, self.proc, self.conn, self.ring, self.lanes = wid, proc, conn, ring, lanes
        self.last_seen = time.monotonic()
        self.stats: list[list[float]] | None = None
        self.lock = threading.Lock()  # conn sends from the feeder thread only; kept for close


class ProcessExecutor:
    """Parent side of the worker pool: the feeder thread, the rings, fault detection."""

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
    ) -> None:
        self.plan = plan
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
        self._closed = False
        self._pull: Callable[[int], list[Any]] | None = None
        self.replay_dropped = 0

    def set_target(self, lane: int, cursor: Any) -> None:
        if cursor is None:
            self.targets.pop(lane, None)
        else:
            self.targets[lane] = cursor

    def start(self, engine: Any) -> None:
        import dill
        import multiprocess

        from zephon.shm import ShmRing, sweep_stale_segments

        sweep_stale_segments()
        self._pull = engine.pull
        ctx = multiprocess.get_context(self.start_method)
        lanes = engine.lanes
        n = min(self.num_workers, len(lanes))
        done = [lane for lane in lanes if engine.trackers[lane].done]
        try:
            for wid in range(n):
                mine = lanes[wid::n]
                cfg = {
                    "ops": [op.fresh() for op in self.plan.ops],
                    "filter_index": self.plan.filter_index,
                    "targets": {lane: list(self.targets[lane][1:]) for lane in mine if lane in self.targets},
                    "lanes": mine,
                    "output": engine.output,
                    "start_lane": engine.next_lane,
                    "done": [lane for lane in mine if lane in done],
                }
                ring = ShmRing.create(self.nslots, self.slot_bytes)
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(wid, dill.dumps(cfg, recurse=True), child_conn, ring.name),
                    name=f"zephon-worker-{wid}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                h = _Handle(wid, proc, parent_conn, ring, mine)
                self.handles.append(h)
                for lane in mine:
                    self.owner[lane] = h
        except BaseException:
            self.close()
            raise
        self._feeder = threading.Thread(target=self._feed_loop, name="zephon-feeder", daemon=True)
        self._feeder.start()

    # the feeder: answers "need" requests, catches errors and deaths
    def _feed_loop(self) -> None:
        from multiprocess.connection import wait

        conns = {h.conn: h for h in self.handles}
        sentinels = {h.proc.sentinel: h for h in self.handles}
        while not self._stop.is_set() and self.error is None:
            try:
                ready = wait([*conns, *sentinels], timeout=_POLL_S)
            except OSError:
                return
            for obj in ready:
                h = conns.get(obj)
                if h is None:
                    continue
                try:
                    msg = _unpack(h.conn.recv_bytes())
                except (EOFError, OSError):
                    conns.pop(obj, None)
                    continue
                if msg["t"] == "need":
                    assert self._pull is not None
                    lane = msg["lane"]
                    try:
                        items = encode_feed(self._pull(lane))
                    except BaseException as e:  # noqa: BLE001 - a work-source failure
                        self._fail(e)
                        return
                    try:
                        h.conn.send_bytes(_pack({"t": "feed", "lane": lane, "items": items}))
                    except OSError:
                        conns.pop(obj, None)
                elif msg["t"] == "error":
                    self._fail(rebuild_error(h.id, h.proc.pid, msg))
                    return
            for s in ready:
                h = sentinels.get(s)
                if h is not None:
                    self._fail(self._death(h))
                    return

    def _death(self, h: _Handle) -> WorkerError:
        h.proc.join(timeout=1)
        code = h.proc.exitcode
        # An error message may race the process sentinel: prefer the worker's own words.
        try:
            while h.conn.poll(0):
                msg = _unpack(h.conn.recv_bytes())
                if msg["t"] == "error":
                    err = rebuild_error(h.id, h.proc.pid, msg)
                    return err if isinstance(err, WorkerError) else WorkerError(str(err))
        except (EOFError, OSError):
            pass
        if code is not None and code < 0:
            how = f"was killed by {_signal_name(code)}"
        else:
            how = f"exited with code {code}"
        return WorkerError(
            f"worker {h.id} (pid {h.proc.pid}, lanes {h.lanes}) {how}; the pipeline cannot "
            "continue. Restore the last checkpoint into a new pipeline to go on"
        )

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    # reading outputs
    def next_output(self, lane: int) -> LaneOutput:
        h = self.owner[lane]
        waited_since = time.monotonic()
        while True:
            if self.error is not None:
                raise self.error
            if self._closed:
                raise WorkerError("the pipeline was closed")
            try:
                msg = h.ring.get(timeout_s=_POLL_S, zero_copy=self.zero_copy)
                break
            except TimeoutError:
                if not h.proc.is_alive():
                    # the feeder reports deaths; give it a moment to pick the right words
                    time.sleep(_POLL_S)
                    if self.error is None:
                        self._fail(self._death(h))
                elif time.monotonic() - waited_since > self.worker_timeout_s:
                    self._fail(
                        WorkerError(
                            f"worker {h.id} (pid {h.proc.pid}, lanes {h.lanes}) produced nothing for "
                            f"{self.worker_timeout_s:.0f} s (worker_timeout_s): it is hung or stopped"
                        )
                    )
        h.last_seen = time.monotonic()
        meta = _unpack(msg.meta)
        if "stats" in meta:
            h.stats = meta["stats"]
        if meta["lane"] != lane:
            raise WorkerError(f"worker {h.id} sent lane {meta['lane']} when lane {lane} was due; this is a Zephon bug")
        tombs = _unflat(meta["tombstones"])
        if meta.get("end"):
            msg.release()
            return LaneOutput(lane, None, tombs, end=True)
        arrays = msg.arrays
        keys = meta["keys"]
        if keys is not None:
            data: Any = dict(zip(keys, arrays))
        elif meta.get("single") or "last" in meta:
            data = arrays[0]
        else:
            data = meta["value"]
        if not self.zero_copy:
            msg.release()
        mix = {int(c): int(w) for c, w in meta["mix"]}
        contributors = _unflat(meta["contributors"])
        if "last" in meta:
            rec: Record = BatchRecord(data, lane, contributors, mix, SampleCursor(lane, *meta["last"]), meta["n"])
        else:
            rec = Record(data, lane, contributors, mix)
        out = LaneOutput(lane, rec, tombs)
        if self.zero_copy:
            out.lease = msg
        return out

    def op_stats(self) -> list[dict[str, Any]]:
        ops = [op for op in self.plan.ops if op.name != "batch"] if self.plan.ops[-1].name == "batch" else self.plan.ops
        totals = [[0, 0, 0.0] for _ in ops]
        for h in self.handles:
            for t, s in zip(totals, h.stats or ()):
                t[0] += int(s[0])
                t[1] += int(s[1])
                t[2] += float(s[2])
        return [
            {"name": op.name, "records_in": t[0], "records_out": t[1], "seconds": round(t[2], 6), "place": "workers"}
            for op, t in zip(ops, totals)
        ]

    def extra_stats(self) -> dict[str, Any]:
        return {
            "workers": [
                {"id": h.id, "pid": h.proc.pid, "lanes": h.lanes, "alive": h.proc.is_alive(), "ring": h.ring.name}
                for h in self.handles
            ]
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for h in self.handles:
            try:
                h.conn.send_bytes(_pack({"t": "stop"}))
            except (OSError, ValueError):
                pass
            h.ring.close()  # wakes a worker blocked on a full ring
        if self._feeder is not None and self._feeder is not threading.current_thread():
            self._feeder.join(timeout=2)
        deadline = time.monotonic() + 2
        for h in self.handles:
            h.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if h.proc.is_alive():
                h.proc.kill()
                h.proc.join(timeout=2)
            try:
                h.conn.close()
            except OSError:
                pass
            h.ring.unlink()
