"""Question 6: moving a batch from a worker process to the parent.

Zephon's ring (zero-copy views, and copied out) against ``multiprocessing.Queue`` (pickled
arrays) and a new shared-memory segment per array (Grain's default transport), for batches
of 64 KiB, 192 KiB and 1 MiB. The producer is a child process that writes each batch into
the transport (for the ring: straight into the slot, as ``batch`` does); the consumer is the
parent, which receives it and touches every page. GB/s and microseconds per handoff are
measured at the consumer; candidates alternate over several repetitions.

    python -m benchmarks.transport [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import multiprocess as mp
import numpy as np

from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table

SIZES = {"64 KiB": 64 << 10, "192 KiB": 192 << 10, "1 MiB": 1 << 20}


def _touch(a: np.ndarray) -> int:
    return int(a[:: 4096 // a.itemsize].sum())  # one read per page


# ----------------------------------------------------------------------------- producers
def _ring_producer(conn: Any, nbytes: int, count: int) -> None:
    from zephon.shm import ShmRing, recv_fds

    (fd,) = recv_fds(conn)  # the ring's descriptor, as Zephon's workers get theirs
    ring = ShmRing.attach(fd)
    src = np.arange(nbytes // 4, dtype=np.int32)
    for _ in range(count):
        slot = ring.reserve(timeout_s=30)
        np.copyto(slot.array(src.shape, src.dtype), src)
        slot.commit(b"m")
    ring.close()


def _queue_producer(q: Any, nbytes: int, count: int) -> None:
    src = np.arange(nbytes // 4, dtype=np.int32)
    for _ in range(count):
        q.put(src)


def _segment_producer(q: Any, nbytes: int, count: int) -> None:
    from multiprocessing import resource_tracker, shared_memory

    src = np.arange(nbytes // 4, dtype=np.int32)
    for _ in range(count):
        shm = shared_memory.SharedMemory(create=True, size=src.nbytes)
        np.copyto(np.ndarray(src.shape, src.dtype, buffer=shm.buf), src)
        q.put((shm.name, src.shape))
        shm.close()
        resource_tracker.unregister(shm._name, "shared_memory")  # the consumer unlinks it


# ----------------------------------------------------------------------------- consumers
def run_ring(nbytes: int, count: int, zero_copy: bool) -> float:
    from zephon.shm import ShmRing

    ctx = mp.get_context("spawn")
    from zephon.shm import send_fds

    ring = ShmRing.create(8, nbytes + (64 << 10))
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_ring_producer, args=(child_end, nbytes, count))
    proc.start()
    child_end.close()
    send_fds(parent_end, [ring.fileno()])
    try:
        msg = ring.get(timeout_s=60, zero_copy=zero_copy)  # first message: start the clock
        _touch(msg.arrays[0])
        msg.release()
        t0 = time.perf_counter()
        for _ in range(count - 1):
            msg = ring.get(timeout_s=60, zero_copy=zero_copy)
            _touch(msg.arrays[0])
            msg.release()
        return (time.perf_counter() - t0) / (count - 1)
    finally:
        proc.join(timeout=10)
        ring.close()
        parent_end.close()


def run_queue(nbytes: int, count: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=8)
    proc = ctx.Process(target=_queue_producer, args=(q, nbytes, count))
    proc.start()
    _touch(q.get(timeout=60))
    t0 = time.perf_counter()
    for _ in range(count - 1):
        _touch(q.get(timeout=60))
    dt = (time.perf_counter() - t0) / (count - 1)
    proc.join(timeout=10)
    return dt


def run_segments(nbytes: int, count: int) -> float:
    from multiprocessing import shared_memory

    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=8)
    proc = ctx.Process(target=_segment_producer, args=(q, nbytes, count))
    proc.start()

    def receive() -> None:
        name, shape = q.get(timeout=60)
        shm = shared_memory.SharedMemory(name=name)
        out = np.array(np.ndarray(shape, np.int32, buffer=shm.buf))  # the consumer owns it
        _touch(out)
        shm.close()
        shm.unlink()  # also unregisters it from this process's resource tracker

    receive()
    t0 = time.perf_counter()
    for _ in range(count - 1):
        receive()
    dt = (time.perf_counter() - t0) / (count - 1)
    proc.join(timeout=10)
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    rows = []
    for label, nbytes in SIZES.items():
        count = 50 if args.quick else max(200, min(4000, (800 << 20) // nbytes))
        cands = {
            "zephon ring (zero-copy)": lambda n=nbytes, c=count: run_ring(n, c, True),
            "zephon ring (copied out)": lambda n=nbytes, c=count: run_ring(n, c, False),
            "multiprocessing.Queue (pickle)": lambda n=nbytes, c=count: run_queue(n, c),
            "shm segment per array (Grain)": lambda n=nbytes, c=count: run_segments(
                n, max(20, c // 4)
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in cands}
        for r in range(repeats):
            names = list(cands)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(cands[name]())
        seg = statistics.median(times["shm segment per array (Grain)"])
        for name, ts in times.items():
            dt = statistics.median(ts)
            rows.append(
                {
                    "batch": label,
                    "transport": name,
                    "GB/s": round(nbytes / dt / 1e9, 2),
                    "us/handoff": round(dt * 1e6, 1),
                    "x segment-per-array": round(seg / dt, 1),
                }
            )
    print_table(rows, list(rows[0]), title="Worker -> parent transport (medians)")
    write_results("transport", rows, args.results, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
