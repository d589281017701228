"""Issue 33 items 3 and 4: each rank's place (its liveness key) in a job's rounds.

A key of a process of this host that is gone is taken over at once (a job restarted right
after a crash checkpoints at its first call); another host's is waited for until its lease
lapses, within the round's budget; a live one is another job that the location cannot
tell apart, refused at once with an error naming ``job_id=``, on the leader and on the
followers, and the first job's rounds go on untouched."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tests.unit.checkpoint.test_aggregate_round import (
    KEYS,
    Roots,
    close_all,
    make_aggs,
    make_state,
    run_ranks,
)
from zephon.checkpoint.rounds.holder import Holder, holder_value
from zephon.errors import AggregationError


@pytest.fixture
def local(tmp_path):
    return Roots("local", tmp_path)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _lapse(lease) -> None:
    """The holder's death: its refresher stops, its key is not deleted."""
    lease._stopped.set()
    lease._thread.join()


def test_holder_values_name_the_process():
    h = Holder(holder_value("abc123", 4))
    assert h.session == "abc123" and h.gone() is False  # this process
    gone = Holder(f"s rank=0 pid={_dead_pid()} host={h.host} start=1".encode())
    assert gone.gone() is True
    assert Holder(b"s rank=0 pid=1 host=elsewhere start=1").gone() is None  # cannot ask
    assert Holder(b"junk").gone() is None


def test_the_keys_of_dead_ranks_of_this_host_are_taken_over_at_once(local):
    root = local.new()
    n = 3
    junk = local.store(root)
    pid, host = _dead_pid(), Holder(holder_value("x", 0)).host
    # A crashed run's keys, with a long lease: leader and followers, processes gone.
    for key, rank in [(KEYS.leader, 0), (KEYS.member(1), 1), (KEYS.member(2), 2)]:
        lease = junk.keep_alive(
            key, f"dead00000000 rank={rank} pid={pid} host={host} start=1".encode(), 60.0
        )
        _lapse(lease)
    aggs = make_aggs(local, root, n, timeout_s=20.0)
    t = time.monotonic()
    out = run_ranks(aggs, [make_state(r, n, 3) for r in range(n)])
    assert all(isinstance(res, dict) for res, _ in out), out
    assert time.monotonic() - t < 3.0  # not the 60 s lease
    close_all(aggs)
    assert local.files(root) == []


def test_another_hosts_dead_key_is_waited_for_until_its_lease_lapses(local):
    root = local.new()
    junk = local.store(root)
    lease = junk.keep_alive(KEYS.leader, b"feed00000000 rank=0 pid=1 host=elsewhere start=1", 1.0)
    _lapse(lease)
    (agg,) = make_aggs(local, root, 1, timeout_s=10.0, lease_ttl_s=1.0)
    t = time.monotonic()
    assert agg.round(make_state(0, 1, 2))["step"] == 2
    assert 0.3 < time.monotonic() - t < 3.0  # waited for the lapse, no longer
    agg.close()


def test_a_live_key_of_another_host_is_an_error_after_the_wait(local):
    root = local.new()
    junk = local.store(root)
    lease = junk.keep_alive(KEYS.leader, b"feed00000000 rank=0 pid=1 host=elsewhere start=1", 0.5)
    try:
        (agg,) = make_aggs(local, root, 1, timeout_s=1.5, lease_ttl_s=0.5)
        with pytest.raises(AggregationError) as info:
            agg.round(make_state(0, 1, 2))
        assert "held by a process of another host (waited 0.5 s for its lease" in str(info.value)
        assert "Pipeline(job_id=...) or ZEPHON_JOB_ID" in str(info.value)
        agg.close()
    finally:
        lease.stop()


def test_a_second_job_with_the_same_id_is_refused_on_every_rank_and_the_first_goes_on(local):
    """Two jobs of one pipeline and no job id of their own on one location: the second's
    leader and followers are refused at once, naming job_id=; the first job's round, at
    another step, commits as if the second were not there."""
    root = local.new()
    n = 3
    first = make_aggs(local, root, n, timeout_s=10.0)
    out = run_ranks(first, [make_state(r, n, 3) for r in range(n)])
    assert all(isinstance(res, dict) for res, _ in out)
    second = make_aggs(local, root, n, timeout_s=10.0)
    results: dict[str, list] = {}

    def run(name, aggs, step):
        results[name] = run_ranks(aggs, [make_state(r, n, step) for r in range(n)])

    threads = [
        threading.Thread(target=run, args=("first", first, 6)),
        threading.Thread(target=run, args=("second", second, 40)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(res, dict) for res, _ in results["first"]), results["first"]
    for r, (err, elapsed_s) in enumerate(results["second"]):
        assert isinstance(err, AggregationError), (r, err)
        assert "Pipeline(job_id=...) or ZEPHON_JOB_ID" in str(err), err
        assert elapsed_s < 2.0, (r, elapsed_s)
    close_all(second)
    close_all(first)
    assert local.files(root) == []
