"""Rounds as threads over one directory: job identity (two jobs, two pipelines, foreign
records), agreement (a stale leader, a commit racing a give-up) and stores that refuse
writes (a full disk, no permission). The basic round is in test_aggregate_round.py.

No timings are asserted here: budgets are long (60 s), and a rank that waited one out says
"timed out", which the tests refuse; how fast the ranks fail is measured in
benchmarks/round_scale.py."""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import pytest

from tests.unit.checkpoint._stores import Wrapped
from tests.unit.checkpoint.test_aggregate_round import (
    JOB,
    KEYS,
    check_results,
    close_all,
    lanes_of,
    make_aggs,
    make_state,
    merge,
    run_ranks,
    without_round,
)
from zephon.checkpoint.aggregate import Aggregator
from zephon.checkpoint.rounds.keys import STATE, Announcement, decode, encode
from zephon.checkpoint.stores import DirectoryStore
from zephon.errors import AggregationError

FP_TRAIN = "a" * 64
FP_EVAL = "b" * 64


@pytest.fixture
def local(tmp_path):
    from tests.unit.checkpoint.test_aggregate_round import Roots

    return Roots("local", tmp_path)


def marked_state(rank: int, n: int, step: int, marker: int) -> dict:
    st = make_state(rank, n, step)
    for lane in st["lanes"]:
        lane["job"] = marker
    return st


# ----------------------------------------------------------------------------- identity


def _run_jobs(jobs: list[tuple[list[Aggregator], int]], rounds: int) -> list[list[Any]]:
    """Every job's ranks as threads at once, ``rounds`` rounds each; results per job."""
    results: list[list[Any]] = [[None] * len(aggs) * 0 for aggs, _ in jobs]
    lock = threading.Lock()

    def rank_main(j: int, r: int) -> None:
        aggs, marker = jobs[j]
        n = len(aggs)
        for step in range(rounds):
            try:
                res: Any = aggs[r].round(marked_state(r, n, step, marker))
            except Exception as e:  # noqa: BLE001 - judged below
                res = e
            with lock:
                results[j].append((r, step, res))

    threads = [
        threading.Thread(target=rank_main, args=(j, r))
        for j, (aggs, _) in enumerate(jobs)
        for r in range(len(aggs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung"
    return results


@pytest.mark.parametrize(
    ("ids_a", "ids_b"),
    [((JOB + "-a", FP_TRAIN), (JOB + "-b", FP_TRAIN)), ((JOB, FP_TRAIN), (JOB, FP_EVAL))],
    ids=["two-jobs-one-pipeline", "one-job-two-pipelines"],
)
def test_two_jobs_or_two_pipelines_on_one_location_never_mix(local, ids_a, ids_b):
    root = local.new()
    n, rounds = 3, 4
    a = make_aggs(local, root, n, job_id=ids_a[0], fingerprint=ids_a[1])
    b = make_aggs(local, root, n, job_id=ids_b[0], fingerprint=ids_b[1])
    results = _run_jobs([(a, 1), (b, 2)], rounds)
    for marker, per_job in zip((1, 2), results, strict=True):
        assert len(per_job) == n * rounds
        for rank, step, res in per_job:
            assert isinstance(res, dict), res
            assert {lane["job"] for lane in res["lanes"]} == {marker}, (rank, step, res)
            assert {lane["cursor"][0] for lane in res["lanes"]} == {step}
            want = range(2 * n) if rank == 0 else lanes_of(rank, n)
            assert [lane["lane"] for lane in res["lanes"]] == list(want)
    close_all(a + b)
    assert local.files(root) == []


class _Rewrite(Wrapped):
    """A store whose state records come out with another job id or fingerprint."""

    def __init__(self, inner: Any, **fields: Any) -> None:
        super().__init__(inner)
        self._fields = fields

    def create(self, key, value, *, fence=None):
        rec = decode(value, STATE)
        if rec is not None:
            rec.update(self._fields)
            value = encode(**rec)
        return self._inner.create(key, value, fence=fence)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"job_id": "intruder"}, "belongs to job 'intruder'"),
        ({"fingerprint": FP_EVAL}, f"pipeline {FP_EVAL[:12]}…"),
    ],
)
def test_a_state_of_another_job_or_pipeline_is_refused_naming_both(local, fields, named):
    root = local.new()
    n = 3
    aggs = make_aggs(
        local,
        root,
        n,
        fingerprint=FP_TRAIN,
        timeout_s=20.0,
        store_wrap=lambda r, s: _Rewrite(s, **fields) if r == 1 else s,
    )
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    err, _ = out[0]
    assert isinstance(err, AggregationError)
    assert "rank 1's state in round" in str(err) and named in str(err)
    assert f"this leader runs job {JOB!r}" in str(err) and f"pipeline {FP_TRAIN[:12]}…" in str(err)
    for r in (1, 2):
        assert isinstance(out[r][0], AggregationError) and named in str(out[r][0])
    close_all(aggs)


def test_an_announcement_of_another_job_is_refused_naming_both(local):
    root = local.new()
    n = 2
    foreign = Announcement("0123456789ab-1", "0123456789ab", 1, n, "someone-else", FP_TRAIN, step=1)
    local.store(root).put(KEYS.round, foreign.encode())
    (_, follower) = make_aggs(local, root, n, timeout_s=5.0)
    with pytest.raises(AggregationError) as info:
        follower.round(make_state(1, n, 1))
    msg = str(info.value)
    assert msg.startswith("[rank=1] the announcement in ")
    assert "is for job 'someone-else'" in msg and f"this rank runs job {JOB!r}" in msg


def test_a_second_leader_of_the_same_job_and_pipeline_is_refused(local):
    root = local.new()
    first = make_aggs(local, root, 1)
    assert without_round(first[0].round(make_state(0, 1, 1))) == merge([make_state(0, 1, 1)])
    second = make_aggs(local, root, 1)
    t = time.monotonic()
    with pytest.raises(AggregationError, match="the leader's liveness key of job") as info:
        second[0].round(make_state(0, 1, 1))
    assert time.monotonic() - t < 1.0, "a live holder on this host is refused at once"
    assert "two jobs with the same job id and pipeline share this location" in str(info.value)
    assert "Pipeline(job_id=...) or ZEPHON_JOB_ID" in str(info.value)
    assert "held by a live process of this host" in str(info.value)
    close_all(first + second)
    third = make_aggs(local, root, 1)  # once the first released its key, all is well
    assert without_round(third[0].round(make_state(0, 1, 2))) == merge([make_state(0, 1, 2)])
    close_all(third)
    assert local.files(root) == []


def test_job_id_comes_from_the_launcher(monkeypatch):
    from zephon.checkpoint.rounds.job import resolve_job_id

    for var in ("ZEPHON_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    for var in ("PMIX_NAMESPACE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "jax", None)  # not imported: not asked
    assert resolve_job_id()[0] == "default"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert resolve_job_id() == ("torch:10.0.0.1:29500", "MASTER_ADDR:MASTER_PORT")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert resolve_job_id()[0] == "slurm:77.3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not an id
    assert resolve_job_id()[0] == "slurm:77.3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-5")
    assert resolve_job_id()[0] == "torchelastic:run-5"
    monkeypatch.setenv("ZEPHON_JOB_ID", "mine")
    assert resolve_job_id() == ("mine", "ZEPHON_JOB_ID")
    assert resolve_job_id("given")[0] == "given"
    monkeypatch.setenv("ZEPHON_JOB_ID", "")
    with pytest.raises(ValueError, match="ZEPHON_JOB_ID must be a non-empty str"):
        resolve_job_id()


# ----------------------------------------------------------------------------- agreement


def test_a_stale_leader_that_never_noticed_its_pause_finds_the_followers_abort(local):
    """The leader "pauses" after collecting every state: its liveness key stops being
    refreshed, so the followers give it up and decide the round as failed. It then resumes
    believing its lease is fine; its commit loses to their abort, and it fails too."""
    root = local.new()
    n, ttl = 3, 0.4
    aggs: list[Aggregator] = []
    gave_up = threading.Event()

    def pausing_merge(states):
        lease = aggs[0]._side.lease
        lease._stopped.set()  # the refresher is paused with the process
        lease._thread.join()
        assert gave_up.wait(10), "the followers never gave up"
        lease._expiry = time.time() + 60  # it does not notice that it lapsed
        return merge(states)

    aggs.extend(make_aggs(local, root, n, timeout_s=20.0, lease_ttl_s=ttl, merge_fn=pausing_merge))
    out: list[Any] = [None] * n

    def follower(r: int) -> None:
        try:
            out[r] = aggs[r].round(make_state(r, n, 1))
        except AggregationError as e:
            out[r] = e

    threads = [threading.Thread(target=follower, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    leader = threading.Thread(target=follower, args=(0,))
    leader.start()
    for t in threads:
        t.join(20)
    gave_up.set()
    leader.join(20)
    for r in (1, 2):
        assert isinstance(out[r], AggregationError) and "is gone" in str(out[r]), out[r]
    assert isinstance(out[0], AggregationError), "a split: the stale leader succeeded"
    assert "ended before this leader could commit it" in str(out[0])
    assert "is gone" in str(out[0])
    close_all(aggs)


class _BlindToDecisions(Wrapped):
    """A follower store that never sees the round's decision while it waits."""

    def get(self, key):
        return None if ".c.d." in key else self._inner.get(key)


def test_a_follower_giving_up_after_the_commit_takes_the_commit(local):
    root = local.new()
    n = 2
    aggs = make_aggs(
        local,
        root,
        n,
        timeout_s=[5.0, 0.5],
        store_wrap=lambda r, s: _BlindToDecisions(s) if r == 1 else s,
    )
    states = [make_state(r, n, 1) for r in range(n)]
    out = run_ranks(aggs, states)
    check_results([res for res, _ in out], states)
    close_all(aggs)


# ----------------------------------------------------------------------------- refusals


class _Disk:
    """What the store's filesystem does: nothing, full (data writes fail with ENOSPC,
    an empty file still fits), or read-only for this job (EACCES)."""

    def __init__(self) -> None:
        self.full = False
        self.denied = False

    def check(self, key: str, value: bytes | None) -> None:
        if self.denied:
            raise PermissionError(errno.EACCES, "Permission denied", key)
        if self.full and (value is None or len(value) > 0):
            raise OSError(errno.ENOSPC, "No space left on device", key)


class _OnDisk(Wrapped):
    """A DirectoryStore whose writes go through a _Disk (deletes always work unless
    denied; reads always work)."""

    def __init__(self, inner: DirectoryStore, disk: _Disk, fill_after: str | None = None):
        super().__init__(inner)
        self._disk = disk
        self._fill_after = fill_after

    def put(self, key, value, *, fence=None):
        self._disk.check(key, value)
        self._inner.put(key, value, fence=fence)
        if self._fill_after is not None and key.endswith(self._fill_after):
            self._disk.full = True

    def create(self, key, value, *, fence=None):
        self._disk.check(key, value)
        return self._inner.create(key, value, fence=fence)

    def announce(self, key, value):
        self._disk.check(key, value)
        return self._inner.announce(key, value)

    def keep_alive(self, key, value, ttl_s, *, exclusive=False):
        self._disk.check(key, value)
        return self._inner.keep_alive(key, value, ttl_s, exclusive=exclusive)

    def delete(self, key):
        if self._disk.denied:
            raise PermissionError(errno.EACCES, "Permission denied", key)
        self._inner.delete(key)


def test_a_follower_that_cannot_write_its_state_ends_the_round_at_once(local):
    """Issue 14 item 19: the follower's write fails; it publishes a notice the leader
    reads, so nobody waits out a timeout, and every error names the store's error."""
    root = local.new()
    n = 3
    bad = _Disk()
    bad.full = True  # only rank 2's writes fail: its notice is empty, the others probe fine

    def wrap(r, s):
        if r == 2:
            return _OnDisk(s, bad)
        return s

    aggs = make_aggs(local, root, n, timeout_s=60.0, store_wrap=wrap)
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    for r in range(n):
        err, elapsed_s = out[r]
        assert isinstance(err, AggregationError), (r, err)
        assert "timed out" not in str(err)  # (their budget is 60 s: no one waited it out)
        assert elapsed_s < 2.0, (r, elapsed_s, str(err))
        assert str(err).startswith(f"[rank={r}] ")
    # (its first write is its liveness key: that one fails)
    assert "could not write its liveness key" in str(out[2][0])
    assert "No space left on device" in str(out[2][0])
    # The others read the (empty) notice of a rank whose store is full; their own store
    # works, so they cannot name the error themselves, and say what they know.
    assert "refused its notice" in str(out[0][0]) and "refused its notice" in str(out[1][0])
    close_all(aggs)


def test_a_disk_that_fills_up_during_the_round_fails_every_rank_naming_the_error(local):
    root = local.new()
    n = 4
    disk = _Disk()
    aggs = make_aggs(
        local,
        root,
        n,
        timeout_s=60.0,
        store_wrap=lambda r, s: _OnDisk(s, disk, fill_after=".c.round" if r == 0 else None),
    )
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    for r in range(n):
        err, elapsed_s = out[r]
        assert isinstance(err, AggregationError), (r, err)
        assert "No space left on device" in str(err), (r, str(err))
        assert elapsed_s < 2.0, (r, elapsed_s, str(err))
        assert "timed out" not in str(err)
        assert str(err).startswith(f"[rank={r}] ")
    close_all(aggs)


def test_a_store_that_refuses_every_write_fails_every_rank_within_two_seconds(local):
    root = local.new()
    n = 3
    disk = _Disk()
    disk.denied = True
    aggs = make_aggs(local, root, n, timeout_s=60.0, store_wrap=lambda r, s: _OnDisk(s, disk))
    out = run_ranks(aggs, [make_state(r, n, 1) for r in range(n)])
    for r in range(n):
        err, elapsed_s = out[r]
        assert isinstance(err, AggregationError), (r, err)
        assert "Permission denied" in str(err), str(err)
        assert elapsed_s < 2.0, (r, elapsed_s, str(err))
        assert "timed out" not in str(err)
    assert "refuses writes" in str(out[1][0]) and "raise its quota" in str(out[1][0])
    close_all(aggs)
