"""Checkpoint rounds over a shared directory with every rank its own OS process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._rounds_rank import fake_state, lanes_of, merge, share_of

SCRIPT = Path(__file__).with_name("_rounds_rank.py")
pytestmark = [pytest.mark.stores, pytest.mark.processes]


def run_job(
    tmp_path: Path,
    root: Path,
    n: int,
    *,
    rounds: int = 1,
    timeout_s: float | list[float] = 20.0,
    lease_ttl_s: float = 10.0,
    modes: dict[int, str] | None = None,
    linger_s: dict[int, float] | None = None,
    tag: str = "job",
) -> list[dict]:
    """Start ``n`` rank processes on ``root`` and return each one's JSON report."""
    timeouts = timeout_s if isinstance(timeout_s, list) else [timeout_s] * n
    procs = []
    outs = []
    for r in range(n):
        out = tmp_path / f"{tag}-rank{r}.json"
        outs.append(out)
        cmd = [
            sys.executable,
            str(SCRIPT),
            "--root", str(root),
            "--rank", str(r),
            "--world-size", str(n),
            "--out", str(out),
            "--rounds", str(rounds),
            "--timeout-s", str(timeouts[r]),
            "--lease-ttl-s", str(lease_ttl_s),
            "--mode", (modes or {}).get(r, "ok"),
            "--linger-s", str((linger_s or {}).get(r, 0.0)),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    reports = []
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        try:
            _, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {r} hung") from None
        if out.exists():
            reports.append(json.loads(out.read_text()))
        else:
            reports.append({"rank": r, "returncode": p.returncode, "stderr": err[-2000:]})
    return reports


def namespace_files(root: Path) -> list[str]:
    """Every file under the store's namespace, named as its key (``g~/f`` is key ``g.f``)."""
    base = root / "zephon"
    return sorted(
        os.path.relpath(os.path.join(d, f), base).replace("~/", ".")
        for d, _, files in os.walk(base)
        for f in files
    )


def check_round(reports: list[dict], n: int, step: int) -> None:
    """The leader got the merged state of ``step``; every follower its share of it."""
    expected = merge([fake_state(r, n, step) for r in range(n)])
    assert reports[0]["merged"][step] == expected
    for r, rep in enumerate(reports[1:], start=1):
        got = dict(rep["merged"][step])
        share = got.pop("share")
        assert share["rank"] == r and share["lanes_total"] == len(expected["lanes"]), share
        assert got == share_of(expected, r)


def test_four_processes_get_the_merged_state_and_their_shares(tmp_path):
    n, rounds = 4, 3
    root = tmp_path / "agg"
    reports = run_job(tmp_path, root, n, rounds=rounds)
    for rep in reports:
        assert rep.get("error") is None, rep
        assert len(rep["digests"]) == rounds, rep
    for step in range(rounds):
        check_round(reports, n, step)
    assert namespace_files(root) == []  # the leader's close() removed the last marker


def test_missing_rank_is_named_and_followers_fail_on_the_notice(tmp_path):
    n = 4
    leader_timeout_s = 3.0
    reports = run_job(
        tmp_path,
        tmp_path / "agg",
        n,
        timeout_s=[leader_timeout_s, 60.0, 60.0, 60.0],
        modes={3: "absent"},
        linger_s={0: 1.0},
    )
    lead = reports[0]
    assert lead["error_type"] == "AggregationError"
    assert f"rank 3 (lanes {lanes_of(3)})" in lead["error"]
    assert "waiting for 1 of 4 ranks" in lead["error"]
    assert leader_timeout_s <= lead["elapsed_s"] < leader_timeout_s + 1.0
    for rep in reports[1:3]:
        assert rep["error_type"] == "AggregationError"
        assert "the leader (rank 0) failed checkpoint round" in rep["error"]
        assert f"rank 3 (lanes {lanes_of(3)})" in rep["error"]
        # On the notice, shortly after the leader gave up; not at their own 60 s deadline.
        assert rep["failed_at_unix"] - lead["failed_at_unix"] < 1.0
        assert rep["elapsed_s"] < leader_timeout_s + 5.0


def test_lane_mismatch_fails_every_rank_at_once(tmp_path):
    n = 4
    # The leader lives on a little after failing (as a training loop reporting the error
    # would): ranks slower to start than the mismatch still find its notice. (One that
    # first looks after the leader closed cannot tell its job's notice from a dead job's
    # and waits out its budget; see test_aggregate_round.)
    reports = run_job(
        tmp_path,
        tmp_path / "agg",
        n,
        timeout_s=60.0,
        modes={2: "bad-lanes"},
        linger_s={0: 3.0},
    )
    expected = f"it reports lanes {lanes_of(2)[:1]}, the leader expects {lanes_of(2)}"
    for rep in reports:
        assert rep["error_type"] == "AggregationError", rep
        assert expected in rep["error"]
        assert rep["elapsed_s"] < 10.0  # process start-up skew, not the 60 s budget


def test_sigkilled_leader_then_a_restarted_job_over_the_same_directory(tmp_path):
    """The leader dies before publishing (no notice): followers fail about a lease TTL
    later, naming the leader. A new job then runs over the leftovers and succeeds."""
    n, ttl = 4, 1.0
    root = tmp_path / "agg"
    reports = run_job(tmp_path, root, n, timeout_s=60.0, lease_ttl_s=ttl, modes={0: "die-in-merge"})
    assert "rank" in reports[0] and reports[0].get("returncode") == -9  # SIGKILL, no report
    died_at = json.loads((tmp_path / "job-rank0.json.dying").read_text())["at_unix"]
    for rep in reports[1:]:
        assert rep["error_type"] == "AggregationError", rep
        assert "the leader (rank 0) of round" in rep["error"] and "is gone" in rep["error"]
        assert "did rank 0 die?" in rep["error"]
        assert rep["failed_at_unix"] - died_at < 2 * ttl + 0.5
    # the dead leader's (expired) key is left
    assert any(f.endswith(".c.leader") for f in namespace_files(root))

    time.sleep(0.1)
    again = run_job(tmp_path, root, n, rounds=2, lease_ttl_s=ttl, tag="restart")
    for rep in again:
        assert rep.get("error") is None, rep
    check_round(again, n, 1)
    # What the dead run left (its followers' states and aborts) was removed by the new leader.
    assert namespace_files(root) == []


def _start_job(tmp_path: Path, root: Path, n: int, *, lease_ttl_s: float, tag: str) -> list:
    procs = []
    for r in range(n):
        cmd = [
            sys.executable,
            str(SCRIPT),
            "--root", str(root),
            "--rank", str(r),
            "--world-size", str(n),
            "--out", str(tmp_path / f"{tag}-rank{r}.json"),
            "--timeout-s", "60",
            "--lease-ttl-s", str(lease_ttl_s),
            "--mode", "stop-in-merge" if r == 0 else "ok",
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    return procs


def _wait_for(path: Path, procs: list, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            raise AssertionError(f"{path.name} never appeared")
        time.sleep(0.02)


@pytest.mark.parametrize("followers_give_up", [True, False])
def test_stale_leader_sigstopped_before_its_commit_the_ranks_agree(tmp_path, followers_give_up):
    """Rank 0 stops itself (SIGSTOP) after collecting every state, just before its commit.
    Resumed after the followers gave up on it (its lease expired), it must fail too; resumed
    before that, every rank succeeds. Never a split."""
    n, ttl = 3, 1.0
    tag = f"stale-{followers_give_up}"
    procs = _start_job(tmp_path, tmp_path / "agg", n, lease_ttl_s=ttl, tag=tag)
    try:
        _wait_for(tmp_path / f"{tag}-rank0.json.stopped", procs)
        if followers_give_up:
            for p in procs[1:]:
                p.wait(timeout=30)  # they give up on the stopped leader
        else:
            time.sleep(0.2)  # well inside the lease
        os.kill(procs[0].pid, signal.SIGCONT)
        for p in procs:
            p.communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate()
    reports = [json.loads((tmp_path / f"{tag}-rank{r}.json").read_text()) for r in range(n)]
    if followers_give_up:
        for rep in reports[1:]:
            assert rep["error_type"] == "AggregationError", rep
            assert "is gone" in rep["error"], rep["error"]
        lead = reports[0]
        assert lead["error_type"] == "AggregationError", "the resumed leader must not succeed"
        # It knows its lease lapsed (the clock says so), or finds the followers' abort.
        assert (
            "lapsed during round" in lead["error"]
            or "ended before this leader could commit it" in lead["error"]
        ), lead["error"]
        assert lead["merged"] == []
    else:
        for rep in reports:
            assert rep.get("error") is None, rep
        check_round(reports, n, 0)


def test_a_job_restarted_right_after_every_rank_was_killed_checkpoints_at_once(tmp_path):
    """Issue 33 item 4: every rank SIGKILLed mid-round (the leader stopped in its merge),
    the same job started again at once with a long lease: the dead ranks' liveness keys
    (this host's, their processes gone) are taken over, not waited for, and the first
    round commits within a second or two instead of a lease time."""
    n, ttl = 3, 30.0
    root = tmp_path / "agg"
    procs = _start_job(tmp_path, root, n, lease_ttl_s=ttl, tag="crashed")
    try:
        _wait_for(tmp_path / "crashed-rank0.json.stopped", procs)
        time.sleep(0.2)  # the followers wait for the commit, holding their keys
    finally:
        # every rank killed before any is waited for (SIGKILL ends a stopped process too):
        # a follower still running once the leader is gone would notice, fail its round
        # and close, taking its key with it
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
    left = namespace_files(root)
    assert any(f.endswith(".c.leader") for f in left), left  # the dead leader's key...
    assert sum(".m." in f for f in left) == n - 1, left  # ...and the followers'
    t = time.monotonic()
    again = run_job(tmp_path, root, n, rounds=2, lease_ttl_s=ttl, timeout_s=20.0, tag="again")
    elapsed_s = time.monotonic() - t
    for rep in again:
        assert rep.get("error") is None, rep
    check_round(again, n, 1)
    assert elapsed_s < ttl / 3, f"the restart waited {elapsed_s:.1f} s for dead ranks' keys"
