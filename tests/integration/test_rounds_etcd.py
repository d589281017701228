"""Checkpoint rounds over a real etcd with default limits, ranks as threads (each with its
own EtcdStore, as separate hosts would have): more ranks than one etcd transaction may
touch (--max-txn-ops=128), two jobs or two pipelines on one namespace, waiting without
polling (watches), and an etcd over its space quota."""

from __future__ import annotations

import base64
import os
import threading
import uuid
from typing import Any

import pytest

from tests.etcd_server import etcd_server
from zephon.errors import AggregationError

pytestmark = [pytest.mark.stores, pytest.mark.etcd]


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as server:
        yield server


def lanes_of(rank: int, lanes_per_rank: int = 1) -> list[int]:
    return list(range(rank * lanes_per_rank, (rank + 1) * lanes_per_rank))


def state_of(rank: int, n: int, step: int, mark: str = "", lanes_per_rank: int = 1) -> dict:
    return {
        "topology": {
            "rank": rank,
            "world_size": n,
            "dp_size": n,
            "canonical_replicas": n * lanes_per_rank,
        },
        "lanes": [
            {"lane": lane, "step": step, "mark": mark} for lane in lanes_of(rank, lanes_per_rank)
        ],
        "step": step,
    }


def merge(states: list[dict]) -> dict:
    lanes = sorted((x for s in states for x in s["lanes"]), key=lambda x: x["lane"])
    return {"lanes": lanes, "step": states[0]["step"]}


def make_aggs(url: str, namespace: str, n: int, **kw: Any) -> list[Any]:
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.checkpoint.stores.etcd import EtcdStore

    lanes_per_rank = kw.pop("lanes_per_rank", 1)
    return [
        Aggregator(
            EtcdStore.from_url(f"{url}/{namespace}", request_timeout_s=10.0),
            rank=r,
            world_size=n,
            timeout_s=kw.get("timeout_s", 60.0),
            expected_lanes=lambda rank: lanes_of(rank, lanes_per_rank),
            merge=merge,
            lease_ttl_s=kw.get("lease_ttl_s", 10.0),
            job_id=kw.get("job_id", "test"),
            fingerprint=kw.get("fingerprint", ""),
        )
        for r in range(n)
    ]


def run(aggs: list[Any], step: int, mark: str = "", lanes_per_rank: int = 1) -> list[Any]:
    n = len(aggs)
    out: list[Any] = [None] * n

    def one(r: int) -> None:
        try:
            out[r] = aggs[r].round(state_of(r, n, step, mark, lanes_per_rank))
        except Exception as e:  # noqa: BLE001 - judged by the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a rank hung"
    return out


def _etcd_keys(url: str, namespace: str) -> list[str]:
    from zephon.checkpoint.stores.etcd import EtcdStore

    s = EtcdStore.from_url(f"{url}/{namespace}")
    try:
        return s.list_keys("")
    finally:
        s.close()


def test_more_ranks_than_an_etcd_transaction_may_touch(etcd):
    """150 ranks: more than the 128 operations etcd allows in one transaction (the old
    round failed from 130 ranks on). Every rank gets its result, each follower with a
    handful of requests, and nothing is left once the job closes."""
    n = 150
    namespace = uuid.uuid4().hex
    aggs = make_aggs(etcd.url, namespace, n)
    try:
        for step in range(2):
            out = run(aggs, step)
            errors = [o for o in out if isinstance(o, BaseException)]
            assert not errors, errors[:3]
            assert [x["lane"] for x in out[0]["lanes"]] == list(range(n))
            for r in range(1, n):
                assert out[r]["lanes"] == [{"lane": r, "step": step, "mark": ""}]
        follower_requests = [a.last_round.requests for a in aggs[1:]]
        # a state, an ack, maybe a probe: never one request per rank or per poll
        assert max(follower_requests) <= 6, follower_requests
    finally:
        for a in aggs:
            a.close()
    assert _etcd_keys(etcd.url, namespace) == []


def test_a_waiting_follower_sends_no_requests_while_it_waits(etcd):
    """The leader comes 1.5 s late: a polling follower would send hundreds of reads in
    that time; a watching one sends none (it only writes its state and its ack)."""
    namespace = uuid.uuid4().hex
    aggs = make_aggs(etcd.url, namespace, 2)
    try:
        out: list[Any] = [None, None]

        def follower() -> None:
            out[1] = aggs[1].round(state_of(1, 2, 0))

        t = threading.Thread(target=follower)
        t.start()
        t.join(1.5)
        assert t.is_alive()
        out[0] = aggs[0].round(state_of(0, 2, 0))
        t.join(30)
        assert isinstance(out[1], dict), out
        stats = aggs[1].last_round
        # its place (a lease and its key: first round only), the probe (after 0.5 s), the
        # state, the ack
        assert stats.requests <= 8, stats
        assert stats.events >= 3, stats  # announcement, its close, the commit: pushed
    finally:
        for a in aggs:
            a.close()


@pytest.mark.parametrize(
    ("a", "b"),
    [(("job-a", ""), ("job-b", "")), (("job", "a" * 64), ("job", "b" * 64))],
    ids=["two-jobs", "two-pipelines"],
)
def test_two_jobs_or_two_pipelines_in_one_namespace_never_mix(etcd, a, b):
    n = 3
    namespace = uuid.uuid4().hex
    jobs = {
        mark: make_aggs(etcd.url, namespace, n, job_id=job, fingerprint=fp)
        for mark, (job, fp) in zip("AB", (a, b), strict=True)
    }
    results: dict[str, list[Any]] = {"A": [], "B": []}
    try:
        for step in range(3):
            threads = [
                threading.Thread(
                    target=lambda m=m, step=step: results[m].append(run(jobs[m], step, m))
                )
                for m in "AB"
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
    finally:
        for aggs in jobs.values():
            for agg in aggs:
                agg.close()
    for mark, rounds in results.items():
        assert len(rounds) == 3
        for step, out in enumerate(rounds):
            for rank, res in enumerate(out):
                assert isinstance(res, dict), res
                assert {(x["mark"], x["step"]) for x in res["lanes"]} == {(mark, step)}
                assert len(res["lanes"]) == (n if rank == 0 else 1)
    assert _etcd_keys(etcd.url, namespace) == []


def _fill(url: str, namespace: str) -> str:
    """Put junk until etcd refuses: returns its error."""
    from zephon.checkpoint.stores.etcd import EtcdStore

    s = EtcdStore.from_url(f"{url}/{namespace}-junk")
    try:
        for i in range(1000):
            try:
                s.put(f"junk{i}", os.urandom(900_000))
            except AggregationError as e:
                return str(e)
        raise AssertionError("etcd took 900 MB under a 24 MiB quota")
    finally:
        s.close()


def test_an_etcd_over_its_quota_fails_every_rank_naming_the_quota():
    """Rounds over an etcd whose space quota is used up: every rank ends its round naming
    etcd's error ('database space exceeded'), none after waiting out its budget, none
    blaming another rank. First with the quota full before the round (nobody can write
    anything), then with it filling up between the announcement and the followers' states
    (only deletes still work)."""
    with etcd_server(extra_args=("--quota-backend-bytes=25165824",)) as server:
        namespace = uuid.uuid4().hex
        n = 4
        aggs = make_aggs(server.url, namespace, n, lease_ttl_s=5.0)
        try:
            assert all(isinstance(o, dict) for o in run(aggs, 0)), "a healthy round first"
            # The quota runs out while rank 0 is already waiting for the states.
            from zephon.checkpoint.rounds import follower as follower_module

            filled = threading.Event()
            real_write = follower_module.Follower._write_state

            def write_after_the_fill(self, joined, state):
                if self.ctx.rank == 1 and not filled.is_set():
                    _fill(server.url, namespace)
                    filled.set()
                filled.wait(60)
                return real_write(self, joined, state)

            follower_module.Follower._write_state = write_after_the_fill  # type: ignore[method-assign]
            try:
                out = run(aggs, 1)
            finally:
                follower_module.Follower._write_state = real_write  # type: ignore[method-assign]
            _check_quota_errors(out)
            out = run(aggs, 2)  # and a round that starts with etcd full
            _check_quota_errors(out)
        finally:
            for a in aggs:
                a.close()


def _check_quota_errors(out: list[Any]) -> None:
    for r, err in enumerate(out):
        assert isinstance(err, AggregationError), (r, err)
        msg = str(err)
        assert msg.startswith(f"[rank={r}] "), msg
        assert "database space exceeded" in msg, msg
        assert "timed out" not in msg, msg  # (a 60 s budget: nobody waited it out)


def test_etcd_history_is_compacted_after_each_round(etcd):
    """Deleted states stay in etcd's history until compacted; the leader compacts after
    every committed round, so reading a revision from before the last round fails."""
    from zephon.checkpoint.stores.etcd import EtcdStore

    namespace = uuid.uuid4().hex
    aggs = make_aggs(etcd.url, namespace, 3, lanes_per_rank=4)
    probe = EtcdStore.from_url(f"{etcd.url}/{namespace}")
    try:
        before = probe.status()["revision"]
        for step in range(3):
            assert all(isinstance(o, dict) for o in run(aggs, step, lanes_per_rank=4))
        key = base64.b64encode(b"x").decode()
        with pytest.raises(AggregationError, match="required revision has been compacted"):
            probe._call("/kv/range", {"key": key, "revision": before + 1}, "old read")
    finally:
        probe.close()
        for a in aggs:
            a.close()


def test_with_a_blob_location_states_never_enter_etcd(etcd, tmp_path):
    """``etcd://...?blobs=DIR``: the states and the acks go to the directory; etcd sees
    only the coordination keys, and followers send etcd nothing."""
    from zephon.checkpoint.aggregate import Aggregator
    from zephon.checkpoint.stores import DirectoryStore, open_store

    n = 5
    namespace = uuid.uuid4().hex
    url = f"{etcd.url}/{namespace}?blobs={tmp_path}"
    seen: dict[str, list[str]] = {}

    def spying_merge(states: list[dict]) -> dict:
        seen["etcd"] = _etcd_keys(etcd.url, namespace)
        seen["blobs"] = DirectoryStore(tmp_path, namespace).list_keys("")
        return merge(states)

    aggs = [
        Aggregator(
            open_store(aggregate_store=url),
            rank=r,
            world_size=n,
            timeout_s=60.0,
            expected_lanes=lanes_of,
            merge=spying_merge,
            job_id="blobs",
        )
        for r in range(n)
    ]
    try:
        for step in range(2):
            out = run(aggs, step)
            assert [x["lane"] for x in out[0]["lanes"]] == list(range(n))
            assert all(
                out[r]["lanes"] == [{"lane": r, "step": step, "mark": ""}] for r in range(1, n)
            )
        # While round 2 merges: round 1's states (kept for its shares) and round 2's (the
        # leader's too: it writes its own before it commits).
        assert len([k for k in seen["blobs"] if ".s." in k]) == n + n, seen
        assert not [k for k in seen["etcd"] if ".s." in k], seen
        for a in aggs[1:]:
            assert a.last_round.requests == 2  # its state, its ack: both in the directory
    finally:
        for a in aggs:
            a.close()
    assert _etcd_keys(etcd.url, namespace) == []
    assert os.listdir(tmp_path / namespace) == []


_CLOSE_DURING_OUTAGE = """
import sys
from zephon.checkpoint.aggregate import Aggregator
from zephon.checkpoint.stores.etcd import EtcdStore

agg = Aggregator(
    EtcdStore.from_url(sys.argv[1], request_timeout_s=1.0),
    rank=0,
    world_size=1,
    timeout_s=10.0,
    expected_lanes=lambda r: [0],
    merge=lambda states: {"lanes": states[0]["lanes"], "step": states[0]["step"]},
    lease_ttl_s=120.0,  # longer than the outage may last on a loaded machine
    job_id="outage",
)
agg.round({"topology": {"rank": 0, "world_size": 1, "dp_size": 1, "canonical_replicas": 1},
           "lanes": [{"lane": 0}], "step": 3})
print("committed", flush=True)
sys.stdin.readline()  # the test stops etcd meanwhile
agg.close()  # its lease cannot be revoked: etcd does not answer
print("closed", flush=True)
"""


def test_a_leader_that_closed_while_etcd_was_down_does_not_block_the_next_job(etcd):
    """Issue 33 item 4: the leader's liveness lease could not be revoked (etcd down while
    it closed) and etcd renews leases when it comes back; the next job's leader, on
    the same host, takes the key over at once since its holder's process is gone, instead
    of waiting out the lease (120 s here, so that it cannot run out during the outage, which
    lasts one request_timeout_s per cleanup step: longer than 10 s on a loaded machine)."""
    import subprocess
    import sys
    import time

    from zephon.checkpoint.aggregate import Aggregator
    from zephon.checkpoint.stores.etcd import EtcdStore

    url = f"{etcd.url}/{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLOSE_DURING_OUTAGE, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "committed"
        # Killed, not paused: a paused server reads the queued revoke once it resumes and
        # the lease is gone after all (CI saw it); a killed one never sees the request.
        etcd.kill()
        try:
            proc.stdin.write("close\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "closed"
            assert proc.wait(timeout=30) == 0
        finally:
            etcd.start()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    leftover = EtcdStore.from_url(url)
    try:
        assert any(k.endswith(".c.leader") for k in leftover.list_keys("")), "the key stayed"
    finally:
        leftover.close()
    agg = Aggregator(
        EtcdStore.from_url(url),
        rank=0,
        world_size=1,
        timeout_s=10.0,
        expected_lanes=lambda r: [0],
        merge=lambda states: {"lanes": states[0]["lanes"], "step": states[0]["step"]},
        lease_ttl_s=120.0,
        job_id="outage",
    )
    try:
        t = time.monotonic()
        state = {
            "topology": {"rank": 0, "world_size": 1, "dp_size": 1, "canonical_replicas": 1},
            "lanes": [{"lane": 0}],
            "step": 0,
        }
        assert agg.round(state)["step"] == 0
        assert time.monotonic() - t < 60.0, "waited for the dead leader's lease"
    finally:
        agg.close()
