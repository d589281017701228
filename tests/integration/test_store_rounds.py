"""Real checkpoint rounds (``Aggregator``) over a real etcd, one OS process per rank, and
the faults that only real processes and a real server show: a leader SIGKILLed before
publishing, and a SIGSTOPped etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.etcd_server import etcd_server
from tests.integration.test_store_contract import busy_factor
from zephon.errors import AggregationError

pytestmark = [pytest.mark.stores, pytest.mark.etcd, pytest.mark.processes]

HERE = Path(__file__).parent
WORLD_SIZE = 4
LEASE_TTL_S = 2.0


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as server:
        yield server


def _run_ranks(url: str, rounds: int, mode: str = "normal", timeout_s: float = 60.0):
    """Start WORLD_SIZE rank processes; return [(returncode, [json records], stderr)]."""
    namespace = uuid.uuid4().hex
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_store_rounds_rank.py"),
                url,
                namespace,
                str(rank),
                str(WORLD_SIZE),
                str(rounds),
                str(LEASE_TTL_S),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            results.append((p.returncode, [json.loads(x) for x in out.splitlines() if x], err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def test_rounds_over_etcd_with_four_rank_processes(etcd):
    from tests.integration._store_rounds_rank import expected_result, without_share

    rounds = 3
    results = _run_ranks(etcd.url, rounds)
    for rank, (rc, records, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}: {records}\n{err[-3000:]}"
        assert [r["round"] for r in records] == list(range(rounds))
        for r in records:
            assert r["ok"], r
            want = expected_result(rank, WORLD_SIZE, r["round"])
            assert without_share(r["merged"]) == want, (rank, r)


def test_leader_killed_before_publishing_followers_fail_within_two_lease_ttls(etcd):
    results = _run_ranks(etcd.url, 1, mode="die_before_publish")
    rc0, records0, err0 = results[0]
    assert rc0 == -9, f"the leader should have SIGKILLed itself: {rc0}\n{err0[-3000:]}"
    died = records0[-1]["dying"]
    for rank, (rc, records, err) in enumerate(results[1:], start=1):
        assert rc == 3, f"rank {rank} exited {rc}: {records}\n{err[-3000:]}"
        (record,) = records
        assert not record["ok"]
        assert "is gone" in record["error"] and "rank 0" in record["error"], record["error"]
        waited = record["t"] - died
        assert waited < 2 * LEASE_TTL_S, f"rank {rank} failed {waited:.2f} s after the leader died"


def test_stalled_etcd_fails_the_round_with_its_endpoint_then_the_next_round_works(etcd):
    """Ranks as threads of this process (each with its own store): etcd is SIGSTOPped
    during a round, every rank fails within its budget naming the endpoint, and after
    SIGCONT the same Aggregators complete a round."""
    from tests.integration._store_rounds_rank import (
        expected_result,
        lanes_of,
        merge,
        state_of,
        without_share,
    )
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.checkpoint.stores.etcd import EtcdStore

    namespace = uuid.uuid4().hex
    world_size = 2
    aggs = [
        Aggregator(
            EtcdStore([etcd.endpoint], namespace=namespace, request_timeout_s=0.5),
            rank=rank,
            world_size=world_size,
            timeout_s=5.0,
            expected_lanes=lanes_of,
            merge=merge,
            lease_ttl_s=LEASE_TTL_S,
        )
        for rank in range(world_size)
    ]

    def run_round(round_no: int) -> list:
        out: list = [None] * world_size

        def one(rank: int) -> None:
            try:
                out[rank] = aggs[rank].round(state_of(rank, world_size, round_no))
            except AggregationError as e:
                out[rank] = e

        threads = [threading.Thread(target=one, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        return out

    try:
        assert all(isinstance(r, dict) for r in run_round(0))
        etcd.pause()
        t0 = time.monotonic()
        try:
            failed = run_round(1)
        finally:
            etcd.resume()
        # the round's budget, and as much again where the leader may have written its
        # commit and keeps asking for the outcome (every rank must learn the same one),
        # with 3 s to spare; slower on a busy machine
        assert time.monotonic() - t0 < (2 * 5.0 + 3.0) * busy_factor()
        for r in failed:
            assert isinstance(r, AggregationError), r
            assert etcd.endpoint in str(r), str(r)
        ok = run_round(2)
        assert [without_share(r) for r in ok] == [
            expected_result(r, world_size, 2) for r in range(world_size)
        ], ok
    finally:
        for a in aggs:
            a.close()
